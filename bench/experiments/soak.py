"""The soak's transfers (``bench soak``): the micro-benchmark's pairing, kept going for a time, in constant memory.

A sender and a receiver (one process each; both in one process for ``local``) move one size after
another, each for ``Point.seconds`` after its warm-up, as ``bench micro`` does (:mod:`bench.experiments.micro`):
the receiver says it is ready for transfer ``i`` (through the coordinator), the sender reads the
clock and sends, the receiver consumes the tensor (a reduce-max), reads the clock, then compares every
element with what the sender wrote and counts the tensors that differ.

Unlike ``bench micro`` neither side keeps a list of clock readings: a soak goes on for hours, and
memory that grows with every transfer is what it exists to find. The receiver's ready signal for
transfer ``i`` carries its two clock readings of transfer ``i - 1``, so the sender, which knows when it
sent that one, adds the transfer's time to a :class:`~bench.ground.stats.StreamingStats` (a fixed-size
histogram) and forgets it. Each process has its large freed blocks go back to the system at once
(:func:`bench.ground.memory.return_large_frees`: the allocator's keeping of freed buffers is no leak). Each
side samples its own resident memory into a bounded :class:`~bench.ground.stats.RssTrace` as it goes and
judges it at the end of the point (:class:`~bench.ground.stats.LeakCriterion`): memory settles for the
point's first minute (its first third when shorter), then its floor (each quarter's lowest sample)
may rise at most 2 MB.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import transports
from bench.experiments.micro import (
    PROGRESS_EVERY_S,
    RECEIVER,
    SENDER,
    CoordinatorSignals,
    MicroError,
    Point,
    Progress,
    TransportLine,
    clock_ns,
    content,
    marker,
    run_line,
    run_pair,
)
from bench.experiments.training import model_record
from bench.ground.memory import return_large_frees
from bench.ground.sizes import format_size
from bench.ground.stats import LeakCriterion, MemoryVerdict, RssTrace, StreamingStats
from bench.launch import Launcher, RankContext
from bench.results import SoakRecord
from bench.runtime.analyzer import Layout
from bench.runtime.config import StepTimes, TrainConfig
from transports import Key, fabric


class SoakError(RuntimeError):
    """A transport's soak failed; the message names the transport and the rank."""


@dataclass(frozen=True)
class SoakSide:
    """One side's account of one point: transfers (warm-up included), what the receiver found corrupted,
    the sender's streaming statistics of the timed transfers, and this process's memory verdict."""

    role: str
    size_bytes: int
    transfers: int
    memory: MemoryVerdict
    corrupted: int = 0
    #: sender: µs from send to the receiver having consumed the tensor, and to ``recv`` returning
    time_us: StreamingStats | None = None
    transfer_us: StreamingStats | None = None
    #: sender: seconds from the first timed send to the last transfer consumed
    seconds: float = math.nan
    fabric: dict[str, Any] | None = None


def sender_loop(transport, points: list[Point], ctrl, report: Callable[[Any], None],
                criterion: LeakCriterion) -> None:
    """Send transfer after transfer as the receiver asks; time each one from the readings it sends back."""
    for point in points:
        spec = point.spec
        trace = RssTrace()
        trace.sample(force=True)
        tensor = transport.placement.allocate(spec)
        tensor[...] = content(point)
        time_us, transfer_us = StreamingStats(), StreamingStats()
        first = t_send = last = 0
        i = 0
        while True:
            kind, ready, received, done = ctrl.recv()  # the receiver's readings of transfer i - 1, if any
            if received is not None and i - 1 >= point.warmup:
                time_us.add((done - t_send) / 1e3)
                transfer_us.add((received - t_send) / 1e3)
                last = done
            if kind == "done":
                break
            if ready != i:
                raise RuntimeError(f"the sender expected the receiver to be ready for transfer {i} of "
                                   f"{format_size(point.size_bytes)}, it said {ready!r}")
            tensor.flat[-1] = marker(i, point.dtype)
            t_send = clock_ns()
            if i == point.warmup:
                first = t_send
            transport.send(Key(spec.name, i, SENDER, RECEIVER), tensor)
            i += 1
            trace.sample()
        trace.sample(force=True)
        report(SoakSide("sender", point.size_bytes, i, trace.judge(criterion), time_us=time_us,
                        transfer_us=transfer_us, seconds=(last - first) / 1e9 if last else math.nan,
                        fabric=transport.describe()))
        del tensor


