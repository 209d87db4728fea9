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

import pytest

from bench.results import load_run

#: generous bounds for a busy machine: how long a run may take to start, or to stop
BOUND_S = 120


def rank_processes(parent: int) -> dict[int, int]:
    """The rank processes (``python -m bench.launch.rank HUB RANK ...``) whose parent is ``parent``: pid -> rank."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and "bench.launch.rank" in argv:
            found[int(entry.name)] = int(argv[argv.index("bench.launch.rank") + 2])
    return found


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie has ended)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


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
                        transport, "--no-references", "--no-plot", "--out", str(out))
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


def test_a_model_run_stopped_by_sigterm_says_so_and_leaves_no_rank(tmp_path):
    pytest.importorskip("tensorflow")
    out = tmp_path / "run"
    bench = start_bench("model", "tests.tiny_models:TINY", "--transport", "grpc_tcp,local", "--steps", "1000000",
                        "--warmup", "1", "--no-plot", "--out", str(out))
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


def test_ranks_die_with_a_killed_bench_and_its_run_reads_as_killed(tmp_path):
    out = tmp_path / "run"
    bench = start_bench("micro", "--sizes", "1KB,4MB", "--iters", "3000", "--warmup", "1", "--transports",
                        "grpc_tcp", "--no-references", "--no-plot", "--out", str(out))
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
from bench.launch import RankSpec
from bench.launch.local import LocalLauncher
from tests.test_interrupts import hold_the_interpreter

LocalLauncher().run([RankSpec(hold_the_interpreter, "stuck")], 600,
                    lambda rank, pid: print(pid, flush=True))
"""


def test_a_rank_stuck_in_c_dies_with_its_coordinator():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    coordinator = subprocess.Popen([sys.executable, "-c", COORDINATOR], stdout=subprocess.PIPE, text=True, env=env)
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
