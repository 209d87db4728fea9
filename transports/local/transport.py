"""Same-process hand-over: the reference implementation and the "Local" line of the figures.

The receiver gets the sender's very array (no copy), as TensorFlow's
same-device rendezvous hands over a reference-counted tensor; the producer
must treat a sent array as read-only until the consumer is done with it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from transports.base import MAX_STEP, Cluster, Inbound, Key, Outbound, PeerError, Transport, TransportClosed
from transports.common import settle
from transports.dtypes import PLAIN_DTYPES
from transports.rendezvous import Rendezvous

_inboxes: dict[tuple[tuple[str, ...], int], Rendezvous] = {}
_inboxes_lock = threading.Lock()


def _inbox(cluster: Cluster, rank: int) -> Rendezvous:
    with _inboxes_lock:
        key = (cluster.addresses, rank)
        if key not in _inboxes:
            _inboxes[key] = Rendezvous(f"local rank {rank}")
        return _inboxes[key]


class LocalTransport(Transport):
    """Hands arrays between transport instances of one process through a shared table."""

    name = "local"
    same_process_only = True

    def start(self, cluster: Cluster, rank: int) -> None:
        if not 0 <= rank < cluster.size:
            raise ValueError(f"local: rank {rank} is not in a cluster of {cluster.size}")
        self.cluster, self.rank = cluster, rank
        self._inbox = _inbox(cluster, rank)

    def close(self) -> None:
        if self.cluster is None:
            return
        with _inboxes_lock:
            _inboxes.pop((self.cluster.addresses, self.rank), None)
        for _array, sent in self._inbox.close():
            if sent is not None:  # (a persistent send's was done at its hand-over)
                settle(sent, error=TransportClosed(f"local rank {self.rank} closed before receiving"))

    def _start_send(self, key: Key, array: np.ndarray) -> Future:
        self._check_key(key, "send")
        array = np.asarray(array)
        sent: Future = Future()
        _inbox(self.cluster, key.dst).put(key, (array, sent))
        self.ledger.sent(array.nbytes)
        return sent

    def _refused(self, key: Key, error: BaseException) -> None:
        _inbox(self.cluster, key.dst).fail(
            key, PeerError(f"local: {self.peer_name(key.src)} failed to send {key}: {error}"))

    def _start_recv(self, key: Key) -> Future:
        taken = self._inbox.take(key)
        received: Future = Future()

        def deliver(done: Future) -> None:
            if done.exception() is not None:
                settle(received, error=done.exception())
                return
            settle(received, self._taken(done.result()))

        taken.add_done_callback(deliver)
        return received

    def _recv_and_wait(self, key: Key, timeout: float | None) -> np.ndarray:
        """A receive whose tensor was sent already is taken here, with no future of its own (bench micro's Local
        line hands each tensor over in one thread: this is its whole receive); else as any receive waits."""
        parked = self._inbox.take_parked(key)
        if parked is not None:
            return self._taken(parked)
        return self._wait(self._start_recv(key), key, "recv", timeout)

    def _taken(self, item: tuple[np.ndarray, Future | None]) -> np.ndarray:
        """The sent ``(array, its send's future)`` taken: counted, the send done (a persistent send's, None, was done
        at its hand-over)."""
        array, sent = item
        self.ledger.received(array.nbytes)
        if sent is not None:
            settle(sent)
        return array

    def _outbound(self, name: str, dst: int) -> Outbound:
        return _HandOver(self, name, dst)

    def _inbound(self, name: str, src: int) -> Inbound:
        return _TakeOver(self, name, src)


class _HandOver(Outbound):
    """``local``'s persistent send: the array handed over to the receiver's table, done at once (the receiver gets
    this very array, which the producer treats as read-only until the consumer is done with it, as every local
    send's array). So one thread may send and then receive it (bench micro's Local line does), and a send costs
    what a hand-over costs: no future, no key made (a plain tuple is equal to the :class:`Key` of its fields, and
    hashes alike: the table matches it with keyed receives), the array's checks made once per array object (as
    zerocopy's persistent send: an array keeps its dtype's kind and its byte count for life), counted in a tally of
    its own."""

    __slots__ = ("__weakref__", "_array", "_nbytes", "_put", "_tally")

    def __init__(self, transport: LocalTransport, name: str, dst: int) -> None:
        super().__init__(transport, name, transport.rank, dst)
        self._put = _inbox(transport.cluster, dst).put
        self._tally = transport.ledger.tally(self)
        self._array: np.ndarray | None = None
        self._nbytes = 0

    def send(self, step: int, array: np.ndarray, timeout: float | None = None) -> None:
        if array is not self._array:
            if type(array) is not np.ndarray or array.dtype not in PLAIN_DTYPES:
                # taken in (another framework's tensor) and checked: a ValueError says what is wrong
                array = self.link._check_outgoing(Key(self.name, step, self.src, self.dst), array)
            self._array, self._nbytes = array, array.nbytes
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            self.link._check_key(Key(self.name, step, self.src, self.dst), "send")  # says what is wrong
        self._put((self.name, step, self.src, self.dst), (array, None))
        tally = self._tally
        tally["tensors_sent"] += 1
        tally["payload_bytes_sent"] += self._nbytes


class _TakeOver(Inbound):
    """``local``'s persistent receive: a tensor handed over already is taken from the table at once (by a plain
    tuple, as :class:`_HandOver` puts it); else the receive waits as :meth:`LocalTransport.recv` does."""

    __slots__ = ("__weakref__", "_take_parked", "_tally")

    def __init__(self, transport: LocalTransport, name: str, src: int) -> None:
        super().__init__(transport, name, src, transport.rank)
        self._take_parked = transport._inbox.take_parked
        self._tally = transport.ledger.tally(self)

    def recv(self, step: int, timeout: float | None = None) -> np.ndarray:
        parked = self._take_parked((self.name, step, self.src, self.dst)) if type(step) is int else None
        if parked is None:
            return self.link.recv(Key(self.name, step, self.src, self.dst), timeout)
        array, sent = parked
        if sent is not None:  # a keyed send's: done now
            settle(sent)
        tally = self._tally
        tally["tensors_received"] += 1
        tally["payload_bytes_received"] += array.nbytes
        return array