def receiver_loop(transport, points: list[Point], ctrl, report: Callable[[Any], None],
                  criterion: LeakCriterion) -> None:
    """Receive for each point's seconds after its warm-up, checking every element of every tensor."""
    for point in points:
        spec = point.spec
        trace = RssTrace()
        trace.sample(force=True)
        expected = content(point).reshape(-1)[:-1]
        corrupted = 0
        readings: tuple[int, int] | tuple[None, None] = (None, None)
        ends = math.inf
        reported = time.monotonic()
        i = 0
        while i < point.warmup or time.monotonic() < ends:
            if i == point.warmup:
                ends = time.monotonic() + (point.seconds or 0.0)
            ctrl.send(("ready", i, *readings))
            tensor = transport.recv(Key(spec.name, i, SENDER, RECEIVER))
            t_received = clock_ns()
            largest = tensor.max()
            t_done = clock_ns()
            readings = (t_received, t_done)
            wrong = (tensor.shape != spec.shape or largest != marker(i, point.dtype)
                     or not np.array_equal(tensor.reshape(-1)[:-1], expected))
            corrupted += bool(wrong)
            del tensor
            i += 1
            trace.sample()
            if (now := time.monotonic()) - reported >= PROGRESS_EVERY_S:  # the watchdog wants signs of life
                report(Progress(point.size_bytes, i))
                reported = now
        ctrl.send(("done", i, *readings))
        trace.sample(force=True)
        report(SoakSide("receiver", point.size_bytes, i, trace.judge(criterion), corrupted=corrupted))


def role_job(label: str, options: dict, criterion: LeakCriterion, points: list[Point], ctx: RankContext) -> None:
    """A rank of the soak: rank 0 sends, rank 1 receives."""
    return_large_frees()
    with transports.create(transports.resolve(label)[0], **options) as transport:
        transport.start(ctx.cluster, ctx.rank)
        transport.placement.plan([p.spec for p in points])
        loop = sender_loop if ctx.rank == SENDER else receiver_loop
        loop(transport, points, CoordinatorSignals(ctx, RECEIVER - ctx.rank), ctx.report, criterion)


def pair_job(label: str, options: dict, criterion: LeakCriterion, points: list[Point], ctx: RankContext) -> None:
    """Both roles in one process, in two threads (``local``, which cannot cross processes)."""
    return_large_frees()
    run_pair(label, options, points, ctx.cluster.token,
             lambda transport, ctrl: sender_loop(transport, points, ctrl, ctx.report, criterion),
             lambda transport, ctrl: receiver_loop(transport, points, ctrl, ctx.report, criterion))


@dataclass
class SoakLine(TransportLine):
    """A transport soaked: the micro harness's line, with the soak's rank jobs (its loops check every tensor
    and follow memory) and its leak ``criterion``."""

    criterion: LeakCriterion = dataclasses.field(default_factory=LeakCriterion)

    @property
    def log_label(self) -> str:
        return f"soak-{self.name}"

    def jobs(self) -> tuple[Callable[..., None], Callable[..., None]]:
        return (functools.partial(role_job, self.name, self.options, self.criterion),
                functools.partial(pair_job, self.name, self.options, self.criterion))


def run_transport(label: str, points: list[Point], options: dict[str, Any], launcher: Launcher,
                  on_point: Callable[[Point, SoakSide, SoakSide], None],
                  criterion: LeakCriterion | None = None) -> None:
    """Soak every point over transport ``label`` built with ``options``; ``on_point(point, sender, receiver)``
    gets both sides' accounts of each point as soon as it is done."""
    line = SoakLine(label, options, criterion=criterion or LeakCriterion())
    try:
        run_line(line, points, launcher, options.get("timeout_s", 120.0), on_sides=on_point)
    except MicroError as exc:
        raise SoakError(str(exc)) from None


