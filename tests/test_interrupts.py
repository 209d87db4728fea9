"""Signals to bench: a run stops as with Ctrl-C, keeps what it measured, says why in meta.json, and leaves nobody.

Every test runs ``bench`` as a subprocess and finds the run's rank processes by their parent (the bench
process), never by system-wide counts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench.experiments.micro import SILENCE_SLACK_S
from bench.results import load_run

from .processes import gone, rank_processes

#: generous bounds for a busy machine: how long a run may take to start, or to stop
BOUND_S = 120


def wait_gone(pids: list[int], bound_s: float = BOUND_S) -> list[int]:
    """The pids still alive after waiting up to ``bound_s`` for them to end."""
    end = time.monotonic() + bound_s
    while time.monotonic() < end and not all(gone(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if not gone(pid)]


def start_bench(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-m", "bench.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def records_written(out: Path) -> int:
    try:
        return max(0, len((out / "records.csv").read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def wait_for_a_record(bench: subprocess.Popen, out: Path, ranks: int) -> list[int]:
    """Wait until the run has written a record and its ``ranks`` rank processes run; their pids."""
    deadline = time.monotonic() + BOUND_S
    pids: dict[int, int] = {}
    while records_written(out) < 1 or len(pids) < ranks:
        assert time.monotonic() < deadline, "the run never wrote a record"
        assert bench.poll() is None, bench.stdout.read()
        time.sleep(0.1)
        pids = rank_processes(bench.pid) or pids
    return list(pids)


def finish(bench: subprocess.Popen) -> str:
    try:
        output, _ = bench.communicate(timeout=BOUND_S)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    return output


@pytest.mark.parametrize(("signum", "transport", "ranks"), [
    (signal.SIGTERM, "grpc_tcp", 2),
    (signal.SIGHUP, "local", 1),
    (signal.SIGINT, "local", 1),
], ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_keeps_the_records_marks_the_run_and_stops_every_rank(tmp_path, signum, transport, ranks):
    out = tmp_path / "run"
    # the first size takes seconds, the second far longer: the signal comes while it is measured
    bench = start_bench("micro", "--sizes", "1KB,4MB", "--iters", "3000", "--warmup", "1", "--transports",
                        transport, "--no-references", "--no-peers", "--no-plot", "--out", str(out))
    pids = wait_for_a_record(bench, out, ranks)
    os.kill(bench.pid, signum)
    output = finish(bench)
    name = signal.Signals(signum).name
    assert bench.returncode == 128 + signum, output
    assert f"interrupted by {name}" in output and str(out) in output, output
    assert "Traceback" not in output, output
    run = load_run(out)
    assert run.meta["status"] == "interrupted"
    assert run.meta["reason"] == f"interrupted by {name}"
    assert list(run.records["size_bytes"]) == [1024]  # the point measured before the signal is kept
    assert wait_gone(pids) == []


@pytest.mark.parametrize("command", ["model", "scale"])
def test_a_model_run_stopped_by_sigterm_says_so_and_leaves_no_rank(tmp_path, command):
    pytest.importorskip("tensorflow")
    out = tmp_path / "run"
    runs = ["--transport", "grpc_tcp,local"] if command == "model" else ["--transport", "grpc_tcp", "--servers", "1,2"]
    bench = start_bench(command, "tests.tiny_models:TINY", *runs, "--steps", "1000000", "--warmup", "1", "--no-plot",
                        "--out", str(out))
    deadline = time.monotonic() + BOUND_S
    pids: dict[int, int] = {}
    while len(pids) < 2:  # the worker and the PS of the first run
        assert time.monotonic() < deadline, "the training ranks never started"
        assert bench.poll() is None, bench.stdout.read()
        time.sleep(0.2)
        pids = rank_processes(bench.pid)
    os.kill(bench.pid, signal.SIGTERM)
    output = finish(bench)
    assert bench.returncode == 128 + signal.SIGTERM, output
    assert "interrupted by SIGTERM" in output and str(out) in output
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["status"], meta["reason"]) == ("interrupted", "interrupted by SIGTERM")
    assert wait_gone(list(pids)) == []


def test_a_soak_stopped_by_sigterm_keeps_the_points_it_checked(tmp_path):
    out = tmp_path / "run"
    # two points of 8 s each: the signal comes during the second, as soon as its ranks run (a look every 0.1 s)
    bench = start_bench("soak", "--transports", "local", "--sizes", "1KB,4KB", "--duration", "16", "--steps", "0",
                        "--out", str(out))
    pids = wait_for_a_record(bench, out, 1)
    os.kill(bench.pid, signal.SIGTERM)
    output = finish(bench)
    assert bench.returncode == 128 + signal.SIGTERM, output
    assert "interrupted by SIGTERM" in output and str(out) in output, output
    run = load_run(out)
    assert (run.meta["status"], run.meta["reason"]) == ("interrupted", "interrupted by SIGTERM")
    assert sorted(run.records["process"]) == ["receiver", "sender"]  # the first point's two rows
    assert list(run.records["corrupted"]) == [0, 0]
    assert wait_gone(pids) == []


def test_ranks_die_with_a_killed_bench_and_its_run_reads_as_killed(tmp_path):
    out = tmp_path / "run"
    bench = start_bench("micro", "--sizes", "1KB,4MB", "--iters", "3000", "--warmup", "1", "--transports",
                        "grpc_tcp", "--no-references", "--no-peers", "--no-plot", "--out", str(out))
    pids = wait_for_a_record(bench, out, 2)
    bench.kill()
    bench.wait()
    assert wait_gone(pids) == []
    assert json.loads((out / "meta.json").read_text())["status"] == "running"  # nobody could write otherwise
    assert load_run(out).meta["status"] == "killed"


# -- a rank whose main thread never returns to Python: only the kernel can end it -----------------------------


def hold_the_interpreter(ctx) -> None:
    """A rank job that reports its pid, then matches a regular expression that backtracks for ever.

    The match is one C call that holds the GIL: no Python signal handler runs, and no other thread (the one
    that would see the coordinator go) gets to run either.
    """
    ctx.report(os.getpid())
    re.match(r"(a+)+$", "a" * 64 + "b")


COORDINATOR = """
import sys
from bench.launch import RankSpec, create
from tests.test_interrupts import hold_the_interpreter

