"""The two sides of a timed transfer (see the package's docstring): the sender's and the receiver's loops, what
they drive (a :class:`TimedLink`: a transport, or a peer library's link) and how they signal each other outside
the timed interval (:class:`ReadySignals`), what each side reports, and the rank jobs that run them."""

from __future__ import annotations

import contextlib
import functools
import gc
import mmap
import multiprocessing as mp
import os
import platform
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

import transports
from bench.experiments.micro.points import (
    RECEIVER,
    SENDER,
    DeviceSource,
    Point,
    fill,
    first_wrong,
    marker,
    on_host,
    prepare,
)
from bench.experiments.micro.shared import make_shared, open_shared
from bench.experiments.micro.sources import rewriter
from bench.experiments.stream import accept, connect, host_port, listen, recv_into, recv_message, send_message
from bench.ground.memory import rss_mb
from bench.ground.sizes import format_size
from bench.launch import RankContext
from transports import Cluster, Inbound, Outbound, Transport, TransportStats
from transports.placement import Placement

#: the receiver reports its progress at least this often (and after every transfer slower than that), so the
#: launcher's watchdog measures liveness, not the length of a point
PROGRESS_EVERY_S = 1.0
#: more seconds allowed until the run's first report: ranks import, start their transport and connect
STARTUP_S = 60.0


@runtime_checkable
class TimedLink(Protocol):
    """What the loops drive: a :class:`transports.Transport`, or a peer library's link
    (:class:`bench.experiments.peers.PeerLink`). A point's transfers go through its persistent send and receive
    (:class:`transports.Outbound`, :class:`transports.Inbound`), the fast path a user's loop takes; ``recv`` returns
    the tensor, valid until the next ``recv``."""

    placement: Placement

    def outbound(self, name: str, dst: int) -> Outbound: ...

    def inbound(self, name: str, src: int) -> Inbound: ...

    def stats(self) -> TransportStats: ...

    def describe(self) -> dict[str, Any]: ...


class ReadySignals(Protocol):
    """The ready signals between the two sides, outside the timed interval: the receiver sends the number of the
    transfer it is ready for, then ``"done"``; the sender receives them (:class:`DirectSignals`,
    :class:`CoordinatorSignals`, MPI's own, a pipe's end)."""

    def send(self, value: Any) -> None: ...

    def recv(self) -> Any: ...


#: the system-wide monotonic clock every side reads, in ns: ``clock_gettime(CLOCK_MONOTONIC)`` (Python's
#: ``monotonic`` on Linux) called directly, with no frame of ours (a wrapper cost 55 ns a read, three reads a
#: transfer on the Local line's one thread)
clock_ns = time.monotonic_ns


def _cpu_seconds(per_thread: bool) -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD if per_thread else resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Progress:
    """receiver -> coordinator: ``done`` transfers of ``size_bytes`` so far."""

    size_bytes: int
    done: int


@dataclass(frozen=True)
class Side:
    """One side's measurements of one size: clock readings, CPU seconds, ledger, fabric description."""

    role: str
    size_bytes: int
    times: list
    cpu_s: float
    stats: TransportStats
    fabric: dict[str, Any] | None
    #: transfers this side completed (warm-up included), of which the receiver found ``corrupted`` wrong
    transfers: int = 0
    corrupted: int = 0
    #: this process's resident memory (MB) before the point's first transfer and after its last
    rss_start_mb: float = float("nan")
    rss_end_mb: float = float("nan")
    #: the sender's whole writes of its tensor (``--source fresh``: one per transfer, warm-up included), and the
    #: clock when each timed transfer's ended (beside ``times``; empty when the tensor is reused)
    fresh_writes: int = 0
    written: list = field(default_factory=list)


def wait_above(words: np.ndarray, seen: int, poll_s: float) -> None:
    """Until ``words[0]`` (written by another process) is above ``seen``: polled for ``poll_s``, then in naps
    growing to a millisecond."""
    until, nap = time.monotonic() + poll_s, 0.0
    while words[0] <= seen:
        if nap or poll_s <= 0 or time.monotonic() > until:
            nap = min(0.001, max(nap * 2, 0.00005))
            time.sleep(nap)


