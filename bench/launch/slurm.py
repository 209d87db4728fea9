"""``--launcher slurm``: the ranks are the tasks of a Slurm step (``srun -n 4 bench ... --launcher slurm``).

No MPI is needed. Each task reads who it is from Slurm's variables (``slurm_step.py``: :class:`SlurmStep`:
``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``, ...). Task 0 is the
coordinator (see ``job.py``): it listens on its bind address with the job's token and writes where it listens into a
*rendezvous file* readable by the user only (``rendezvous.py``: ``$TENSOR_BENCH_RENDEZVOUS``, default
``~/.cache/tensor-bench/rendezvous``, which must be shared by the step's nodes: a home directory on a
cluster). The other tasks read it and join, each proving it knows the token (the token is in the file,
unless ``TENSOR_BENCH_TOKEN`` gives it to every task). Every wait is bounded and names who is missing.

The job's channel (this module) is then that star of connections. A task whose coordinator is gone, or which is told
the job failed, ends itself (SIGTERM, so that its transports close; a hard exit if that does not end it
within :data:`END_GRACE_S`): a failed rank ends the step, as ``MPI_Abort`` would.

Outside a step, ``bench ... --launcher slurm --nodes N`` submits the same command as a batch job
(``sbatch.py``: :func:`~bench.launch.sbatch.submit`; ``--dry-run`` prints the script) and follows its state until
it ends.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
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
from bench.launch.rendezvous import JOIN_S, publish, read_published, rendezvous_dir
from bench.launch.slurm_step import SlurmStep, in_step
from bench.launch.wire import send_message
from transports.common import Availability

#: seconds a task ended by its coordinator gets to close its transports before it exits hard
END_GRACE_S = 10.0
#: how a task that may not start a run learns it: the hint of a step too small
START_HINT = "srun -n {n} bench ... --launcher slurm (or --tasks {n} with --nodes to submit)"


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
            publish(self._path, hub.address, None if given else token)
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
        address, token = read_published(self._path, self.step)
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