create(sys.argv[1]).run([RankSpec(hold_the_interpreter, "stuck")], 600, lambda rank, pid: print(pid, flush=True))
"""


def _netns_available() -> bool:
    from bench.launch.hosts import NetnsUnavailable, check_support

    try:
        check_support()
    except NetnsUnavailable:
        return False
    return True


@pytest.mark.parametrize("launcher", [
    "local",
    pytest.param("netns", marks=pytest.mark.system("netns")),
])
def test_a_rank_stuck_in_c_dies_with_its_coordinator(launcher):
    """Under netns the rank runs through ``ip netns exec``, which execs it in place: its parent is the coordinator
    too, and the kernel's PR_SET_PDEATHSIG (or else the hosts' reaper) ends it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    coordinator = subprocess.Popen([sys.executable, "-c", COORDINATOR, launcher], stdout=subprocess.PIPE, text=True,
                                   env=env)
    rank = None
    try:
        rank = int(coordinator.stdout.readline())
        coordinator.kill()
        coordinator.wait()
        assert wait_gone([rank], 30) == [], "the rank outlived its coordinator"
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
        if rank is not None and not gone(rank):
            os.kill(rank, signal.SIGKILL)  # it is ours: it was reported by our own coordinator


# -- the watchdog measures liveness, not the length of a point ------------------------------------------------


