"""A ``bench micro`` run's measurements: its lines (:func:`lines_of`) at every size, in rounds when asked, and
beside busy processes with ``--contend``, each record (and its samples) written as it is measured, its
``of_reference`` and ``of_peer`` set against the lines measured before it at the same size."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.experiments.micro.lines import MicroError, MicroLine, make_record, run_line, transfer_times
from bench.experiments.micro.loops import Side
from bench.experiments.micro.points import Point
from bench.launch import Launcher, LaunchError
from bench.launch.private import PrivateHosts
from bench.results import MicroRecord, RunWriter
from transports.memory import HOST, Memory

if TYPE_CHECKING:
    from tqdm import tqdm as ProgressBar


@dataclass(frozen=True)
class SweepSettings:
    """What a sweep is asked to do beside its lines and points (``bench micro``'s options)."""

    #: every size this many times, interleaved
    rounds: int = 1
    #: busy processes beside a second pass of every point (0: quiet only)
    contend: int = 0
    #: seconds one transfer may take
    timeout_s: float = 120.0
    #: where the tensors live: the sender's memory, the receiver's (--memory)
    memory: tuple[Memory, Memory] = (HOST, HOST)


#: each timed transfer's times (µs) by column of samples.csv (:func:`transfer_times`)
Times = dict[str, np.ndarray]
#: what a pass does with each point measured: ``keep(record, times)``
Keep = Callable[[MicroRecord, Times | None], None]


class Sweep:
    """The measurements of one ``bench micro`` run: every line at every size (in rounds when asked), each record
    (and its samples) written as it is measured. It asks a line what it can do, never what it is called."""

    def __init__(self, settings: SweepSettings, launcher: Launcher, writer: RunWriter, lines: list[MicroLine]) -> None:
        self.settings, self.launcher, self.writer = settings, launcher, writer
        self.failures: list[str] = []
        self.failed: set[str] = set()  # the lines that failed: not tried again in later rounds
        self.fabrics: dict[str, str] = {}
        self.reference_MBps: dict[int, float] = {}
        self.best_peer_p50_us: dict[tuple[int, int], float] = {}  # (size, round) -> the lowest p50 of a peer line
        self.best_peer_contended_p50_us: dict[tuple[int, int], float] = {}  # the same, with --contend
        self.lines: list[MicroLine] = []
        self.hosts: dict[str, PrivateHosts] = {}  # line name -> where its ranks run
        self.left_out: dict[str, str] = {}  # an optional line (a reference, a peer) that cannot run here -> why
        #: a line that runs less isolated than asked (the MPI pair where no network namespace can be made) -> how
        self.isolation: dict[str, str] = {}
        for line in lines:
            self._admit(line)

    def _admit(self, line: MicroLine) -> None:
        """Keep ``line`` if it can run here and under the launcher; an optional line (a reference, a peer) that
        cannot is left out, and why is kept for ``say_left_out`` and meta.json (a transport cannot fail so: the
        command checked the transports before)."""
        status = line.availability()
        why = status.reason if not status.ok else line.memory_problem(self.settings.memory)
        if why is None:
            try:
                self.hosts[line.name] = line.hosts(self.launcher)
            except LaunchError as exc:
                why = str(exc)
        if why is None:
            self.lines.append(line)
            if weaker := getattr(line, "weaker_isolation", None):  # said in one line, and kept in meta.json
                self.isolation[line.name] = weaker
                self.writer.meta["isolation"] = self.isolation
        elif line.required:
            self._fail(line, why)
        else:
            self.left_out[line.name] = why

    def say_left_out(self, out: Path) -> None:
        """One line naming the optional lines that cannot run here, and where it says why and how to add each; one
        line per way a line runs less isolated than asked."""
        for how in dict.fromkeys(self.isolation.values()):
            names = [name for name, said in self.isolation.items() if said == how]
            print(f"bench micro: weaker isolation for {', '.join(names)}: {how} ('isolation' in "
                  f"{out / 'meta.json'})", file=sys.stderr)
        if self.left_out:
            print(f"bench micro: not available here, left out: {', '.join(self.left_out)} (why, and how to add "
                  f"each: 'left_out' in {out / 'meta.json'}; --no-peers, --no-references to skip them)",
                  file=sys.stderr)

    def close(self) -> None:
        """Release the hosts made for lines (a private emulated host)."""
        for hosts in self.hosts.values():
            if hosts.own:
                hosts.launcher.close()
        self.hosts.clear()

    def measure(self, points: list[Point]) -> None:
        """Every line at every point: one launch per line over all sizes, or with --rounds or --contend, per size
        every line once per round (a launch each, and one more beside the busy processes), round after round."""
        from tqdm import tqdm

        from bench.ground.sizes import format_size

        rounds, passes = self.settings.rounds, 2 if self.settings.contend else 1
        total = sum(p.transfers for line in self.lines for p in line.points(points))
        with tqdm(total=total * rounds * passes, unit="xfer", dynamic_ncols=True, disable=None) as bar:
            if rounds == 1 and passes == 1:
                for line in self.lines:
                    if not line.points(points):  # none of its sizes asked (the harness line above 64KB): no launch
                        continue
                    started = time.monotonic()
                    self._run(line, line.points(points), 1, bar)
                    self._log_progress(bar, f"{line.name}: {len(line.points(points))} sizes", started)
                return
            for point in points:
                started = time.monotonic()
                for round_ in range(1, rounds + 1):
                    for line in self.lines:
                        if not (mine := line.points([point])):
                            continue
                        if line.name in self.failed:
                            bar.update((point.transfers) * passes)  # it failed before: not tried again
                            continue
                        self._run(line, mine, round_, bar)
                self._log_progress(bar, f"{format_size(point.size_bytes)}: every line, {rounds} round(s)", started)

    @staticmethod
    def _log_progress(bar: ProgressBar, what: str, started: float) -> None:
        """Where no progress bar is drawn (output to a file or a pipe: a log), a line for each part done."""
        if bar.disable:
            print(f"bench micro: {what} done in {time.monotonic() - started:.0f} s", flush=True)

    def _run(self, line: MicroLine, points: list[Point], round_: int, bar: ProgressBar) -> None:
        """``line`` at ``points`` in round ``round_``, each record written once measured; with --contend (one
        point at a time, then) the point again beside the busy processes before its record is written."""
        if not self.settings.contend:
            self._pass(line, points, round_, bar, lambda record, times: self._add(line, record, times))
            return
        from bench.ground.contention import busy_processes

        quiet: list = []
        self._pass(line, points, round_, bar, lambda record, times: quiet.append((record, times)))
        contended: dict[int, MicroRecord] = {}
        if quiet:
            with busy_processes(self.settings.contend):
                self._pass(line, points, round_, bar, lambda record, times: contended.setdefault(record.size_bytes,
                                                                                                  record),
                           " contended")
        for record, times in quiet:
            self._add(line, record, times, contended.get(record.size_bytes))

    def _pass(self, line: MicroLine, points: list[Point], round_: int, bar: ProgressBar, keep: Keep,
              phase: str = "") -> None:
        """One launch of ``line`` over ``points``: ``keep(record, times)`` for each point measured."""
        from bench.ground.sizes import format_size

        base = bar.n
        done_before = {p.size_bytes: sum(q.transfers for q in points if q.size_bytes < p.size_bytes)
                       for p in points}
        where = (f" round {round_}" if self.settings.rounds > 1 else "") + phase
        bar.set_postfix_str(f"{line.name}{where}")

        def progress(size: int, n: int) -> None:
            bar.set_postfix_str(f"{line.name} {format_size(size)}{where}")
            bar.update(base + done_before[size] + n - bar.n)

        def on_sides(point: Point, sender: Side, receiver: Side) -> None:
            times = transfer_times(sender, receiver)
            keep(make_record(line.name, point, sender, receiver, round_, times), times)

        def on_record(point: Point, record: MicroRecord) -> None:
            record.round = round_
            keep(record, None)
            progress(point.size_bytes, point.transfers)

        try:
            run_line(line, points, self.hosts[line.name].launcher, self.settings.timeout_s, on_sides, on_record,
                     progress)
        except MicroError as exc:
            if line.required:
                self._fail(line, str(exc), bar)
            else:
                self.failed.add(line.name)
                bar.write(f"bench micro: warning: no {line.name} line: {exc}", file=sys.stderr)
        bar.update(base + sum(p.transfers for p in points) - bar.n)

    def _add(self, line: MicroLine, record: MicroRecord, times: Times | None, contended: MicroRecord | None = None
             ) -> None:
        """Write a record (and its samples), its throughput set against the bandwidth reference of its size and
        (a transport's) its p50 against the best peer's at its size and round; with --contend, what the
        ``contended`` record of the same point measured, set against the quiet p50 and the best peer's."""
        from bench.results import of_peer, of_reference

        if line.bandwidth_reference:
            self.reference_MBps[record.size_bytes] = record.throughput_MBps
        record.of_reference = of_reference(record.throughput_MBps, self.reference_MBps.get(record.size_bytes))
        at = (record.size_bytes, record.round)
        if contended is not None:
            record.contend = self.settings.contend
            record.contended_p50_us, record.contended_p99_us = contended.p50_us, contended.p99_us
            record.contended_of_quiet = of_peer(contended.p50_us, record.p50_us)  # the same ratio, to the quiet p50
        if line.time_reference and record.p50_us is not None and record.p50_us > 0:
            self.best_peer_p50_us[at] = min(record.p50_us, self.best_peer_p50_us.get(at, float("inf")))
            if record.contended_p50_us is not None and record.contended_p50_us > 0:
                self.best_peer_contended_p50_us[at] = min(record.contended_p50_us,
                                                          self.best_peer_contended_p50_us.get(at, float("inf")))
        elif line.required:
            record.of_peer = of_peer(record.p50_us, self.best_peer_p50_us.get(at))
            record.contended_of_peer = of_peer(record.contended_p50_us, self.best_peer_contended_p50_us.get(at))
        self.writer.add(record)
        if times is not None:
            self.writer.add_samples(record, times)
        self.fabrics[line.name] = record.fabric

    def _fail(self, line: MicroLine, why: str, bar: ProgressBar | None = None) -> None:
        self.failures.append(why)
        self.failed.add(line.name)
        (bar.write if bar is not None else print)(f"bench micro: error: {why}", file=sys.stderr)
