"""The one-node Slurm of the tests (``tools/slurm-bed``, ``tests/slurm.py``, the ``slurm_bed`` fixture): ``srun -n 4``
runs four tasks on a 2-core machine, ``sbatch --test-only`` judges a script, and nothing of a step is left after it
ends; a bed of its own: a failed up leaves nothing running, down stops a bed with a step running, and twice.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.processes import gone
from tests.slurm import SlurmBed, bed_processes, leftovers, srun

pytestmark = pytest.mark.system("slurm")

#: the bound of every wait here (the bed answers in well under a second on an idle machine)
BOUND_S = 30


def _wait(condition, bound_s: float = BOUND_S) -> bool:
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_srun_n_4_runs_four_tasks_numbered_0_to_3(slurm_bed):
    done = srun(slurm_bed, 4, "bash", "-c", 'echo "TASK $SLURM_PROCID $SLURM_NTASKS $SLURM_STEP_RESV_PORTS"',
                timeout=BOUND_S)
    assert done.returncode == 0, done.stdout + done.stderr
    tasks = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("TASK ")]
    assert sorted(int(procid) for procid, *_ in tasks) == [0, 1, 2, 3]
    assert {ntasks for _, ntasks, *_ in tasks} == {"4"}
    # MpiParams=ports: every task of the step has the same reserved ports
    assert len({tuple(ports) for _, _, *ports in tasks}) == 1 and tasks[0][2:], done.stdout


def test_sbatch_test_only_accepts_a_script_that_fits_and_queues_nothing(slurm_bed, tmp_path):
    script = tmp_path / "tiny.sh"
    script.write_text("#!/bin/sh\n#SBATCH --ntasks=2\ntrue\n")
    tested = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True,
                            timeout=BOUND_S, env=slurm_bed.env)
    assert tested.returncode == 0, tested.stderr
    assert "to start at" in tested.stderr
    too_big = subprocess.run(["sbatch", "--test-only", "--ntasks=1000", str(script)], capture_output=True,
                             text=True, timeout=BOUND_S, env=slurm_bed.env)
    assert too_big.returncode != 0, too_big.stderr
    queued = subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=BOUND_S, env=slurm_bed.env)
    assert queued.returncode == 0 and queued.stdout == "", queued.stdout + queued.stderr


def test_a_step_is_left_over_while_it_runs_and_nothing_of_it_after(slurm_bed, tmp_path):
    """Each task leaves a child running in the background (its output elsewhere, so srun does not wait for it):
    the step ending kills it, and leftovers() sees the step while it runs and nothing after. (srun returns ~3 s
    after the tasks here: proctrack/pgid waits 1 s, then 2 s, for the killed child's zombie, which PID 1 here
    reaps only every ~2 s; about 1 s elsewhere.)"""
    stop = tmp_path / "stop"
    task = (f'sleep 300 >/dev/null 2>&1 & echo $! > {tmp_path}/child.$SLURM_PROCID.new; '
            f'mv {tmp_path}/child.$SLURM_PROCID.new {tmp_path}/child.$SLURM_PROCID; '
            f'while [ ! -e {stop} ]; do sleep 0.05; done')
    step = subprocess.Popen(["srun", "-n", "2", "bash", "-c", task], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=slurm_bed.env, stdin=subprocess.DEVNULL)
    try:
        files = [tmp_path / "child.0", tmp_path / "child.1"]
        assert _wait(lambda: all(file.exists() for file in files)), "the tasks never started"
        children = [int(file.read_text()) for file in files]
        running = leftovers(slurm_bed)
        assert set(children) <= set(running), (children, running)
        assert any(Path(f"/proc/{pid}/comm").read_text().strip() == "slurmstepd" for pid in running), running
        stop.touch()
        stdout, stderr = step.communicate(timeout=BOUND_S)
    finally:
        stop.touch()
        if step.poll() is None:
            step.kill()
            step.communicate()
    assert step.returncode == 0, stdout + stderr
    # PID 1 here reaps orphans every ~2 s: a zombie has ended
    assert _wait(lambda: not leftovers(slurm_bed)), leftovers(slurm_bed)
    assert all(gone(pid) for pid in children)


@pytest.fixture
def spare_bed():
    """A bed of the test's own (not the session's): down and removed at its end."""
    bed = SlurmBed(tempfile.mkdtemp(prefix="slurm-bed-"))
    yield bed
    try:
        bed.down()
    finally:
        shutil.rmtree(bed.dir, ignore_errors=True)


def test_a_failed_up_leaves_nothing_running(spare_bed, monkeypatch):
    monkeypatch.setenv("BED_UP_TIMEOUT", "0")  # munged and the daemons start; the node is never waited for
    with pytest.raises(RuntimeError, match="not idle"):
        spare_bed.up()
    assert bed_processes(spare_bed) == []
    assert (spare_bed.dir / "log" / "slurmctld.log").exists()  # it did get as far as the daemons


def test_down_stops_a_bed_whose_step_runs_and_twice_is_fine(spare_bed):
    spare_bed.up()
    step = subprocess.Popen(["srun", "-n", "2", "sleep", "300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=spare_bed.env, stdin=subprocess.DEVNULL)
    try:
        # two tasks and their slurmstepd
        assert _wait(lambda: len(leftovers(spare_bed)) >= 3), leftovers(spare_bed)
        spare_bed.down()
        step.communicate(timeout=BOUND_S)
    finally:
        if step.poll() is None:
            step.kill()
            step.communicate()
    assert step.returncode != 0
    assert bed_processes(spare_bed) == [] and leftovers(spare_bed) == []
    spare_bed.down()
