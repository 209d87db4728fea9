"""``--launcher slurm``: the ranks are the tasks of a Slurm step (``srun -n 4 bench ... --launcher slurm``).

No MPI is needed. Each task reads who it is from Slurm's variables (:class:`SlurmStep`: ``SLURM_PROCID``,
``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``, ...). Task 0 is the coordinator (see
``job.py``): it listens on its bind address with the job's token and writes where it listens into a
*rendezvous file* readable by the user only (``$TENSOR_BENCH_RENDEZVOUS``, default
``~/.cache/tensor-bench/rendezvous``, which must be shared by the step's nodes: a home directory on a
cluster). The other tasks read it and join, each proving it knows the token (the token is in the file,
unless ``TENSOR_BENCH_TOKEN`` gives it to every task). Every wait is bounded and names who is missing.

The job's channel is then that star of connections. A task whose coordinator is gone, or which is told
the job failed, ends itself (SIGTERM, so that its transports close; a hard exit if that does not end it
within :data:`END_GRACE_S`): a failed rank ends the step, as ``MPI_Abort`` would.

Outside a step, ``bench ... --launcher slurm --nodes N`` submits the same command as a batch job
(:func:`submit`; ``--dry-run`` prints the script) and follows its state until it ends.

Why one module of 600 lines: the step's environment, the rendezvous file and the channel are one protocol,
read top to bottom with its checks (who owns the file, what it may say); the batch submission at the end
(:class:`Submission`, :func:`submit`) is the part that could stand apart.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.launch.addresses import resolve_bind
from bench.launch.context import connect
from bench.launch.hub import Hub
from bench.launch.job import (
    JobChannel,
    JobLauncher,
    announcement_problem,
    channel_receive,
    channel_send,
    hostnames_problem,
    value_problem,
)
from bench.launch.messages import TOKEN_VARIABLE, Hello, LaunchError
from bench.launch.wire import send_message
from transports.common import Availability

#: where task 0 says where it listens (a directory the step's nodes share); default below
RENDEZVOUS_VARIABLE = "TENSOR_BENCH_RENDEZVOUS"
DEFAULT_RENDEZVOUS = Path("~/.cache/tensor-bench/rendezvous")
#: seconds the tasks of a step get to find each other: task 0 to write its file, the others to join
JOIN_S = 300.0
#: seconds a task ended by its coordinator gets to close its transports before it exits hard
END_GRACE_S = 10.0
#: how a task that may not start a run learns it: the hint of a step too small
START_HINT = "srun -n {n} bench ... --launcher slurm (or --tasks {n} with --nodes to submit)"


class SlurmEnvironmentError(LaunchError):
    """Slurm's variables are missing or do not agree; the message names the variable."""


# -- who this task is --------------------------------------------------------------------------


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``node[01-03,7],gpu-a[1-2]b``) as host names, in order."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        if not item:
            raise ValueError(f"an empty host name in {text!r}")
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_range(part[1:-1], text))
            elif "[" in part or "]" in part:
                raise ValueError(f"unbalanced brackets in {text!r}")
            else:
                choices.append([part])
        names += ["".join(combo) for combo in product(*choices)]
    return names


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in {text!r}")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in {text!r}")
    items.append(text[start:])
    return items


def _expand_range(spec: str, text: str) -> list[str]:
    """``01-03,7`` -> 01 02 03 7: a range keeps its lower bound's zero padding."""
    out = []
    for piece in spec.split(","):
        low, dash, high = piece.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{piece!r} is not a number or a range in {text!r}")
        if not dash:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"the range {piece!r} runs backwards in {text!r}")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


