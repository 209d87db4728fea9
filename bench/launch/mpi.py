"""``--launcher mpi``: the ranks are processes that ``mpirun`` or ``srun`` started, one per rank.

Every process runs the same command (``mpirun -np 4 bench model fcn5 --launcher mpi``). MPI rank 0
is the coordinator: it runs the experiment as the command says, writes the results, and for each
run of the experiment tells the others (a broadcast) that a run of N ranks begins, with the
address of its hub and the run's token. Every process then picks a port on its bind address and
an allgather gives everybody every rank's address (mpi4py does this bootstrap; nothing else goes
over MPI). Processes 0..N-1 join the run through the hub as any rank does (process 0 serves its
rank in a thread while it coordinates); the others sit it out. Processes other than 0 never run
the experiment themselves: :meth:`MpiLauncher.serve` waits for runs until the coordinator ends the
job. A failed run ends the whole job (``MPI_Abort``) once the coordinator has written what it has:
the other ranks may still be inside that run, and MPI can neither interrupt nor replace them.

Where ranks listen (``--bind``): an address, or an interface whose IPv4 address is taken; by
default loopback when every process runs on one host, else the address the host name resolves to.
UCX over tcp is pointed at the same interface.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from bench.launch.addresses import resolve_bind, ucx_devices
from bench.launch.base import (
    Hub,
    Launcher,
    LaunchError,
    RankFailed,
    RankResult,
    RankSpec,
    connect,
    coordinate,
    run_token,
    serve_rank,
)
from transports import Cluster, load_fabric
from transports.ports import free_port


def mpirun_path() -> str | None:
    """The ``mpirun`` beside this Python (Open MPI's wheel brings it), else the first on PATH; None without one."""
    return shutil.which("mpirun", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


class MpiLauncher(Launcher):
    """Ranks are MPI processes; process 0 coordinates (see the module docstring)."""

    name = "mpi"
    #: the command line's launch options it takes (``bench.launch.create`` refuses the others), and why it refuses
    #: one for a reason of its own
    options: ClassVar[tuple[str, ...]] = ("bind",)
    refuses: ClassVar[dict[str, str]] = {}
    starts_processes = False

    def __init__(self, bind: str | None = None, log_dir: Path | None = None) -> None:
        # MPI brings its own copy of UCX's libraries; ours must be loaded first, or UCX's symbols clash
        load_fabric()
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise LaunchError(f"--launcher mpi needs mpi4py ({exc}); install it with pip install -e '.[mpi]'") from None
        self._comm = MPI.COMM_WORLD
        self.process = self._comm.Get_rank()
        self.world = self._comm.Get_size()
        self.log_dir = log_dir
        hostnames = self._comm.allgather(socket.gethostname())
        self.hosts = sorted(set(hostnames))
        # every process decides alike (the same hostnames, the same --bind), so they agree without a word
        self.bind = resolve_bind(bind, hostnames)
        self._broken = ""
        self._ended = False
        os.environ.update(ucx_devices(self.bind))

    @property
    def is_coordinator(self) -> bool:  # type: ignore[override]
        return self.process == 0

    def describe(self) -> dict[str, Any]:
        from mpi4py import MPI

        return {"launcher": self.name, "bind": self.bind, "world_size": self.world, "hosts": self.hosts,
                "mpi_library": MPI.Get_library_version().splitlines()[0].strip()}

    # the coordinator (process 0) -------------------------------------------------------------

    def run(self, ranks: list[RankSpec], timeout_s: float, on_report: Callable[[int, Any], None] | None = None,
            label: str = "run", startup_s: float = 0.0) -> list[RankResult]:
        if not self.is_coordinator:
            raise LaunchError("under MPI only process 0 starts runs; the others serve them (MpiLauncher.serve)")
        if self._broken:
            raise LaunchError(f"not started: {self._broken}")
        if len(ranks) > self.world:
            raise LaunchError(f"this run needs {len(ranks)} ranks ({', '.join(s.name for s in ranks)}), "
                              f"but the MPI job has {self.world}: start it with mpirun -np {len(ranks)}")
        if any(spec.service for spec in ranks):
            raise LaunchError("ranks that serve until stopped (tf_grpc's servers) cannot run under --launcher mpi; "
                              "use --launcher local or netns")
        token = run_token()
        hub = Hub((self.bind, 0), token, len(ranks))
        try:
            self._comm.bcast({"ranks": len(ranks), "hub": hub.address, "token": token}, root=0)
            cluster = Cluster(tuple(self._addresses()[: len(ranks)]), token)
            own = threading.Thread(target=self._serve_rank, args=(hub.address, token), name="mpi-rank-0",
                                   daemon=True)
            own.start()
            try:
                return coordinate(hub, ranks, cluster, timeout_s, on_report or (lambda rank, payload: None),
                                  lambda: {}, startup_s=startup_s)
            except RankFailed as exc:
                # the other ranks may still be inside the failed run, and MPI can neither interrupt nor replace
                # them: the job ends (MPI_Abort at close) once the coordinator has written what it has
                self._broken = f"rank {exc.rank} ({exc.name}) failed in an earlier run, which ends an MPI job"
                raise
            finally:
                own.join(timeout=30)
        finally:
            hub.close()

    def close(self) -> None:
        """End the job: the others stop serving; after a lost rank, MPI_Abort ends every process."""
        if self._ended or not self.is_coordinator:
            return
        self._ended = True
        if self._broken:
            sys.stdout.flush()
            sys.stderr.flush()
            self._comm.Abort(1)
        self._comm.bcast(None, root=0)

    # every process ---------------------------------------------------------------------------

    def _addresses(self) -> list[str]:
        return self._comm.allgather(f"{self.bind}:{free_port(self.bind)}")

    def _serve_rank(self, hub: str | tuple[str, int], token: str) -> None:
        with contextlib.suppress(LaunchError, OSError, EOFError):
            serve_rank(connect(tuple(hub), token), self.process, in_own_process=False)

    def serve(self) -> int:
        """Processes other than 0: take part in every run the coordinator starts, until it ends the job."""
        while True:
            announced = self._comm.bcast(None, root=0)
            if announced is None:
                return 0
            self._addresses()
            if self.process < announced["ranks"]:
                self._serve_rank(announced["hub"], announced["token"])
