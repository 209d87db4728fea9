"""The relay: a rank that starts an MPI job of its own (``mpirun -np 2``, a pair of processes, on this host), gathers
the pair at a hub, hands both their work and passes their reports on to the coordinator (:func:`gather_pair`,
:func:`relay_pair`, :func:`end_mpirun`); and the two private directories that mpirun and the pair write into,
removed however the relay ends, by a reaper outside its emulated host when it is killed
(:func:`private_directories`, :func:`private_files`). The ``mpi`` peer lines are its one user
(``bench.experiments.peers.mpi``); what the pair runs is theirs."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from bench.launch.hosts import REAPER_PIPES, spawn_reaper
from bench.launch.hub import Hub
from bench.launch.wire import receive_message, send_message

#: seconds mpirun may take to end once both processes said they finished
_EXIT_S = 30.0


#: Open MPI's (and UCX's) parameters naming where shared-memory backing files go (default: /dev/shm)
BACKING_VARIABLES = ("OMPI_MCA_btl_sm_backing_directory", "OMPI_MCA_osc_sm_backing_directory",
                      "OMPI_MCA_osc_rdma_backing_directory", "OMPI_MCA_osc_ucx_backing_directory",
                      "OMPI_MCA_shmem_mmap_backing_file_base_dir", "UCX_POSIX_DIR")
SHM = "/dev/shm"


@contextlib.contextmanager
def private_directories(prefix: str) -> Iterator[tuple[str, str | None]]:
    """Two 0700 directories of the relay's (their names start with ``prefix``), gone however it ends (a reaper removes
    them if this process is killed): one in /tmp (mpirun's log, and mpirun's session directory: ``TMPDIR``) and one
    in /dev/shm (the relay's socket, and the pair's shared-memory files, which Open MPI leaves behind when its
    processes are killed), or None where /dev/shm takes no directory (the socket is then in the first)."""
    private = tempfile.mkdtemp(prefix=prefix)
    shm = None
    with contextlib.suppress(OSError):
        shm = tempfile.mkdtemp(prefix=prefix, dir=SHM)
    try:
        reaper = _Reaper([private, *([shm] if shm else [])])
    except BaseException:
        _remove(private, shm)
        raise
    try:
        yield private, shm
    finally:
        _remove(private, shm)
        reaper.release()


#: the reaper's program: leave the relay's network namespace for its parent's (argv[1]; an emulated host's
#: teardown kills every process inside it, and would kill the reaper before it removed anything), say so, wait for
#: the relay to close the pipe, and unless it said "closed" first, remove the directories (argv[2:])
_REAPER = (
    "import ctypes, os, shutil, sys\n"
    "try:\n"
    "    fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "    ctypes.CDLL(None).setns(fd, 0x40000000)\n"  # CLONE_NEWNET; where it fails (not root), it stays
    "    os.close(fd)\n"
    "except OSError:\n"
    "    pass\n"
    "sys.stdout.write('ready\\n')\n"
    "sys.stdout.flush()\n"
    "if sys.stdin.buffer.read() != b'closed':\n"
    "    for directory in sys.argv[2:]:\n"
    "        shutil.rmtree(directory, ignore_errors=True)\n"
)


class _Reaper:
    """A process that removes ``directories`` when the relay dies without removing them (SIGKILL).

    ``bench.launch.hosts.Reaper`` does that too, but it would run inside the relay's emulated host, whose
    teardown kills it: this one runs in the coordinator's network namespace, and is ready once started.
    """

    def __init__(self, directories: list[str]) -> None:
        self._process, self._pipe = spawn_reaper(
            [sys.executable, "-I", "-c", _REAPER, f"/proc/{os.getppid()}/ns/net", *directories],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._process.stdout.readline()  # in its namespace: from now on an emulated host's teardown spares it

    def release(self) -> None:
        """The directories are gone: the reaper exits (and is waited for)."""
        REAPER_PIPES.discard(self._pipe)
        with contextlib.suppress(OSError):
            os.write(self._pipe, b"closed")
        os.close(self._pipe)
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process.stdout.close()


def _remove(*directories: str | None) -> None:
    for directory in directories:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)


def private_files(private: str, shm: str | None) -> dict[str, str]:
    """The environment that puts every file mpirun and the pair make under the line's own directories."""
    env = {"TMPDIR": private}  # PRRTE's and PMIx's session directories (``ompi.*``, ``prte.*``)
    if shm:
        env.update(dict.fromkeys(BACKING_VARIABLES, shm))
    return env


def gather_pair(hub: Hub, proc: subprocess.Popen, startup_s: float,
                broken: Callable[[str], Exception]) -> dict[int, Connection]:
    """Both processes of ``proc`` (mpirun) joined at ``hub``, by rank, within ``startup_s``; else ``broken(what)``
    is raised (what went wrong: mpirun ended first, or they did not start in time)."""
    conns: dict[int, Connection] = {}
    deadline = time.monotonic() + startup_s
    while len(conns) < 2:
        try:
            rank, conn = hub.arrivals.get(timeout=0.2)
            conns[rank] = conn
        except queue.Empty:
            if proc.poll() is not None:
                raise broken(f"mpirun exited (code {proc.returncode}) before both MPI processes started") from None
            if time.monotonic() > deadline:
                raise broken(f"the MPI processes did not start within {startup_s:.0f} s") from None
    return conns


def relay_pair(conns: dict[int, Connection], proc: subprocess.Popen, work: Any, roles: dict[int, str],
               report: Callable[[Any], None], broken: Callable[[str], Exception],
               failed: Callable[[str], Exception]) -> None:
    """Send ``work`` to both processes, pass every message they send on to ``report`` until both said
    ``"finished"``, then wait for mpirun to end. A process that says ``("failed", error)`` raises ``failed(what)``;
    one that ends without a word, or mpirun ending early or badly, raises ``broken(what)`` (``roles`` names each
    process by its rank in ``what``)."""
    for conn in conns.values():
        send_message(conn, work)
    open_ = {conn: rank for rank, conn in conns.items()}
    while open_:
        ready = wait(list(open_), timeout=0.5)
        for conn in ready:
            role = roles[open_[conn]]
            try:
                message = receive_message(conn)  # decoded as data: nothing it sends can run code here
            except (EOFError, OSError):
                raise broken(f"the MPI {role} ended without a word") from None
            if message == "finished":
                del open_[conn]
            elif isinstance(message, tuple) and message[:1] == ("failed",):
                raise failed(f"the MPI {role} failed: {message[1]}")
            else:
                report(message)
        if not ready and proc.poll() is not None:
            raise broken(f"mpirun exited (code {proc.returncode}) before the MPI processes finished")
    try:
        code = proc.wait(timeout=_EXIT_S)
    except subprocess.TimeoutExpired:
        raise broken(f"mpirun did not end within {_EXIT_S:.0f} s of both processes finishing") from None
    if code != 0:
        raise broken(f"mpirun exited with code {code}")


def end_mpirun(proc: subprocess.Popen) -> None:
    """mpirun gone, and its processes with it (SIGTERM: mpirun ends its job; then SIGKILL)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