class DirectSignals:
    """The ready signals between sender and receiver, outside the transport: set up once through the coordinator
    (the receiver's port), then no third process is woken per transfer, as MPI's own signals wake none. A signal is
    the transfer the receiver is ready for, or -1 for done.

    Where both sides map the same memory (one host, x86's ordered stores), a signal is a store into a ring of words
    in a file both map (made in a private 0700 directory under /dev/shm without following links, removed as soon
    as the sender mapped it): sending one costs the receiver no system call, which would otherwise land inside the
    timed interval (the receiver signals, then waits for the transfer; a transfer of a few µs arrives while it is
    still in ``send``: 6.4 µs of the harness line at 1KB over the stream). Elsewhere it is 8 bytes on a TCP stream
    of their own (:mod:`bench.experiments.stream`). The sender waits for one by polling for :attr:`POLL_S`, then
    in naps of up to a millisecond (the ring) or blocked on the stream, as an MPI process waits (the ``mpi`` lines'
    signals are MPI's, which spin): a sender that slept until its signal came back to its transfer on a core gone
    idle (zerocopy over shared memory, the send's part of a transfer, p50 per round: 64KB 3.2-5.4 µs against 2.8-3.1
    polling, 1MB 21.7-22.8 against 21.1-21.3)."""

    _SIGNAL = struct.Struct("<q")
    _DONE = -1
    #: seconds a wait for a signal polls before it blocks
    POLL_S = 0.05
    #: signals the ring holds (the receiver is at most two ahead: done, then the next point's first)
    RING = 64

    def __init__(self, ctx: RankContext, *, spin: bool = True) -> None:
        #: whether a wait polls first (POLL_S); a sender whose transport completes sends on threads of its own
        #: (``Transport.completes_on_threads``) naps or blocks at once: a wait spinning in Python held the GIL
        #: those threads need (the interpreter hands it over every 5 ms) and the core they run on: a 1KB
        #: transfer over grpc_tcp took 6.5 ms spun for, 1.0 ms napped for
        self.poll_s = self.POLL_S if spin else 0.0
        other = RECEIVER - ctx.rank  # the rank of the other side
        host = host_port(ctx.cluster.addresses[ctx.rank])[0]
        if ctx.rank == RECEIVER:
            with listen(host) as server:
                ctx.send_to(other, server.getsockname()[1])
                self.sock = accept(server, ctx.cluster.token, STARTUP_S)
        else:
            port = ctx.receive(timeout=STARTUP_S)
            self.sock = connect((host_port(ctx.cluster.addresses[other])[0], port), ctx.cluster.token, STARTUP_S)
        self._buffer = bytearray(self._SIGNAL.size)
        self._ring: np.ndarray | None = None  # head (signals sent), nonce, then RING signals
        self._map: mmap.mmap | None = None
        self._taken = 0
        if platform.machine() in ("x86_64", "AMD64"):
            self._share(ctx.rank == RECEIVER)
        self.sock.settimeout(None)  # a silent other side is the launcher's watchdog's to find (its reports stop)

    def _share(self, receiving: bool) -> None:
        """The ring of words, where both sides can map it: the receiver makes it and names it with a nonce, the
        sender maps it and says whether it found the nonce there; the name is gone once the sender answered."""
        size = 8 * (2 + self.RING)
        if receiving:
            nonce = int.from_bytes(os.urandom(7), "little")

            def tell(path: str, mapped: mmap.mmap) -> bool:
                np.frombuffer(mapped, np.int64, 2 + self.RING)[1] = nonce
                send_message(self.sock, f"{path} {nonce}".encode())
                return recv_message(self.sock, 16) == b"shared"

            self._map, shared = make_shared(size, "bench-signals-", tell)
            ring = np.frombuffer(self._map, np.int64, 2 + self.RING)
        else:
            path, _, nonce = recv_message(self.sock, 4096).decode().rpartition(" ")
            try:
                self._map = open_shared(path, size)
                ring = np.frombuffer(self._map, np.int64, 2 + self.RING)
                shared = int(ring[1]) == int(nonce)  # the same file, not one of that name on another host
            except (OSError, ValueError):
                shared = False
            send_message(self.sock, b"shared" if shared else b"stream")
        if shared:
            self._ring = ring
        elif self._map is not None:
            with contextlib.suppress(NameError):
                del ring
            self._map.close()
            self._map = None

    def send(self, value: Any) -> None:
        signal = self._DONE if value == "done" else value
        ring = self._ring
        if ring is None:
            self.sock.sendall(self._SIGNAL.pack(signal))
            return
        head = int(ring[0])
        ring[2 + head % self.RING] = signal
        ring[0] = head + 1  # after the signal: x86 keeps stores in order

    def recv(self) -> Any:
        if self._ring is not None:
            return self._take()
        view = memoryview(self._buffer)
        try:
            got = self._poll(view)
            if got < len(view):
                recv_into(self.sock, view[got:])
        except EOFError:
            raise RuntimeError("the other side closed the ready signals' stream (it ended or failed)") from None
        (value,) = self._SIGNAL.unpack(self._buffer)
        return "done" if value == self._DONE else value

    def _poll(self, view: memoryview) -> int:
        """Bytes of ``view`` filled from the stream by polling it (never blocking) for up to :attr:`poll_s`."""
        got, until = 0, time.monotonic() + self.poll_s
        while got < len(view) and time.monotonic() < until:
            try:
                n = self.sock.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if n == 0:
                raise EOFError("the other side closed the connection")
            got += n
        return got

    def _take(self) -> Any:
        """The next signal of the ring: polled for :attr:`poll_s`, then in naps growing to a millisecond."""
        ring, taken = self._ring, self._taken
        wait_above(ring, taken, self.poll_s)
        value = int(ring[2 + taken % self.RING])
        self._taken = taken + 1
        return "done" if value == self._DONE else value

    def close(self) -> None:
        self._ring = None
        mapped, self._map = self._map, None
        if mapped is not None:
            # a view of the ring may outlive ours: the frames of a wait that an interrupt (SIGTERM: SystemExit)
            # unwinds hold theirs until it is handled. Closing then would raise BufferError over the interrupt;
            # the map is unmapped with its last view instead
            with contextlib.suppress(BufferError):
                mapped.close()
        self.sock.close()

    def __enter__(self) -> DirectSignals:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CoordinatorSignals:
    """The ready signals between sender and receiver, outside the transport (through the coordinator)."""

    def __init__(self, ctx: RankContext, other: int) -> None:
        self.ctx, self.other = ctx, other

    def send(self, value: Any) -> None:
        self.ctx.send_to(self.other, value)

    def recv(self) -> Any:
        return self.ctx.receive()


