"""The send/receive micro-benchmark of the paper's section 5.1 (its Figure 8).

A sender and a receiver run in separate processes (the paper's two servers;
the ``local`` reference runs both in one process, as it must). For every
size, after warm-up transfers, each timed transfer goes like this:

1. the receiver tells the sender, outside the transport (over a TCP stream of
   their own, :class:`DirectSignals`), that it is ready for transfer ``i`` and calls ``recv``;
2. the sender reads the clock (``t_send``) and calls ``send``;
3. the receiver gets the tensor, consumes it with a reduce-max (as in the
   paper) and reads the clock (``t_done``); then, outside the timed interval,
   it checks what arrived (see *the data check*).

*Time per transfer* is ``t_done - t_send``: from the sender handing the
tensor over to the receiver having consumed it. The receiver also reads the
clock when ``recv`` returns, which splits each transfer into moving the
tensor (``transfer_p50_us``) and consuming it (``consume_p50_us``). Both ends read
``CLOCK_MONOTONIC``, which Linux keeps system-wide, so the difference is
exact for processes on one host (every launcher here, and ``mpi`` on one node). The ready signal keeps transfers from
overlapping, so the time is a latency, not a pipelined rate. Throughput is
``size / mean time per transfer`` in MB/s with MB = 2**20 bytes. CPU seconds
are those of each side's process (all its threads) over the timed transfers.
Copied bytes come from the transports' ledgers (both sides, per transfer).

*The data check.* The sender fills its tensor with a known pattern (:func:`fill`: random values below 1
that repeat every ``PERIOD`` elements, a prime, so that no piece moved by a power-of-two offset matches),
and writes into the last element a marker that the reduce-max must find. A transfer of
``FULL_CHECK_BYTES`` or more, which transports move in pieces (lanes, chunks, work requests) where a marker
shows only that the last piece landed, is checked byte for byte: before each of them the sender also stamps
every 4 KiB of the tensor with a value of that transfer (so that a piece left over from the transfer
before is caught too), and the receiver compares every byte with the pattern, chunk by chunk (no second
copy of the tensor in memory), after reading the clock. Smaller transfers are checked by the marker,
and every byte with ``Point.check`` (the soak).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import resource
import socket
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

import transports
from bench.experiments.stream import accept, connect, host_port, listen, recv_into
from bench.ground.memory import rss_mb
from bench.ground.sizes import format_size
from bench.launch import Launcher, LaunchError, RankContext, RankSpec
from bench.launch.private import PrivateHosts
from bench.results import MicroRecord, latency_summary
from transports import Cluster, Key, TensorSpec, Transport, TransportStats, fabric
from transports.common import Availability

#: bytes moved per size when --iters is not given; fewer iterations for large sizes
BYTES_PER_POINT = 2 << 30
MIN_ITERS = 5
MAX_ITERS = 1000
SENDER, RECEIVER = 0, 1

#: a transfer of this many bytes or more is checked byte for byte (see the module docstring)
FULL_CHECK_BYTES = 64 << 10
#: the fill pattern repeats every PERIOD elements (a prime)
PERIOD = 1_048_573
#: the stamps of a checked transfer: one element per this many bytes
STAMP_BYTES = 4096
#: elements filled or compared at a time (a multiple of every stamp stride)
CHUNK = 1 << 20


#: the receiver reports its progress at least this often (and after every transfer slower than that), so the
#: launcher's watchdog measures liveness, not the length of a point
PROGRESS_EVERY_S = 1.0
#: seconds of silence allowed beyond --timeout: one progress interval and scheduling on a busy machine
SILENCE_SLACK_S = 5.0
#: more seconds allowed until the run's first report: ranks import, start their transport and connect
STARTUP_S = 60.0


@dataclass(frozen=True)
class Point:
    """One size to measure, with its warm-up and timed iteration counts.

    ``seconds``: timed transfers go on for this long instead of ``iters`` of them (the soak).
    ``check``: the receiver compares every element of every tensor with what the sender wrote and
    counts the tensors that differ instead of failing at the first (the soak); otherwise it checks every
    byte of transfers of ``FULL_CHECK_BYTES`` or more and the marker (the maximum) of smaller ones.
    ``extra_copies``: the sender copies the tensor this many more times per transfer, after reading the
    clock (``--extra-copy``: a known slow-down, counted as copied bytes, to check that comparisons catch one).
    """

    size_bytes: int
    warmup: int
    iters: int
    seconds: float | None = None
    check: bool = False
    extra_copies: int = 0

    @property
    def dtype(self) -> np.dtype:
        # float32 as tensors usually are; bytes when the size is not a whole number of floats
        return np.dtype(np.float32 if self.size_bytes % 4 == 0 else np.uint8)

    @property
    def stamped(self) -> bool:
        """Whether its transfers carry stamps and are checked byte for byte (see the module docstring)."""
        return self.size_bytes >= FULL_CHECK_BYTES

    @property
    def spec(self) -> TensorSpec:
        shape = (self.size_bytes // self.dtype.itemsize,)
        return TensorSpec(f"tensor_{self.size_bytes}", shape, self.dtype, SENDER, RECEIVER)


def plan_points(sizes: list[int], iters: int | None = None, warmup: int | None = None) -> list[Point]:
    """Iteration counts per size: ``iters`` for all when given, else about 2 GiB of traffic per size."""
    points = []
    for size in sizes:
        n = iters if iters is not None else max(MIN_ITERS, min(MAX_ITERS, BYTES_PER_POINT // size))
        w = warmup if warmup is not None else max(1, min(10, n // 10))
        points.append(Point(size, w, n))
    return points


def marker(i: int, dtype: np.dtype) -> float:
    """The value the sender writes into the last element of transfer ``i``: the tensor's maximum."""
    return float(2 + i % 250) if dtype == np.uint8 else float(2 + i)


