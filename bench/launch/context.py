"""The rank's side of a run: joining the coordinator's hub (:func:`connect`), what a job sees of its run
(:class:`RankContext`: the cluster, reports, messages to other ranks) and serving one rank's assignment
(:func:`serve_rank`, with its heartbeats)."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from bench.ground.memory import peak_rss_mb, reset_peak_rss
from bench.launch.messages import (
    HANDSHAKE_S,
    HEARTBEAT_S,
    TOKEN_VARIABLE,
    Alive,
    Assignment,
    Confirm,
    Confirmed,
    Failed,
    Finished,
    Hello,
    LaunchError,
    RankSpec,
    Relay,
    Report,
    Stop,
    describe_error,
    waited_on_others,
)
from bench.launch.wire import WireError, receive_message, send_message, socket_timeouts
from transports import Cluster

# -- the rank's side ----------------------------------------------------------------------------


def connect(address: str | tuple[str, int], token: str) -> Connection:
    """A connection to the coordinator's hub, authenticated both ways with ``token``."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(address)
            socket_timeouts(sock, HANDSHAKE_S)
            conn = Connection(os.dup(sock.fileno()))  # socket options belong to the socket, shared by the dup
            answer_challenge(conn, token.encode())
            deliver_challenge(conn, token.encode())
            socket_timeouts(sock, 0)
        except (OSError, EOFError, AuthenticationError) as exc:
            raise LaunchError(f"cannot join the run's coordinator at {address}: {exc}; is it running, "
                              f"and do both use the same {TOKEN_VARIABLE}?") from None
    return conn


class RankContext:
    """What a rank's job sees of the run: who it is, the cluster, and its line to the coordinator."""

    def __init__(self, conn: Connection, assignment: Assignment) -> None:
        self.rank = assignment.rank
        self.name = assignment.spec.name
        self.host = assignment.spec.host
        self.cluster = assignment.cluster
        self.size = assignment.cluster.size
        self.link_interface = assignment.link_interface
        self._conn = conn
        self._send_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._unconfirmed: dict[int, set[int]] = {}  # ticket -> the ranks that have not confirmed it yet
        self._confirmations = threading.Condition()
        self._tickets = 0

    def report(self, payload: Any) -> None:
        """Send a typed payload to the coordinator (it reaches the experiment's ``on_report``)."""
        self._send(Report(payload))

    def send_to(self, rank: int, payload: Any) -> None:
        """Send a payload to another rank of the run (through the coordinator)."""
        self._send(Relay(self.rank, rank, payload))

    def tell(self, ranks: list[int], payload: Any, timeout: float) -> None:
        """Send ``payload`` to each of ``ranks`` and return once it is in every one's inbox (their :meth:`poll` or
        :meth:`receive` then has it): what a rank does after this, the others know of before they next look.
        Their hub threads confirm it whatever their jobs are doing. Raises LaunchError naming the ranks that
        did not confirm within ``timeout``."""
        with self._confirmations:
            self._tickets += 1
            ticket = self._tickets
            self._unconfirmed[ticket] = set(ranks)
        for rank in ranks:
            self._send(Relay(self.rank, rank, Confirm(payload, ticket)))
        with self._confirmations:
            done = self._confirmations.wait_for(lambda: not self._unconfirmed[ticket], timeout)
            missing = sorted(self._unconfirmed.pop(ticket))
        if not done:
            raise LaunchError(f"rank {self.rank} ({self.name}): rank(s) {', '.join(map(str, missing))} did not "
                              f"confirm a message within {timeout:g} s")

    def _confirmed(self, ticket: int, rank: int) -> None:
        with self._confirmations:
            self._unconfirmed.get(ticket, set()).discard(rank)
            self._confirmations.notify_all()

    def receive(self, timeout: float | None = None) -> Any:
        """The next payload another rank sent here."""
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise LaunchError(f"rank {self.rank} ({self.name}) heard nothing from the other ranks "
                              f"within {timeout:g} s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def poll(self) -> Any | None:
        """The next payload another rank sent here, or None when none is waiting (never blocks)."""
        try:
            item = self._inbox.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def link_bytes(self) -> tuple[int, int] | None:
        """(tx, rx) bytes so far on this rank's link to the other hosts; None when it has no link of its own."""
        if self.link_interface is None:
            return None
        stats = f"/sys/class/net/{self.link_interface}/statistics"
        with open(f"{stats}/tx_bytes") as tx, open(f"{stats}/rx_bytes") as rx:
            return int(tx.read()), int(rx.read())

    def _send(self, message: Any) -> None:
        with self._send_lock:
            send_message(self._conn, message)


def serve_rank(conn: Connection, rank: int, in_own_process: bool) -> None:
    """A rank's life: say hello, take the assignment, run the job, report how it ended.

    ``in_own_process``: the process exists for this rank alone (local, netns), so it exits as soon
    as the coordinator is gone or asks a service to stop. Under MPI one process serves a rank of
    every run in turn, and the job runs in the calling thread.
    """
    send_message(conn, Hello(rank))
    try:
        assignment = receive_message(conn)
        if not isinstance(assignment, Assignment) or assignment.rank != rank \
                or not isinstance(assignment.spec, RankSpec) or not callable(assignment.spec.job) \
                or not isinstance(assignment.cluster, Cluster):
            raise WireError("the coordinator's first message is not this rank's assignment")
    except WireError as exc:  # said, so that the run names it rather than a death
        with contextlib.suppress(OSError):
            send_message(conn, Failed(describe_error(exc)))
        raise
    ctx = RankContext(conn, assignment)
    done = threading.Event()

    def listen() -> None:
        while True:
            try:
                message = receive_message(conn)
            except (EOFError, OSError, WireError):
                if not done.is_set():
                    if in_own_process:
                        os._exit(3)  # the coordinator is gone: nobody is left to report to
                    ctx._inbox.put(LaunchError(f"rank {rank}: the coordinator closed the run"))
                return
            if isinstance(message, Relay):
                payload = message.payload
                if isinstance(payload, Confirmed):
                    ctx._confirmed(payload.ticket, message.src)
                    continue
                if isinstance(payload, Confirm):
                    ctx._inbox.put(payload.payload)
                    with contextlib.suppress(OSError):
                        ctx._send(Relay(rank, message.src, Confirmed(payload.ticket)))
                    continue
                ctx._inbox.put(payload)
            elif isinstance(message, Stop):
                done.set()
                with contextlib.suppress(OSError):
                    ctx._send(Finished(None, peak_rss_mb()))
                if in_own_process:
                    os._exit(0)
                return

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            try:
                ctx._send(Alive())
            except OSError:
                return

    threading.Thread(target=listen, name=f"rank-{rank}-hub", daemon=True).start()
    threading.Thread(target=beat, name=f"rank-{rank}-heartbeat", daemon=True).start()
    reset_peak_rss()
    try:
        result = assignment.spec.job(ctx)
    except BaseException as exc:  # the coordinator decides what a failure means
        done.set()
        with contextlib.suppress(OSError):
            ctx._send(Failed(describe_error(exc), waited_on_others(exc)))
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return
    done.set()
    try:
        ctx._send(Finished(result, peak_rss_mb()))
    except WireError as exc:  # a result that cannot travel: said, naming what, rather than a death
        ctx._send(Failed(f"its result cannot go to the coordinator: {exc}"))