@contextlib.contextmanager
def _uncollected(points: list[Point]) -> Any:
    """Python's cyclic collector off while a side's transfers run, as ``timeit`` keeps it off: a collection that
    any allocation may trigger (the harness's, the transport's) lands in whichever transfer is being timed, a tail
    of no line's own. Each point begins with a collection instead, outside every timed interval. Not in the soak
    (points that check every transfer or run for a time): it watches memory grow, and must see what a user's
    process keeps."""
    enabled = gc.isenabled()
    if any(point.check or point.seconds is not None for point in points):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _source(link: TimedLink, point: Point) -> tuple[Any, Callable[[int], None], Any, Callable[[], Any] | None]:
    """The sender's tensor of ``point`` (where ``link`` places one, in the point's sender memory), filled; what
    marks it before transfer ``i`` (:func:`_mark`; a device tensor's through its host mirror); the scratch
    tensor of ``--extra-copy`` (None without); and its fresh write (``--source fresh``: :func:`.rewriter`; None
    when it is reused)."""
    tensor = link.placement.allocate(point.spec)
    if type(tensor) is np.ndarray:
        flat = tensor.reshape(-1)
        fill(flat)
        mark = functools.partial(_mark, flat, point)
    else:
        mark = functools.partial(DeviceSource(tensor).mark, point)
    scratch = np.empty_like(tensor) if point.extra_copies else None
    return tensor, mark, scratch, rewriter(tensor) if point.fresh else None


