"""A rank of the local launcher killed, or its coordinator, leaves none of the rank's files: neither UCX's
shared-memory segments (``ucx_shm_posix_*``, made at a tensor's size when a tensor is planned and unlinked only once
mapped) nor what libraries delete at a clean exit only (TensorFlow's ``__autograph_generated_file*.py``).

Each test finds the files by the rank that held them (its open descriptors) or in a ``TMPDIR`` of its own, never by
system-wide counts: other processes make and remove files in /tmp and /dev/shm all the time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import gone, rank_processes

ROOT = Path(__file__).resolve().parent.parent
#: generous bounds for a busy machine
BOUND_S = 120
#: the name UCX's posix transport gives a segment (UCX 1.18 and later)
SEGMENT = "ucx_shm_posix_"


def _start(args: list[str], tmpdir: Path) -> subprocess.Popen:
    tmpdir.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), "TMPDIR": str(tmpdir)}
    return subprocess.Popen([sys.executable, "-m", "bench.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)


def _finish(bench: subprocess.Popen) -> str:
    try:
        output, _ = bench.communicate(timeout=BOUND_S * 2)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    return output


def _wait(condition, bound_s: float = BOUND_S) -> bool:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _linked_segments(pid: int) -> list[str]:
    """The segments ``pid`` has open that still have a name (UCX has not unlinked them yet)."""
    found = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if os.path.basename(target).startswith(SEGMENT) and not target.endswith(" (deleted)"):
                    found.append(target)
    return found


def _stopped_in_a_segments_window(bench: subprocess.Popen) -> tuple[int, list[str]] | None:
    """A rank of ``bench`` stopped (SIGSTOP) while it holds a segment UCX has not unlinked yet, and those segments;
    None if the run ended first. Only a stopped rank is sure to keep the name: it cannot unlink it any more."""
    ranks: dict[int, int] = {}
    while bench.poll() is None:
        if len(ranks) < 2:
            ranks = rank_processes(bench.pid)
        for pid in ranks:
            if not _linked_segments(pid):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                _wait(lambda pid=pid: _state(pid) in ("T", "t", "Z", None), 30)
                if segments := [path for path in _linked_segments(pid) if os.path.exists(path)]:
                    return pid, segments
                os.kill(pid, signal.SIGCONT)
    return None


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _zerocopy_over_shared_memory() -> str | None:
    """Why zerocopy cannot run over UCX's shared memory here, or None."""
    import transports

    availability = transports.REGISTRY.load("zerocopy").availability()
    if not availability.ok:
        return f"zerocopy cannot run here: {availability.reason}"
    return None if os.path.isdir("/dev/shm") else "no /dev/shm here"


@pytest.mark.parametrize("kill", ["rank SIGKILL", "coordinator SIGTERM", "coordinator SIGKILL"])
def test_a_rank_killed_while_it_plans_a_tensor_leaves_none_of_its_segments(tmp_path, kill):
    """A rank stopped while UCX has just made a segment for a tensor being planned (before it is unlinked), then
    killed (or its coordinator is): the segment used to stay in /dev/shm (37 to 479 MB each, 6 kills in 15)."""
    if (why := _zerocopy_over_shared_memory()) is not None:
        pytest.skip(why)
    tmpdir = tmp_path / "tmp"
    caught = None
    for _attempt in range(3):  # the run may plan its tensors before a look finds a segment; then again
        bench = _start(["micro", "--sizes", "128MB", "--iters", "2", "--warmup", "1", "--rounds", "20",
                        "--transports", "zerocopy", "--fabric-transport", "shm", "--no-references", "--no-peers",
                        "--no-plot", "--timeout", "120", "--out", str(tmp_path / f"run{_attempt}")], tmpdir)
        try:
            caught = _stopped_in_a_segments_window(bench)
            if caught is None:
                _finish(bench)
                continue
            pid, segments = caught
            if kill == "rank SIGKILL":
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(bench.pid, signal.SIGTERM if kill.endswith("SIGTERM") else signal.SIGKILL)
            output = _finish(bench)
            assert _wait(lambda pid=pid: gone(pid)), f"rank {pid} outlived the run"
            # a killed coordinator's reaper removes them once it sees it go, and the run's directory they were in
            left = [*segments, *{os.path.dirname(path) for path in segments} - {"/dev/shm"}]
            assert _wait(lambda left=left: not any(os.path.exists(path) for path in left)), (
                f"left: {[path for path in left if os.path.exists(path)]}\n{output[-3000:]}")
            assert "Traceback" not in output, output[-3000:]
            if kill == "rank SIGKILL":
                assert bench.returncode == 1 and "died (killed by SIGKILL)" in output, output[-3000:]
            break
        finally:
            if bench.poll() is None:
                bench.kill()
                bench.wait()
            for path in caught[1] if caught else ():  # what the old launcher left: ours, found by the rank
                with contextlib.suppress(OSError):
                    os.unlink(path)
    else:
        pytest.skip("no look found a rank while it held a segment not yet unlinked")
    assert _wait(lambda: not any(tmpdir.iterdir())), sorted(path.name for path in tmpdir.iterdir())


def test_ranks_of_a_model_run_sigkilled_leave_no_temporary_file(tmp_path):
    """``bench model --launcher local --servers 2`` with its ranks SIGKILLed once TensorFlow has written its
    generated modules: they used to stay in the temporary directory (two per killed rank)."""
    pytest.importorskip("tensorflow")
    tmpdir = tmp_path / "tmp"
    bench = _start(["model", "tests.tiny_models:TINY", "--launcher", "local", "--servers", "2", "--transport",
                    "grpc_tcp", "--steps", "1000000", "--warmup", "1", "--no-plot", "--out", str(tmp_path / "run")],
                   tmpdir)
    try:
        assert _wait(lambda: any(tmpdir.rglob("__autograph_generated_file*.py")) or bench.poll() is not None), (
            "TensorFlow wrote no generated module")
        assert bench.poll() is None, _finish(bench)[-3000:]
        written = [path.name for path in tmpdir.rglob("__autograph_generated_file*.py")]
        ranks = rank_processes(bench.pid)
        assert len(ranks) == 4, ranks  # a worker and a parameter server per server
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        output = _finish(bench)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 1 and "died (killed by SIGKILL)" in output, output[-3000:]
    assert written and "Traceback" not in output, output[-3000:]
    assert sorted(path.name for path in tmpdir.rglob("*")) == []
