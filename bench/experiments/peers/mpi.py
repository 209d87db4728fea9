"""The ``mpi`` and ``mpi_rma`` peers: what MPI moves between two processes of one host (mpi4py on the MPI it
finds; the ``mpi`` extra brings Open MPI's wheel, whose shared-memory transport carries the data).

- ``mpi``: ``comm.Send`` of the tensor's bytes, ``comm.Recv`` into a buffer preallocated per tensor.
- ``mpi_rma``: one-sided. Per tensor both sides make a window (``Win.Allocate``: the receiver's holds an 8-byte
  flag and the tensor, the sender's nothing) and open a passive epoch on it (``Lock_all``). A send is ``Put``
  of the bytes, ``Flush``, ``Put`` of the flag (the transfer's number), ``Flush``; a receive polls the flag
  (``Win.Sync`` between reads) and returns a view of the window. The window of a tensor is made at its first
  transfer (a warm-up one) and freed at the next tensor's.

A tensor over 1 GiB goes in pieces of 1 GiB (messages or puts): Open MPI's wheel refuses a count beyond a C int.

The two MPI processes must be started together (Open MPI 5's singletons cannot connect to each other:
``Comm_accept``/``Comm_connect`` and ``Comm.Join`` fail with ``MPI_ERR_INTERN``), so the line's one rank, the
*relay*, runs ``mpirun -np 2 python -m bench.experiments.peers.mpi HUB``. The two processes join the relay over
a Unix socket in a private directory (authenticated with the run's token, as ranks join a coordinator), get the
points, signal each other over MPI (tag 1, outside the timed interval as always) and send their reports to the
relay, which hands them to the coordinator. So the line runs where its relay's launcher runs processes on this
host (the local launcher). mpirun's own listener (PRRTE's) binds every interface whatever it is told, and Open MPI's
tcp component listens on every interface too, so the pair is kept off the network, the strongest way this machine
allows (``MpiLine.hosts`` chooses; ``listeners`` says which):

1. in a private emulated host, as perftest's tools run (root and iproute2: ``bench.launch.private``);
2. else, where the kernel makes network namespaces but ``ip`` is missing (a bare Debian root), mpirun and its
   processes in a network namespace of their own with only loopback (``unshare``; a user namespace too when not
   root);
3. else (a container that makes no namespace), on the host's network with every address they bind put on loopback
   (a small library preloaded into mpirun and its processes, built here with the C compiler the install needed:
   Open MPI has no option that binds PRRTE's listener). Reachable then from this host's other users, not from other
   hosts: that weaker isolation is said in one line of ``bench micro``'s output and kept in ``meta.json``
   (``isolation``), and the relay checks that nothing of the pair listens off loopback before the first transfer
   (``bench.experiments.peers.isolation`` holds the namespace, the library and the check).

Under a launcher of emulated hosts both processes would share one host and never cross its link, and under
``--launcher mpi`` a second mpirun inside an MPI job is not started: there it is left out.

The line leaves nothing however it ends: mpirun's session directory (``TMPDIR``) and the pair's shared-memory files
(Open MPI's ``sm_segment.*``, its windows', UCX's: every ``*_backing_directory``) go into two 0700 directories of the
relay's, one in /tmp and one in /dev/shm, removed when it ends, or by a reaper outside its emulated host when it is
killed; mpirun gets SIGTERM when the relay dies. A failure while /dev/shm has no room says so.

The links and their signals are ``mpi_links.py``, the plain loops ``mpi_plain.py``, the relay's process handling
(mpirun's pair gathered, fed and followed; the private directories and their reaper) ``bench.launch.relay``; this
module holds the lines, what keeps the pair off the network, and the MPI processes' main (mpirun starts this module
in both).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from bench.experiments.micro import RECEIVER, SENDER, STARTUP_S, Point
from bench.experiments.peers import PeerLine, PeerLineError, drive
from bench.experiments.peers.isolation import (
    ENTER_NAMESPACE,
    compiler_problem,
    listening_off_loopback,
    loopback_environment,
    own_namespace_problem,
    process_tree,
)
from bench.experiments.peers.mpi_links import FLAG_BYTES, MpiLink, MpiRmaLink, MpiSignals
from bench.experiments.peers.mpi_plain import PlainLoop, PlainRmaLoop
from bench.launch import Launcher, LaunchError, RankContext, RankSpec
from bench.launch import hosts as emulated_hosts
from bench.launch.context import connect
from bench.launch.hub import Hub
from bench.launch.messages import TOKEN_VARIABLE, Hello, describe_error
from bench.launch.mpi import mpirun_path
from bench.launch.private import PrivateHosts, hosts_for_open_listeners
from bench.launch.relay import SHM, end_mpirun, gather_pair, private_directories, private_files, relay_pair
from bench.launch.wire import receive_message, send_message
from transports import Cluster
from transports.common import Availability

# -- the line: a relay rank and the MPI pair it starts ---------------------------------------------------


@dataclass
class MpiLine(PeerLine):
    """mpi4py point-to-point between two processes that one ``mpirun`` starts."""

    module: ClassVar[str] = "mpi4py"
    install: ClassVar[str] = "pip install -e '.[mpi]' brings mpi4py and Open MPI's wheel"
    link_class: ClassVar[type[MpiLink]] = MpiLink
    #: how the pair is kept off the network (set by :meth:`hosts`): EMULATED_HOST, OWN_NAMESPACE or LOOPBACK
    listeners: str = field(default="", compare=False)

    def availability(self) -> Availability:
        if not (status := super().availability()).ok:
            return status
        if mpirun_path() is None:
            return Availability(False, f"no mpirun here ({self.install})")
        return Availability(True)

    def hosts(self, launcher: Launcher) -> PrivateHosts:
        if not launcher.starts_processes or launcher.private_hosts:
            raise LaunchError(f"the {self.name} line starts its own pair of MPI processes on this host: under "
                              f"--launcher {launcher.name} they would not cross the run's links (measure it "
                              "under --launcher local)")
        self.listeners = EMULATED_HOST
        try:  # mpirun (PRRTE's listener) and Open MPI's tcp component listen on every interface
            return hosts_for_open_listeners(launcher, _WHAT, _LEAVE_OUT)
        except LaunchError:
            no_host = _emulated_host_problem()
            if no_host is None or not ipaddress.ip_address(launcher.bind).is_loopback:
                raise  # refused for another reason, or asked to listen on the network and refused that
        if (no_namespace := own_namespace_problem()) is None:
            self.listeners = OWN_NAMESPACE
            return PrivateHosts(launcher, False, True, f"no emulated host here ({no_host}): {_WHAT} in a network "
                                                       "namespace of their own, with only loopback")
        if (no_compiler := compiler_problem()) is not None:
            raise LaunchError(f"{_WHAT} listen on every interface, and here no network namespace can be made "
                              f"({no_namespace}) nor their listeners bound to loopback ({no_compiler}); or pass "
                              f"{_LEAVE_OUT}")
        self.listeners = LOOPBACK
        return PrivateHosts(launcher, False, False, self.weaker_isolation or "")

    @property
    def weaker_isolation(self) -> str | None:
        """One line saying how the pair is exposed, where it runs less isolated than in a network namespace (the run
        prints it and keeps it in meta.json); None where it is isolated."""
        if self.listeners != LOOPBACK:
            return None
        return (f"no network namespace can be made here ({own_namespace_problem()}): {_WHAT} run on the host's "
                "network with every address they bind put on loopback, reachable from this host's other users but "
                "not from other hosts")

    def link(self, cluster: Cluster, rank: int) -> MpiLink:
        raise NotImplementedError("an MPI link is made in the MPI processes (see _mpi_process)")

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        return [RankSpec(functools.partial(_relay_job, self, points), "mpirun")]


@dataclass
class MpiRmaLine(MpiLine):
    """MPI one-sided put, flush and flag between two processes that one ``mpirun`` starts."""

    link_class: ClassVar[type[MpiLink]] = MpiRmaLink


@dataclass
class MpiPlainLine(MpiLine):
    """The ``mpi`` line's calibration (``bench micro --calibrate``): mpi4py's ``Send``/``Recv`` in a plain loop
    (:class:`PlainLoop`), measured beside the ``mpi`` line and never a candidate for ``of_peer``."""

    name: str = "mpi_plain"
    link_class: ClassVar[type] = PlainLoop
    time_reference: ClassVar[bool] = False


@dataclass
class MpiRmaPlainLine(MpiPlainLine):
    """The ``mpi_rma`` line's calibration: its one-sided protocol in a plain loop (:class:`PlainRmaLoop`)."""

    name: str = "mpi_rma_plain"
    link_class: ClassVar[type] = PlainRmaLoop