def _reduce_max(point: Point) -> Callable[[Any], Any] | None:
    """How the receiver consumes a tensor of ``point`` in device memory: a reduce-max on the device, waited for (its
    one-element result read back); None in host memory, where the loop calls ``tensor.max()`` itself (the bound
    method: 50 ns less than calling ``np.ndarray.max`` on it, inside the timed interval)."""
    if point.receiver_memory.is_device:
        return lambda tensor: tensor.max().item()
    return None


def _mark(flat: np.ndarray, point: Point, i: int) -> None:
    """Before transfer ``i``: a checked transfer's stamps and marker, else the marker alone."""
    if point.checked(i):
        prepare(flat, point, i)
    else:
        flat[-1] = marker(i, flat.dtype)


def sender_loop(transport: TimedLink, points: list[Point], ctrl: ReadySignals, report: Callable[[Any], None],
                per_thread_cpu: bool) -> None:
    """The sender's side of ``points``: per transfer, wait for the receiver's ready signal, write the whole tensor
    (``--source fresh``), stamp and mark it, read the clock and send it; a :class:`Side` reported per point."""
    with _uncollected(points):
        for point in points:
            gc.collect()  # the last point's garbage, outside any timed transfer
            spec = point.spec
            rss0 = rss_mb()
            tensor, mark, scratch, rewrite = _source(transport, point)
            outbound = transport.outbound(spec.name, RECEIVER)
            starts, written, t_written = [], [], 0
            cpu0, stats0 = _cpu_seconds(per_thread_cpu), transport.stats()
            i = 0
            while (signal := ctrl.recv()) != "done":  # the receiver says which transfer it is ready for, or done
                if signal != i:  # the receiver is done with transfer i - 1
                    raise RuntimeError(f"the sender expected the receiver to be ready for transfer {i} of "
                                       f"{format_size(point.size_bytes)}, it said {signal!r}")
                if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
                    rewrite()
                    t_written = clock_ns()
                mark(i)
                if i == point.warmup:
                    cpu0, stats0 = _cpu_seconds(per_thread_cpu), transport.stats()
                timed = point.timed(i)
                t_send = clock_ns()
                if scratch is not None:  # --extra-copy (no range() made in the timed interval without it)
                    for _ in range(point.extra_copies):
                        np.copyto(scratch, tensor)
                outbound.send(i, tensor)
                if timed:
                    starts.append(t_send)
                    if rewrite is not None:
                        written.append(t_written)
                i += 1
            report(Side("sender", point.size_bytes, starts, _cpu_seconds(per_thread_cpu) - cpu0,
                        transport.stats() - stats0, transport.describe(), transfers=i, rss_start_mb=rss0,
                        rss_end_mb=rss_mb(), fresh_writes=i if rewrite is not None else 0, written=written))
            del tensor, mark, outbound, rewrite


def receiver_loop(transport: TimedLink, points: list[Point], ctrl: ReadySignals, report: Callable[[Any], None],
                  per_thread_cpu: bool) -> None:
    """The receiver's side of ``points``: per transfer, signal ready, receive, reduce-max and read the clock, then
    check what arrived; :class:`Progress` reported as it goes, a :class:`Side` per point."""
    with _uncollected(points):
        for point in points:
            gc.collect()  # the last point's garbage, outside any timed transfer
            spec = point.spec
            rss0 = rss_mb()
            dones = []
            corrupted = 0
            total = point.transfers
            inbound = transport.inbound(spec.name, SENDER)
            reduce_max = _reduce_max(point)
            reported = time.monotonic()
            ends = None if point.seconds is None else float("inf")
            i = 0
            while i < total if ends is None else (i < point.warmup or time.monotonic() < ends):
                if i == point.warmup:
                    cpu0, stats0 = _cpu_seconds(per_thread_cpu), transport.stats()
                    if point.seconds is not None:
                        ends = time.monotonic() + point.seconds
                ctrl.send(i)
                tensor = inbound.recv(i)
                t_received = clock_ns()
                largest = tensor.max() if reduce_max is None else reduce_max(tensor)
                t_done = clock_ns()
                if point.timed(i):
                    dones.append((t_received, t_done))
                corrupted += _check(tensor, point, i, largest)
                del tensor
                i += 1
                now = time.monotonic()
                # at a point's end and every PROGRESS_EVERY_S (the watchdog wants signs of life), no more often: a
                # report wakes the coordinator, whose turn on a core of two delayed the next transfer (1KB over
                # zerocopy: 160-220 µs against 8.5, every 5% of a point when it reported that often)
                if i == total or now - reported >= PROGRESS_EVERY_S:
                    report(Progress(point.size_bytes, i))
                    reported = now
            cpu = _cpu_seconds(per_thread_cpu) - cpu0
            stats = transport.stats() - stats0
            ctrl.send("done")
            report(Side("receiver", point.size_bytes, dones, cpu, stats, None, transfers=i,
                        corrupted=corrupted, rss_start_mb=rss0, rss_end_mb=rss_mb()))