class FakeClock:
    """``time`` for bench.experiments.micro, whose monotonic clock moves only when a transfer takes time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


class SlowTransport:
    """A receiving transport whose every transfer takes ``seconds`` of the fake clock."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def recv(self, key):
        from bench.experiments.micro import marker

        self.clock.now += self.seconds
        tensor = np.zeros(256, dtype=np.float32)  # 1KB
        tensor[-1] = marker(key.step, tensor.dtype)
        return tensor

    def inbound(self, name, src):
        from transports import Inbound

        return Inbound(self, name, src, 1)

    def stats(self):
        from transports import TransportStats

        return TransportStats()


class Signals:
    def send(self, value) -> None:
        pass


@pytest.mark.parametrize("transfer_s", [0.3, 2.5])
def test_the_receiver_reports_progress_often_in_time_however_long_the_point(monkeypatch, transfer_s):
    """A point of 400 transfers of 0.3 s (2 min) or 2.5 s each: before, progress came every 5% of the point
    (20 transfers: 6 s, 50 s), and the watchdog counted a long point as silence ("no progress for 63 s" while
    every transfer took 45 ms). Now a report comes at least every second, and after every slower transfer."""
    from bench.experiments import micro
    from bench.experiments.micro import loops

    clock = FakeClock()
    monkeypatch.setattr(loops, "time", clock)
    reports: list[float] = []

    def report(payload) -> None:
        if isinstance(payload, micro.Progress):
            reports.append(clock.now)

    started = clock.now
    micro.receiver_loop(SlowTransport(clock, transfer_s), [micro.Point(1024, warmup=0, iters=400)], Signals(),
                        report, per_thread_cpu=True)
    gaps = np.diff([started, *reports])
    # the first transfer that ends a second or more after the last report is reported: a slower one at once
    bound = transfer_s if transfer_s >= 1.0 else 1.0 + transfer_s
    assert gaps.max() <= bound + 1e-6, (gaps.max(), bound)


@pytest.mark.system("netns")  # the point's length is the link's
def test_a_point_far_longer_than_the_timeout_is_not_silence(tmp_path):
    """``--timeout 1`` bounds one transfer and the silence of the ranks (plus a few seconds), not a point: a
    point that lasts far longer completes (before, the watchdog gave up on points longer than 20 x its
    bound: 'no progress for 63 s' while transfers took 45 ms).

    The point's length is the link's, not the machine's: 1500 transfers of 1KB over a link shaped to 1 Mbit/s
    (about 10 ms each) take about 16 s, against a bound of 6 s. Counted in transfers over a local pair, its length
    was the CPU's: a minute on a busy machine, a second or two on a quiet one, shorter than the bound."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "bench.cli", "micro", "--sizes", "1KB", "--iters", "1500",
                           "--warmup", "0", "--transports", "grpc_tcp", "--timeout", "1", "--no-references",
                           "--no-peers", "--no-plot", "--launcher", "netns", "--link-rate", "1mbit", "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stdout + done.stderr
    run = load_run(out)
    assert run.meta["status"] == "complete"
    assert list(run.records["iters"]) == [1500]
    assert run.records["mean_us"].iloc[0] * 1500 / 1e6 > 2 * (1 + SILENCE_SLACK_S)  # the point outlasted the bound


def test_a_timed_point_reports_about_once_a_second_not_every_transfer(monkeypatch):
    """The soak's points last a duration (iters 0): 5% of no iterations reported every transfer, a message to
    the coordinator per tensor (1000 a second at 1KB)."""
    from bench.experiments import micro
    from bench.experiments.micro import loops

    clock = FakeClock()
    monkeypatch.setattr(loops, "time", clock)
    progress: list[float] = []
    micro.receiver_loop(SlowTransport(clock, 0.01), [micro.Point(1024, warmup=2, iters=0, seconds=5.0)], Signals(),
                        lambda payload: progress.append(clock.now) if isinstance(payload, micro.Progress) else None,
                        per_thread_cpu=True)
    assert 4 <= len(progress) <= 7, len(progress)  # about one a second over 5 s, not ~500
