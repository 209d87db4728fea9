"""Helpers that both the transports and the fabric beneath them use, written once.

This module imports nothing of the project: ``transports/base.py`` (the transport layer) and
``transports/fabric/`` (the layer below it) both build on it, and so does every layer above
(``bench/launch`` keeps its launchers in a :class:`Registry`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, InvalidStateError
from typing import Any, NamedTuple

import numpy as np


class Availability(NamedTuple):
    """Whether a transport, a fabric backend or a launcher can run on this machine, and if not, why."""

    ok: bool
    reason: str = ""
    #: where it can run, what it would use (``mpirun: /usr/bin/mpirun``), for ``bench info``
    detail: str = ""

    def line(self) -> str:
        """``available``, ``available (detail)`` or ``not available: reason``: one line for ``bench info``."""
        if not self.ok:
            return f"not available: {self.reason}"
        return f"available ({self.detail})" if self.detail else "available"


class Registry(Mapping[str, str]):
    """Things of one kind (transports, fabric backends, launchers) by name, each imported only when asked for.

    ``entries``: name -> ``"module:attribute"``, or ``("module:attribute", "what it is")``; their order is
    the order of :meth:`names` (of figures, tables and ``--help``). As a mapping it is name ->
    ``"module:attribute"``. An unknown name raises ``unknown`` (a ``LookupError`` unless told) listing the
    known names; an entry whose module cannot be imported raises ImportError from :meth:`load` and is
    reported by :meth:`availability`, so one missing library breaks no other entry.
    """

    def __init__(self, kind: str, entries: Mapping[str, str | tuple[str, str]],
                 unknown: Callable[[str], Exception] = LookupError) -> None:
        self.kind = kind
        self._unknown = unknown
        self._targets: dict[str, str] = {}
        self._about: dict[str, str] = {}
        for name, entry in entries.items():
            target, about = (entry, "") if isinstance(entry, str) else entry
            module, _, attribute = target.partition(":")
            if not module or not attribute:
                raise ValueError(f"{kind} '{name}': '{target}' is not 'module:attribute'")
            self._targets[name] = target
            self._about[name] = about

    def __getitem__(self, name: str) -> str:
        return self._targets[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self._targets!r})"

    def names(self) -> list[str]:
        """Every registered name, in order."""
        return list(self._targets)

    def descriptions(self) -> dict[str, str]:
        """name -> what it is (as registered), in order."""
        return dict(self._about)

    def check(self, name: str) -> None:
        """Raise the registry's error for a name it does not have, listing the known ones."""
        if name not in self._targets:
            raise self._unknown(f"unknown {self.kind} '{name}' (known: {', '.join(self._targets)})")

    def module(self, name: str) -> str:
        """The module that defines ``name``'s entry."""
        self.check(name)
        return self._targets[name].partition(":")[0]

    def load(self, name: str) -> Any:
        """The registered object: its module imported now (ImportError when it cannot be)."""
        module = self.module(name)
        return getattr(importlib.import_module(module), self._targets[name].partition(":")[2])

    def availability(self, name: str, probe: Callable[[Any], Availability]) -> Availability:
        """``probe(the registered object)``; a module that cannot be imported is reported, not raised."""
        try:
            loaded = self.load(name)
        except ImportError as exc:
            return Availability(False, f"cannot import {self.module(name)}: {exc}")
        return probe(loaded)


def settle(future: Future, result: Any = None, error: BaseException | None = None) -> bool:
    """Complete ``future`` unless it is already done; returns whether this call completed it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True


def done_future(result: Any = None) -> Future:
    """A future that is already done, with ``result``."""
    future: Future = Future()
    future.set_result(result)
    return future


def data_pointer(array: Any) -> int:
    """The address of ``array``'s first byte: host memory (NumPy's array interface) or device memory (a CuPy
    array's ``__cuda_array_interface__``)."""
    if type(array) is np.ndarray:
        return array.ctypes.data
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is not None:
        return int(interface["data"][0])
    return array.__array_interface__["data"][0]


def in_device_memory(array: Any) -> bool:
    """Whether ``array`` is a device array (CuPy's, or any with ``__cuda_array_interface__``), not host memory."""
    return type(array) is not np.ndarray and hasattr(array, "__cuda_array_interface__")


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an ``alignment``-byte boundary (TensorFlow wants 64)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    backing = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -backing.ctypes.data % alignment
    return backing[start : start + nbytes].view(dtype).reshape(shape)
