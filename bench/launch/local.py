"""``--launcher local``: every rank a process on this machine, listening on the bind address (loopback).

Each rank is ``python -m bench.launch.rank`` in a session of its own, its output in a log file.
Whatever happens (a failed rank, a timeout, Ctrl-C), every rank's process group is ended before
``run`` returns: SIGTERM first, so transports release registered and shared memory, then SIGKILL.
A rank whose coordinator is killed outright exits by itself (its hub connection closes), and the
run's directory (``$TMPDIR/bench-run-*``: the hub's socket, unless ``log_dir`` the ranks' logs, and each rank's own
``TMPDIR``, ``r<N>``) goes with the coordinator however it ends: a reaper (``bench.launch.hosts.Reaper``) removes
it. So does the run's directory under ``/dev/shm`` (``UCX_POSIX_DIR`` of every rank: UCX's shared-memory segments,
``ucx_shm_posix_*``, which UCX unlinks only once a segment is mapped, so that a rank killed while it plans a tensor
left one of the tensor's size behind). What libraries write to the temporary directory and delete at a clean exit
only (TensorFlow's ``__autograph_generated_file*.py``, two per rank) goes with the rank's ``TMPDIR``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from bench.ground.quiet_tensorflow import is_start_up_noise
from bench.launch.addresses import resolve_bind, ucx_devices
from bench.launch.base import Launcher
from bench.launch.hosts import Reaper
from bench.launch.hub import Hub, coordinate
from bench.launch.messages import RankFailed, RankResult, RankSpec, run_token
from transports import Cluster
from transports.ports import free_port, release_cluster_ports

#: seconds ranks get to exit by themselves after their result, and after SIGTERM
_EXIT_GRACE_S = 30.0
_TERM_GRACE_S = 5.0
#: characters of a rank's log an error quotes
_LOG_TAIL_CHARS = 2500
#: where UCX's posix transport makes its shared-memory segments unless told (``UCX_POSIX_DIR``)
_SHM = "/dev/shm"
#: bytes from the end of a rank's log searched for its fatal cause, and the most characters of it an error line quotes
_CAUSE_SEARCH_BYTES = 1 << 18
_CAUSE_CHARS = 240


def describe_exit(returncode: int) -> str:
    """``exit code 1`` or ``killed by SIGKILL``."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def log_tail(path: Path, chars: int = _LOG_TAIL_CHARS) -> str:
    """The end of a rank's log without TensorFlow's start-up lines, nor the list of extension modules a crashed
    rank's faulthandler writes after its stacks (hundreds of names with TensorFlow loaded: the stacks say where)."""
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines()
             if not is_start_up_noise(line) and not line.startswith("Extension modules: ")]
    return "\n".join(lines)[-chars:].strip()


#: words of a line that says why a process died (a library's error, glibc's or the kernel's words)
_CAUSE = re.compile(r"error|fail|abort|cannot|can't|unable|out of memory|bad_alloc|denied|exhausted|terminate",
                    re.IGNORECASE)
#: what faulthandler writes around the stacks of a crashed rank: the signal, not its cause
_NOT_CAUSE = re.compile(r"^(Fatal Python error: (Aborted|Segmentation fault|Bus error|Floating point exception)\b|"
                        r"Current thread|Thread 0x|  File |Stack \(most recent|Extension modules|Python runtime state)")
#: deaths a signal from outside gives (``describe_exit``'s words)
_SENT_DEATHS = frozenset(f"killed by {name}" for name in ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP"))
#: an operating system's error in a line: the most telling cause when several lines say one
_OS_WORDS = re.compile(r"Resource temporarily unavailable|Cannot allocate memory|Too many open files|"
                       r"No space left on device|Out of memory|bad_alloc|Permission denied", re.IGNORECASE)
#: the prefix of a glog line (gRPC, TensorFlow): ``E1126 12:01:37.663139   18505 thd.cc:157] ``
_GLOG_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S+\] ")


