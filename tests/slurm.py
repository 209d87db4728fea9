"""The one-node Slurm of the tests: a bed started by ``tools/slurm-bed`` (munged, slurmctld and slurmd, everything in
one directory), ``srun`` on it, and what is left of its steps.

The session's bed is the ``slurm_bed`` fixture (``tests/conftest.py``); a test that asks for it skips where
:func:`unavailable` says why. The node advertises at least 8 CPUs, so ``srun -n 4`` runs on a 2-core machine, and
every step has ``SLURM_STEP_RESV_PORTS``. Used by ``tests/test_slurm_bed.py``, the slurm launcher's tests and the
launcher conformance suite.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BED = ROOT / "tools" / "slurm-bed"
#: how Debian installs what the bed runs
INSTALL = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
#: the commands the bed runs, and the Debian package of each
COMMANDS = {"munged": "munge", "munge": "munge", "unmunge": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
            "srun": "slurm-client", "sbatch": "slurm-client", "squeue": "slurm-client", "scancel": "slurm-client",
            "sinfo": "slurm-client", "ss": "iproute2"}
#: variables another Slurm sets or reads (a shell inside a real allocation): srun would look for that job on the bed
FOREIGN_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SQUEUE_", "SINFO_", "SCANCEL_", "SCONTROL_")
#: bounds of the bed's up (its own wait for the node is 30 s) and down (a daemon gets 15 s after SIGTERM)
UP_TIMEOUT_S = 90
DOWN_TIMEOUT_S = 120


@functools.cache
def unavailable() -> str | None:
    """One line saying why the bed cannot run here, or None where it can."""
    if not Path("/proc/self/environ").exists():
        return "the Slurm bed needs Linux's /proc"
    if os.geteuid() != 0:
        return "the Slurm bed needs root (its daemons run as SlurmUser=root)"
    missing = [name for name in COMMANDS if shutil.which(name) is None]
    if not missing:
        return None
    packages = {COMMANDS[name] for name in missing}
    install = [INSTALL] if packages - {"iproute2"} else []
    if "iproute2" in packages:
        install.append("apt-get install -y iproute2")
    return f"the Slurm bed needs {', '.join(missing)}: {' && '.join(install)}"


def clean_environ() -> dict[str, str]:
    """This process's environment without the variables of any other Slurm."""
    return {name: value for name, value in os.environ.items() if not name.startswith(FOREIGN_PREFIXES)}


