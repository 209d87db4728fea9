"""The ``mpi`` and ``mpi_rma`` peers: what MPI moves between two processes of one host (mpi4py on the MPI it
finds; the ``mpi`` extra brings Open MPI's wheel, whose shared-memory transport carries the data).

- ``mpi``: ``comm.Send`` of the tensor's bytes, ``comm.Recv`` into a buffer preallocated per tensor.
- ``mpi_rma``: one-sided. Per tensor both sides make a window (``Win.Allocate``: the receiver's holds an 8-byte
  flag and the tensor, the sender's nothing) and open a passive epoch on it (``Lock_all``). A send is ``Put``
  of the bytes, ``Flush``, ``Put`` of the flag (the transfer's number), ``Flush``; a receive polls the flag
  (``Win.Sync`` between reads) and returns a view of the window. The window of a tensor is made at its first
  transfer (a warm-up one) and freed at the next tensor's.

A tensor over 1 GiB goes in pieces of 1 GiB (messages or puts): Open MPI's wheel refuses a count beyond a C int.

The two MPI processes must be started together (Open MPI 5's singletons cannot connect to each other:
``Comm_accept``/``Comm_connect`` and ``Comm.Join`` fail with ``MPI_ERR_INTERN``), so the line's one rank, the
*relay*, runs ``mpirun -np 2 python -m bench.experiments.peers.mpi HUB``. The two processes join the relay over
a Unix socket in a private directory (authenticated with the run's token, as ranks join a coordinator), get the
points, signal each other over MPI (tag 1, outside the timed interval as always) and send their reports to the
relay, which hands them to the coordinator. So the line runs where its relay's launcher runs processes on this
host (the local launcher). mpirun's own listener (PRRTE's) binds every interface whatever it is told, and Open MPI's
tcp component listens on every interface too, so the pair is kept off the network, the strongest way this machine
allows (``MpiLine.hosts`` chooses; ``listeners`` says which):

1. in a private emulated host, as perftest's tools run (root and iproute2: ``bench.launch.private``);
2. else, where the kernel makes network namespaces but ``ip`` is missing (a bare Debian root), mpirun and its
   processes in a network namespace of their own with only loopback (``unshare``; a user namespace too when not
   root);
3. else (a container that makes no namespace), on the host's network with every address they bind put on loopback
   (a small library preloaded into mpirun and its processes, built here with the C compiler the install needed:
   Open MPI has no option that binds PRRTE's listener). Reachable then from this host's other users, not from other
   hosts: that weaker isolation is said in one line of ``bench micro``'s output and kept in ``meta.json``
   (``isolation``), and the relay checks that nothing of the pair listens off loopback before the first transfer
   (``bench.experiments.peers.isolation`` holds the namespace, the library and the check).

Under a launcher of emulated hosts both processes would share one host and never cross its link, and under
``--launcher mpi`` a second mpirun inside an MPI job is not started: there it is left out.

The line leaves nothing however it ends: mpirun's session directory (``TMPDIR``) and the pair's shared-memory files
(Open MPI's ``sm_segment.*``, its windows', UCX's: every ``*_backing_directory``) go into two 0700 directories of the
relay's, one in /tmp and one in /dev/shm, removed when it ends, or by a reaper outside its emulated host when it is
killed; mpirun gets SIGTERM when the relay dies. A failure while /dev/shm has no room says so.

Why one module of 800 lines: mpirun starts it as ``__main__`` in both MPI processes, which take from it the
links, their persistent sends and receives, the plain loop and the signals; the relay that starts them is the
line's other half, and shares its protocol (hello, points, reports).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from bench.experiments.micro import RECEIVER, SENDER, STARTUP_S, Point
from bench.experiments.peers import PeerLine, PeerLineError, PeerLink, drive
from bench.experiments.peers.isolation import (
    ENTER_NAMESPACE,
    compiler_problem,
    listening_off_loopback,
    loopback_environment,
    own_namespace_problem,
    process_tree,
)
from bench.launch import Launcher, LaunchError, RankContext, RankSpec
from bench.launch import hosts as emulated_hosts
from bench.launch.context import connect
from bench.launch.hosts import REAPER_PIPES, spawn_reaper
from bench.launch.hub import Hub
from bench.launch.messages import TOKEN_VARIABLE, Hello, describe_error
from bench.launch.mpi import mpirun_path
from bench.launch.private import PrivateHosts, hosts_for_open_listeners
from bench.launch.wire import receive_message, send_message
from transports import Cluster, Inbound, Key, Outbound
from transports.common import Availability

#: the signals' tag (the data goes on DATA_TAG)
SIGNAL_TAG, DATA_TAG = 1, 2
#: seconds mpirun may take to end once both processes said they finished
_EXIT_S = 30.0
#: bytes before the tensor in a receiver's window: the flag (the number of the last transfer written, plus one)
_FLAG_BYTES = 8
#: the most bytes one message or put carries: Open MPI's wheel refuses counts beyond a C int (MPI_ERR_ARG), so a
#: larger tensor goes in pieces of this size, as a user of MPI moves one
CHUNK_BYTES = 1 << 30


def _library() -> str:
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
        return {"fabric": "mpi", "used": [_library()]}

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
        mine = _FLAG_BYTES + nbytes if self.comm.Get_rank() == RECEIVER else 0
        self._window = MPI.Win.Allocate(mine, 1, comm=self.comm)
        if mine:
            memory = np.frombuffer(self._window.tomemory(), dtype=np.uint8)
            self._flag = memory[:_FLAG_BYTES].view(np.int64)
            self._flag[0] = 0
            self._data = memory[_FLAG_BYTES:].view(dtype).reshape(shape)
        self._window.Lock_all()
        self.comm.Barrier()  # the receiver's flag is zero before the first put
        self._window_of = key.name

    def send(self, key: Key, tensor: np.ndarray) -> None:
        self._open(key)
        window = self._window
        for offset, piece in enumerate(_pieces(_bytes(tensor))):
            window.Put(piece, RECEIVER, target=_FLAG_BYTES + offset * CHUNK_BYTES)
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
            self._pieces = [(_FLAG_BYTES + offset * CHUNK_BYTES, piece)
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


# -- the calibration: the same transfers as a user's plain loop writes them ----------------------------------


class PlainLoop:
    """The ``mpi`` line's calibration (``mpi_plain``): what mpi4py moves in the ten lines a user would write, with
    the protocol of every line (the receiver's ready signal outside the timed interval, its reduce-max inside) and
    none of the harness: no link, no ledger, no data check beyond the marker. The distance from the ``mpi`` line to
    this one is what the harness costs MPI; the ``harness`` line, what it costs every line. :class:`PlainRmaLoop`
    is the ``mpi_rma`` line's.

    Its two processes are placed as every line's ranks are (:func:`bind_timing_thread`: the sender on the first
    CPU, the receiver on the second). Left where the kernel puts them, both often ran on one core (the woken
    process goes to its waker's), where a 1MB message moves through the core's own cache: 70-86 µs against
    146-157 µs across two cores here, a placement, not a cost of the harness. Its tensor holds data in every page,
    as the lines' do: one from ``np.zeros`` that is never written is the kernel's one zero page mapped over and
    over, which a copy reads from the cache (1MB: 67-80 µs from zeros, 98-102 from a filled tensor)."""

    #: told apart from a link class by this, not by identity: the MPI processes run this module as ``__main__``
    plain = True
    name = "mpi_plain"

    @classmethod
    def run(cls, comm: Any, points: list[Point], report: Any) -> None:
        """Time ``points`` between the two processes of ``comm``; the receiver reports a record per point."""
        from bench.experiments.micro import bind_timing_thread, fill
        from bench.experiments.micro.sources import plain_written

        rank = comm.Get_rank()
        bind_timing_thread(rank)
        for point in points:
            if point.size_bytes > CHUNK_BYTES:  # one message carries at most CHUNK_BYTES: no longer ten lines
                continue
            tensor = np.empty(point.spec.shape, point.dtype)
            fill(tensor)  # data in every page, as a user's tensor holds (np.zeros' untouched pages are one zero page)
            written = plain_written(point, rank)
            times = cls.loop(comm, rank, tensor, point.warmup + point.iters, written)
            cls.report_point(comm, rank, point, times, report, written)

    @staticmethod
    def loop(comm: Any, rank: int, tensor: np.ndarray, total: int, written: np.ndarray | None = None) -> np.ndarray:
        """``total`` transfers of ``tensor``: the sender's clock at each send, or the receiver's once consumed; with
        ``written`` (a fresh source), the sender's whole write of the tensor before each, and when it ended."""
        from bench.experiments.micro import clock_ns, marker
        from bench.experiments.micro.sources import rewriter

        ready, times, kind = np.zeros(1, np.int64), np.zeros(total, np.int64), tensor.dtype
        rewrite = rewriter(tensor) if written is not None else None
        for i in range(total):
            if rank == RECEIVER:
                comm.Send(ready, dest=SENDER, tag=SIGNAL_TAG)
                comm.Recv(tensor, source=SENDER, tag=DATA_TAG)
                if tensor.max() != marker(i, kind):
                    raise PeerLineError(f"mpi_plain: transfer {i} of {tensor.nbytes} bytes arrived wrong")
                times[i] = clock_ns()
            else:
                comm.Recv(ready, source=RECEIVER, tag=SIGNAL_TAG)
                if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
                    rewrite()
                    written[i] = clock_ns()
                tensor[-1] = marker(i, kind)
                times[i] = clock_ns()
                comm.Send(tensor, dest=RECEIVER, tag=DATA_TAG)
        return times

    @classmethod
    def report_point(cls, comm: Any, rank: int, point: Point, times: np.ndarray, report: Any,
                     written: np.ndarray | None = None) -> None:
        """The sender's clocks (the sends', then its fresh writes' ends: zeros without) to the receiver, which
        reports the point's record."""
        from bench.experiments.micro import Measured
        from bench.experiments.micro.sources import plain_columns
        from bench.experiments.references.running import record
        from bench.results import latency_summary

        if rank == SENDER:
            comm.Send(np.stack([times, written if written is not None else np.zeros_like(times)]), dest=RECEIVER,
                      tag=SIGNAL_TAG)
            return
        clocks = np.zeros((2, len(times)), np.int64)
        comm.Recv(clocks, source=SENDER, tag=SIGNAL_TAG)
        starts, written = clocks
        summary = latency_summary((times - starts)[point.warmup:] / 1e3)
        report(Measured(point.size_bytes, record(
            cls.name, point.size_bytes, point.warmup, point.iters, **summary,
            throughput_MBps=point.size_bytes / 2**20 / (summary["mean_us"] / 1e6),
            sender_cpu_s=float("nan"), receiver_cpu_s=float("nan"), copied_bytes=0,
            fabric=f"mpi:{_library()}", **plain_columns(point, starts, written))))


class PlainRmaLoop(PlainLoop):
    """The ``mpi_rma`` line's calibration (``mpi_rma_plain``): the same one-sided protocol in a plain loop (a window
    of flag and tensor on the receiver; ``Put``, ``Flush``, ``Put`` of the flag, ``Flush``; the receiver polls the
    flag with ``Win.Sync`` between reads)."""

    name = "mpi_rma_plain"

    @staticmethod
    def loop(comm: Any, rank: int, tensor: np.ndarray, total: int, written: np.ndarray | None = None) -> np.ndarray:
        from mpi4py import MPI

        from bench.experiments.micro import clock_ns, marker
        from bench.experiments.micro.sources import rewriter

        ready, times, kind = np.zeros(1, np.int64), np.zeros(total, np.int64), tensor.dtype
        rewrite = rewriter(tensor) if written is not None else None
        window = MPI.Win.Allocate(_FLAG_BYTES + tensor.nbytes if rank == RECEIVER else 0, 1, comm=comm)
        try:
            if rank == RECEIVER:
                memory = np.frombuffer(window.tomemory(), dtype=np.uint8)
                flag = memory[:_FLAG_BYTES].view(np.int64)
                flag[0] = 0
                data = memory[_FLAG_BYTES:].view(kind)
            window.Lock_all()
            comm.Barrier()  # the receiver's flag is zero before the first put
            mark, payload = np.zeros(1, np.int64), tensor.reshape(-1).view(np.uint8)
            for i in range(total):
                if rank == RECEIVER:
                    comm.Send(ready, dest=SENDER, tag=SIGNAL_TAG)
                    while flag[0] != i + 1:
                        window.Sync()
                    if data.max() != marker(i, kind):
                        raise PeerLineError(f"mpi_rma_plain: transfer {i} of {tensor.nbytes} bytes arrived wrong")
                    times[i] = clock_ns()
                else:
                    comm.Recv(ready, source=RECEIVER, tag=SIGNAL_TAG)
                    if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
                        rewrite()
                        written[i] = clock_ns()
                    tensor[-1] = marker(i, kind)
                    times[i] = clock_ns()
                    window.Put(payload, RECEIVER, target=_FLAG_BYTES)
                    window.Flush(RECEIVER)
                    mark[0] = i + 1
                    window.Put(mark, RECEIVER, target=0)
                    window.Flush(RECEIVER)
            window.Unlock_all()
        finally:
            if rank == RECEIVER:
                del memory, flag, data
            window.Free()
        return times


# -- the line: a relay rank and the MPI pair it starts ---------------------------------------------------


@dataclass
class MpiLine(PeerLine):
    """mpi4py point-to-point between two processes that one ``mpirun`` starts."""

    module: ClassVar[str] = "mpi4py"
    install: ClassVar[str] = "pip install -e '.[mpi]' brings mpi4py and Open MPI's wheel"
    link_class: ClassVar[type[MpiLink]] = MpiLink
    #: how the pair is kept off the network (set by :meth:`hosts`): EMULATED_HOST, OWN_NAMESPACE or LOOPBACK
    listeners: str = field(default="", compare=False)

    def availability(self) -> Availability:
        if not (status := super().availability()).ok:
            return status
        if mpirun_path() is None:
            return Availability(False, f"no mpirun here ({self.install})")
        return Availability(True)

    def hosts(self, launcher: Launcher) -> PrivateHosts:
        if not launcher.starts_processes or launcher.private_hosts:
            raise LaunchError(f"the {self.name} line starts its own pair of MPI processes on this host: under "
                              f"--launcher {launcher.name} they would not cross the run's links (measure it "
                              "under --launcher local)")
        self.listeners = EMULATED_HOST
        try:  # mpirun (PRRTE's listener) and Open MPI's tcp component listen on every interface
            return hosts_for_open_listeners(launcher, _WHAT, _LEAVE_OUT)
        except LaunchError:
            no_host = _emulated_host_problem()
            if no_host is None or not ipaddress.ip_address(launcher.bind).is_loopback:
                raise  # refused for another reason, or asked to listen on the network and refused that
        if (no_namespace := own_namespace_problem()) is None:
            self.listeners = OWN_NAMESPACE
            return PrivateHosts(launcher, False, True, f"no emulated host here ({no_host}): {_WHAT} in a network "
                                                       "namespace of their own, with only loopback")
        if (no_compiler := compiler_problem()) is not None:
            raise LaunchError(f"{_WHAT} listen on every interface, and here no network namespace can be made "
                              f"({no_namespace}) nor their listeners bound to loopback ({no_compiler}); or pass "
                              f"{_LEAVE_OUT}")
        self.listeners = LOOPBACK
        return PrivateHosts(launcher, False, False, self.weaker_isolation or "")

    @property
    def weaker_isolation(self) -> str | None:
        """One line saying how the pair is exposed, where it runs less isolated than in a network namespace (the run
        prints it and keeps it in meta.json); None where it is isolated."""
        if self.listeners != LOOPBACK:
            return None
        return (f"no network namespace can be made here ({own_namespace_problem()}): {_WHAT} run on the host's "
                "network with every address they bind put on loopback, reachable from this host's other users but "
                "not from other hosts")

    def link(self, cluster: Cluster, rank: int) -> MpiLink:
        raise NotImplementedError("an MPI link is made in the MPI processes (see _mpi_process)")

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        return [RankSpec(functools.partial(_relay_job, self, points), "mpirun")]


@dataclass
class MpiRmaLine(MpiLine):
    """MPI one-sided put, flush and flag between two processes that one ``mpirun`` starts."""

    link_class: ClassVar[type[MpiLink]] = MpiRmaLink


@dataclass
class MpiPlainLine(MpiLine):
    """The ``mpi`` line's calibration (``bench micro --calibrate``): mpi4py's ``Send``/``Recv`` in a plain loop
    (:class:`PlainLoop`), measured beside the ``mpi`` line and never a candidate for ``of_peer``."""

    name: str = "mpi_plain"
    link_class: ClassVar[type] = PlainLoop
    time_reference: ClassVar[bool] = False


@dataclass
class MpiRmaPlainLine(MpiPlainLine):
    """The ``mpi_rma`` line's calibration: its one-sided protocol in a plain loop (:class:`PlainRmaLoop`)."""

    name: str = "mpi_rma_plain"
    link_class: ClassVar[type] = PlainRmaLoop


def _relay_job(line: MpiLine, points: list[Point], ctx: RankContext) -> None:
    """Start the MPI pair, hand it the points, pass its reports on; a failure of either is this rank's."""
    with _private_directories() as (private, shm):
        # in /dev/shm where there is a directory: a path of fixed length, while the rank's TMPDIR (the local
        # launcher's $TMPDIR/bench-run-*/r<N>) can make one past a Unix socket's 107 bytes
        hub = Hub(os.path.join(shm or private, "hub"), ctx.cluster.token, 2)
        log_path = Path(private) / "mpirun.log"
        env = {**os.environ, TOKEN_VARIABLE: ctx.cluster.token, "PYTHONPATH": os.pathsep.join(sys.path),
               # Open MPI refuses root unless told twice
               "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               **_private_files(private, shm)}
        if line.listeners == LOOPBACK:
            env.update(loopback_environment(private, env))
        with open(log_path, "w+") as log:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _START_MPIRUN, str(os.getpid()),
                                     "namespace" if line.listeners == OWN_NAMESPACE else "-",
                                     mpirun_path() or "mpirun", "-np", "2", "--oversubscribe", sys.executable,
                                     "-m", __name__, hub.address], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
            try:
                _relay(line, points, ctx, hub, proc, log)
            except PeerLineError as exc:
                if short := _shm_short(points):  # said in the first line: that is the line an error shows
                    first, newline, rest = str(exc).partition("\n")
                    raise PeerLineError(f"{first}{short}{newline}{rest}") from None
                raise
            finally:
                _end(proc)
                hub.close()


# -- keeping the pair off the network -----------------------------------------------------------------------------

#: how the pair is kept off the network (``MpiLine.listeners``): see the module's docstring
EMULATED_HOST, OWN_NAMESPACE, LOOPBACK = "emulated host", "own namespace", "loopback"
_WHAT = "mpirun and its MPI processes"
_LEAVE_OUT = "--peers without mpi and mpi_rma"

#: runs mpirun (argv[3:]) so that it gets SIGTERM, ending its job, should the relay (argv[1]) die first (SIGKILL:
#: no ``finally`` runs), in a network namespace of its own when argv[2] is "namespace"; exits 3 if the relay is
#: gone already
_START_MPIRUN = ENTER_NAMESPACE + (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 15, 0, 0, 0)\n"  # PR_SET_PDEATHSIG, SIGTERM; kept across exec
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(3)\n"
    "if sys.argv[2] == 'namespace':\n"
    "    enter_namespace()\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def _emulated_host_problem() -> str | None:
    """Why no private emulated host can be made here (bench.launch.hosts' probe), or None."""
    try:
        emulated_hosts.check_support()
    except emulated_hosts.NetnsUnavailable as exc:
        return str(exc)
    return None



#: Open MPI's (and UCX's) parameters naming where shared-memory backing files go (default: /dev/shm)
_BACKING_VARIABLES = ("OMPI_MCA_btl_sm_backing_directory", "OMPI_MCA_osc_sm_backing_directory",
                      "OMPI_MCA_osc_rdma_backing_directory", "OMPI_MCA_osc_ucx_backing_directory",
                      "OMPI_MCA_shmem_mmap_backing_file_base_dir", "UCX_POSIX_DIR")
_SHM = "/dev/shm"


@contextlib.contextmanager
def _private_directories() -> Iterator[tuple[str, str | None]]:
    """Two 0700 directories of this line, gone however it ends (a reaper removes them if this process is killed):
    one in /tmp (mpirun's log, and mpirun's session directory: ``TMPDIR``) and one in /dev/shm (the relay's socket,
    and the pair's shared-memory files, which Open MPI leaves behind when its processes are killed), or None where
    /dev/shm takes no directory (the socket is then in the first)."""
    private = tempfile.mkdtemp(prefix="bench-mpi-peer-")
    shm = None
    with contextlib.suppress(OSError):
        shm = tempfile.mkdtemp(prefix="bench-mpi-peer-", dir=_SHM)
    try:
        reaper = _Reaper([private, *([shm] if shm else [])])
    except BaseException:
        _remove(private, shm)
        raise
    try:
        yield private, shm
    finally:
        _remove(private, shm)
        reaper.release()


#: the reaper's program: leave the relay's network namespace for its parent's (argv[1]; an emulated host's
#: teardown kills every process inside it, and would kill the reaper before it removed anything), say so, wait for
#: the relay to close the pipe, and unless it said "closed" first, remove the directories (argv[2:])
_REAPER = (
    "import ctypes, os, shutil, sys\n"
    "try:\n"
    "    fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "    ctypes.CDLL(None).setns(fd, 0x40000000)\n"  # CLONE_NEWNET; where it fails (not root), it stays
    "    os.close(fd)\n"
    "except OSError:\n"
    "    pass\n"
    "sys.stdout.write('ready\\n')\n"
    "sys.stdout.flush()\n"
    "if sys.stdin.buffer.read() != b'closed':\n"
    "    for directory in sys.argv[2:]:\n"
    "        shutil.rmtree(directory, ignore_errors=True)\n"
)


class _Reaper:
    """A process that removes ``directories`` when the relay dies without removing them (SIGKILL).

    ``bench.launch.hosts.Reaper`` does that too, but it would run inside the relay's emulated host, whose
    teardown kills it: this one runs in the coordinator's network namespace, and is ready once started.
    """

    def __init__(self, directories: list[str]) -> None:
        self._process, self._pipe = spawn_reaper(
            [sys.executable, "-I", "-c", _REAPER, f"/proc/{os.getppid()}/ns/net", *directories],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._process.stdout.readline()  # in its namespace: from now on an emulated host's teardown spares it

    def release(self) -> None:
        """The directories are gone: the reaper exits (and is waited for)."""
        REAPER_PIPES.discard(self._pipe)
        with contextlib.suppress(OSError):
            os.write(self._pipe, b"closed")
        os.close(self._pipe)
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process.stdout.close()


def _remove(*directories: str | None) -> None:
    for directory in directories:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def _private_files(private: str, shm: str | None) -> dict[str, str]:
    """The environment that puts every file mpirun and the pair make under the line's own directories."""
    env = {"TMPDIR": private}  # PRRTE's and PMIx's session directories (``ompi.*``, ``prte.*``)
    if shm:
        env.update(dict.fromkeys(_BACKING_VARIABLES, shm))
    return env


def _shm_short(points: list[Point]) -> str:
    """``; /dev/shm is full (...)`` when /dev/shm has less room than the largest tensor of ``points`` (a failure
    of the pair's shared-memory windows or segments then has that cause), else ''."""
    try:
        stat = os.statvfs(_SHM)
    except OSError:
        return ""
    free = stat.f_bavail * stat.f_frsize
    need = _FLAG_BYTES + max((point.size_bytes for point in points), default=0) + _SHM_MARGIN_BYTES
    if free >= need:
        return ""
    return (f"; {_SHM} is full ({_spelled(free)} free of {_spelled(stat.f_blocks * stat.f_frsize)}, the MPI pair's "
            f"shared memory needs about {_spelled(need)}): free space there (rm files you know are stale) or "
            f"enlarge it (mount -o remount,size=8G {_SHM})")


#: shared memory the pair needs beyond its window: Open MPI's segments for its shared-memory transport
_SHM_MARGIN_BYTES = 16 << 20


def _spelled(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} bytes"


def _relay(line: MpiLine, points: list[Point], ctx: RankContext, hub: Hub, proc: subprocess.Popen, log: Any) -> None:
    def broken(what: str) -> PeerLineError:
        log.flush()
        log.seek(0)
        tail = "".join(log.readlines()[-8:]).strip()
        return PeerLineError(f"{line.name}: {what}" + (f"; mpirun said:\n{tail}" if tail else ""))

    conns: dict[int, Connection] = {}
    deadline = time.monotonic() + STARTUP_S
    while len(conns) < 2:
        try:
            rank, conn = hub.arrivals.get(timeout=0.2)
            conns[rank] = conn
        except queue.Empty:
            if proc.poll() is not None:
                raise broken(f"mpirun exited (code {proc.returncode}) before both MPI processes started") from None
            if time.monotonic() > deadline:
                raise broken(f"the MPI processes did not start within {STARTUP_S:.0f} s") from None
    if line.listeners == LOOPBACK and (exposed := listening_off_loopback(process_tree(proc.pid))):
        raise broken(f"the MPI pair listens off loopback ({', '.join(exposed)}) although every address it binds "
                     f"was to be put there; pass {_LEAVE_OUT}")
    for conn in conns.values():
        send_message(conn, (line.link_class, points, line.timeout_s))
    open_ = {conn: rank for rank, conn in conns.items()}
    while open_:
        ready = wait(list(open_), timeout=0.5)
        for conn in ready:
            role = "sender" if open_[conn] == SENDER else "receiver"
            try:
                message = receive_message(conn)  # decoded as data: nothing it sends can run code here
            except (EOFError, OSError):
                raise broken(f"the MPI {role} ended without a word") from None
            if message == "finished":
                del open_[conn]
            elif isinstance(message, tuple) and message[:1] == ("failed",):
                raise PeerLineError(f"{line.name}: the MPI {role} failed: {message[1]}")
            else:
                ctx.report(message)
        if not ready and proc.poll() is not None:
            raise broken(f"mpirun exited (code {proc.returncode}) before the MPI processes finished")
    try:
        code = proc.wait(timeout=_EXIT_S)
    except subprocess.TimeoutExpired:
        raise broken(f"mpirun did not end within {_EXIT_S:.0f} s of both processes finishing") from None
    if code != 0:
        raise broken(f"mpirun exited with code {code}")


def _end(proc: subprocess.Popen) -> None:
    """mpirun gone, and its processes with it (SIGTERM: mpirun ends its job; then SIGKILL)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _mpi_process(hub: str) -> int:
    """One of the two MPI processes: join the relay, get the points, run its side, report."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    conn = connect(hub, os.environ.pop(TOKEN_VARIABLE, ""))
    send_message(conn, Hello(rank))
    link_class, points, timeout_s = receive_message(conn)
    if getattr(link_class, "plain", False):  # the calibration: no link, no harness
        try:
            link_class.run(comm, points, lambda message: send_message(conn, message))
        except Exception as exc:
            with contextlib.suppress(OSError):
                send_message(conn, ("failed", describe_error(exc)))
            comm.Abort(1)
        send_message(conn, "finished")
        return 0
    link = link_class(comm, timeout_s)
    try:
        drive(link, points, rank, MpiSignals(comm, RECEIVER - rank),
              lambda message: send_message(conn, message))
    except Exception as exc:  # said first: closing a window is collective and would wait for the other process
        with contextlib.suppress(OSError):
            send_message(conn, ("failed", describe_error(exc)))
        comm.Abort(1)  # the other process may wait on this one: end the job
    link.close()
    send_message(conn, "finished")
    return 0


if __name__ == "__main__":
    sys.exit(_mpi_process(sys.argv[1]))
