"""The send/receive micro-benchmark of the paper's section 5.1 (its Figure 8).

A sender and a receiver run in separate processes (the paper's two servers;
the ``local`` reference runs both in one process, as it must). For every
size, after warm-up transfers, each timed transfer goes like this:

1. the receiver tells the sender, outside the transport (through the
   launcher's coordinator), that it is ready for transfer ``i`` and calls ``recv``;
2. the sender reads the clock (``t_send``) and calls ``send``;
3. the receiver gets the tensor, consumes it with a reduce-max (as in the
   paper), checks the result, and reads the clock (``t_done``).

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
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import transports
from bench.launch import Launcher, LaunchError, RankContext, RankSpec
from bench.sizes import format_size
from transports import Cluster, Key, TensorSpec, TransportStats

#: bytes moved per size when --iters is not given; fewer iterations for large sizes
BYTES_PER_POINT = 2 << 30
MIN_ITERS = 5
MAX_ITERS = 1000
SENDER, RECEIVER = 0, 1


@dataclass(frozen=True)
class Point:
    """One size to measure, with its warm-up and timed iteration counts."""

    size_bytes: int
    warmup: int
    iters: int

    @property
    def dtype(self) -> np.dtype:
        # float32 as tensors usually are; bytes when the size is not a whole number of floats
        return np.dtype(np.float32 if self.size_bytes % 4 == 0 else np.uint8)

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


class PeerSignals:
    """The ready signals between sender and receiver, outside the transport (through the coordinator)."""

    def __init__(self, ctx: RankContext, peer: int) -> None:
        self.ctx, self.peer = ctx, peer

    def send(self, value: Any) -> None:
        self.ctx.send_to(self.peer, value)

    def recv(self) -> Any:
        return self.ctx.receive()


def sender_loop(transport, points: list[Point], ctrl, report: Callable[[Any], None], per_thread_cpu: bool) -> None:
    rng = np.random.default_rng(0)
    for point in points:
        spec = point.spec
        tensor = transport.allocate(spec)
        if point.dtype == np.uint8:
            tensor[...] = rng.integers(0, 2, size=spec.shape, dtype=np.uint8)
        else:
            tensor[...] = rng.random(spec.shape, dtype=np.float32)
        starts = []
        for i in range(point.warmup + point.iters):
            if ctrl.recv() != i:  # the receiver is done with transfer i - 1
                raise RuntimeError("sender and receiver lost step")
            tensor.flat[-1] = marker(i, point.dtype)
            if i == point.warmup:
                cpu0, stats0 = _cpu_seconds(per_thread_cpu), transport.stats()
            t_send = clock_ns()
            transport.send(Key(spec.name, i, SENDER, RECEIVER), tensor)
            starts.append(t_send)
        if ctrl.recv() != "done":
            raise RuntimeError("receiver did not finish the point")
        report(Side("sender", point.size_bytes, starts[point.warmup :], _cpu_seconds(per_thread_cpu) - cpu0,
                    transport.stats() - stats0, transport.describe()))
        del tensor


def receiver_loop(transport, points: list[Point], ctrl, report: Callable[[Any], None], per_thread_cpu: bool) -> None:
    for point in points:
        spec = point.spec
        dones = []
        total = point.warmup + point.iters
        for i in range(total):
            if i == point.warmup:
                cpu0, stats0 = _cpu_seconds(per_thread_cpu), transport.stats()
            ctrl.send(i)
            tensor = transport.recv(Key(spec.name, i, SENDER, RECEIVER))
            t_received = clock_ns()
            largest = tensor.max()
            t_done = clock_ns()
            dones.append((t_received, t_done))
            if tensor.shape != spec.shape or largest != marker(i, point.dtype):
                raise RuntimeError(
                    f"transfer {i} of {format_size(point.size_bytes)} arrived wrong: shape {tensor.shape}, "
                    f"max {largest} (expected {spec.shape}, {marker(i, point.dtype)})"
                )
            del tensor
            if (i + 1) % max(1, total // 20) == 0 or i + 1 == total:
                report(Progress(point.size_bytes, i + 1))
        cpu = _cpu_seconds(per_thread_cpu) - cpu0
        stats = transport.stats() - stats0
        ctrl.send("done")
        report(Side("receiver", point.size_bytes, dones[point.warmup :], cpu, stats, None))


def role_job(label: str, options: dict, points: list[Point], ctx: RankContext) -> None:
    """A rank of the benchmark: rank 0 sends, rank 1 receives."""
    with transports.create(transports.resolve(label)[0], **options) as transport:
        transport.start(ctx.cluster, ctx.rank)
        transport.plan([p.spec for p in points])
        loop = sender_loop if ctx.rank == SENDER else receiver_loop
        loop(transport, points, PeerSignals(ctx, RECEIVER - ctx.rank), ctx.report, False)


def pair_job(label: str, options: dict, points: list[Point], ctx: RankContext) -> None:
    """Both roles in one process, in two threads (``local``, which cannot cross processes)."""
    ctrl_send, ctrl_recv = mp.Pipe()
    failures: list[BaseException] = []
    pair = [transports.create(transports.resolve(label)[0], **options) for _ in range(2)]
    cluster = Cluster.on_loopback(2, token=ctx.cluster.token)

    def role(loop, transport, ctrl) -> None:
        try:
            loop(transport, points, ctrl, ctx.report, True)
        except BaseException as exc:
            failures.append(exc)
            ctrl.close()  # the other side must not wait for a signal that will never come

    try:
        for rank, transport in enumerate(pair):
            transport.start(cluster, rank)
            transport.plan([p.spec for p in points])
        threads = [threading.Thread(target=role, args=(sender_loop, pair[SENDER], ctrl_send), daemon=True),
                   threading.Thread(target=role, args=(receiver_loop, pair[RECEIVER], ctrl_recv), daemon=True)]
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


def ranks_of(label: str, options: dict[str, Any], points: list[Point]) -> list[RankSpec]:
    """The run's ranks: a sender and a receiver on two hosts, or one rank for a same-process transport."""
    if transports.transport_class(transports.resolve(label)[0]).same_process_only:
        return [RankSpec(functools.partial(pair_job, label, options, points), "sender+receiver")]
    job = functools.partial(role_job, label, options, points)
    return [RankSpec(job, "sender", host=0), RankSpec(job, "receiver", host=1)]


