"""The lines of ``bench micro`` and how one is measured: :class:`MicroLine` (what the harness asks of a line),
:class:`TransportLine` (one of our transports), :func:`run_line` (a line's ranks at its points, through the
launch layer) and the record of a point from both sides' measurements."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

import transports
from bench.experiments.micro.loops import STARTUP_S, Progress, Side, pair_job, role_job
from bench.experiments.micro.points import Point
from bench.experiments.micro.sources import source_columns
from bench.launch import Launcher, LaunchError, RankSpec
from bench.launch.private import PrivateHosts
from bench.results import MicroRecord, latency_summary
from transports import fabric
from transports.common import Availability
from transports.memory import Memory

#: seconds of silence allowed beyond --timeout: one progress interval and scheduling on a busy machine
SILENCE_SLACK_S = 5.0


class MicroError(RuntimeError):
    """A transport's run failed; the message names the transport and the side."""


@dataclass(frozen=True)
class Measured:
    """rank -> coordinator: a line's record of one size, measured whole inside the rank (a reference tool)."""

    size_bytes: int
    record: MicroRecord


class MicroLine(ABC):
    """One line of ``bench micro``: a transport, a reference measured beside them (``bench.experiments.references``),
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

    def memory_problem(self, memory: tuple[Memory, Memory]) -> str | None:
        """Why it cannot measure tensors in ``memory`` (the sender's, the receiver's: ``--memory``), in one line;
        None when it can. A line measures host memory unless it says more."""
        if any(side.is_device for side in memory):
            return f"measures host memory only, not --memory {memory[0]},{memory[1]}"
        return None

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

    def memory_problem(self, memory: tuple[Memory, Memory]) -> str | None:
        return None  # every transport takes device memory (one that moves host memory only stages it, counted)

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
    # the ledgers and CPU times cover every transfer past the warm-up: the timed ones and the checked ones between
    moved = max(1, receiver.transfers - point.warmup) if receiver.transfers else per
    both = sender.stats + receiver.stats
    copied = both.copied_bytes + point.extra_copies * point.size_bytes * moved
    return MicroRecord(
        transport=name, size_bytes=point.size_bytes, round=round, dtype=point.dtype.name, warmup=point.warmup,
        iters=per, **summary,
        transfer_p50_us=float(np.percentile(times["transfer_us"], 50)),
        consume_p50_us=float(np.percentile(times["time_us"] - times["transfer_us"], 50)),
        throughput_MBps=point.size_bytes / 2**20 / (summary["mean_us"] / 1e6),
        sender_cpu_s=sender.cpu_s, receiver_cpu_s=receiver.cpu_s,
        sender_cpu_us_per_transfer=sender.cpu_s / moved * 1e6,
        receiver_cpu_us_per_transfer=receiver.cpu_s / moved * 1e6,
        copied_bytes_per_transfer=copied / moved, serialisations_per_transfer=both.serialisations / moved,
        deserialisations_per_transfer=both.deserialisations / moved,
        control_messages_per_transfer=both.control_messages / moved, registrations=both.registrations,
        registrations_per_transfer=both.registrations / moved, fabric=fabric.label(sender.fabric),
        extra_copies=point.extra_copies, sender_memory=str(point.sender_memory),
        receiver_memory=str(point.receiver_memory), device_to_host_bytes_per_transfer=both.device_to_host_bytes / moved,
        host_to_device_bytes_per_transfer=both.host_to_device_bytes / moved,
        device_to_device_bytes_per_transfer=both.device_to_device_bytes / moved,
        **source_columns(point.source, sender.times, sender.written, sender.fresh_writes))