def _relay_job(line: MpiLine, points: list[Point], ctx: RankContext) -> None:
    """Start the MPI pair, hand it the points, pass its reports on; a failure of either is this rank's."""
    with private_directories("bench-mpi-peer-") as (private, shm):
        # in /dev/shm where there is a directory: a path of fixed length, while the rank's TMPDIR (the local
        # launcher's $TMPDIR/bench-run-*/r<N>) can make one past a Unix socket's 107 bytes
        hub = Hub(os.path.join(shm or private, "hub"), ctx.cluster.token, 2)
        log_path = Path(private) / "mpirun.log"
        env = {**os.environ, TOKEN_VARIABLE: ctx.cluster.token, "PYTHONPATH": os.pathsep.join(sys.path),
               # Open MPI refuses root unless told twice
               "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               **private_files(private, shm)}
        if line.listeners == LOOPBACK:
            env.update(loopback_environment(private, env))
        with open(log_path, "w+") as log:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _START_MPIRUN, str(os.getpid()),
                                     "namespace" if line.listeners == OWN_NAMESPACE else "-",
                                     mpirun_path() or "mpirun", "-np", "2", "--oversubscribe", sys.executable,
                                     "-m", __name__, hub.address], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
            try:
                _relay(line, points, ctx, hub, proc, log)
            except PeerLineError as exc:
                if short := _shm_short(points):  # said in the first line: that is the line an error shows
                    first, newline, rest = str(exc).partition("\n")
                    raise PeerLineError(f"{first}{short}{newline}{rest}") from None
                raise
            finally:
                end_mpirun(proc)
                hub.close()