class SlurmBed:
    """A one-node Slurm cluster whose every file is under ``dir``: ``up()`` starts it, ``down()`` stops it (also
    as a context manager). ``conf`` is its slurm.conf; ``env`` the environment for srun, sbatch, squeue..."""

    def __init__(self, dir: str | os.PathLike) -> None:
        #: resolved as the bed resolves it: a task's SLURM_CONF is this path exactly
        self.dir = Path(os.path.realpath(dir))
        self.conf = self.dir / "slurm.conf"
        self.started = False

    @property
    def env(self) -> dict[str, str]:
        """``os.environ`` now (without another Slurm's variables), with ``SLURM_CONF`` naming this bed."""
        return {**clean_environ(), "SLURM_CONF": str(self.conf)}

    def _run(self, action: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([str(BED), action, str(self.dir)], capture_output=True, text=True, timeout=timeout,
                              cwd="/", env=clean_environ(), stdin=subprocess.DEVNULL)

    def up(self) -> SlurmBed:
        """Start the bed; on any failure nothing of it runs and RuntimeError says why (its output)."""
        try:
            done = self._run("up", UP_TIMEOUT_S)
        except subprocess.TimeoutExpired as timeout:
            self._run("down", DOWN_TIMEOUT_S)  # the script was killed before its own cleanup
            raise RuntimeError(f"tools/slurm-bed up {self.dir} took over {UP_TIMEOUT_S} s") from timeout
        if done.returncode != 0:
            raise RuntimeError(f"tools/slurm-bed up {self.dir} failed (exit {done.returncode}): "
                               f"{done.stdout}{done.stderr}")
        printed = done.stdout.strip().removeprefix("export SLURM_CONF=")
        if Path(printed) != self.conf:
            self._run("down", DOWN_TIMEOUT_S)
            raise RuntimeError(f"tools/slurm-bed up {self.dir} printed {done.stdout!r}, not SLURM_CONF={self.conf}")
        self.started = True
        return self

    def down(self) -> None:
        """Stop the bed: its jobs, daemons, steps' leftovers and munged (fine on a bed that is down). The
        directory stays (logs, state)."""
        if not self.dir.is_dir():
            return
        done = self._run("down", DOWN_TIMEOUT_S)
        self.started = False
        if done.returncode != 0:
            raise RuntimeError(f"tools/slurm-bed down {self.dir} failed (exit {done.returncode}): "
                               f"{done.stdout}{done.stderr}")

    def __enter__(self) -> SlurmBed:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def __repr__(self) -> str:
        return f"SlurmBed({str(self.dir)!r}{', up' if self.started else ''})"


def srun(bed: SlurmBed, ntasks: int, *argv: str, timeout: float, env: dict[str, str] | None = None,
         kill_on_bad_exit: bool = False, cwd: str | os.PathLike = ROOT) -> subprocess.CompletedProcess:
    """``srun -n NTASKS ARGV...`` on the bed to its end, its output captured (text); ``env`` adds to the bed's
    environment. ``kill_on_bad_exit``: srun's ``--kill-on-bad-exit=1`` (a task that fails ends the others); srun's
    default otherwise (the others run to their end). Past ``timeout`` seconds srun is killed (TimeoutExpired)."""
    command = ["srun", "-n", str(ntasks), f"--kill-on-bad-exit={int(kill_on_bad_exit)}", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**bed.env, **(env or {})}, stdin=subprocess.DEVNULL)


def _state(pid: int | str) -> str:
    """The state letter of /proc/PID/stat ('' if the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _ancestors() -> set[int]:
    """This process and its ancestors."""
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def _processes_with(conf: Path) -> dict[int, list[bytes]]:
    """Live (not zombie) processes, this one and its ancestors aside, whose environment has SLURM_CONF=conf: pid ->
    their environment's entries."""
    wanted = b"SLURM_CONF=" + os.fsencode(str(conf))
    skip = _ancestors()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in environ and _state(entry.name) not in ("", "Z", "X"):
            found[int(entry.name)] = environ
    return found


def leftovers(bed: SlurmBed) -> list[int]:
    """What is left of the bed's steps: live (not zombie) processes whose environment has the bed's SLURM_CONF and
    which are slurmstepd or carry SLURM_JOB_ID (tasks and their children), this process and its ancestors aside."""
    found = []
    for pid, environ in _processes_with(bed.conf).items():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm == "slurmstepd" or any(entry.startswith(b"SLURM_JOB_ID=") for entry in environ):
            found.append(pid)
    return sorted(found)


def left_after_steps(bed: SlurmBed, bound_s: float) -> list[int]:
    """What is left of the bed's steps once Slurm has had ``bound_s`` seconds to end them (empty at once, usually).

    srun returns when its tasks have exited, not when the step has: the step's slurmstepd reports to slurmctld and
    then exits, and on a busy machine it is still there a moment after srun returned. A process of a step that is
    left behind is still there after the bound, and is returned."""
    deadline = time.monotonic() + bound_s
    while (found := leftovers(bed)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def bed_processes(bed: SlurmBed) -> list[int]:
    """Every live process of the bed: its daemons (munged by its command line), steps and tasks, and any client
    (srun...) given its environment, this process and its ancestors aside. Empty once it is down."""
    found = set(_processes_with(bed.conf))
    marker = os.fsencode(str(bed.dir) + "/")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in found:
            try:
                if marker in (entry / "cmdline").read_bytes() and _state(entry.name) not in ("", "Z", "X"):
                    found.add(int(entry.name))
            except OSError:
                continue
    return sorted(found - _ancestors())