def _check(tensor: np.ndarray, point: Point, i: int, largest: Any) -> bool:
    """Whether transfer ``i`` of ``point`` arrived wrong: its shape, dtype and marker (the reduce-max ``largest``),
    and every byte of a checked transfer. Counted in the soak (``point.check``); elsewhere a RuntimeError says what
    was found."""
    spec = point.spec
    wrong = tensor.shape != spec.shape or tensor.dtype != spec.dtype or largest != marker(i, point.dtype)
    where = None
    if not wrong and point.checked(i):  # every byte compared, else the marker only
        where = first_wrong(on_host(tensor).reshape(-1), point, i)
        wrong = where is not None
    if wrong and not point.check:
        found = (f"element {where} of {tensor.size} differs from what the sender wrote" if where is not None
                 else f"shape {tensor.shape}, {tensor.dtype}, max {largest} (expected {spec.shape}, "
                      f"{spec.dtype}, {marker(i, point.dtype)})")
        raise RuntimeError(f"transfer {i} of {format_size(point.size_bytes)} arrived wrong: {found}")
    return wrong


def solo_loop(sender: Transport, receiver: Transport, points: list[Point], report: Callable[[Any], None]) -> None:
    """Both sides of ``points`` in this one thread (``local``, whose transfer is a hand-over inside the process):
    per transfer, the two loops' steps without the wait between them: the sender's fresh write (``--source
    fresh``), its marker (a checked transfer's stamps), the clock and the persistent send (local's is done at the
    hand-over); then the receive, the clock, the reduce-max, the clock and the check. No thread waits on another
    (two threads handing over took 25 µs at 1KB, the GIL's turn), so its time is the floor every line's stands on:
    the harness's own work and the reduce-max, without a transfer. The thread's CPU time is the receiver's; the
    sender's is not told apart (NaN)."""
    with _uncollected(points):
        for point in points:
            gc.collect()  # the last point's garbage, outside any timed transfer
            spec = point.spec
            rss0 = rss_mb()
            tensor, mark, scratch, rewrite = _source(sender, point)
            outbound, inbound = sender.outbound(spec.name, RECEIVER), receiver.inbound(spec.name, SENDER)
            reduce_max = _reduce_max(point)
            starts, dones, corrupted, written, t_written = [], [], 0, [], 0
            total = point.transfers
            cpu0, sent0, received0 = _cpu_seconds(True), sender.stats(), receiver.stats()
            reported = time.monotonic()
            for i in range(total):
                if i == point.warmup:
                    cpu0, sent0, received0 = _cpu_seconds(True), sender.stats(), receiver.stats()
                if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
                    rewrite()
                    t_written = clock_ns()
                mark(i)
                timed = point.timed(i)
                t_send = clock_ns()
                if scratch is not None:  # --extra-copy (no range() made in the timed interval without it)
                    for _ in range(point.extra_copies):
                        np.copyto(scratch, tensor)
                outbound.send(i, tensor)  # a hand-over, done at once (local's persistent send)
                arrived = inbound.recv(i)
                t_received = clock_ns()
                largest = arrived.max() if reduce_max is None else reduce_max(arrived)
                t_done = clock_ns()
                if timed:
                    starts.append(t_send)
                    dones.append((t_received, t_done))
                    if rewrite is not None:
                        written.append(t_written)
                corrupted += _check(arrived, point, i, largest)
                del arrived
                if time.monotonic() - reported >= PROGRESS_EVERY_S or i + 1 == total:
                    report(Progress(point.size_bytes, i + 1))
                    reported = time.monotonic()
            cpu = _cpu_seconds(True) - cpu0
            report(Side("sender", point.size_bytes, starts, float("nan"), sender.stats() - sent0, sender.describe(),
                        transfers=total, rss_start_mb=rss0, rss_end_mb=rss_mb(),
                        fresh_writes=total if rewrite is not None else 0, written=written))
            report(Side("receiver", point.size_bytes, dones, cpu, receiver.stats() - received0, None, transfers=total,
                        corrupted=corrupted, rss_start_mb=rss0, rss_end_mb=rss_mb()))
            del tensor, mark, outbound, inbound, rewrite