def soak_records(name: str, point: Point, sender: SoakSide, receiver: SoakSide) -> list[SoakRecord]:
    """The ``soak`` rows of a point, one per side: tensors sent, received, corrupted and lost, the transfers'
    median time and throughput, and memory (once settled, at the end, and its floor's rise in between)."""
    time_us = sender.time_us or StreamingStats()
    common = {"phase": "micro", "transport": name, "size_bytes": point.size_bytes, "seconds": sender.seconds,
              "p50_us": time_us.percentile(50),
              "throughput_MBps": point.size_bytes / 2**20 / (time_us.mean / 1e6) if time_us.count else math.nan,
              "fabric": fabric.label(sender.fabric)}
    return [SoakRecord(**common, process=side.role, transfers=side.transfers, tensors_sent=sent,
                       tensors_received=received, corrupted=corrupted, lost=lost, rss_start_mb=side.memory.start_mb,
                       rss_end_mb=side.memory.end_mb, rss_growth_mb=side.memory.growth_mb)
            for side, sent, received, corrupted, lost in (
                (sender, sender.transfers, 0, 0, 0),
                (receiver, 0, receiver.transfers, receiver.corrupted, sender.transfers - receiver.transfers))]


# -- training, every tensor checked (``bench soak``'s model phase) ---------------------------------------------


def checksum(array: np.ndarray) -> int:
    """CRC-32 of the bytes of ``array``."""
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


class CheckedTransport:
    """A transport whose every tensor is checked on arrival.

    Each send first tells the receiving rank, over the launcher (outside the transport), the tensor's
    key and CRC-32; each receive (``recv``, and ``recv_many`` and ``recv_each`` for each tensor as it
    arrives) computes the CRC-32 of what arrived and counts it as corrupted when it differs. Tensors
    announced but never received are counted as lost (:meth:`counts`). Everything else goes to the
    wrapped transport.

    ``memory``: the rank's :class:`~bench.ground.stats.RssTrace`, started afresh when the first tensor of step
    ``timed_from`` arrives, so that it covers the timed steps (the model built and traced, warm-up done);
    :meth:`finish` stops it and judges it with the counts.
    """

    def __init__(self, transport, ctx, timeout_s: float, memory: RssTrace | None = None,
                 timed_from: int = 0) -> None:
        self._transport = transport
        self._ctx = ctx
        self._timeout_s = timeout_s
        self._notices: dict[tuple[str, int, int], int] = {}
        self._lock = threading.Lock()
        self.sent = self.received = self.corrupted = 0
        self._trace, self._memory, self._timed_from = memory, memory, timed_from

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def _announce(self, key: Key, array: np.ndarray) -> None:
        self._ctx.send_to(key.dst, ("crc", key.name, key.step, key.src, checksum(array)))
        with self._lock:
            self.sent += 1

    def send(self, key: Key, array: np.ndarray) -> None:
        self._announce(key, array)
        return self._transport.send(key, array)

    def send_async(self, key: Key, array: np.ndarray):
        self._announce(key, array)
        return self._transport.send_async(key, array)

    def recv(self, key: Key) -> np.ndarray:
        tensor = self._transport.recv(key)
        self._check(key, tensor)
        return tensor

    def recv_each(self, keys: Sequence[Key], timeout: float | None = None) -> Iterator[tuple[Key, np.ndarray]]:
        """The wrapped transport's ``recv_each``, each tensor checked as it arrives."""
        for key, tensor in self._transport.recv_each(keys, timeout):
            self._check(key, tensor)
            yield key, tensor

    #: every tensor of ``keys``, received together and each checked (through :meth:`recv_each`)
    recv_many = transports.Transport.recv_many

    def _check(self, key: Key, tensor: np.ndarray) -> None:
        got = checksum(tensor)
        with self._lock:  # one reader of the notices at a time; a notice is sent before its tensor
            while (key.name, key.step, key.src) not in self._notices:
                self._take(self._ctx.receive(timeout=self._timeout_s))
            want = self._notices.pop((key.name, key.step, key.src))
            self.received += 1
            self.corrupted += got != want
            if self._memory is not None and key.step >= self._timed_from:
                self._memory.restart()
                self._memory = None

    def _take(self, notice: Any) -> None:
        if not (isinstance(notice, tuple) and len(notice) == 5 and notice[0] == "crc"):
            raise RuntimeError(f"rank {self._ctx.rank} ({self._ctx.name}) got {notice!r} where it expected the "
                               "checksum of a tensor")
        self._notices[(notice[1], notice[2], notice[3])] = notice[4]

    def counts(self, drain_s: float = 1.0) -> dict[str, int]:
        """Tensors sent, received, corrupted, and lost (announced to this rank, never received)."""
        with self._lock, contextlib.suppress(Exception):
            while True:
                self._take(self._ctx.receive(timeout=drain_s))
        return {"tensors_sent": self.sent, "tensors_received": self.received, "corrupted": self.corrupted,
                "lost": len(self._notices)}

    def finish(self) -> dict[str, Any]:
        """:meth:`counts` and the memory's verdict (``memory``), the trace stopped (what goes to the rank's record)."""
        if self._trace is not None:
            self._trace.stop()
        # the ranks finish at about the same time: a notice still on its way has a second to arrive
        return {**self.counts(), "memory": self._trace.judge() if self._trace is not None else None}


