"""``--launcher slurm``: who a task is from Slurm's variables, the batch script it submits, and runs on the one-node
Slurm of the tests (``tests/slurm.py``): ``srun`` of bench itself, a killed rank, and a submitted job.

The launcher conformance suite (``tests/test_launcher_conformance.py``) runs over slurm too.
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

import pandas as pd
import pytest

from bench.launch import detect
from bench.launch.rendezvous import RENDEZVOUS_VARIABLE
from bench.launch.sbatch import Submission, strip_submit_options
from bench.launch.slurm_step import SlurmEnvironmentError, SlurmStep, expand_hostlist
from tests.launch_jobs import BOUND_S
from tests.processes import gone
from tests.slurm import left_after_steps, leftovers, srun

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, "-m", "bench.cli"]

#: a task's variables as srun sets them (the ones the launcher reads), task 1 of 4 on the second of two nodes
STEP = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "node[07-08]",
        "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_NODEID": "1", "SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0"}


# -- who a task is ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("listed", "hosts"), [
    ("vm", ["vm"]),
    ("node[07-09]", ["node07", "node08", "node09"]),
    ("a[1-2,5],b3", ["a1", "a2", "a5", "b3"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
])
def test_a_slurm_host_list_expands_in_order(listed, hosts):
    assert expand_hostlist(listed) == hosts


@pytest.mark.parametrize("listed", ["node[1-", "node]1[", "node[a-b]", "node[5-2]", "a,,b"])
def test_a_broken_host_list_is_refused(listed):
    with pytest.raises(ValueError):
        expand_hostlist(listed)


def test_a_task_reads_its_rank_the_steps_size_and_nodes():
    step = SlurmStep.from_environment(STEP)
    assert (step.task, step.tasks, step.nodes, step.node, step.name) == (1, 4, ("node07", "node08"), "node08", "41.0")


def test_the_steps_own_variables_win_over_the_jobs():
    step = SlurmStep.from_environment({**STEP, "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "node[01-09]"})
    assert step.tasks == 4 and step.nodes == ("node07", "node08")


@pytest.mark.parametrize(("change", "said"), [
    ({"SLURM_PROCID": None}, r"^SLURM_PROCID is not set: --launcher slurm runs in the tasks of a Slurm step "
                             r"\(srun -n N bench \.\.\. --launcher slurm\), or submits one with --nodes N$"),
    ({"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": None}, r"^SLURM_STEP_NUM_TASKS or SLURM_NTASKS is not set"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, r"^SLURM_STEP_NODELIST or SLURM_JOB_NODELIST is not"),
    ({"SLURM_PROCID": "x1"}, r"^SLURM_PROCID='x1' is not a number$"),
    ({"SLURM_PROCID": "4"}, r"^SLURM_PROCID=4 is not a task of a step of SLURM_STEP_NUM_TASKS=4$"),
    ({"SLURM_NODEID": "2"}, r"^SLURM_NODEID=2 is not a node of SLURM_STEP_NODELIST='node\[07-08\]' \(2 nodes\)$"),
    ({"SLURM_STEP_NODELIST": "node[07-"}, r"^SLURM_STEP_NODELIST='node\[07-' is not a Slurm host list: unbalanced"),
])
def test_a_missing_or_inconsistent_variable_is_one_line_naming_it(change, said):
    env = {name: value for name, value in {**STEP, **change}.items() if value is not None}
    with pytest.raises(SlurmEnvironmentError, match=said) as raised:
        SlurmStep.from_environment(env)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(("env", "chosen"), [
    ({}, "local"),
    ({"SLURM_JOB_ID": "3", "SLURM_PROCID": "0"}, "local"),  # a batch script or salloc's shell: no step, no tasks
    (STEP, "slurm"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
    ({**STEP, "OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),  # mpirun inside a step: its processes are MPI's
    ({"PMIX_RANK": "0"}, "mpi"),
])
def test_auto_picks_the_launcher_of_where_bench_runs(env, chosen):
    assert detect(env) == chosen


# -- the batch script ----------------------------------------------------------------------------------------------


def test_the_submitted_command_drops_what_only_the_submission_uses():
    argv = ["micro", "--sizes", "1KB", "--launcher", "slurm", "--nodes", "2", "--tasks=4", "--dry-run", "--out",
            "x", "--transports", "zerocopy"]
    assert strip_submit_options(argv) == ["micro", "--sizes", "1KB", "--transports", "zerocopy"]


def test_the_batch_script_runs_the_command_in_every_task_under_srun(tmp_path):
    script = Submission(["micro", "--sizes", "1KB"], 2, 4, tmp_path / "micro-1", tmp_path).script()
    assert script.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --ntasks=4\n" in script
    assert f"#SBATCH --output={tmp_path}/micro-1.slurm-%j.log\n" in script
    last = script.strip().splitlines()[-1]
    assert last.startswith("exec srun --kill-on-bad-exit=1 ")
    assert last.endswith(f"-m bench.cli micro --sizes 1KB --launcher slurm --out {tmp_path}/micro-1")


def test_submitting_options_need_the_slurm_launcher_and_no_step():
    bench = subprocess.run([*BENCH, "micro", "--nodes", "2"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                           env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert bench.returncode == 2
    assert "--nodes submit(s) a Slurm job: use with --launcher slurm" in bench.stderr
    inside = subprocess.run([*BENCH, "micro", "--launcher", "slurm", "--nodes", "2"], capture_output=True,
                            text=True, cwd=ROOT, timeout=120, env={**os.environ, **STEP})
    assert inside.returncode == 2 and "already a task of a Slurm step" in inside.stderr


def test_outside_a_step_the_slurm_launcher_says_how_to_start_it():
    bench = subprocess.run([*BENCH, "micro", "--sizes", "1KB", "--launcher", "slurm"], capture_output=True,
                           text=True, cwd=ROOT, timeout=120,
                           env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert bench.returncode == 2
    assert "SLURM_PROCID is not set: --launcher slurm runs in the tasks of a Slurm step" in bench.stderr
    assert "Traceback" not in bench.stderr


# -- on the one-node Slurm ---------------------------------------------------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(sys.path), RENDEZVOUS_VARIABLE: str(tmp_path / "rendezvous"),
            "TMPDIR": str(tmp_path)}


@pytest.mark.system("slurm")
def test_the_dry_run_is_a_batch_script_that_sbatch_accepts(slurm_bed, tmp_path):
    printed = subprocess.run([*BENCH, "micro", "--sizes", "1KB", "--launcher", "slurm", "--nodes", "1", "--dry-run",
                              "--out", str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT,
                             timeout=120, env=slurm_bed.env)
    assert printed.returncode == 0, printed.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(printed.stdout)
    tested = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=120,
                            env=slurm_bed.env)
    assert tested.returncode == 0, tested.stderr
    assert not (tmp_path / "run").exists()  # nothing was run


@pytest.mark.system("slurm")
def test_micro_under_srun_writes_every_transports_records(slurm_bed, tmp_path):
    out = tmp_path / "micro"
    done = srun(slurm_bed, 2, *BENCH, "micro", "--sizes", "1KB,64KB", "--iters", "20", "--no-peers",
                "--no-references", "--no-plot", "--transports", "zerocopy,grpc_tcp", "--launcher", "slurm", "--out",
                str(out), timeout=600, env=_env(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    records = pd.read_csv(out / "records.csv")
    assert sorted(set(records["transport"])) == ["grpc_tcp", "zerocopy"]
    assert len(records) == 4 and (records["p50_us"] > 0).all()
    launcher = json.loads((out / "meta.json").read_text())["settings"]["launcher"]
    assert launcher["launcher"] == "slurm" and launcher["world_size"] == 2 and launcher["bind"] == "127.0.0.1"
    assert left_after_steps(slurm_bed, BOUND_S) == []


@pytest.mark.system("slurm")
def test_a_killed_rank_ends_the_step_naming_it_and_leaves_nothing(slurm_bed, tmp_path):
    out = tmp_path / "micro"
    env = {**slurm_bed.env, **_env(tmp_path)}
    step = subprocess.Popen(["srun", "-n", "2", *BENCH, "micro", "--sizes", "64MB", "--iters", "1000", "--no-peers",
                             "--no-references", "--no-plot", "--transports", "zerocopy", "--launcher", "slurm",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    try:
        victim = _task_pid(slurm_bed, 1, out)
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = step.communicate(timeout=BOUND_S * 3)
    finally:
        if step.poll() is None:
            step.kill()
            step.wait()
    assert step.returncode != 0
    # killed inside a run (task 0's hub names its rank) or between two (the job's channel does)
    assert re.search(r"rank 1 \((\w+\) died|task 1 of Slurm step \d+\.\d+\) is gone)", stdout + stderr), \
        stdout + stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "failed"
    assert left_after_steps(slurm_bed, BOUND_S) == [] and gone(victim)


def _task_pid(bed, task: int, out: Path) -> int:
    """The pid of task ``task`` of the bed's step, once the run is under way (its results directory exists)."""
    deadline = time.monotonic() + BOUND_S * 3
    while time.monotonic() < deadline:
        if (out / "records.csv").exists() or (out / "meta.json").exists():
            for pid in leftovers(bed):
                try:
                    env = dict(line.split("=", 1) for line in
                               Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
                               if "=" in line)
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if env.get("SLURM_PROCID") == str(task) and b"bench.cli" in cmdline:
                    return pid
        time.sleep(0.2)
    raise AssertionError(f"task {task} of the step never showed up")