def bind_timing_thread(rank: int) -> int | None:
    """Keep the calling thread (the one that sends or receives and reads the clock) on a core of its own: the
    sender's on the first CPU this process may use, the receiver's on the second; the process's other threads
    (progress, gRPC's) stay free. Unbound, the receiver's ready signal wakes the sender on the receiver's own
    core (the kernel places a woken task near its waker), where the two then take turns while the other core
    idles, and a small transfer's time doubled or tripled from one launch to the next (6 or 17 µs at 4KB).
    Returns the CPU, or None where there is only one."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    cpu = cpus[rank % 2]
    os.sched_setaffinity(0, {cpu})  # pid 0: this thread only; threads it starts later inherit it
    return cpu


def role_job(label: str, options: dict, points: list[Point], ctx: RankContext) -> None:
    """A rank of the benchmark: rank 0 sends, rank 1 receives."""
    with transports.create(transports.resolve(label)[0], **options) as transport:
        transport.start(ctx.cluster, ctx.rank)
        transport.placement.plan([p.spec for p in points])
        loop = sender_loop if ctx.rank == SENDER else receiver_loop
        with DirectSignals(ctx, spin=not transport.completes_on_threads) as signals:
            if options.get("fabric_transport") != "tcp":
                # over UCX's tcp a write lands only when the receiver's progress threads run, and a receiver bound
                # to one core doubled its mean time at 1MB here (p50 alike): its threads need the cores free
                bind_timing_thread(ctx.rank)
            loop(transport, points, signals, ctx.report, False)


def pair_job(label: str, options: dict, points: list[Point], ctx: RankContext) -> None:
    """Both roles in one process, in one thread (``local``, which cannot cross processes): :func:`solo_loop`."""
    pair = [transports.create(transports.resolve(label)[0], **options) for _ in range(2)]
    cluster = Cluster.on_loopback(2, token=ctx.cluster.token)
    try:
        for rank, transport in enumerate(pair):
            transport.start(cluster, rank)
            transport.placement.plan([p.spec for p in points])
        solo_loop(pair[SENDER], pair[RECEIVER], points, ctx.report)
    finally:
        for transport in pair:
            transport.close()


def run_pair(label: str, options: dict, points: list[Point], token: str,
             sender: Callable[[Transport, ReadySignals], None],
             receiver: Callable[[Transport, ReadySignals], None]) -> None:
    """A sender and a receiver of ``label`` in this process, in two threads joined by a pipe:
    ``sender(transport, ctrl)`` and ``receiver(transport, ctrl)`` (the soak's same-process pair; micro's Local runs
    in one thread, :func:`solo_loop`)."""
    ctrl_send, ctrl_recv = mp.Pipe()
    failures: list[BaseException] = []
    pair = [transports.create(transports.resolve(label)[0], **options) for _ in range(2)]
    cluster = Cluster.on_loopback(2, token=token)

    def role(loop, transport, ctrl) -> None:
        try:
            loop(transport, ctrl)
        except BaseException as exc:
            failures.append(exc)
            ctrl.close()  # the other side must not wait for a signal that will never come

    try:
        for rank, transport in enumerate(pair):
            transport.start(cluster, rank)
            transport.placement.plan([p.spec for p in points])
        threads = [threading.Thread(target=role, args=(sender, pair[SENDER], ctrl_send), daemon=True),
                   threading.Thread(target=role, args=(receiver, pair[RECEIVER], ctrl_recv), daemon=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
    finally:
        for transport in pair:
            transport.close()

