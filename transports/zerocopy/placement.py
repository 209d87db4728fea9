"""zerocopy's placement: where its receive slots and the tensors it sends live (its registered pool).

The transport (``transports/zerocopy/transport.py``) makes one :class:`PoolPlacement` of its own; this is the
part of it that plans (reserves the pool for the plan's slots and sends) and hands out memory to build tensors in.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from transports.fabric_transport import FabricPlacement, FabricTransport
from transports.placement import TensorSpec
from transports.zerocopy.protocol import CONTROL_BYTES, slots_bytes, slots_for


class PoolPlacement(FabricPlacement):
    """zerocopy's placement: its receive slots and (unless it stages every send, rdma_cp) the tensors it sends
    live in its registered pool, placed when the plan gives their shapes (the graph analysis)."""

    def __init__(self, transport: FabricTransport) -> None:
        """``transport``: the zerocopy transport (rdma_cp's too) whose pool and receive slots this places; typed as
        its base, so that this module does not import the transport's, which imports it."""
        super().__init__(transport)
        self._zerocopy = transport

    @property
    def zero_copy_sends(self) -> bool:
        """Whether a tensor in registered memory is sent from where it is (the analysis on, no staging)."""
        return self._zerocopy.analysis and self._zerocopy.sender.places_sends

    def plan(self, specs) -> None:
        transport = self._zerocopy
        specs = list(specs)
        if not transport.analysis:  # nothing is known ahead: every tensor goes by dynamic allocation
            specs = [replace(s, shape=None) for s in specs]
        incoming = [s for s in specs if s.dst == transport.rank and s.shape is not None]
        outgoing = [s for s in specs if s.src == transport.rank and s.shape is not None]
        in_pool = [s for s in incoming if not transport.moves_device(s)]  # (the others' slots: in device memory)
        for spec in incoming:  # each slot must fit this rank's memory (a product of Python ints: no overflow)
            if (nbytes := math.prod(spec.shape) * np.dtype(spec.dtype).itemsize) > transport.memory_bytes:
                raise ValueError(f"{transport.name}: cannot place '{spec.name}' from rank {spec.src}: "
                                 f"{np.dtype(spec.dtype)} {tuple(spec.shape)} is {nbytes} bytes, more than this "
                                 f"rank's memory ({transport.memory_bytes} bytes)")
        super().plan(specs)
        sizes = [slots_bytes(s.nbytes, slots_for(s.nbytes)) for s in in_pool] + [CONTROL_BYTES] * len(incoming)
        placed = [s for s in outgoing if not s.src_memory.is_device] if transport.sender.places_sends else []
        transport.pool.reserve(sizes, [s.nbytes for s in placed], peers=[s.src for s in in_pool + incoming],
                               source_peers=[s.dst for s in placed])
        for spec in incoming:
            transport._incoming_slot(spec.name, spec.src)

    def allocate(self, spec: TensorSpec) -> np.ndarray:
        if spec.shape is None:
            raise ValueError(f"cannot allocate tensor '{spec.name}': its shape is not known statically")
        if not self.zero_copy_sends or spec.src_memory.is_device:  # ordinary memory (the analysis off, rdma_cp) or
            return super().allocate(spec)  # device memory (staged through the pool: transports/base.py)
        return self._zerocopy.pool.alloc(spec.nbytes, source=True, peer=spec.dst).view(spec.dtype, spec.shape)
