"""A signal to any command leaves nothing behind, and a killed run of the MPI peers leaves none of its files.

Each test gives the command a ``TMPDIR`` of its own and finds what the run made by name (its temporary directory,
the shared-memory files its MPI processes had mapped), never by system-wide counts: other processes on a busy
machine make and remove files in /tmp and /dev/shm all the time.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import children_of, gone
from tests.test_peers import ROOT, needs_mpi
from tests.test_report import micro_run

#: generous bounds for a busy machine
BOUND_S = 120


def _environment(tmpdir: Path) -> dict[str, str]:
    tmpdir.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), "TMPDIR": str(tmpdir)}


def _wait(condition, bound_s: float = BOUND_S, step_s: float = 0.02) -> bool:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(step_s)
    return condition()


def _descendants(root: int) -> set[int]:
    found, todo = set(), [root]
    while todo:
        for child in children_of(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _drawing(tmpdir: Path, report: subprocess.Popen) -> bool:
    return any(tmpdir.glob("bench-report-*")) or report.poll() is not None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_to_bench_report_leaves_no_temporary_directory(tmp_path, signum):
    """The report draws its figures in ``$TMPDIR/bench-report-*``: a signal while it draws removes it, and the
    command says it was interrupted (128 + the signal)."""
    runs = [micro_run(tmp_path / f"run{i}") for i in range(4)]  # figures enough to take a moment
    tmpdir = tmp_path / "tmp"
    env = _environment(tmpdir)
    for attempt in range(5):  # the report may finish before the signal comes; then again
        report = subprocess.Popen([sys.executable, "-m", "bench.cli", "report", *map(str, runs), "--out",
                                   str(tmp_path / f"page{attempt}.html")], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
        try:
            assert _wait(functools.partial(_drawing, tmpdir, report), step_s=0.005)
            if report.poll() is None:
                time.sleep(0.05)  # into the drawing
                report.send_signal(signum)
            output, _ = report.communicate(timeout=BOUND_S)
        finally:
            if report.poll() is None:
                report.kill()
                report.wait()
        assert not list(tmpdir.glob("bench-report-*")), output
        if report.returncode != 0:
            break
    else:
        pytest.skip("the report always finished before the signal came")
    assert report.returncode == 128 + signum, output
    assert f"bench report: interrupted by {signal.Signals(signum).name}" in output
    assert "Traceback" not in output


#: mount namespaces with a /dev/shm of their own can be made here (root and unshare)
PRIVATE_SHM = os.geteuid() == 0 and shutil.which("unshare") is not None
needs_private_shm = pytest.mark.system("mountns")

#: runs "$@" (bench) in a mount namespace whose /dev/shm is a fresh tmpfs ($SHM_SIZE): every file there is the
#: run's. Once bench has ended it waits (up to a minute) for that /dev/shm to empty, and lists what is left.
_PRIVATE_SHM = r"""
mount -t tmpfs -o "size=$SHM_SIZE,mode=1777" tmpfs /dev/shm || exit 97
[ -n "$SHM_FILL" ] && dd if=/dev/zero of=/dev/shm/fill bs=64k 2>/dev/null
"$@" > "$OUT/bench.log" 2>&1 &
echo $! > "$OUT/bench.pid"
wait $!
echo $? > "$OUT/bench.rc"
rm -f /dev/shm/fill
i=0
while [ -n "$(ls -A /dev/shm)" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
find /dev/shm -mindepth 1 > "$OUT/shm.left"
"""


def start_with_private_shm(out: Path, tmpdir: Path, args: list[str], size: str = "512m",
                           fill: bool = False) -> subprocess.Popen:
    """``bench ARGS`` under a /dev/shm of its own (``fill``: full from the start); ``out`` gets its pid, exit code,
    output, and what was left in that /dev/shm."""
    out.mkdir(exist_ok=True)
    env = {**_environment(tmpdir), "OUT": str(out), "SHM_SIZE": size, "SHM_FILL": "1" if fill else ""}
    return subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", _PRIVATE_SHM, "sh",
                             sys.executable, "-m", "bench.cli", *args], cwd=ROOT, env=env)


def _mpi_processes(pids: set[int]) -> set[int]:
    found = set()
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"bench.experiments.peers.mpi" in argv and b"-m" in argv[:2]:
            found.add(pid)
    return found


def _shm_of(pid: int) -> list[str]:
    """The files in ``pid``'s /dev/shm (its mount namespace's), at any depth."""
    root = Path(f"/proc/{pid}/root/dev/shm")
    try:
        return [str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()]
    except OSError:
        return []


@needs_mpi
@needs_private_shm
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_mpi_peer_run_leaves_no_files(tmp_path, signum):
    """bench killed while the MPI pair measures: no process of the run is left, nothing in its TMPDIR (the relay's
    ``bench-mpi-peer-*``, mpirun's session directory ``ompi.*``), and nothing in its /dev/shm (Open MPI's
    ``sm_segment.*``: the run has a /dev/shm of its own, so whatever is there is the run's)."""
    out, tmpdir = tmp_path / "out", tmp_path / "tmp"
    holder = start_with_private_shm(out, tmpdir, [
        "micro", "--sizes", "16MB", "--iters", "100000", "--warmup", "1", "--transports", "local",
        "--no-references", "--peers", "mpi_rma", "--no-plot", "--timeout", "120", "--out", str(tmp_path / "run")])
    seen: set[int] = set()
    try:
        assert _wait(lambda: (out / "bench.pid").exists() or holder.poll() is not None), "bench never started"
        assert _wait(lambda: (out / "bench.pid").read_text().strip() != ""), "bench never started"
        pid = int((out / "bench.pid").read_text())

        def measuring() -> bool:
            assert holder.poll() is None, (out / "bench.log").read_text()[-3000:]
            family = _descendants(pid)
            seen.update(family)
            # both MPI processes run, and their shared memory is made
            return len(_mpi_processes(family)) == 2 and any("sm_segment" in name for name in _shm_of(pid))

        assert _wait(measuring, step_s=0.1), "the MPI pair never started"
        time.sleep(1)
        seen.update(_descendants(pid))
        os.kill(pid, signum)
        holder.wait(timeout=BOUND_S + 90)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    output = (out / "bench.log").read_text()[-3000:]
    assert holder.returncode == 0, output
    assert _wait(lambda: all(gone(pid) for pid in seen), 60), f"left running: {[p for p in seen if not gone(p)]}"
    assert (out / "shm.left").read_text().split() == [], output
    assert sorted(path.name for path in tmpdir.iterdir()) == [], output


@needs_mpi
@needs_private_shm
def test_a_full_dev_shm_is_named_when_the_mpi_rma_line_fails(tmp_path):
    """A /dev/shm with no room left: the mpi_rma line fails (Open MPI says only ``MPI_ERR_WIN: invalid window``),
    and its warning names /dev/shm, how full it is and the fix; the run goes on without it."""
    out = tmp_path / "out"
    holder = start_with_private_shm(out, tmp_path / "tmp", [
        "micro", "--sizes", "64KB", "--iters", "10", "--warmup", "1", "--transports", "local", "--no-references",
        "--peers", "mpi_rma", "--no-plot", "--timeout", "60", "--out", str(tmp_path / "run")], size="4m", fill=True)
    try:
        holder.wait(timeout=BOUND_S * 3)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    output = (out / "bench.log").read_text()
    assert holder.returncode == 0 and (out / "bench.rc").read_text().strip() == "0", output[-3000:]
    [warning] = [line for line in output.splitlines() if "no mpi_rma line" in line]
    assert "/dev/shm is full (0 bytes free of 4.0 MiB" in warning, warning
    assert "free space there" in warning
    assert (out / "shm.left").read_text().split() == []
