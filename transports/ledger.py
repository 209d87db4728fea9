"""The copy ledger: what one side of a transport did (:class:`TransportStats`), counted as it goes (:class:`Ledger`).

Every transport keeps one (``transport.ledger``, read with ``transport.stats()``): tensors and payload bytes sent
and received, the payload bytes it copies in user space (host copies) and those it moves across the bus between
device and host memory (staging), serialisations, registrations and control messages. Experiments report copies,
not just time, from these counts.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class TransportStats:
    """The copy ledger: what one side of a transport did, counted since it started.

    ``copied_bytes`` counts payload bytes copied in user space on this side,
    including copies that a library in our call path is known to make (the
    transport's code says where); kernel socket copies are not counted.
    """

    tensors_sent: int = 0
    tensors_received: int = 0
    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0
    copied_bytes: int = 0
    serialisations: int = 0
    deserialisations: int = 0
    registrations: int = 0
    control_messages: int = 0
    #: tensors sent from memory registered before the send (the pool, a registration made earlier): cache hits
    sends_registered: int = 0
    #: tensors sent from memory not registered when the send began: cache misses
    sends_unregistered: int = 0
    #: tensors sent by dynamic allocation (meta-data, then the receiver reads), not into a preallocated slot
    dynamic_transfers: int = 0
    #: payload bytes copied between device memory and host memory (staging; not in ``copied_bytes``), and from
    #: device memory to device memory
    device_to_host_bytes: int = 0
    host_to_device_bytes: int = 0
    device_to_device_bytes: int = 0

    def __sub__(self, other: TransportStats) -> TransportStats:
        return TransportStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __add__(self, other: TransportStats) -> TransportStats:
        return TransportStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Ledger:
    """Thread-safe counters behind :meth:`Transport.stats`. Each thread counts in counts of its own, so a count
    on the per-transfer path takes no lock (the lock guards the list of threads' counts); a snapshot adds them
    up (another thread's count may land just before or just after it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._threads: list[dict[str, int]] = []  # every counting thread's counts, kept after it ends
        self._retired: dict[str, int] | None = None  # the counts of tallies whose owners are gone

    def _counts(self) -> dict[str, int]:
        """This thread's counts (made at its first count)."""
        try:
            return self._local.counts
        except AttributeError:
            counts = self._local.counts = dict.fromkeys(TransportStats.__dataclass_fields__, 0)
            with self._lock:
                self._threads.append(counts)
            return counts

    def add(self, **counts: int) -> None:
        mine = self._counts()
        for name, value in counts.items():
            mine[name] += value

    def count(self, name: str) -> None:
        """One more of the count ``name``: :meth:`add`'s work on the per-transfer path, without its keywords."""
        self._counts()[name] += 1

    def sent(self, nbytes: int, also: str | None = None) -> None:
        """One tensor of ``nbytes`` sent (and one more of the count ``also``): :meth:`add`'s work on the
        per-transfer path, without its keywords."""
        counts = self._counts()
        counts["tensors_sent"] += 1
        counts["payload_bytes_sent"] += nbytes
        if also is not None:
            counts[also] += 1

    def received(self, nbytes: int) -> None:
        """One tensor of ``nbytes`` received (see :meth:`sent`)."""
        counts = self._counts()
        counts["tensors_received"] += 1
        counts["payload_bytes_received"] += nbytes

    def tally(self, owner: object) -> dict[str, int]:
        """Counts of their own for ``owner``, which counts on the per-transfer path without the thread's lookup (a
        persistent transfer: :class:`Outbound`, used by one thread at a time), added into every snapshot; once
        ``owner`` is gone they are folded into the counts of the threads gone (the list stays as long as the
        number of owners alive)."""
        counts = dict.fromkeys(TransportStats.__dataclass_fields__, 0)
        with self._lock:
            self._threads.append(counts)
        weakref.finalize(owner, self._retire, counts)
        return counts

    def _retire(self, counts: dict[str, int]) -> None:
        with self._lock:
            threads = self._threads
            del threads[next(i for i, kept in enumerate(threads) if kept is counts)]  # (remove() compares contents)
            retired = self._retired
            if retired is None:
                retired = self._retired = dict.fromkeys(TransportStats.__dataclass_fields__, 0)
                self._threads.append(retired)
            for name, value in counts.items():
                retired[name] += value

    def snapshot(self) -> TransportStats:
        total = dict.fromkeys(TransportStats.__dataclass_fields__, 0)
        with self._lock:
            threads = list(self._threads)
        for counts in threads:
            for name, value in list(counts.items()):
                total[name] += value
        return TransportStats(**total)