@dataclass(frozen=True)
class SlurmStep:
    """This task of a Slurm step, as Slurm's variables say."""

    job_id: str
    step_id: str
    #: this task's number in the step (0 coordinates) and the step's number of tasks
    task: int
    tasks: int
    #: the step's nodes, in Slurm's order, and the one this task runs on
    nodes: tuple[str, ...]
    node: str

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> SlurmStep:
        """The step from ``env``; a missing or inconsistent variable raises one line naming it."""

        def need(*names: str) -> tuple[str, str]:
            for name in names:
                if env.get(name, "").strip():
                    return name, env[name].strip()
            alternatives = " or ".join(names)
            raise SlurmEnvironmentError(
                f"{alternatives} is not set: --launcher slurm runs in the tasks of a Slurm step "
                "(srun -n N bench ... --launcher slurm), or submits one with --nodes N")

        def number(name: str, value: str) -> int:
            if not value.isdigit():
                raise SlurmEnvironmentError(f"{name}={value!r} is not a number")
            return int(value)

        task = number(*need("SLURM_PROCID"))
        tasks_from, tasks_text = need("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        tasks = number(tasks_from, tasks_text)
        if not 0 <= task < tasks:
            raise SlurmEnvironmentError(f"SLURM_PROCID={task} is not a task of a step of {tasks_from}={tasks}")
        nodes_from, listed = need("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        try:
            nodes = tuple(expand_hostlist(listed))
        except ValueError as exc:
            raise SlurmEnvironmentError(f"{nodes_from}={listed!r} is not a Slurm host list: {exc}") from None
        node_from, node_id = need("SLURM_NODEID")
        index = number(node_from, node_id)
        if index >= len(nodes):
            raise SlurmEnvironmentError(f"SLURM_NODEID={index} is not a node of {nodes_from}={listed!r} "
                                        f"({len(nodes)} nodes)")
        return cls(job_id=need("SLURM_JOB_ID", "SLURM_JOBID")[1], step_id=need("SLURM_STEP_ID", "SLURM_STEPID")[1],
                   task=task, tasks=tasks, nodes=nodes, node=nodes[index])

    @property
    def name(self) -> str:
        return f"{self.job_id}.{self.step_id}"


def in_step(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a task of a Slurm step (started by ``srun``)."""
    return bool(env.get("SLURM_PROCID")) and bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))


# -- the rendezvous ----------------------------------------------------------------------------


def rendezvous_dir(env: Mapping[str, str] = os.environ) -> Path:
    return Path(env.get(RENDEZVOUS_VARIABLE) or DEFAULT_RENDEZVOUS).expanduser()


def _refuse_unless_private(path: Path, fd: int, kind: str) -> None:
    """LaunchError (one line naming ``path`` and the fix) unless the open ``fd`` is this user's ``kind`` ("directory"
    or "file") and nobody else may write it: what another user could plant or change there, a task would trust."""
    st = os.fstat(fd)
    fix = f"set {RENDEZVOUS_VARIABLE} to a directory only you can write (chmod 700)"
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)
    if not is_kind:
        raise LaunchError(f"refusing {path}: not a {kind}; {fix}")
    if st.st_uid != os.geteuid():
        raise LaunchError(f"refusing {path}: owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); {fix}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LaunchError(f"refusing {path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); {fix}")


def _open_private(path: Path, kind: str, dir_fd: int | None = None) -> int:
    """``path`` opened without following a link (O_NOFOLLOW) and checked (:func:`_refuse_unless_private`).
    FileNotFoundError while it is not there."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if kind == "directory" else os.O_NONBLOCK)
    try:
        fd = os.open(path.name if dir_fd is not None else path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else f"not a {kind}" if exc.errno == errno.ENOTDIR \
            else exc.strerror
        raise LaunchError(f"refusing {path}: {what}; set {RENDEZVOUS_VARIABLE} to a directory only you can write "
                          "(chmod 700)") from None
    try:
        _refuse_unless_private(path, fd, kind)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _publish(path: Path, address: tuple[str, int], token: str | None) -> None:
    """Write ``path`` whole (a reader never sees half of it), readable by this user only, in a directory nobody
    else may write (refused otherwise: ``mkdir``'s mode applies only to a directory it creates)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder = _open_private(path.parent, "directory")
    draft = f".{path.name}.{os.getpid()}"
    try:
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump({"address": list(address), **({"token": token} if token else {})}, out)
            os.replace(draft, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(draft, dir_fd=folder)
            raise
    finally:
        os.close(folder)


#: the most a rendezvous file may hold
_PUBLISHED_BYTES = 4096


def _read_file(path: Path) -> str:
    """The rendezvous file's text, from a directory and a file that are this user's alone (else LaunchError)."""
    folder = _open_private(path.parent, "directory")
    try:
        fd = _open_private(path, "file", dir_fd=folder)
    finally:
        os.close(folder)
    with os.fdopen(fd, "rb") as f:
        return f.read(_PUBLISHED_BYTES + 1).decode(errors="replace")


def _parse_published(path: Path, text: str, step: SlurmStep) -> tuple[tuple[str, int], str]:
    said = json.loads(text)
    if len(text) > _PUBLISHED_BYTES or not isinstance(said, dict):
        raise LaunchError(f"{path} is not a rendezvous file of bench (remove it)")
    address, token = said.get("address"), os.environ.get(TOKEN_VARIABLE) or said.get("token")
    if not (isinstance(address, list) and len(address) == 2 and isinstance(address[0], str)
            and type(address[1]) is int and 0 < address[1] < 65536):
        raise LaunchError(f"{path} is not a rendezvous file of bench: no address (remove it)")
    if not token or not isinstance(token, str):
        raise LaunchError(f"{path} gives no token and {TOKEN_VARIABLE} is not set: every task of step "
                          f"{step.name} needs the same {TOKEN_VARIABLE}, or none")
    return (address[0], address[1]), token


def _read_published(path: Path, step: SlurmStep) -> tuple[tuple[str, int], str]:
    """Task 0's address and token, once its file is there (at most :data:`JOIN_S`); a file or directory another
    user could have written is refused at once."""
    deadline = time.monotonic() + JOIN_S
    while True:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return _parse_published(path, _read_file(path), step)
        if time.monotonic() > deadline:
            raise LaunchError(f"task 0 of Slurm step {step.name} did not say where it listens within {JOIN_S:g} s "
                              f"(no {path}): is it running, and is {path.parent} shared by the step's nodes "
                              f"({', '.join(dict.fromkeys(step.nodes))})? Set {RENDEZVOUS_VARIABLE} to a "
                              "directory they share")
        time.sleep(0.05)


def _raise_on_stop_signals() -> dict[int, Any]:
    """SIGTERM and SIGHUP raise SystemExit here (the main thread), so that ``finally`` runs; the handlers before."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous[signum] = signal.signal(signum, _exit_on_signal)
    return previous


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


# -- the job's channel -------------------------------------------------------------------------


class SlurmChannel(JobChannel):
    """The step's channel: every task's authenticated connection to task 0 (see the module docstring)."""

    def __init__(self, step: SlurmStep, bind: str | None = None) -> None:
        self.step = step
        self.process = step.task
        self.world = step.tasks
        self.job = f"Slurm step {step.name}"
        self._peers: dict[int, Connection] = {}
        self._coordinator: Connection | None = None
        self._announced: queue.Queue[Any] = queue.Queue()
        self._ended = threading.Event()
        self._path = rendezvous_dir() / f"slurm-{step.name}"
        if self.process == 0:
            self.hostnames = self._gather_joiners(resolve_bind(bind, list(step.nodes)))
        else:
            self.hostnames = self._join()

    # task 0 ------------------------------------------------------------------------------------

    def _gather_joiners(self, address: str) -> list[str]:
        """Listen, say where, and wait for every other task of the step: their host names, in task order."""
        given = os.environ.get(TOKEN_VARIABLE)
        token = given or secrets.token_hex(16)
        hub = Hub((address, 0), token, self.world)
        previous = _raise_on_stop_signals()  # a task 0 stopped while it waits removes its file (finally below)
        try:
            _publish(self._path, hub.address, None if given else token)
            deadline = time.monotonic() + JOIN_S
            while len(self._peers) < self.world - 1:
                left = deadline - time.monotonic()
                try:
                    task, conn = hub.arrivals.get(timeout=max(0.0, min(left, 1.0)))
                except queue.Empty:
                    if left <= 0:
                        missing = [str(t) for t in range(1, self.world) if t not in self._peers]
                        raise LaunchError(f"task(s) {', '.join(missing)} of Slurm step {self.step.name} did not "
                                          f"join task 0 within {JOIN_S:g} s (did they start? can they reach "
                                          f"{address}? do they read {self._path}?)") from None
                    continue
                if task == 0 or task in self._peers:
                    conn.close()
                    continue
                self._peers[task] = conn
        except BaseException:
            self._close_peers()
            raise
        finally:
            hub.close()
            with contextlib.suppress(OSError):
                self._path.unlink()
            _restore_signals(previous)
        hostnames = [socket.gethostname()] + [self._receive(task) for task in range(1, self.world)]
        self.announce(hostnames)
        return hostnames

    def _receive(self, task: int) -> Any:
        conn = self._peers[task]
        try:
            if not conn.poll(JOIN_S):
                raise LaunchError(f"{self._who(task)} said nothing for {JOIN_S:g} s")
            said = channel_receive(conn)
        except (EOFError, OSError):
            raise LaunchError(f"{self._who(task)} is gone (its connection to task 0 closed)") from None
        problem = value_problem(said)
        if problem:
            raise LaunchError(f"{self._who(task)} sent what task 0 refuses ({problem})")
        return said

    def _who(self, task: int) -> str:
        """Task ``task`` as errors name it: the rank it serves in every run, and where it is."""
        return f"rank {task} (task {task} of Slurm step {self.step.name})"

    def announce(self, message: Any) -> None:
        gone = []
        for task, conn in self._peers.items():
            try:
                channel_send(conn, ["announce", message])
            except OSError:
                gone.append(self._who(task))
        if gone:  # every living task has the message all the same
            raise LaunchError(f"{', '.join(gone)} {'is' if len(gone) == 1 else 'are'} gone (the connection to task "
                              "0 closed)")

    def abort(self) -> None:
        for conn in self._peers.values():
            with contextlib.suppress(OSError):
                channel_send(conn, ["abort", None])

    def _close_peers(self) -> None:
        for conn in self._peers.values():
            conn.close()
        self._peers.clear()

    # the other tasks ---------------------------------------------------------------------------

    def _join(self) -> list[str]:
        address, token = _read_published(self._path, self.step)
        conn = connect(address, token)
        send_message(conn, Hello(self.process))
        channel_send(conn, socket.gethostname())
        self._coordinator = conn
        threading.Thread(target=self._listen, name="slurm-channel", daemon=True).start()
        return self.announcement()

    def _listen(self) -> None:
        """Hand announcements to the main thread; end this task when the job failed or its coordinator is gone."""
        assert self._coordinator is not None
        first = True
        try:
            while True:
                said = channel_receive(self._coordinator)
                kind, message = said if isinstance(said, list) and len(said) == 2 else (None, None)
                if kind == "abort":
                    break
                if kind != "announce":
                    problem: str | None = "not an announcement"
                elif first:  # the step's host names, in task order
                    problem = hostnames_problem(message, self.world)
                else:
                    problem = announcement_problem(message, self.world)
                first = False
                if problem:
                    print(f"bench: task {self.process} of Slurm step {self.step.name}: refused what the coordinator "
                          f"sent ({problem}); ending this task", file=sys.stderr, flush=True)
                    break
                self._announced.put(message)
                if message is None:
                    return
        except (EOFError, OSError, LaunchError):
            if self._ended.is_set():
                return
        print(f"bench: task {self.process} of Slurm step {self.step.name}: the coordinator (task 0) "
              "ended the job or is gone; ending this task", file=sys.stderr, flush=True)
        threading.Timer(END_GRACE_S, os._exit, args=(1,)).start()
        os.kill(os.getpid(), signal.SIGTERM)

    def announcement(self) -> Any:
        return self._announced.get()

    # both --------------------------------------------------------------------------------------

    def gather(self, value: str) -> list[str]:
        if self.process == 0:
            return [value] + [self._receive(task) for task in range(1, self.world)]
        assert self._coordinator is not None
        try:
            channel_send(self._coordinator, value)
        except OSError:
            raise LaunchError(f"task 0 of Slurm step {self.step.name} is gone") from None
        return []

    def start_hint(self, processes: int) -> str:
        return START_HINT.format(n=processes)

    def describe(self) -> dict[str, Any]:
        return {"slurm_job": self.step.job_id, "slurm_step": self.step.step_id, "nodes": list(self.step.nodes)}

    def close(self) -> None:
        self._ended.set()
        self._close_peers()
        if self._coordinator is not None:
            self._coordinator.close()
        with contextlib.suppress(OSError):
            self._path.unlink()


class SlurmLauncher(JobLauncher):
    """Ranks are the tasks of a Slurm step; task 0 coordinates."""

    name = "slurm"

    @classmethod
    def availability(cls) -> Availability:
        if in_step():
            return Availability(True, detail=f"a task of Slurm step {os.environ.get('SLURM_JOB_ID', '?')}."
                                             f"{os.environ.get('SLURM_STEP_ID') or os.environ.get('SLURM_STEPID')}")
        if not shutil.which("srun"):
            return Availability(False, "no srun here (run on a Slurm cluster's node, or apt install slurm-client)")
        return Availability(True, detail="run under srun -n N, or submit with --nodes N: sbatch "
                                         + ("found" if shutil.which("sbatch") else "not found"))

    def __init__(self, bind: str | None = None, log_dir: Path | None = None) -> None:
        step = SlurmStep.from_environment(os.environ)
        if step.task != 0:
            # a task told to end (its coordinator failed a run or is gone) closes its transports on the way out
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        super().__init__(SlurmChannel(step, bind), bind=bind, log_dir=log_dir)


# -- submitting a job --------------------------------------------------------------------------

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