def clock_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@functools.cache
def _pattern(dtype: np.dtype) -> np.ndarray:
    """The fill pattern's period, followed by its first ``CHUNK`` elements again: any ``CHUNK`` elements of
    the pattern are one slice of it. Values below 1 (float32) or 0 and 1 (uint8): below every marker."""
    rng = np.random.default_rng(2019)
    if dtype == np.uint8:
        period = rng.integers(0, 2, size=PERIOD, dtype=np.uint8)
    else:
        period = rng.random(PERIOD, dtype=np.float32)
    pattern = np.concatenate([period, period[:CHUNK]])
    pattern.flags.writeable = False
    return pattern


def _stamps(i: int, pages: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The stamps of transfer ``i`` on ``pages`` (indices of its 4 KiB pieces): a hash of the page and the
    transfer, below 1 (float32) or 0 and 1 (uint8), different in every page from transfer ``i - 1``'s."""
    mixed = (pages.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)  # 24 bits
    if dtype == np.uint8:
        return ((mixed + np.uint64(i & 1)) & np.uint64(1)).astype(np.uint8)
    mixed = (mixed + np.uint64((i * 0x3779B1) & 0xFFFFFF)) & np.uint64(0xFFFFFF)
    return mixed.astype(np.float32) / np.float32(1 << 24)


def _stride(dtype: np.dtype) -> int:
    return STAMP_BYTES // dtype.itemsize


def content(point: Point) -> np.ndarray:
    """What the sender puts in the tensor of ``point`` before stamps and marker: the same on both sides.

    The whole tensor at once (for small points and tests); the sender fills its tensor in chunks (:func:`fill`).
    """
    return np.resize(_pattern(point.dtype)[:PERIOD], point.spec.shape[0])


def fill(flat: np.ndarray) -> None:
    """Write the fill pattern into ``flat`` (a 1-D tensor), a chunk at a time."""
    pattern = _pattern(flat.dtype)
    for start in range(0, flat.size, CHUNK):
        count = min(CHUNK, flat.size - start)
        offset = start % PERIOD
        flat[start : start + count] = pattern[offset : offset + count]


def prepare(flat: np.ndarray, point: Point, i: int) -> None:
    """Before transfer ``i``: its stamps (a checked point's) and its marker, into the sender's filled tensor."""
    if point.stamped:
        stride = _stride(flat.dtype)
        flat[::stride] = _stamps(i, np.arange(-(-flat.size // stride)), flat.dtype)
    flat[-1] = marker(i, flat.dtype)


def first_wrong(flat: np.ndarray, point: Point, i: int) -> int | None:
    """The index of the first element of ``flat`` (transfer ``i`` of ``point``, as received) that differs from
    what the sender wrote, or None. Compared as integers (every bit: -0.0 is not 0.0), a chunk at a time."""
    dtype = flat.dtype
    pattern, stride = _pattern(dtype), _stride(dtype)
    bits = np.dtype(f"u{dtype.itemsize}")
    expected = np.empty(min(CHUNK, flat.size), dtype)
    for start in range(0, flat.size, CHUNK):
        count = min(CHUNK, flat.size - start)
        offset = start % PERIOD
        want = expected[:count]
        want[...] = pattern[offset : offset + count]
        if point.stamped:  # chunks start on a stamp: CHUNK is a multiple of the stride
            first = start // stride
            want[::stride] = _stamps(i, np.arange(first, first + -(-count // stride)), dtype)
        if start + count == flat.size:
            want[-1] = marker(i, dtype)
        got = flat[start : start + count]
        if not np.array_equal(got.view(bits), want.view(bits)):
            return start + int(np.flatnonzero(got.view(bits) != want.view(bits))[0])
    return None


def _cpu_seconds(per_thread: bool) -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD if per_thread else resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- the two roles -------------------------------------------------------------


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


class DirectSignals:
    """The ready signals between sender and receiver, outside the transport, over a TCP stream of their own
    (:mod:`bench.experiments.stream`): set up once through the coordinator (the receiver's port), then no third
    process is woken per transfer, as MPI's own signals wake none. A signal is 8 bytes: the transfer the
    receiver is ready for, or -1 for done. A side waiting for one polls the stream for :attr:`POLL_S` before it
    blocks, as an MPI process waits (the ``mpi`` lines' signals are MPI's, which spin): a sender that slept
    until its signal came back to its transfer on a core gone idle (zerocopy over shared memory, the send's part
    of a transfer, p50 per round: 64KB 3.2-5.4 µs against 2.8-3.1 polling, 1MB 21.7-22.8 against 21.1-21.3)."""

    _SIGNAL = struct.Struct("<q")
    _DONE = -1
    #: seconds a wait for a signal polls before it blocks
    POLL_S = 0.05

    def __init__(self, ctx: RankContext) -> None:
        peer = RECEIVER - ctx.rank
        host = host_port(ctx.cluster.addresses[ctx.rank])[0]
        if ctx.rank == RECEIVER:
            with listen(host) as server:
                ctx.send_to(peer, server.getsockname()[1])
                self.sock = accept(server, ctx.cluster.token, STARTUP_S)
        else:
            port = ctx.receive(timeout=STARTUP_S)
            self.sock = connect((host_port(ctx.cluster.addresses[peer])[0], port), ctx.cluster.token, STARTUP_S)
        self.sock.settimeout(None)  # a silent peer is the launcher's watchdog's to find (its reports stop)
        self._buffer = bytearray(self._SIGNAL.size)

    def send(self, value: Any) -> None:
        self.sock.sendall(self._SIGNAL.pack(self._DONE if value == "done" else value))

    def recv(self) -> Any:
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
        """Bytes of ``view`` filled from the stream by polling it (never blocking) for up to :attr:`POLL_S`."""
        got, until = 0, time.monotonic() + self.POLL_S
        while got < len(view) and time.monotonic() < until:
            try:
                n = self.sock.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if n == 0:
                raise EOFError("the other side closed the connection")
            got += n
        return got

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> DirectSignals:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PeerSignals:
    """The ready signals between sender and receiver, outside the transport (through the coordinator)."""

    def __init__(self, ctx: RankContext, peer: int) -> None:
        self.ctx, self.peer = ctx, peer

    def send(self, value: Any) -> None:
        self.ctx.send_to(self.peer, value)

    def recv(self) -> Any:
        return self.ctx.receive()


def sender_loop(transport, points: list[Point], ctrl, report: Callable[[Any], None], per_thread_cpu: bool) -> None:
    for point in points:
        spec = point.spec
        rss0 = rss_mb()
        tensor = transport.placement.allocate(spec)
        flat = tensor.reshape(-1)
        fill(flat)
        scratch = np.empty_like(tensor) if point.extra_copies else None
        starts = []
        cpu0, stats0 = _cpu_seconds(per_thread_cpu), transport.stats()
        i = 0
        while (signal := ctrl.recv()) != "done":  # the receiver says which transfer it is ready for, or done
            if signal != i:  # the receiver is done with transfer i - 1
                raise RuntimeError(f"the sender expected the receiver to be ready for transfer {i} of "
                                   f"{format_size(point.size_bytes)}, it said {signal!r}")
            prepare(flat, point, i)
            if i == point.warmup:
                cpu0, stats0 = _cpu_seconds(per_thread_cpu), transport.stats()
            t_send = clock_ns()
            for _ in range(point.extra_copies):
                np.copyto(scratch, tensor)
            transport.send(Key(spec.name, i, SENDER, RECEIVER), tensor)
            starts.append(t_send)
            i += 1
        report(Side("sender", point.size_bytes, starts[point.warmup :], _cpu_seconds(per_thread_cpu) - cpu0,
                    transport.stats() - stats0, transport.describe(), transfers=i, rss_start_mb=rss0,
                    rss_end_mb=rss_mb()))
        del tensor, flat


def receiver_loop(transport, points: list[Point], ctrl, report: Callable[[Any], None], per_thread_cpu: bool) -> None:
    for point in points:
        spec = point.spec
        rss0 = rss_mb()
        full = point.check or point.stamped  # every byte compared, or the marker only
        dones = []
        corrupted = 0
        total = point.warmup + point.iters
        step = max(1, total // 20)
        reported = time.monotonic()
        ends = None if point.seconds is None else float("inf")
        i = 0
        while i < total if ends is None else (i < point.warmup or time.monotonic() < ends):
            if i == point.warmup:
                cpu0, stats0 = _cpu_seconds(per_thread_cpu), transport.stats()
                if point.seconds is not None:
                    ends = time.monotonic() + point.seconds
            ctrl.send(i)
            tensor = transport.recv(Key(spec.name, i, SENDER, RECEIVER))
            t_received = clock_ns()
            largest = tensor.max()
            t_done = clock_ns()
            dones.append((t_received, t_done))
            wrong = tensor.shape != spec.shape or tensor.dtype != spec.dtype or largest != marker(i, point.dtype)
            where = None
            if full and not wrong:
                where = first_wrong(tensor.reshape(-1), point, i)
                wrong = where is not None
            if point.check:
                corrupted += bool(wrong)
            elif wrong:
                found = (f"element {where} of {tensor.size} differs from what the sender wrote" if where is not None
                         else f"shape {tensor.shape}, {tensor.dtype}, max {largest} (expected {spec.shape}, "
                              f"{spec.dtype}, {marker(i, point.dtype)})")
                raise RuntimeError(f"transfer {i} of {format_size(point.size_bytes)} arrived wrong: {found}")
            del tensor
            i += 1
            now = time.monotonic()
            # every 5% of a point (of a timed one: no such share), and at least every PROGRESS_EVERY_S: the
            # watchdog wants signs of life
            if (ends is None and (i % step == 0 or i == total)) or now - reported >= PROGRESS_EVERY_S:
                report(Progress(point.size_bytes, i))
                reported = now
        cpu = _cpu_seconds(per_thread_cpu) - cpu0
        stats = transport.stats() - stats0
        ctrl.send("done")
        report(Side("receiver", point.size_bytes, dones[point.warmup :], cpu, stats, None, transfers=i,
                    corrupted=corrupted, rss_start_mb=rss0, rss_end_mb=rss_mb()))


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
        with DirectSignals(ctx) as signals:
            if options.get("fabric_transport") != "tcp":
                # over UCX's tcp a write lands only when the receiver's progress threads run, and a receiver bound
                # to one core doubled its mean time at 1MB here (p50 alike): its threads need the cores free
                bind_timing_thread(ctx.rank)
            loop(transport, points, signals, ctx.report, False)


def pair_job(label: str, options: dict, points: list[Point], ctx: RankContext) -> None:
    """Both roles in one process, in two threads (``local``, which cannot cross processes)."""
    run_pair(label, options, points, ctx.cluster.token,
             lambda transport, ctrl: sender_loop(transport, points, ctrl, ctx.report, True),
             lambda transport, ctrl: receiver_loop(transport, points, ctrl, ctx.report, True))


def run_pair(label: str, options: dict, points: list[Point], token: str,
             sender: Callable[[Transport, Any], None], receiver: Callable[[Transport, Any], None]) -> None:
    """A sender and a receiver of ``label`` in this process, in two threads joined by a pipe:
    ``sender(transport, ctrl)`` and ``receiver(transport, ctrl)`` (written once for micro and soak)."""
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


# -- the coordinator -----------------------------------------------------------


class MicroError(RuntimeError):
    """A transport's run failed; the message names the transport and the side."""


@dataclass(frozen=True)
class Measured:
    """rank -> coordinator: a line's record of one size, measured whole inside the rank (a reference tool)."""

    size_bytes: int
    record: MicroRecord


class MicroLine(ABC):
    """One line of ``bench micro``: a transport, a reference measured beside them (``bench.experiments.reference``),
    or a peer library timed as a transport is (``bench.experiments.peers``).

    A line says whether it can run here, where its ranks run, and which ranks measure it; the harness
    (:func:`run_line`, and the command's sweep) owns the sizes, warm-up, rounds, timing of the transports, the
    records and their ``of_reference``, and asks nothing of a line's name. Its ranks report what they measure:
    a transport's sender and receiver each a :class:`Side` per size (the harness times the transfers between
    them), a reference a :class:`Measured` record per size.
    """

    #: the records' ``transport`` column
    name: str
    #: whether a failure fails the run (a transport); a reference that cannot run is left out with one line
    required: ClassVar[bool] = False
    #: whether its throughput at a size is every record's ``of_reference`` denominator at that size
    bandwidth_reference: ClassVar[bool] = False
    #: whether its p50 at a size is a candidate for the transports' ``of_peer`` denominator (a peer line)
    time_reference: ClassVar[bool] = False

    @property
    def log_label(self) -> str:
        """What its ranks' logs are named after."""
        return self.name

    def availability(self) -> Availability:
        """Whether it can run here, and if not, why in one line with the fix."""
        return Availability(True)

    def points(self, points: list[Point]) -> list[Point]:
        """The points it measures of those asked (a latency test stops at 1 MiB)."""
        return points

    def hosts(self, launcher: Launcher) -> PrivateHosts:
        """Where its ranks run: the run's launcher, unless it needs hosts of its own (private ones, say).
        Raises ``LaunchError`` when it cannot run under ``launcher``."""
        return PrivateHosts(launcher, False, launcher.private_hosts, f"--launcher {launcher.name}")

    @abstractmethod
    def ranks(self, points: list[Point]) -> list[RankSpec]:
        """The ranks that measure ``points`` (what ``self.points`` kept)."""


@dataclass
class TransportLine(MicroLine):
    """A transport (``label``: its name and options, e.g. ``grpc_rdma:direct``) built with ``options``: a sender
    and a receiver on two hosts, or one rank of both for a same-process transport (``local``)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    #: copies of each tensor the sender makes before sending it (--extra-copy: a known slow-down)
    extra_copies: int = 0
    required: ClassVar[bool] = True

    def points(self, points: list[Point]) -> list[Point]:
        return [replace(p, extra_copies=self.extra_copies) for p in points]

    def jobs(self) -> tuple[Callable[..., None], Callable[..., None]]:
        """Its rank jobs, each taking ``(points, ctx)``: one side's (a rank per side), and both sides' in one
        process (a same-process transport); the soak's are others."""
        return (functools.partial(role_job, self.name, self.options),
                functools.partial(pair_job, self.name, self.options))

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        role, pair = self.jobs()
        if transports.transport_class(transports.resolve(self.name)[0]).same_process_only:
            return [RankSpec(functools.partial(pair, points), "sender+receiver")]
        job = functools.partial(role, points)
        return [RankSpec(job, "sender", host=0), RankSpec(job, "receiver", host=1)]


def run_line(line: MicroLine, points: list[Point], launcher: Launcher, timeout_s: float,
             on_sides: Callable[[Point, Side, Side], None] = lambda point, sender, receiver: None,
             on_record: Callable[[Point, MicroRecord], None] = lambda point, record: None,
             on_progress: Callable[[int, int], None] = lambda size, n: None) -> None:
    """Measure ``line`` at its ``points`` on ``launcher`` (the launcher of ``line.hosts``): a transport's
    ``on_sides(point, sender, receiver)`` as soon as both sides of a point are in, a reference's
    ``on_record(point, record)``. ``timeout_s`` bounds one transfer (a reference: one size). Raises
    :class:`MicroError` naming the line."""
    sides: dict[tuple[str, int], Side] = {}
    by_size = {p.size_bytes: p for p in points}

    def on_report(rank: int, payload: Any) -> None:
        if isinstance(payload, Progress):
            on_progress(payload.size_bytes, payload.done)
        elif isinstance(payload, Measured):
            on_record(by_size[payload.size_bytes], payload.record)
        else:  # a side's account of a point (the soak's has the same role and size)
            sides[(payload.role, payload.size_bytes)] = payload
            size = payload.size_bytes
            if ("sender", size) in sides and ("receiver", size) in sides:
                on_sides(by_size[size], sides.pop(("sender", size)), sides.pop(("receiver", size)))

    try:
        # a transfer may take up to timeout_s, and the receiver reports at least every PROGRESS_EVERY_S
        launcher.run(line.ranks(points), timeout_s + SILENCE_SLACK_S, on_report, label=line.log_label,
                     startup_s=STARTUP_S)
    except LaunchError as exc:
        raise MicroError(f"{line.name}: {exc}") from None


def transfer_times(sender: Side, receiver: Side) -> dict[str, np.ndarray]:
    """Each timed transfer's time (µs): ``time_us`` from send to consumed, ``transfer_us`` from send to
    ``recv`` returning (the columns of ``samples.csv``)."""
    starts = np.array(sender.times, dtype=np.int64)
    received, done = np.array(receiver.times, dtype=np.int64).reshape(-1, 2).T
    return {"time_us": (done - starts) / 1e3, "transfer_us": (received - starts) / 1e3}


def make_record(name: str, point: Point, sender: Side, receiver: Side, round: int = 1,
                times: dict[str, np.ndarray] | None = None) -> MicroRecord:
    """The record of a point from both sides' measurements (``times``: their :func:`transfer_times`, if the
    caller has them already)."""
    times = times if times is not None else transfer_times(sender, receiver)
    summary = latency_summary(times["time_us"])
    per = len(times["time_us"])  # point.iters, or as many as fitted in the point's seconds
    both = sender.stats + receiver.stats
    copied = both.copied_bytes + point.extra_copies * point.size_bytes * per
    return MicroRecord(
        transport=name, size_bytes=point.size_bytes, round=round, dtype=point.dtype.name, warmup=point.warmup,
        iters=per, **summary,
        transfer_p50_us=float(np.percentile(times["transfer_us"], 50)),
        consume_p50_us=float(np.percentile(times["time_us"] - times["transfer_us"], 50)),
        throughput_MBps=point.size_bytes / 2**20 / (summary["mean_us"] / 1e6),
        sender_cpu_s=sender.cpu_s, receiver_cpu_s=receiver.cpu_s,
        sender_cpu_us_per_transfer=sender.cpu_s / per * 1e6, receiver_cpu_us_per_transfer=receiver.cpu_s / per * 1e6,
        copied_bytes_per_transfer=copied / per, serialisations_per_transfer=both.serialisations / per,
        deserialisations_per_transfer=both.deserialisations / per,
        control_messages_per_transfer=both.control_messages / per, registrations=both.registrations,
        registrations_per_transfer=both.registrations / per, fabric=fabric.label(sender.fabric),
        extra_copies=point.extra_copies)
