"""The links of the ``mpi`` and ``mpi_rma`` peer lines, made in the two MPI processes that ``mpirun`` starts (see
``bench.experiments.peers.mpi``): :class:`MpiLink` (``comm.Send`` of the tensor's bytes, ``comm.Recv`` into a buffer
preallocated per tensor) and :class:`MpiRmaLink` (one-sided: a window per tensor, ``Put``, ``Flush``, ``Put`` of a
flag, ``Flush``; the receiver polls the flag), their persistent sends and receives, and the ready signals between the
two processes over MPI itself (:class:`MpiSignals`). A tensor over 1 GiB goes in pieces of :data:`CHUNK_BYTES`."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.experiments.micro import RECEIVER, SENDER
from bench.experiments.peers import PeerLineError, PeerLink
from transports import Inbound, Key, Outbound

#: the signals' tag (the data goes on DATA_TAG)
SIGNAL_TAG, DATA_TAG = 1, 2
#: bytes before the tensor in a receiver's window: the flag (the number of the last transfer written, plus one)
FLAG_BYTES = 8
#: the most bytes one message or put carries: Open MPI's wheel refuses counts beyond a C int (MPI_ERR_ARG), so a
#: larger tensor goes in pieces of this size, as a user of MPI moves one
CHUNK_BYTES = 1 << 30


def library() -> str:
    """The MPI library mpi4py runs on, as a line's ``describe()`` names it: ``open-mpi-v5.0.11``."""
    from mpi4py import MPI

    first = MPI.Get_library_version().split(",")[0].strip()  # "Open MPI v5.0.11"
    return first.replace(" ", "-").lower()


class MpiSignals:
    """The ready signals between the two MPI processes, over MPI itself (tag 1): one int64 each, sent and received
    from a buffer of its own (no pickling: a signal costs what a user's would), -1 for done."""

    _DONE = -1

    def __init__(self, comm: Any, other: int) -> None:
        self.comm, self.other = comm, other
        self._out = np.zeros(1, np.int64)
        self._in = np.zeros(1, np.int64)

    def send(self, value: Any) -> None:
        self._out[0] = self._DONE if value == "done" else value
        self.comm.Send(self._out, dest=self.other, tag=SIGNAL_TAG)

    def recv(self) -> Any:
        self.comm.Recv(self._in, source=self.other, tag=SIGNAL_TAG)
        value = int(self._in[0])
        return "done" if value == self._DONE else value


class MpiLink(PeerLink):
    """Two-sided MPI: ``Send``/``Recv`` of the bytes. What a transfer does beyond the library's call is made once
    per tensor (its byte views, the status) and reused, as a user's loop would."""

    def __init__(self, comm: Any, timeout_s: float) -> None:
        super().__init__(timeout_s)
        from mpi4py import MPI

        self.comm = comm
        self._byte = MPI.BYTE
        self._status = MPI.Status()
        #: the last tensor sent and received, each with its pieces (views of at most CHUNK_BYTES)
        self._sending: tuple[np.ndarray | None, list[np.ndarray]] = (None, [])
        self._receiving: tuple[np.ndarray | None, list[np.ndarray]] = (None, [])

    def send(self, key: Key, tensor: np.ndarray) -> None:
        sending, pieces = self._sending
        if sending is not tensor:
            pieces = _pieces(_bytes(tensor))
            self._sending = (tensor, pieces)
        send = self.comm.Send
        for piece in pieces:
            send(piece, dest=RECEIVER, tag=DATA_TAG)
        self._sent(tensor)

    def recv(self, key: Key) -> np.ndarray:
        buffer = self.buffer(key)
        receiving, pieces = self._receiving
        if receiving is not buffer:
            pieces = _pieces(_bytes(buffer))
            self._receiving = (buffer, pieces)
        status, got = self._status, 0
        for piece in pieces:
            self.comm.Recv(piece, source=SENDER, tag=DATA_TAG, status=status)
            got += status.Get_count(self._byte)
        if got != buffer.nbytes:
            raise PeerLineError(f"mpi: {key} arrived with {got} bytes, the plan says {buffer.nbytes}")
        self._received(buffer)
        return buffer

    def describe(self) -> dict[str, Any]:
        return {"fabric": "mpi", "used": [library()]}

    # (mpi_rma's link, a subclass, moves by puts: there its send and recv per transfer)
    def outbound(self, name: str, dst: int) -> Outbound:
        return _MpiOutbound(self, name, dst) if type(self) is MpiLink else super().outbound(name, dst)

    def inbound(self, name: str, src: int) -> Inbound:
        return _MpiInbound(self, name, src) if type(self) is MpiLink else super().inbound(name, src)