@dataclass(frozen=True)
class ContentCheck:
    """The soak's watch over a training rank's transport (``TrainConfig.watch``): every tensor checked
    (:class:`CheckedTransport`), this process's memory traced over the timed steps from ``timed_from``, large
    freed blocks going back to the system at once (:func:`bench.ground.memory.return_large_frees`)."""

    timeout_s: float
    timed_from: int

    def __call__(self, transport, ctx) -> CheckedTransport:
        return_large_frees()  # resident memory follows what is alive (see the function)
        memory = RssTrace().start()  # sampled by a thread of its own through the steps
        return CheckedTransport(transport, ctx, self.timeout_s, memory, self.timed_from)


def checked(config: TrainConfig) -> TrainConfig:
    """``config`` as the soak trains it: every tensor checked, nothing kept that grows with the steps."""
    return dataclasses.replace(config, watch=ContentCheck(config.timeout_s, config.warmup), constant_memory=True)


def model_soak_records(config: TrainConfig, outcome: dict[int, tuple[str, StepTimes]]) -> list[SoakRecord]:
    """The ``soak`` rows of a :func:`checked` training run: one per process (worker, PS), with tensors sent,
    received, corrupted and lost, and resident memory (the process's :class:`~bench.ground.stats.MemoryVerdict`: once
    settled, at the end, and its floor's rise in between)."""
    step_time = model_record(config, outcome).step_time_s
    layout = Layout(config.servers)
    rows = []
    for rank, (role, times) in sorted(outcome.items()):
        check = times.extra["watch"]
        memory = check["memory"]
        server = rank if role == "worker" else rank - layout.servers
        rows.append(SoakRecord(phase="model", transport=config.label or config.transport, model=config.model,
                               process=f"{role} {server}", seconds=times.total,
                               transfers=config.warmup + config.steps, tensors_sent=check["tensors_sent"],
                               tensors_received=check["tensors_received"], corrupted=check["corrupted"],
                               lost=check["lost"], rss_start_mb=memory.start_mb, rss_end_mb=memory.end_mb,
                               rss_growth_mb=memory.growth_mb, step_time_s=step_time,
                               fabric=fabric.label(times.extra.get("fabric"))))
    return rows


def model_soak_memory(outcome: dict[int, tuple[str, StepTimes]]) -> list[Any]:
    """Each process's :class:`~bench.ground.stats.MemoryVerdict` of a :func:`checked` training run, in the order of
    :func:`model_soak_records`' rows."""
    return [times.extra["watch"]["memory"] for _, (_, times) in sorted(outcome.items())]
