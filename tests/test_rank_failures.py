"""A rank killed in the middle of bench micro, model or scale ends the run with an error naming it; nobody is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.results import load_run

from .processes import gone, rank_processes

#: generous: the machine running the tests may be busy
BOUND_S = 120


def kill_rank_mid_run(args: list[str], victim: int, ranks: int, settle_s: float) -> tuple[subprocess.CompletedProcess,
                                                                                         list[int]]:
    """Start ``bench ARGS``, wait until a run of ``ranks`` ranks is up for ``settle_s``, SIGKILL rank ``victim``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    bench = subprocess.Popen([sys.executable, "-m", "bench.cli", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + BOUND_S
        ranks_now: dict[int, int] = {}
        while len(ranks_now) < ranks:
            assert time.monotonic() < deadline, "the run's ranks never started"
            assert bench.poll() is None, bench.stdout.read()
            time.sleep(0.2)
            ranks_now = rank_processes(bench.pid)
        time.sleep(settle_s)
        pids = list(ranks_now)
        victim_pid = next(pid for pid, rank in ranks_now.items() if rank == victim)
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = bench.communicate(timeout=BOUND_S)
        assert time.monotonic() - killed_at < BOUND_S
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    return subprocess.CompletedProcess(bench.args, bench.returncode, output, ""), pids


@pytest.mark.parametrize(("args", "victim", "named"), [
    (["micro", "--sizes", "1KB", "--iters", "1000000", "--transports", "zerocopy", "--fabric-transport", "shm",
      "--no-references", "--no-peers"], 1, "rank 1 (receiver) died (killed by SIGKILL)"),
    (["model", "tests.tiny_models:TINY", "--transport", "zerocopy", "--steps", "1000000", "--fabric-transport",
      "shm"], 1, "rank 1 (ps 0) died (killed by SIGKILL)"),
], ids=["micro", "model"])
def test_a_killed_rank_is_named_and_nothing_keeps_running(tmp_path, args, victim, named):
    if args[0] == "model":
        pytest.importorskip("tensorflow")
    out = tmp_path / "run"
    done, pids = kill_rank_mid_run([*args, "--no-plot", "--out", str(out)], victim=victim, ranks=2, settle_s=4)
    assert done.returncode == 1, done.stdout
    assert named in done.stdout
    assert all(gone(pid) for pid in pids)
    assert load_run_meta(out)["status"] == "failed"


def test_scale_names_a_killed_rank_and_keeps_nothing_running(tmp_path):
    pytest.importorskip("tensorflow")
    out = tmp_path / "run"
    # 2000 replayed steps of the tiny model take a minute over grpc_tcp, and the Local line, run after, seconds
    done, pids = kill_rank_mid_run(["scale", "tests.tiny_models:TINY", "--transport", "grpc_tcp", "--servers", "2",
                                    "--steps", "2000", "--no-plot", "--out", str(out)],
                                   victim=3, ranks=4, settle_s=3)
    assert done.returncode == 1, done.stdout
    assert "rank 3 (ps 1) died (killed by SIGKILL)" in done.stdout
    assert all(gone(pid) for pid in pids)
    # the runs after the failed one still ran: the Local line kept its record
    assert list(load_run(out).records["transport"]) == ["local"]


def load_run_meta(path: Path) -> dict:
    import json

    return json.loads((path / "meta.json").read_text())