class _MpiOutbound(Outbound):
    """The ``mpi`` line's send per transfer, as a user's loop writes it: ``comm.Send`` of each piece of the tensor
    (one below :data:`CHUNK_BYTES`), the pieces made once per tensor. What it adds to a user's line is counted in the
    link's counts in place (a method call for them cost about 0.05 µs of a 2 µs transfer at 1KB)."""

    __slots__ = ("_counts", "_link", "_pieces", "_send", "_tensor")

    def __init__(self, link: MpiLink, name: str, dst: int) -> None:
        super().__init__(link, name, SENDER, dst)
        self._link, self._send, self._counts = link, link.comm.Send, link._counts
        self._tensor: np.ndarray | None = None
        self._pieces: list[np.ndarray] = []

    def send(self, step: int, array: np.ndarray, timeout: float | None = None) -> None:
        if array is not self._tensor:
            self._pieces, self._tensor = _pieces(_bytes(array)), array
        send = self._send
        for piece in self._pieces:
            send(piece, RECEIVER, DATA_TAG)
        counts = self._counts
        counts["tensors_sent"] += 1
        counts["payload_bytes_sent"] += array.nbytes


class _MpiInbound(Inbound):
    """The ``mpi`` line's receive per transfer: ``comm.Recv`` into each piece of the tensor's buffer. The byte count
    is not asked of MPI here (``MpiLink.recv`` asks it): a longer message is MPI's error (truncation), and a shorter
    one leaves the tensor's last element, the transfer's marker, unwritten, which the harness's check finds."""

    __slots__ = ("_buffer", "_counts", "_link", "_nbytes", "_pieces", "_recv")

    def __init__(self, link: MpiLink, name: str, src: int) -> None:
        super().__init__(link, name, src, RECEIVER)
        self._link, self._recv, self._counts = link, link.comm.Recv, link._counts
        self._buffer: np.ndarray | None = None
        self._pieces: list[np.ndarray] = []
        self._nbytes = 0

    def recv(self, step: int, timeout: float | None = None) -> np.ndarray:
        buffer = self._buffer
        if buffer is None:
            buffer = self._buffer = self._link.buffer(Key(self.name, step, self.src, self.dst))
            self._pieces, self._nbytes = _pieces(_bytes(buffer)), buffer.nbytes
        recv = self._recv
        for piece in self._pieces:
            recv(piece, SENDER, DATA_TAG)
        counts = self._counts
        counts["tensors_received"] += 1
        counts["payload_bytes_received"] += self._nbytes
        return buffer


class MpiRmaLink(MpiLink):
    """One-sided MPI: Put, Flush, Put of the flag, Flush; the receiver polls the flag in its window."""

    def __init__(self, comm: Any, timeout_s: float) -> None:
        super().__init__(comm, timeout_s)
        self._window: Any = None
        self._window_of: str | None = None
        self._flag: np.ndarray | None = None
        self._data: np.ndarray | None = None
        self._mark = np.zeros(1, np.int64)

    def _open(self, key: Key) -> None:
        """The window of ``key``'s tensor (collective: both sides get here at the tensor's first transfer)."""
        if self._window_of == key.name:
            return
        from mpi4py import MPI

        self._free()
        shape, dtype, nbytes = self.planned(key)
        mine = FLAG_BYTES + nbytes if self.comm.Get_rank() == RECEIVER else 0
        self._window = MPI.Win.Allocate(mine, 1, comm=self.comm)
        if mine:
            memory = np.frombuffer(self._window.tomemory(), dtype=np.uint8)
            self._flag = memory[:FLAG_BYTES].view(np.int64)
            self._flag[0] = 0
            self._data = memory[FLAG_BYTES:].view(dtype).reshape(shape)
        self._window.Lock_all()
        self.comm.Barrier()  # the receiver's flag is zero before the first put
        self._window_of = key.name

    def send(self, key: Key, tensor: np.ndarray) -> None:
        self._open(key)
        window = self._window
        for offset, piece in enumerate(_pieces(_bytes(tensor))):
            window.Put(piece, RECEIVER, target=FLAG_BYTES + offset * CHUNK_BYTES)
        window.Flush(RECEIVER)
        self._mark[0] = key.step + 1
        window.Put(self._mark, RECEIVER, target=0)
        window.Flush(RECEIVER)
        self._sent(tensor)

    def recv(self, key: Key) -> np.ndarray:
        self._open(key)
        self.await_flag(self._flag, key.step + 1, key, self._window.Sync)
        self._received(self._data)
        return self._data

    # (a subclass that changes send or recv, as the tests' faulty links do, gets them per transfer)
    def outbound(self, name: str, dst: int) -> Outbound:
        return _MpiRmaOutbound(self, name, dst) if type(self) is MpiRmaLink else PeerLink.outbound(self, name, dst)

    def inbound(self, name: str, src: int) -> Inbound:
        return _MpiRmaInbound(self, name, src) if type(self) is MpiRmaLink else PeerLink.inbound(self, name, src)

    def _free(self) -> None:
        if self._window is not None:
            self._flag = self._data = None
            self._window.Unlock_all()
            self._window.Free()
            self._window, self._window_of = None, None

    def close(self) -> None:
        self._free()


