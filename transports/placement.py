"""Where a transport's tensors live: the optional part of a transport, beside its core (``transports/base.py``).

A :class:`Placement` knows the transfers ahead (:meth:`Placement.plan`), gives memory for tensors a producer
will send (:meth:`Placement.allocate`) and says what of the process's memory is registered with the fabric
(:meth:`Placement.registered`, :meth:`Placement.register_site`). Every transport has one
(``transport.placement``); this default places nothing: the plan is remembered (a receive may check what
arrives against it), tensors are plain numpy memory and nothing is registered. The fabric transports
register memory (``transports.fabric_transport.FabricPlacement``) and zerocopy places its receive slots and
sends in its pool (``transports.zerocopy.placement.PoolPlacement``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from transports.memory import HOST, Memory
from transports.tensors import empty


@dataclass(frozen=True)
class TensorSpec:
    """A statically known cross-process tensor; ``shape`` is None when it is only known at run time.

    ``src_memory`` and ``dst_memory``: where it lives at the sender and at the receiver (a :class:`Memory` or its
    text: ``host``, ``cuda``, ``cuda:N``), as nixlbench's initiator and target segment types."""

    name: str
    shape: tuple[int, ...] | None
    dtype: np.dtype
    src: int
    dst: int
    src_memory: Memory = HOST
    dst_memory: Memory = HOST

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "src_memory", Memory.parse(self.src_memory))
        object.__setattr__(self, "dst_memory", Memory.parse(self.dst_memory))
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def nbytes(self) -> int | None:
        if self.shape is None:
            return None
        return math.prod(self.shape) * self.dtype.itemsize  # Python integers: exact for any shape


class Placement:
    """The default placement: the plan remembered, plain memory, nothing registered."""

    #: whether tensors in memory from :meth:`allocate` or :meth:`register_site` are sent without any copy
    zero_copy_sends: bool = False

    def __init__(self) -> None:
        #: the planned transfers, by (name, src, dst): one name may go between several pairs
        self.specs: dict[tuple[str, int, int], TensorSpec] = {}
        #: whether a planned tensor lives in device memory at its receiver (a receive then looks at its plan)
        self.device_receives = False

    def plan(self, specs: Iterable[TensorSpec]) -> None:
        """Learn the statically known transfers; a placement that can, preallocates for them."""
        for spec in specs:
            self.specs[(spec.name, spec.src, spec.dst)] = spec
            self.device_receives = self.device_receives or spec.dst_memory.is_device

    def spec(self, name: str, src: int, dst: int) -> TensorSpec | None:
        """The planned transfer of ``name`` from ``src`` to ``dst``, if the plan has it."""
        return self.specs.get((name, src, dst))

    def allocate(self, spec: TensorSpec) -> Any:
        """Memory where a producer should build a tensor it will send, of the kind ``spec.src_memory`` says (plain
        host memory here, a CuPy array on a device)."""
        if spec.shape is None:
            raise ValueError(f"cannot allocate tensor '{spec.name}': its shape is not known statically")
        return empty(spec.shape, spec.dtype, spec.src_memory)

    def registered(self, array: np.ndarray) -> bool:
        """Whether ``array``'s memory is registered with the transport's fabric now (False without one)."""
        return False

    def register_site(self, array: np.ndarray) -> int:
        """Register, once, the region of process memory an allocator placed ``array`` in, so that tensors the
        allocator places there later are sent from registered memory; returns the bytes registered (0:
        nothing to do, or no fabric). The region is for this process's sends only: no peer may access it."""
        return 0
