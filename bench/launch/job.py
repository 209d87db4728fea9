"""Launchers of a job whose processes something else started (``mpirun``, ``srun``), one process per rank.

Every process runs the same command (``mpirun -np 4 bench model fcn5 --launcher mpi``, ``srun -n 4 bench
model fcn5 --launcher slurm``). Process 0 is the coordinator: it runs the experiment as the command says,
writes the results, and for each run of the experiment tells the others (an announcement on the job's
channel) that a run of N ranks begins, with the address of its hub and the run's token. Every process
then picks a port on its bind address and the channel gathers every rank's address to the coordinator,
which hands each rank the run's cluster through the hub (nothing else goes over the channel). Processes
0..N-1 join the run through the hub as any rank does (process 0 serves its rank in a thread while it
coordinates); the others sit it out. Processes other than 0 never run the experiment themselves:
:meth:`JobLauncher.serve` waits for runs until the coordinator ends the job. A failed run ends the whole
job once the coordinator has written what it has: the other ranks may still be inside that run, and
nothing can interrupt or replace them.

What a launcher of this kind adds is its :class:`JobChannel`: MPI's collectives (``mpi.py``), or a star of
authenticated connections to process 0 that Slurm's variables lead to (``slurm.py``). What the channel carries is
data, never code: JSON in frames of at most :data:`CHANNEL_BYTES` (:func:`channel_send`), and each announcement is
checked (:func:`announcement_problem`) before it is used; the runs' own messages go through the hub
(``base.py``: data only as well).

A process of the job ends with ``os._exit`` (:meth:`JobLauncher.end_process`), past the ``atexit`` handlers with
which libraries delete their temporary files (TensorFlow's autograph writes a module per function it converts):
each process makes its files in a temporary directory of its own (``tempfile.tempdir``), removed there.

Where ranks listen (``--bind``): an address, or an interface whose IPv4 address is taken; by default
loopback when every process runs on one host, else the address the host name resolves to. UCX over tcp
is pointed at the same interface.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from bench.launch.addresses import resolve_bind, ucx_devices
from bench.launch.base import Launcher
from bench.launch.context import connect, serve_rank
from bench.launch.hub import Hub, coordinate
from bench.launch.messages import LaunchError, RankFailed, RankResult, RankSpec, run_token
from bench.launch.wire import receive_frame
from transports import Cluster
from transports.ports import free_port

#: the most one message of a job's channel may hold (an announcement, a host name, an address)
CHANNEL_BYTES = 64 * 1024
#: the longest host name or address a process may send on the job's channel
VALUE_CHARS = 1024


def channel_encode(message: Any) -> bytes:
    """``message`` (JSON's types) as the bytes of one message of the job's channel."""
    return json.dumps(message, separators=(",", ":")).encode()


def channel_decode(data: bytes) -> Any:
    """A message of the job's channel: JSON of at most CHANNEL_BYTES, else LaunchError (one line)."""
    if len(data) > CHANNEL_BYTES:
        raise LaunchError(f"refused a message of the job's channel over {CHANNEL_BYTES} bytes")
    try:
        return json.loads(data.decode())
    except (ValueError, RecursionError) as exc:
        raise LaunchError(f"refused a message of the job's channel that is not JSON ({type(exc).__name__})") from None


def channel_send(conn: Any, message: Any) -> None:
    """Send ``message`` on a connection of the job's channel (a ``multiprocessing`` Connection)."""
    conn.send_bytes(channel_encode(message))


def channel_receive(conn: Any) -> Any:
    """The next message on a connection of the job's channel; LaunchError for one too big or not JSON."""
    return channel_decode(receive_frame(conn, CHANNEL_BYTES, "the job's channel", LaunchError))


def announcement_problem(message: Any, world: int) -> str | None:
    """Why ``message`` is not an announcement of process 0 (None, or a run of at most ``world`` ranks with the
    address of its hub and its token), or None when it is one."""
    if message is None:
        return None
    if not isinstance(message, dict) or set(message) != {"ranks", "hub", "token"}:
        return "not an announcement of a run"
    ranks, hub, token = message["ranks"], message["hub"], message["token"]
    if type(ranks) is not int or not 1 <= ranks <= world:
        return f"a run of {str(ranks)[:20]} ranks in a job of {world}"
    if not (isinstance(hub, list | tuple) and len(hub) == 2 and isinstance(hub[0], str) and len(hub[0]) <= 255
            and type(hub[1]) is int and 0 < hub[1] < 65536):
        return "no hub address"
    if not isinstance(token, str) or not 0 < len(token) <= 256:
        return "no token"
    return None


def value_problem(value: Any) -> str | None:
    """Why ``value`` is not what a process sends process 0 on the job's channel (a host name or an address: a
    string of at most VALUE_CHARS), or None when it is one."""
    if not isinstance(value, str) or len(value) > VALUE_CHARS:
        return "not a host name or an address"
    return None


def hostnames_problem(message: Any, world: int) -> str | None:
    """Why ``message`` is not the job's host names (one string of at most VALUE_CHARS per process), or None."""
    if not isinstance(message, list) or len(message) != world or any(value_problem(name) for name in message):
        return "no host names"
    return None


class JobChannel(ABC):
    """How the processes of one job reach each other before any run: process 0 to all, all to process 0."""

    #: this process's number in the job (0 coordinates) and the job's number of processes
    process: int
    world: int
    #: every process's host name, in process order
    hostnames: list[str]
    #: the job, for errors ("the MPI job", "Slurm step 41.0")
    job: str

    @abstractmethod
    def announce(self, message: Any) -> None:
        """Process 0: send ``message`` to every other process (None ends the job)."""

    @abstractmethod
    def announcement(self) -> Any:
        """Processes other than 0: the next announcement of process 0 (None: the job is over)."""

    @abstractmethod
    def gather(self, value: str) -> list[str]:
        """Every process, together: each process's ``value`` in process order (on process 0; others may get [])."""

    @abstractmethod
    def abort(self) -> None:
        """Process 0, after a failed run: end every other process of the job now (it may be inside the run)."""

    @abstractmethod
    def start_hint(self, processes: int) -> str:
        """How to start a job of ``processes`` processes, for errors (``mpirun -np 4 ...``)."""

    def describe(self) -> dict[str, Any]:
        """What the job runs on, for ``meta.json``."""
        return {}

    def close(self) -> None:  # noqa: B027 (MPI's channel holds nothing of its own)
        """Release the channel (after the job's end was announced)."""

    def finalize(self) -> None:  # noqa: B027 (only MPI's needs a word before the process exits)
        """What the job's runtime needs before this process exits (MPI_Finalize)."""


class JobLauncher(Launcher):
    """Ranks are the processes of a job; process 0 coordinates (see the module docstring)."""

    #: the command line's launch options it takes (``bench.launch.create`` refuses the others), and why it refuses
    #: one for a reason of its own
    options: ClassVar[tuple[str, ...]] = ("bind",)
    refuses: ClassVar[dict[str, str]] = {}
    starts_processes = False

    def __init__(self, channel: JobChannel, bind: str | None = None, log_dir: Path | None = None) -> None:
        self._channel = channel
        self.process = channel.process
        self.world = channel.world
        self.log_dir = log_dir
        self.hosts = sorted(set(channel.hostnames))
        # every process decides alike (the same hostnames, the same --bind), so they agree without a word
        self.bind = resolve_bind(bind, channel.hostnames)
        self._broken = ""
        self._ended = False
        os.environ.update(ucx_devices(self.bind))
        # this process's temporary files, removed as it ends (see the module docstring)
        self._scratch = tempfile.mkdtemp(prefix="bench-job-")
        tempfile.tempdir = self._scratch
        atexit.register(shutil.rmtree, self._scratch, ignore_errors=True)  # an exit other than end_process's

    @property
    def is_coordinator(self) -> bool:  # type: ignore[override]
        return self.process == 0

    def describe(self) -> dict[str, Any]:
        return {"launcher": self.name, "bind": self.bind, "world_size": self.world, "hosts": self.hosts,
                **self._channel.describe()}

    def ranks_problem(self, needed: int, names: str) -> str | None:
        if needed <= self.world:
            return None
        return (f"this run needs {needed} ranks ({names}), but {self._channel.job} has {self.world}: start it with "
                f"{self._channel.start_hint(needed)}")

    # the coordinator (process 0) -------------------------------------------------------------

    def run(self, ranks: list[RankSpec], timeout_s: float, on_report: Callable[[int, Any], None] | None = None,
            label: str = "run", startup_s: float = 0.0) -> list[RankResult]:
        if not self.is_coordinator:
            raise LaunchError(f"under --launcher {self.name} only process 0 starts runs; the others serve them "
                              "(JobLauncher.serve)")
        if self._broken:
            raise LaunchError(f"not started: {self._broken}")
        if problem := self.ranks_problem(len(ranks), ", ".join(s.name for s in ranks)):
            raise LaunchError(problem)
        if any(spec.service for spec in ranks):
            raise LaunchError(f"ranks that serve until stopped (tf_grpc's servers) cannot run under --launcher "
                              f"{self.name}; use --launcher local or netns")
        token = run_token()
        hub = Hub((self.bind, 0), token, len(ranks))
        try:
            try:
                self._channel.announce({"ranks": len(ranks), "hub": list(hub.address), "token": token})
                cluster = Cluster(tuple(self._addresses()[: len(ranks)]), token)
            except LaunchError as exc:  # a process of the job is gone: the job cannot run another
                self._broken = str(exc)
                raise
            own = threading.Thread(target=self._serve_rank, args=(hub.address, token), name="job-rank-0",
                                   daemon=True)
            own.start()
            try:
                return coordinate(hub, ranks, cluster, timeout_s, on_report or (lambda rank, payload: None),
                                  lambda: {}, startup_s=startup_s)
            except RankFailed as exc:
                # the other ranks may still be inside the failed run, and nothing can interrupt or replace them:
                # the job ends (close) once the coordinator has written what it has
                self._broken = f"rank {exc.rank} ({exc.name}) failed in an earlier run, which ends the job"
                raise
            finally:
                # after a failure, this process's rank may be inside the run for good: the job's end ends it
                own.join(timeout=1 if self._broken else 30)
        finally:
            hub.close()

    def close(self) -> None:
        """End the job: the others stop serving; after a lost rank, they are ended at once."""
        if self._ended or not self.is_coordinator:
            return
        self._ended = True
        if self._broken:
            self._channel.abort()
        else:
            with contextlib.suppress(LaunchError):  # a process gone by now needs no word; the others had theirs
                self._channel.announce(None)
        self._channel.close()

    # every process ---------------------------------------------------------------------------

    def end_process(self, status: int) -> None:
        """End this process of the job without the libraries' destructors, once its part is done and written.

        One process serves every run of the job, so it holds every library any run loaded, and NIXL's wheel
        crashes in its own destructors at exit (its bundled libnl-route, in ``rtnl_tc_unregister``), which would
        turn a finished job into a task killed by SIGSEGV. The runtime is told first (MPI_Finalize); stdio and
        logging are flushed here; the results are closed already."""
        self._channel.finalize()
        tempfile.tempdir = None
        shutil.rmtree(self._scratch, ignore_errors=True)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    def _addresses(self) -> list[str]:
        return self._channel.gather(f"{self.bind}:{free_port(self.bind)}")

    def _serve_rank(self, hub: str | tuple[str, int], token: str) -> None:
        with contextlib.suppress(LaunchError, OSError, EOFError):
            serve_rank(connect(tuple(hub), token), self.process, in_own_process=False)

    def serve(self) -> int:
        """Processes other than 0: take part in every run the coordinator starts, until it ends the job."""
        try:
            while True:
                announced = self._channel.announcement()
                if announced is None:
                    return 0
                problem = announcement_problem(announced, self.world)
                if problem:
                    raise LaunchError(f"process {self.process} of {self._channel.job} refused what process 0 "
                                      f"announced: {problem}")
                self._addresses()
                if self.process < announced["ranks"]:
                    self._serve_rank(announced["hub"], announced["token"])
        finally:
            self._channel.close()