@pytest.mark.system("slurm")
def test_a_submitted_job_runs_to_its_end_and_its_results_land_in_out(slurm_bed, tmp_path):
    out = tmp_path / "micro"
    done = subprocess.run([*BENCH, "micro", "--sizes", "1KB", "--iters", "20", "--no-peers", "--no-references",
                           "--no-plot", "--transports", "zerocopy", "--launcher", "slurm", "--nodes", "1", "--tasks",
                           "2", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**slurm_bed.env, **_env(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"bench: job \d+: RUNNING", done.stderr) and "completed; results in" in done.stderr
    assert list(pd.read_csv(out / "records.csv")["transport"]) == ["zerocopy"]
    assert (tmp_path / "micro.sbatch").exists() and list(tmp_path.glob("micro.slurm-*.log"))


@pytest.mark.system("slurm")
def test_mpi_under_srun_without_pmix_says_to_use_the_slurm_launcher(slurm_bed, tmp_path):
    """The bed's Slurm has no PMIx: each MPI process of the step is a job of one."""
    pytest.importorskip("mpi4py")
    done = srun(slurm_bed, 2, *BENCH, "micro", "--sizes", "1KB", "--transports", "zerocopy", "--no-peers",
                "--no-references", "--no-plot", "--launcher", "mpi", "--out", str(tmp_path / "run"), timeout=300,
                env=_env(tmp_path))
    assert done.returncode != 0
    assert "under srun with 2 tasks, and no PMI from Slurm (srun --mpi=pmix), each MPI process would be a job of " \
           "its own: use --launcher slurm" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
