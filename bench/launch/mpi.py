"""``--launcher mpi``: the ranks are processes that ``mpirun`` started, one per rank (see ``job.py``).

MPI is only the job's channel: a broadcast announces each run, an allgather collects the ranks'
addresses, and ``MPI_Abort`` ends the job after a failed run (MPI can neither interrupt nor replace a
process inside it). The runs themselves go through the coordinator's hub, as under every launcher.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from bench.launch.base import LaunchError
from bench.launch.job import JobChannel, JobLauncher
from bench.launch.slurm import in_step
from transports import load_fabric

#: what a process started by mpirun, or by srun with a PMI plugin, finds in its environment
PMI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")


def mpirun_path() -> str | None:
    """The ``mpirun`` beside this Python (Open MPI's wheel brings it), else the first on PATH; None without one."""
    return shutil.which("mpirun", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


class MpiChannel(JobChannel):
    """The job's channel over MPI's collectives (mpi4py's ``COMM_WORLD``)."""

    def __init__(self) -> None:
        tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
        if in_step() and tasks.isdigit() and int(tasks) > 1 and not any(name in os.environ for name in PMI_VARIABLES):
            # checked before MPI starts: each process would start as a job of one (a singleton, which also leaves
            # Open MPI's shared-memory segment behind in /dev/shm)
            raise LaunchError(f"under srun with {tasks} tasks, and no PMI from Slurm (srun --mpi=pmix), each MPI "
                              "process would be a job of its own: use --launcher slurm, which needs no MPI")
        # MPI brings its own copy of UCX's libraries; ours must be loaded first, or UCX's symbols clash
        load_fabric()
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise LaunchError(f"--launcher mpi needs mpi4py ({exc}); install it with pip install -e '.[mpi]'") from None
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD
        self.process = self._comm.Get_rank()
        self.world = self._comm.Get_size()
        self.hostnames = self._comm.allgather(socket.gethostname())
        self.job = "the MPI job"

    def announce(self, message: Any) -> None:
        self._comm.bcast(message, root=0)

    def announcement(self) -> Any:
        return self._comm.bcast(None, root=0)

    def gather(self, value: str) -> list[str]:
        return self._comm.allgather(value)

    def abort(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._comm.Abort(1)

    def finalize(self) -> None:
        if not self._mpi.Is_finalized():
            self._mpi.Finalize()

    def start_hint(self, processes: int) -> str:
        return f"mpirun -np {processes}"

    def describe(self) -> dict[str, Any]:
        return {"mpi_library": self._mpi.Get_library_version().splitlines()[0].strip()}


class MpiLauncher(JobLauncher):
    """Ranks are MPI processes; process 0 coordinates."""

    name = "mpi"

    @classmethod
    def availability(cls) -> str:
        import importlib.util

        if importlib.util.find_spec("mpi4py") is None:
            return "not available: mpi4py is not installed (pip install -e '.[mpi]')"
        return f"available (mpirun: {mpirun_path() or 'not on PATH; a system mpirun will do'})"

    def __init__(self, bind: str | None = None, log_dir: Path | None = None) -> None:
        super().__init__(MpiChannel(), bind=bind, log_dir=log_dir)