def fatal_cause(path: Path) -> str | None:
    """The line of a rank's log that says why it died, in one line: the last that names an operating system's error,
    else the last that says an error or a failure (not faulthandler's own lines around the stacks); None if none."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - _CAUSE_SEARCH_BYTES))
            text = log.read().decode(errors="replace")
    except OSError:
        return None
    causes = [line.strip() for line in text.splitlines()
              if _CAUSE.search(line) and not _NOT_CAUSE.match(line) and not is_start_up_noise(line)]
    if not causes:
        return None
    cause = next((line for line in reversed(causes) if _OS_WORDS.search(line)), causes[-1])
    cause = _GLOG_PREFIX.sub("", cause)
    return cause if len(cause) <= _CAUSE_CHARS else cause[:_CAUSE_CHARS - 3] + "..."


def _limit(which: int) -> int | None:
    """The soft limit ``which`` of this process (which its ranks inherit), None when unlimited."""
    soft = resource.getrlimit(which)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def limit_hint(text: str) -> str | None:
    """The resource limit of this process (and of the ranks it starts, which inherit it) that an error's ``text``
    points at, with its value and the fix, in one sentence; None when none does (or the limit is not set)."""
    if "Too many open files in system" in text or "[Errno 23]" in text:
        return ("the system's table of open files is full (sysctl fs.file-max): close programs that hold many "
                "files, or raise fs.file-max")
    if "Too many open files" in text or "[Errno 24]" in text:
        if (files := _limit(resource.RLIMIT_NOFILE)) is None:
            return None
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        enough = max(4096, files * 4)
        above = "" if hard == resource.RLIM_INFINITY or hard >= enough else (
            f" (its hard limit is {hard}: above that as root, or in /etc/security/limits.conf)")
        return f"the limit on open files (ulimit -n, RLIMIT_NOFILE) is {files}: raise it with ulimit -n {enough}{above}"
    threads = re.search(r"pthread_create|can't start new thread|thread", text, re.IGNORECASE) is not None
    memory = re.search(r"Cannot allocate memory|MemoryError|bad_alloc|out of memory|mmap|allocat|failed to map",
                       text, re.IGNORECASE) is not None
    if not (threads or memory or "Resource temporarily unavailable" in text):
        return None
    if (space := _limit(resource.RLIMIT_AS)) is not None:
        return (f"the limit on address space (ulimit -v, RLIMIT_AS) is {space // 1024} KB, and threads' stacks and "
                "the libraries' mappings count against it: raise it with ulimit -v unlimited")
    if (data := _limit(resource.RLIMIT_DATA)) is not None:
        return (f"the limit on data memory (ulimit -d, RLIMIT_DATA) is {data // 1024} KB: raise it with "
                "ulimit -d unlimited")
    if threads and (processes := _limit(resource.RLIMIT_NPROC)) is not None:
        return (f"the limit on processes and threads (ulimit -u, RLIMIT_NPROC) is {processes}: raise it with "
                "ulimit -u unlimited")
    return None


def error_with_limit(exc: BaseException) -> str | None:
    """One line for an error a resource limit of this process caused (too many open files, no thread or memory
    under ``ulimit -v``): the error and the limit, its value and the fix; None for any other error."""
    if isinstance(exc, OSError) and exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN):
        return None
    if not isinstance(exc, (OSError, MemoryError, RuntimeError)):
        return None
    text = f"{type(exc).__name__}: {exc}"
    hint = limit_hint(text)
    return f"{text.splitlines()[0]}; {hint}" if hint else None


def explained(exc: RankFailed, log: Path) -> RankFailed:
    """``exc`` with its first line saying why: a rank that died gets the cause its log gives (``died (killed by
    SIGABRT): pthread_create failed: ...``), and a cause a resource limit explains names the limit and the fix."""
    text = str(exc)
    first, newline, rest = text.partition("\n")
    death = re.match(rf"rank {exc.rank} \(.*?\) died \(([^()]*)\)", first) if exc.kind == "died" else None
    # a signal from outside (SIGKILL: the kernel's OOM killer, a user) is no cause the rank's log can know
    if death and death.group(1) not in _SENT_DEATHS and (cause := fatal_cause(log)) is not None:
        first = f"{death.group(0)}: {cause}{first[death.end():]}"
    if (hint := limit_hint(first)) is not None:
        first = f"{first}; {hint}"
    if first != text.partition("\n")[0]:
        exc.args = (f"{first}{newline}{rest}",)
    return exc


def shared_memory_directory() -> Path | None:
    """A new private (0700) directory for a run's shared-memory segments, in the one UCX would use (``UCX_POSIX_DIR``
    as set here, else ``/dev/shm``); None where there is none (UCX's posix transport cannot run there either)."""
    base = os.environ.get("UCX_POSIX_DIR") or _SHM
    try:
        return Path(tempfile.mkdtemp(prefix="bench-run-", dir=base))
    except OSError:
        return None


def rank_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a rank's process: ours, our import path, quiet TensorFlow, and ``extra``."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    # jobs are imported by name in the rank, so it needs our import path (tests, user modules)
    path = [p for p in sys.path if p] + [str(Path(__file__).resolve().parents[2])]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    env.update(extra or {})
    return env


class LocalLauncher(Launcher):
    """Ranks as processes on this machine; :class:`bench.launch.netns.NetnsLauncher` puts them in namespaces."""

    name = "local"
    #: the command line's launch options it takes (``bench.launch.create`` refuses the others), and why it refuses
    #: one for a reason of its own
    options: ClassVar[tuple[str, ...]] = ("bind",)
    refuses: ClassVar[dict[str, str]] = {}

    def __init__(self, bind: str | None = None, log_dir: Path | None = None) -> None:
        self.bind = resolve_bind(bind, [socket.gethostname()])
        self.log_dir = log_dir

    def describe(self) -> dict[str, Any]:
        return {"launcher": self.name, "bind": self.bind}

    # what a subclass changes: where ranks run and listen ------------------------------------

    def _open_hosts(self, ranks: list[RankSpec]) -> None:
        """Prepare the hosts the ranks run on (netns: the namespaces and links)."""

    def _close_hosts(self) -> None:
        """Tear down what ``_open_hosts`` made."""

    def _addresses(self, ranks: list[RankSpec]) -> list[str]:
        return [f"{self.bind}:{free_port(self.bind)}" for _ in ranks]

    def _command(self, spec: RankSpec, argv: list[str]) -> list[str]:
        return argv

    def _environment(self) -> dict[str, str]:
        return ucx_devices(self.bind)  # UCX over tcp listens where the ranks do: on loopback unless told otherwise

    def _link_interface(self, spec: RankSpec) -> str | None:
        return None

    # one run ------------------------------------------------------------------------------------

    def run(self, ranks: list[RankSpec], timeout_s: float, on_report: Callable[[int, Any], None] | None = None,
            label: str = "run", startup_s: float = 0.0) -> list[RankResult]:
        workdir = Path(tempfile.mkdtemp(prefix="bench-run-"))
        shm = shared_memory_directory()
        run_dirs = [workdir, *([shm] if shm else [])]
        reaper = Reaper(directories=[str(path) for path in run_dirs]).start()  # they go with us, however we end
        logs = self._log_paths(workdir, label, len(ranks))
        procs: list[subprocess.Popen] = []
        hub = cluster = None
        try:
            self._open_hosts(ranks)
            token = run_token()
            cluster = Cluster(tuple(self._addresses(ranks)), token)
            hub = Hub(str(workdir / "hub"), token, len(ranks))
            env = rank_environment({**self._environment(), **({"UCX_POSIX_DIR": str(shm)} if shm else {})})
            for rank, spec in enumerate(ranks):
                own = _own_temporary(env, workdir, rank)
                procs.append(self._start(spec, rank, hub.address, token, logs[rank], own))

            def exited() -> dict[int, str]:
                codes = {rank: exit_status(proc) for rank, proc in enumerate(procs)}
                return {rank: describe_exit(code) for rank, code in codes.items() if code is not None}

            try:
                results = coordinate(hub, ranks, cluster, timeout_s, on_report or (lambda rank, payload: None),
                                     exited, self._link_interface, startup_s)
            except RankFailed as exc:
                exc = explained(exc, logs[exc.rank])
                raise exc.with_log(log_tail(logs[exc.rank]) if exc.kind != "failed" else "") from None
            _wait_all(procs, _EXIT_GRACE_S)
            return results
        finally:
            _end_all(procs)
            if hub is not None:
                hub.close()
            if cluster is not None:  # the ranks are gone: the ports free_port reserved for them here go too
                release_cluster_ports(cluster.addresses)
            self._close_hosts()
            for path in run_dirs:  # the ranks are gone: what they left there (segments, temporary files) goes
                shutil.rmtree(path, ignore_errors=True)
            reaper.release(clean=True)

    def _log_paths(self, workdir: Path, label: str, count: int) -> list[Path]:
        folder = workdir
        if self.log_dir is not None:
            folder = Path(self.log_dir)
            folder.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
        return [folder / f"{safe}-rank{rank}.log" for rank in range(count)]

    def _start(self, spec: RankSpec, rank: int, hub_address: str, token: str, log: Path,
               env: dict[str, str]) -> subprocess.Popen:
        # the rank dies with this process (PR_SET_PDEATHSIG, armed in the rank, which checks its parent is us)
        argv = self._command(spec, [sys.executable, "-m", "bench.launch.rank", hub_address, str(rank),
                                    str(os.getpid())])
        with open(log, "wb") as out:
            # a session of its own: Ctrl-C reaches the coordinator only, which ends the ranks in order
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        proc.stdin.write(f"{token}\n".encode())
        proc.stdin.close()
        return proc


def _own_temporary(env: dict[str, str], workdir: Path, rank: int) -> dict[str, str]:
    """``env`` with rank ``rank``'s ``TMPDIR``: a directory of its own in the run's, removed with the run whatever ends
    the rank (a SIGKILL runs no library's clean-up)."""
    own = workdir / f"r{rank}"
    own.mkdir(mode=0o700)
    return {**env, "TMPDIR": str(own)}


def exit_status(proc: subprocess.Popen) -> int | None:
    """The rank's exit status (negative: the signal) once it has ended, else None.

    It does not reap the process: while the ended leader is not reaped, its pid still names its
    process group, so the group can be killed without hitting a stranger that got the pid since.
    """
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.returncode
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _wait_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(exit_status(proc) is None for proc in procs):
        time.sleep(0.05)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    if proc.returncode is None:  # not reaped: the pid is still ours
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)


def _end_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every rank still running (transports close), then SIGKILL its whole process group; reap all."""
    running = [proc for proc in procs if exit_status(proc) is None]
    for proc in running:
        _signal_group(proc, signal.SIGTERM)
    _wait_all(running, _TERM_GRACE_S)
    for proc in procs:
        # also when the leader has ended: a rank's own children stay in its group
        _signal_group(proc, signal.SIGKILL)
        proc.wait()