# -- keeping the pair off the network -----------------------------------------------------------------------------

#: how the pair is kept off the network (``MpiLine.listeners``): see the module's docstring
EMULATED_HOST, OWN_NAMESPACE, LOOPBACK = "emulated host", "own namespace", "loopback"
_WHAT = "mpirun and its MPI processes"
_LEAVE_OUT = "--peers without mpi and mpi_rma"

#: runs mpirun (argv[3:]) so that it gets SIGTERM, ending its job, should the relay (argv[1]) die first (SIGKILL:
#: no ``finally`` runs), in a network namespace of its own when argv[2] is "namespace"; exits 3 if the relay is
#: gone already
_START_MPIRUN = ENTER_NAMESPACE + (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 15, 0, 0, 0)\n"  # PR_SET_PDEATHSIG, SIGTERM; kept across exec
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(3)\n"
    "if sys.argv[2] == 'namespace':\n"
    "    enter_namespace()\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def _emulated_host_problem() -> str | None:
    """Why no private emulated host can be made here (bench.launch.hosts' probe), or None."""
    try:
        emulated_hosts.check_support()
    except emulated_hosts.NetnsUnavailable as exc:
        return str(exc)
    return None


def _shm_short(points: list[Point]) -> str:
    """``; /dev/shm is full (...)`` when /dev/shm has less room than the largest tensor of ``points`` (a failure
    of the pair's shared-memory windows or segments then has that cause), else ''."""
    try:
        stat = os.statvfs(SHM)
    except OSError:
        return ""
    free = stat.f_bavail * stat.f_frsize
    need = FLAG_BYTES + max((point.size_bytes for point in points), default=0) + _SHM_MARGIN_BYTES
    if free >= need:
        return ""
    return (f"; {SHM} is full ({_spelled(free)} free of {_spelled(stat.f_blocks * stat.f_frsize)}, the MPI pair's "
            f"shared memory needs about {_spelled(need)}): free space there (rm files you know are stale) or "
            f"enlarge it (mount -o remount,size=8G {SHM})")


#: shared memory the pair needs beyond its window: Open MPI's segments for its shared-memory transport
_SHM_MARGIN_BYTES = 16 << 20


def _spelled(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} bytes"


def _relay(line: MpiLine, points: list[Point], ctx: RankContext, hub: Hub, proc: subprocess.Popen, log: Any) -> None:
    def broken(what: str) -> PeerLineError:
        log.flush()
        log.seek(0)
        tail = "".join(log.readlines()[-8:]).strip()
        return PeerLineError(f"{line.name}: {what}" + (f"; mpirun said:\n{tail}" if tail else ""))

    conns = gather_pair(hub, proc, STARTUP_S, broken)
    if line.listeners == LOOPBACK and (exposed := listening_off_loopback(process_tree(proc.pid))):
        raise broken(f"the MPI pair listens off loopback ({', '.join(exposed)}) although every address it binds "
                     f"was to be put there; pass {_LEAVE_OUT}")
    relay_pair(conns, proc, (line.link_class, points, line.timeout_s), {SENDER: "sender", RECEIVER: "receiver"},
               ctx.report, broken, lambda what: PeerLineError(f"{line.name}: {what}"))


def _mpi_process(hub: str) -> int:
    """One of the two MPI processes: join the relay, get the points, run its side, report."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    conn = connect(hub, os.environ.pop(TOKEN_VARIABLE, ""))
    send_message(conn, Hello(rank))
    link_class, points, timeout_s = receive_message(conn)
    if getattr(link_class, "plain", False):  # the calibration: no link, no harness
        try:
            link_class.run(comm, points, lambda message: send_message(conn, message))
        except Exception as exc:
            with contextlib.suppress(OSError):
                send_message(conn, ("failed", describe_error(exc)))
            comm.Abort(1)
        send_message(conn, "finished")
        return 0
    link = link_class(comm, timeout_s)
    try:
        drive(link, points, rank, MpiSignals(comm, RECEIVER - rank),
              lambda message: send_message(conn, message))
    except Exception as exc:  # said first: closing a window is collective and would wait for the other process
        with contextlib.suppress(OSError):
            send_message(conn, ("failed", describe_error(exc)))
        comm.Abort(1)  # the other process may wait on this one: end the job
    link.close()
    send_message(conn, "finished")
    return 0


if __name__ == "__main__":
    sys.exit(_mpi_process(sys.argv[1]))
