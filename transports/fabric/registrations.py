"""The registration cache every backend keeps, written once.

Registering memory with the NIC (``ucp_mem_map``, ``ibv_reg_mr``) is expensive, so a backend
registers a buffer once and finds that registration again for any view of it. An entry covers the
whole buffer of the array that holds the memory (its *owner*: the last ndarray up the chain of
bases, e.g. the one numpy made over a DLPack capsule from TensorFlow). The cache never keeps that
array alive: its owner must stay free to reuse the memory, and a registration must not outlive the
memory it covers. So an entry expires when its owner is garbage-collected, and is released at
the next call into the cache (a finalizer may run in any thread), or at close. A region is
anything with ``release()``, which must end with :meth:`RegistrationCache.forget`.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import numpy as np

from transports.common import data_pointer

#: registrations of foreign memory a device keeps at most, the least recently used going first
REGISTRATION_CACHE_SIZE = 256



class _Releasable(Protocol):
    def release(self) -> None: ...


Region = TypeVar("Region", bound=_Releasable)


def owner_of(array: np.ndarray) -> np.ndarray:
    """The array that holds ``array``'s memory: the last array up its chain of bases (NumPy's, or a device array's
    of its own kind)."""
    kind = np.ndarray if isinstance(array, np.ndarray) else type(array)
    while isinstance(array.base, kind):
        array = array.base
    return array


def start_of(array: np.ndarray) -> int:
    """The address of ``array``'s first byte (host or device memory)."""
    return data_pointer(array)


def span_of(array: np.ndarray) -> tuple[int, int]:
    """``[start, end)`` to register for ``array``: its owner's whole buffer when the array lies inside it
    (so that every view finds the one registration), else the array's own bytes."""
    start = start_of(array)
    end = start + array.nbytes
    owner = owner_of(array)
    if owner.flags.c_contiguous and owner.nbytes >= array.nbytes:
        low = start_of(owner)
        if low <= start and end <= low + owner.nbytes:
            return low, low + owner.nbytes
    return start, end


class RegistrationCache(Generic[Region]):
    """A device's live regions (:meth:`track`), and among them the registrations of foreign memory by
    ``[start, end)`` (:meth:`add`), each expiring with its owner array."""

    def __init__(self, limit: int = REGISTRATION_CACHE_SIZE) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._live: set[Region] = set()
        self._entries: OrderedDict[tuple[int, int], Region] = OrderedDict()
        self._expired: list[Region] = []

    def track(self, region: Region) -> None:
        """Count ``region`` (an allocation or a registration) as live until it is :meth:`forget`-ed."""
        with self._lock:
            self._live.add(region)

    def live(self) -> list[Region]:
        """Every live region (for close), after releasing the expired ones."""
        self.release_expired()
        with self._lock:
            return list(self._live)

    def count(self) -> int:
        """How many regions are live, after releasing the expired ones."""
        return len(self.live())

    def find(self, start: int, end: int) -> Region | None:
        """The registration covering ``[start, end)``, or None; a hit becomes the most recently used."""
        with self._lock:
            for (low, high), region in self._entries.items():
                if low <= start and end <= high:
                    self._entries.move_to_end((low, high))
                    return region
        return None

    def add(self, start: int, end: int, region: Region, owner: np.ndarray,
            evictable: Callable[[Region], bool] = lambda region: True) -> list[Region]:
        """Keep ``region`` for ``[start, end)`` until ``owner`` dies; the least recently used entries beyond
        the limit (those ``evictable`` allows) leave the cache and are returned, for the caller to release."""
        weakref.finalize(owner, self._expired.append, region)
        evicted = []
        with self._lock:
            self._entries[(start, end)] = region
            for key, old in list(self._entries.items()):
                if len(self._entries) <= self.limit:
                    break
                if old is not region and evictable(old):
                    evicted.append(old)
                    del self._entries[key]
        return evicted

    def release_expired(self) -> None:
        """Release the registrations whose owners died (deferred to here: a finalizer may run in any thread).

        Each leaves the entries under the lock before it is released: a thread that popped a registration and
        was withdrawing its key while another thread's :meth:`find` still handed it out (for new memory at the
        same address, the dead owner's) gave a peer a key being withdrawn, and its RDMA read a remote access error
        (verbs, the Soft-RoCE guest, five sends in flight at once)."""
        while True:
            with self._lock:
                if not self._expired:
                    return
                region = self._expired.pop()
                for key, value in list(self._entries.items()):
                    if value is region:
                        del self._entries[key]
            region.release()

    def forget(self, region: Region) -> None:
        """Drop ``region`` (it was released)."""
        with self._lock:
            self._live.discard(region)
            for key, value in list(self._entries.items()):
                if value is region:
                    del self._entries[key]
