"""Outside a Slurm step, ``bench ... --launcher slurm --nodes N`` submits the same command as a batch job
(:class:`Submission`, :func:`submit`; ``--dry-run`` prints the script) and follows its state until it ends."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: a job's states that are over (squeue -t all)
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


@dataclass(frozen=True)
class Submission:
    """A batch job that runs one bench command over ``nodes`` nodes with ``tasks`` tasks."""

    argv: list[str]
    nodes: int
    tasks: int
    out: Path
    workdir: Path

    @property
    def script_path(self) -> Path:
        return self.out.with_name(self.out.name + ".sbatch")

    @property
    def log_pattern(self) -> Path:
        return self.out.with_name(self.out.name + ".slurm-%j.log")

    def script(self) -> str:
        command = [sys.executable, "-m", "bench.cli", *self.argv, "--launcher", "slurm", "--out", str(self.out)]
        return "\n".join([
            "#!/bin/bash",
            f"#SBATCH --job-name=bench-{self.argv[0]}",
            f"#SBATCH --nodes={self.nodes}",
            f"#SBATCH --ntasks={self.tasks}",
            f"#SBATCH --chdir={shlex.quote(str(self.workdir))}",
            f"#SBATCH --output={self.log_pattern}",
            "# written by bench: every task runs the same command; task 0 coordinates and writes the results",
            "set -eu",
            # a task that ends badly ends the step at once, rather than leaving the others to run on
            "exec srun --kill-on-bad-exit=1 " + shlex.join(command),
            "",
        ])


def strip_submit_options(argv: list[str]) -> list[str]:
    """The command line without what only the submission uses (``--nodes N``, ``--tasks N``, ``--dry-run``,
    ``--launcher X``, ``--out D``): the job's command gets its own ``--launcher slurm --out``."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--nodes", "--tasks", "--launcher", "--out"):
            skip = "=" not in arg
            continue
        if arg == "--dry-run":
            continue
        kept.append(arg)
    return kept


def submit(submission: Submission, dry_run: bool, poll_s: float = 1.0) -> int:
    """Print the batch script (``dry_run``), or submit it and follow the job to its end; the exit status."""
    script = submission.script()
    if dry_run:
        print(script, end="")
        return 0
    for tool in ("sbatch", "squeue"):
        if not shutil.which(tool):
            print(f"bench: error: --launcher slurm --nodes submits a batch job, and {tool} is not here: run it on a "
                  "Slurm login node (or install slurm-client)", file=sys.stderr)
            return 2
    submission.script_path.parent.mkdir(parents=True, exist_ok=True)
    submission.script_path.write_text(script)
    done = subprocess.run(["sbatch", "--parsable", str(submission.script_path)], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        print(f"bench: error: sbatch refused the job ({submission.script_path}): {done.stderr.strip()}",
              file=sys.stderr)
        return 1
    job = done.stdout.strip().split(";")[0]
    log = Path(str(submission.log_pattern).replace("%j", job))
    print(f"bench: submitted job {job} ({submission.nodes} node(s), {submission.tasks} task(s)); results -> "
          f"{submission.out}, its output -> {log}", file=sys.stderr, flush=True)
    state = _follow(job, poll_s)
    code = _exit_code(job)
    if state == "COMPLETED" and code == 0:
        print(f"bench: job {job} completed; results in {submission.out}", file=sys.stderr)
        return 0
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
    print(f"bench: error: job {job} ended {state}" + (f" (exit code {code})" if code is not None else "")
          + (f"; the end of {log}:\n  " + "\n  ".join(tail) if tail else ""), file=sys.stderr)
    return code or 1


def _follow(job: str, poll_s: float) -> str:
    """Poll the job's state until it is over, saying every change; its last state."""
    seen = ""
    gone_since: float | None = None
    while True:
        done = subprocess.run(["squeue", "-j", job, "-h", "-t", "all", "-o", "%T"], capture_output=True, text=True,
                              timeout=60)
        state = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""
        if state and state != seen:
            print(f"bench: job {job}: {state}", file=sys.stderr, flush=True)
            seen = state
        if state in FINAL_STATES:
            return state
        if not state:  # purged from the controller's memory already, or squeue could not answer for a while
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > 30:
                return seen or "UNKNOWN"
        else:
            gone_since = None
        time.sleep(poll_s)


def _exit_code(job: str) -> int | None:
    """The job's exit code (``scontrol show job``), or None when the controller no longer knows it."""
    done = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=60)
    found = re.search(r"\bExitCode=(\d+):(\d+)", done.stdout)
    if not found:
        return None
    code, signum = int(found.group(1)), int(found.group(2))
    return code or (128 + signum if signum else 0)