def run_transport(label: str, points: list[Point], options: dict[str, Any], launcher: Launcher,
                  on_record: Callable[[dict[str, Any]], None],
                  on_progress: Callable[[int, int], None] = lambda size, n: None) -> None:
    """Measure every point over transport ``label`` built with ``options``; each record as soon as it is measured."""
    timeout_s = options.get("timeout_s", 120.0)
    sides: dict[tuple[str, int], Side] = {}
    by_size = {p.size_bytes: p for p in points}

    def on_report(rank: int, payload: Any) -> None:
        if isinstance(payload, Progress):
            on_progress(payload.size_bytes, payload.done)
            return
        sides[(payload.role, payload.size_bytes)] = payload
        size = payload.size_bytes
        if ("sender", size) in sides and ("receiver", size) in sides:
            on_record(make_record(label, by_size[size], sides.pop(("sender", size)), sides.pop(("receiver", size))))

    try:
        # a transfer may take up to timeout_s; the receiver reports about every 20th
        launcher.run(ranks_of(label, options, points), timeout_s + 60, on_report, label=label)
    except LaunchError as exc:
        raise MicroError(f"{label}: {exc}") from None


def make_record(name: str, point: Point, sender: Side, receiver: Side) -> dict[str, Any]:
    """One row of ``records.csv`` from both sides' measurements."""
    starts = np.array(sender.times, dtype=np.int64)
    received, done = np.array(receiver.times, dtype=np.int64).T
    micros = (done - starts) / 1e3
    mean_us = float(micros.mean())
    per = point.iters
    both = sender.stats + receiver.stats
    return {
        "transport": name,
        "size_bytes": point.size_bytes,
        "dtype": point.dtype.name,
        "warmup": point.warmup,
        "iters": point.iters,
        "p50_us": float(np.percentile(micros, 50)),
        "p99_us": float(np.percentile(micros, 99)),
        "mean_us": mean_us,
        "min_us": float(micros.min()),
        "max_us": float(micros.max()),
        # the same transfers split at the moment recv returned: moving the tensor, then consuming it
        "transfer_p50_us": float(np.percentile((received - starts) / 1e3, 50)),
        "consume_p50_us": float(np.percentile((done - received) / 1e3, 50)),
        "throughput_MBps": point.size_bytes / 2**20 / (mean_us / 1e6),
        "sender_cpu_s": sender.cpu_s,
        "receiver_cpu_s": receiver.cpu_s,
        "sender_cpu_us_per_transfer": sender.cpu_s / per * 1e6,
        "receiver_cpu_us_per_transfer": receiver.cpu_s / per * 1e6,
        "copied_bytes_per_transfer": both.copied_bytes / per,
        "serialisations_per_transfer": both.serialisations / per,
        "deserialisations_per_transfer": both.deserialisations / per,
        "control_messages_per_transfer": both.control_messages / per,
        "registrations": both.registrations,
        "fabric": fabric_label(sender.fabric),
    }


def fabric_label(description: dict[str, Any] | None) -> str:
    """``ucx:cma,posix,sysv`` for a fabric transport, ``none`` for the others."""
    if not description or description.get("fabric", "none") == "none":
        return "none"
    used = description.get("ucx_transports_used") or [description.get("ucx_tls", "?")]
    return f"{description['fabric']}:{','.join(used)}"