class _MpiRmaOutbound(Outbound):
    """The ``mpi_rma`` line's send per transfer, as a user's loop writes it: ``Put`` of each piece, ``Flush``,
    ``Put`` of the flag, ``Flush``; the pieces and the window's methods taken once per tensor (the window is opened
    at the tensor's first transfer, collectively)."""

    __slots__ = ("_flush", "_link", "_pieces", "_put", "_tensor", "_window")

    def __init__(self, link: MpiRmaLink, name: str, dst: int) -> None:
        super().__init__(link, name, SENDER, dst)
        self._link, self._tensor, self._window = link, None, None
        self._pieces: list[tuple[int, np.ndarray]] = []

    def send(self, step: int, array: np.ndarray, timeout: float | None = None) -> None:
        link = self._link
        if link._window_of != self.name or link._window is not self._window or array is not self._tensor:
            link._open(Key(self.name, step, SENDER, RECEIVER))
            self._window, self._tensor = link._window, array
            self._put, self._flush = self._window.Put, self._window.Flush
            self._pieces = [(FLAG_BYTES + offset * CHUNK_BYTES, piece)
                            for offset, piece in enumerate(_pieces(_bytes(array)))]
        put, flush, mark = self._put, self._flush, link._mark
        for target, piece in self._pieces:
            put(piece, RECEIVER, target)
        flush(RECEIVER)
        mark[0] = step + 1
        put(mark, RECEIVER, 0)
        flush(RECEIVER)
        counts = link._counts
        counts["tensors_sent"] += 1
        counts["payload_bytes_sent"] += array.nbytes


class _MpiRmaInbound(Inbound):
    """The ``mpi_rma`` line's receive per transfer: poll the flag (``Win.Sync`` between reads) until the sender put
    this transfer's, then the tensor in the window."""

    __slots__ = ("_link",)

    def __init__(self, link: MpiRmaLink, name: str, src: int) -> None:
        super().__init__(link, name, src, RECEIVER)
        self._link = link

    def recv(self, step: int, timeout: float | None = None) -> np.ndarray:
        link = self._link
        if link._window_of != self.name:
            link._open(Key(self.name, step, SENDER, RECEIVER))
        flag, want = link._flag, step + 1
        if flag[0] != want:
            link.await_flag(flag, want, Key(self.name, step, SENDER, RECEIVER), link._window.Sync)
        data, counts = link._data, link._counts
        counts["tensors_received"] += 1
        counts["payload_bytes_received"] += data.nbytes
        return data


def _bytes(tensor: np.ndarray) -> np.ndarray:
    """The tensor's memory as bytes (no copy)."""
    return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)


def _pieces(data: np.ndarray) -> list[np.ndarray]:
    """``data`` (bytes) in views of at most :data:`CHUNK_BYTES`, in order; one view for a smaller tensor."""
    return [data[start:start + CHUNK_BYTES] for start in range(0, max(1, data.size), CHUNK_BYTES)]
