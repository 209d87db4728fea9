"""``--launcher mpi``: the ranks are processes that ``mpirun`` started, one per rank (see ``job.py``).

MPI is only the job's channel: a broadcast announces each run, an allgather collects the ranks'
addresses, and ``MPI_Abort`` ends the job after a failed run (MPI can neither interrupt nor replace a
process inside it). The runs themselves go through the coordinator's hub, as under every launcher.

The channel carries bytes, never pickles: the JSON messages of ``job.py`` (:func:`~bench.launch.job.channel_encode`),
their lengths first, through MPI's buffer collectives (``Bcast``, ``Allgather``, ``Allgatherv``; mpi4py's
lowercase ones pickle), decoded and checked with the functions Slurm's channel uses. Every process sees the same
lengths before any bytes move, so a message over :data:`~bench.launch.job.CHANNEL_BYTES` is refused by all of
them alike, and none waits for bytes that never come.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.launch.addresses import resolve_bind
from bench.launch.job import (
    CHANNEL_BYTES,
    JobChannel,
    JobLauncher,
    channel_decode,
    channel_encode,
    hostnames_problem,
    value_problem,
)
from bench.launch.messages import LaunchError
from bench.launch.slurm_step import in_step
from transports import load_fabric
from transports.common import Availability

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
        if not any(name in os.environ for name in PMI_VARIABLES):
            # a process no launcher started: MPI would make it a job of one, whose run fails for want of ranks
            # only after its results directory is made, and whose segment stays in /dev/shm
            raise LaunchError(f"--launcher mpi: no MPI launcher started this process (none of "
                              f"{', '.join(PMI_VARIABLES)} is set): run every rank under mpirun (mpirun -np N bench "
                              "... --launcher mpi, N the ranks the run needs: 2 for micro), or leave --launcher mpi "
                              "out")
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
        self.job = "the MPI job"
        self.hostnames = self.gather(socket.gethostname())
        problem = hostnames_problem(self.hostnames, self.world)
        if problem:  # pragma: no cover (gather checked each already)
            raise LaunchError(f"process {self.process} of the MPI job: {problem}")

    def announce(self, message: Any) -> None:
        data = channel_encode(message)
        if len(data) > CHANNEL_BYTES:  # before any collective: nobody waits for bytes that never come
            raise LaunchError(f"an announcement of {len(data)} bytes is over the job channel's {CHANNEL_BYTES}")
        self._broadcast(bytearray(data))

    def announcement(self) -> Any:
        return channel_decode(self._broadcast(None))

    def _broadcast(self, data: bytearray | None) -> bytes:
        """Process 0's ``data`` on every process: its length, then its bytes (``MPI_Bcast`` of each)."""
        length = np.array([len(data) if data is not None else 0], dtype=np.int64)
        self._comm.Bcast([length, self._mpi.INT64_T], root=0)
        size = int(length[0])
        if not 0 < size <= CHANNEL_BYTES:
            raise LaunchError(f"process {self.process} of the MPI job refused what process 0 announced: "
                              f"a message of {size} bytes (the job's channel carries 1 to {CHANNEL_BYTES})")
        buffer = data if data is not None else bytearray(size)
        self._comm.Bcast([buffer, self._mpi.BYTE], root=0)
        return bytes(buffer)

    def gather(self, value: str) -> list[str]:
        """Every process's ``value`` on every process: the lengths (``MPI_Allgather``), then the bytes
        (``MPI_Allgatherv``), each checked as Slurm's task 0 checks what its tasks send."""
        data = channel_encode(value)
        sizes = np.zeros(self.world, dtype=np.int64)
        self._comm.Allgather([np.array([len(data)], dtype=np.int64), self._mpi.INT64_T],
                             [sizes, self._mpi.INT64_T])
        over = [p for p, size in enumerate(sizes) if not 0 < size <= CHANNEL_BYTES]
        if over:  # every process sees the same sizes: all refuse alike, before any bytes move
            raise LaunchError(f"process {over[0]} of the MPI job sent {int(sizes[over[0]])} bytes on the job's "
                              f"channel, which carries 1 to {CHANNEL_BYTES}")
        counts = [int(size) for size in sizes]
        offsets = [sum(counts[:p]) for p in range(self.world)]
        buffer = bytearray(sum(counts))
        self._comm.Allgatherv([data, self._mpi.BYTE], [buffer, (counts, offsets), self._mpi.BYTE])
        values = []
        for p, (count, offset) in enumerate(zip(counts, offsets, strict=True)):
            said = channel_decode(bytes(buffer[offset: offset + count]))
            problem = value_problem(said)
            if problem:
                raise LaunchError(f"process {p} of the MPI job sent what process {self.process} refuses ({problem})")
            values.append(said)
        return values

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
    def availability(cls) -> Availability:
        import importlib.util

        if importlib.util.find_spec("mpi4py") is None:
            return Availability(False, "mpi4py is not installed (pip install -e '.[mpi]')")
        return Availability(True, detail=f"mpirun: {mpirun_path() or 'not on PATH; a system mpirun will do'}")

    def __init__(self, bind: str | None = None, log_dir: Path | None = None) -> None:
        if bind:  # a --bind that names nothing here is refused before MPI starts (its answer needs no other process)
            resolve_bind(bind, [])
        super().__init__(MpiChannel(), bind=bind, log_dir=log_dir)
