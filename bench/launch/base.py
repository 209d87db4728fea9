"""The ranks of a run, how they reach the coordinator, and what they tell it.

A *run* is a list of :class:`RankSpec`: what each rank runs (a picklable callable
``job(ctx) -> result``), a name for messages (``sender``, ``ps 1``), the server (host) it
belongs to, and whether it is a service that runs until it is stopped (a
``tf.distribute.Server``). A :class:`Launcher` starts the ranks its own way (processes here,
in network namespaces, under ``mpirun``) and hands every rank the run's :class:`Cluster`: one
address per rank and the run's token.

Every launcher then uses the same *hub*: the coordinator listens on one socket (a Unix socket in
a private directory when every rank runs on this machine, TCP on the bind address under MPI).
A rank connects, both sides prove they know the run's token (an HMAC challenge each way, before
anything is unpickled; a stranger is logged with its address and dropped), the rank says which
rank it is and receives its :class:`Assignment`. From then on they exchange typed messages:
reports (progress, measurements), relayed messages between ranks, and at the end the rank's
result and its peak memory, or its error. The connection is also how each side learns that the
other is gone: a rank whose coordinator vanished exits at once, and a rank whose connection ends
before its result is reported as dead, by name. A run also ends, naming the ranks that have not
finished, when no rank has said anything for ``timeout_s``; every rank's process sends a heartbeat
meanwhile (which is not progress), so the one that stopped answering (stopped, or stuck holding
Python's lock) is named as the silent one, not the healthy ranks waiting on it.

When several ranks fail, one is the cause: a rank that died (its process ended without a word) before
any that failed; then the first failure that is the rank's own, not a peer's that vanished or a wait
that ran out; the others follow it in the message ("; then ...").
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError, Pipe
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Any, ClassVar

from bench.ground.memory import peak_rss_mb, reset_peak_rss
from transports import Cluster

log = logging.getLogger(__name__)

#: overrides the token a run generates (every rank of a run must use the same one)
TOKEN_VARIABLE = "TENSOR_BENCH_TOKEN"
#: seconds a connecting peer gets to prove it knows the token and say who it is
HANDSHAKE_S = 20.0
#: how often the coordinator looks at its ranks' processes while nothing is said
_POLL_S = 0.2
#: seconds services get to report their peak memory once the others are done
_STOP_GRACE_S = 30.0
#: seconds a rank's failure waits for another rank's death to show, which would be its cause
CAUSE_GRACE_S = 3.0
#: seconds between a rank process's heartbeats
HEARTBEAT_S = 1.0


class LaunchError(RuntimeError):
    """A run could not start or did not end well; the message names the rank and what to do."""


class RankFailed(LaunchError):
    """A rank failed (its job raised), died (its process ended first) or the run fell silent."""

    def __init__(self, rank: int, name: str, message: str, kind: str = "failed") -> None:
        super().__init__(f"rank {rank} ({name}) {message}")
        self.rank = rank
        self.name = name
        self.kind = kind
        self.waited = False  # a failure that followed from another rank's (see Failed)

    def with_log(self, tail: str) -> RankFailed:
        """The same failure, ending with the end of the rank's log."""
        if not tail:
            return self
        failed = RankFailed(self.rank, self.name, "", self.kind)
        failed.args = (f"{self}\n--- the end of rank {self.rank}'s log ---\n{tail}",)
        return failed


def run_token() -> str:
    """The run's token: ``TENSOR_BENCH_TOKEN`` when set, else a fresh random one."""
    return os.environ.get(TOKEN_VARIABLE) or secrets.token_hex(16)


@dataclass(frozen=True)
class RankSpec:
    """What one rank runs: ``job(ctx)`` in the rank's process; its result goes to the coordinator."""

    job: Callable[[RankContext], Any]
    name: str
    #: the server this rank belongs to: ranks of one server share an emulated host (netns)
    host: int = 0
    #: runs until stopped; the run ends when every other rank has finished
    service: bool = False


@dataclass(frozen=True)
class RankResult:
    """What one rank returned, and its process's peak resident memory over the run."""

    rank: int
    name: str
    result: Any
    peak_rss_mb: float


# -- messages on the hub --------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """rank -> coordinator, first: which rank is calling."""

    rank: int


@dataclass(frozen=True)
class Assignment:
    """coordinator -> rank: what to run, and the cluster it runs in."""

    rank: int
    spec: RankSpec
    cluster: Cluster
    #: the rank's network interface whose byte counters tell the traffic on its link (netns), if any
    link_interface: str | None = None


@dataclass(frozen=True)
class Report:
    """rank -> coordinator: a typed payload of the experiment's (progress, a measurement)."""

    payload: Any


@dataclass(frozen=True)
class Relay:
    """rank -> coordinator -> rank ``dst``: a payload for another rank (a ready signal)."""

    src: int
    dst: int
    payload: Any


@dataclass(frozen=True)
class Confirm:
    """A relayed payload whose arrival the receiving rank's hub thread confirms at once (:class:`Confirmed`),
    whatever its job is doing (:meth:`RankContext.tell`)."""

    payload: Any
    ticket: int


@dataclass(frozen=True)
class Confirmed:
    """The answer to :class:`Confirm`: ``ticket``'s payload is in this rank's inbox."""

    ticket: int


@dataclass(frozen=True)
class Finished:
    """rank -> coordinator, last: the job's result and the process's peak memory."""

    result: Any
    peak_rss_mb: float


@dataclass(frozen=True)
class Failed:
    """rank -> coordinator, last: the job raised.

    ``waited``: the error is a consequence of another rank (a peer that vanished or refused, a wait that ran
    out), so another rank's own failure, if there is one, is the cause.
    """

    error: str
    waited: bool = False


@dataclass(frozen=True)
class Alive:
    """rank -> coordinator, every HEARTBEAT_S: the rank's process is running (not progress)."""


@dataclass(frozen=True)
class Stop:
    """coordinator -> service rank: report your peak memory and exit."""


# -- process helpers --------------------------------------------------------------------------


def waited_on_others(exc: BaseException) -> bool:
    """Whether a job's error is a consequence of another rank: a peer that failed, vanished or timed out."""
    from transports import PeerError, TransportClosed, TransportTimeout

    return isinstance(exc, PeerError | TransportTimeout | TransportClosed | TimeoutError) or (
        isinstance(exc, LaunchError) and not isinstance(exc, RankFailed))


def describe_error(exc: BaseException) -> str:
    """``Type: message (at file:line)`` of the innermost frame."""
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel send/receive timeouts on a blocking socket (0: none); a Connection over it then cannot hang."""
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


# -- the rank's side ----------------------------------------------------------------------------


def connect(address: str | tuple[str, int], token: str) -> Connection:
    """A connection to the coordinator's hub, authenticated both ways with ``token``."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(address)
            _timeouts(sock, HANDSHAKE_S)
            conn = Connection(os.dup(sock.fileno()))  # socket options belong to the socket, shared by the dup
            answer_challenge(conn, token.encode())
            deliver_challenge(conn, token.encode())
            _timeouts(sock, 0)
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
            self._conn.send(message)


def serve_rank(conn: Connection, rank: int, in_own_process: bool) -> None:
    """A rank's life: say hello, take the assignment, run the job, report how it ended.

    ``in_own_process``: the process exists for this rank alone (local, netns), so it exits as soon
    as the coordinator is gone or asks a service to stop. Under MPI one process serves a rank of
    every run in turn, and the job runs in the calling thread.
    """
    conn.send(Hello(rank))
    assignment: Assignment = conn.recv()
    ctx = RankContext(conn, assignment)
    done = threading.Event()

    def listen() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
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
    ctx._send(Finished(result, peak_rss_mb()))


# -- the coordinator's side ---------------------------------------------------------------------


class Hub:
    """The coordinator's listener: authenticates callers and hands over one connection per rank."""

    def __init__(self, address: str | tuple[str, int], token: str, ranks: int) -> None:
        self._token = token.encode()
        self._ranks = ranks
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind(address)
            self._listener.listen(max(16, ranks))
        except OSError as exc:
            self._listener.close()
            raise LaunchError(f"the coordinator cannot listen on {address}: {exc}") from None
        self.address = self._listener.getsockname()
        self.arrivals: queue.Queue[tuple[int, Connection]] = queue.Queue()
        self._wake_reader, self._wake_writer = Pipe(duplex=False)
        self._closed = False
        self._accepting = threading.Thread(target=self._accept, name="hub-accept", daemon=True)
        self._accepting.start()

    @property
    def wake(self) -> Connection:
        """Readable whenever a rank has arrived (for ``multiprocessing.connection.wait``)."""
        return self._wake_reader

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(sock, peer), name="hub-greet", daemon=True).start()

    def _greet(self, sock: socket.socket, peer: Any) -> None:
        who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a local process"
        try:
            _timeouts(sock, HANDSHAKE_S)
            conn = Connection(os.dup(sock.fileno()))
            try:
                deliver_challenge(conn, self._token)
                answer_challenge(conn, self._token)
            except (AuthenticationError, EOFError, OSError) as exc:
                log.warning("refused a connection to the run's coordinator from %s: it did not prove it knows "
                            "the run's token (%s)", who, type(exc).__name__)
                conn.close()
                return
            hello = conn.recv()
            if not isinstance(hello, Hello) or not 0 <= hello.rank < self._ranks:
                log.warning("dropped a connection from %s: it did not introduce itself as a rank of the run", who)
                conn.close()
                return
            _timeouts(sock, 0)
        except (OSError, EOFError):
            return
        finally:
            sock.close()  # the Connection holds its own descriptor
        self.arrivals.put((hello.rank, conn))
        with contextlib.suppress(OSError):
            self._wake_writer.send_bytes(b"!")

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if isinstance(self.address, str):
            with contextlib.suppress(OSError):
                os.unlink(self.address)
        self._wake_reader.close()
        self._wake_writer.close()


@dataclass
class _RankState:
    spec: RankSpec
    conn: Connection | None = None
    result: RankResult | None = None
    pending: list[Relay] = field(default_factory=list)  # relayed before the rank connected
    heard_at: float | None = None  # time.monotonic() of its last message, heartbeats included
    failure: RankFailed | None = None  # its job raised (the run ends; one failure is named the cause)


def coordinate(hub: Hub, ranks: list[RankSpec], cluster: Cluster, timeout_s: float,
               on_report: Callable[[int, Any], None], exited: Callable[[], dict[int, str]],
               link_interface: Callable[[RankSpec], str | None] = lambda spec: None,
               startup_s: float = 0.0) -> list[RankResult]:
    """Serve the run's ranks until every non-service rank has finished; returns every rank's result.

    ``exited()`` names the ranks whose process has ended (rank -> how, e.g. "exit code 1"), as far as
    the launcher can tell. Raises :class:`RankFailed` naming the rank when one fails, dies before its
    result, or when no rank has said anything for ``timeout_s`` (``timeout_s + startup_s`` until the
    first report of the run: start-up, imports and connecting, may take longer than any later silence).
    """
    states = [_RankState(spec) for spec in ranks]
    by_conn: dict[Connection, int] = {}
    silence_s = timeout_s + startup_s
    deadline = time.monotonic() + silence_s
    try:
        while not all(s.result for s in states if not s.spec.service):
            for conn in wait([hub.wake, *by_conn], timeout=_POLL_S):
                if conn is hub.wake:  # a rank that joins has said something too
                    _admit(hub, states, by_conn, cluster, link_interface)
                    deadline = time.monotonic() + silence_s
                    continue
                rank = by_conn[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    del by_conn[conn]
                    if states[rank].result is None:
                        how = _await_exit(exited, rank)
                        raise RankFailed(rank, states[rank].spec.name, f"died ({how})", "died") from None
                    continue
                if isinstance(message, Report):
                    silence_s = timeout_s  # the run is under way
                if not isinstance(message, Alive):
                    deadline = time.monotonic() + silence_s
                _handle(rank, message, states, on_report)
                if states[rank].failure is not None:
                    raise _root_cause(states[rank].failure, states, exited, on_report) from None
            for rank, how in exited().items():
                if states[rank].result is None and not _has_unread(states[rank]):
                    raise RankFailed(rank, states[rank].spec.name, f"died ({how})", "died")
            if time.monotonic() > deadline:
                raise _fell_silent(states, silence_s)
        _stop_services(hub, states, by_conn, cluster, on_report, link_interface)
    finally:
        for conn in list(by_conn):
            conn.close()
    return [s.result for s in states]


def _fell_silent(states: list[_RankState], silence_s: float) -> RankFailed:
    """No progress for ``silence_s``: name the rank whose process stopped answering, else the first still running.

    A rank whose heartbeats stopped too (stopped, or stuck holding Python's lock) is what the others wait on;
    when every process still beats, nobody is at fault alone (a deadlock, or a wait longer than the timeout).
    """
    now = time.monotonic()
    running = [i for i, s in enumerate(states) if s.result is None and not s.spec.service]
    still = ", ".join(f"rank {i} ({states[i].spec.name})" for i in running)
    quiet = [(now - s.heard_at, i) for i, s in enumerate(states)
             if s.result is None and s.heard_at is not None and now - s.heard_at > max(3 * HEARTBEAT_S, silence_s / 2)]
    if quiet:
        age, rank = max(quiet)
        return RankFailed(rank, states[rank].spec.name,
                          f"stopped answering: nothing from its process for {age:.0f} s (stopped, or hung "
                          f"holding Python's lock?), and no rank made progress for {silence_s:g} s "
                          f"(still running: {still})", "silent")
    return RankFailed(running[0], states[running[0]].spec.name,
                      f"did not finish: no rank said anything for {silence_s:g} s (still running: {still})",
                      "silent")


def _root_cause(failed: RankFailed, states: list[_RankState], exited: Callable[[], dict[int, str]],
                on_report: Callable[[int, Any], None] = lambda rank, payload: None,
                grace_s: float = CAUSE_GRACE_S) -> RankFailed:
    """One failure, one cause: a rank that died, else the first failure that is a rank's own; the rest follow.

    A rank that died is the cause of the others' failures (they fail when their peer is gone). A killed process
    closes its sockets before the kernel reports it dead (its memory, then its files, then its exit), and a big
    process on a busy machine takes a while over it: its peers can fail and say so before it is seen to be
    gone (and a failure that looks like a rank's own, a library's "connection reset", may be one). So every
    failure waits up to ``grace_s`` for a death to show, reading meanwhile what the others say. A rank whose
    process ended after it said it failed (exit code 0) did not die: what it said is read first.
    """
    failures = [failed]
    end = time.monotonic() + grace_s
    while True:
        for state in states:  # what the others said before they went: their failures
            while state.failure is None and state.result is None and _has_unread(state):
                try:
                    _handle(states.index(state), state.conn.recv(), states, on_report)
                except (EOFError, OSError):  # its end closed (a connection at its end reads as ready): gone
                    state.conn.close()
                    break
            if state.failure is not None and state.failure not in failures:
                failures.append(state.failure)
        for rank, how in exited().items():
            state = states[rank]
            if rank != failed.rank and state.result is None and state.failure is None and not _has_unread(state):
                return RankFailed(rank, state.spec.name, f"died ({how}); then {failed}", "died")
        if time.monotonic() > end:  # no death showed: the first failure of a rank's own, else the first
            own = [f for f in failures if not f.waited]
            cause = (own or failures)[0]
            then = "".join(f"; then {f}" for f in failures if f is not cause)
            if not then:
                return cause
            named = RankFailed(cause.rank, cause.name, "", cause.kind)
            named.args = (f"{cause}{then}",)
            named.waited = cause.waited
            return named
        time.sleep(0.05)


def _has_unread(state: _RankState) -> bool:
    return state.conn is not None and not state.conn.closed and state.conn.poll()


def _await_exit(exited: Callable[[], dict[int, str]], rank: int, patience_s: float = 5.0) -> str:
    """How the rank's process ended, once the launcher can tell (its connection closed first)."""
    end = time.monotonic() + patience_s
    while time.monotonic() < end:
        how = exited().get(rank)
        if how:
            return how
        time.sleep(0.05)
    return "its connection to the coordinator closed"


def _admit(hub: Hub, states: list[_RankState], by_conn: dict[Connection, int], cluster: Cluster,
           link_interface: Callable[[RankSpec], str | None]) -> None:
    with contextlib.suppress(OSError):
        while hub.wake.poll():
            hub.wake.recv_bytes()
    while True:
        try:
            rank, conn = hub.arrivals.get_nowait()
        except queue.Empty:
            return
        state = states[rank]
        if state.conn is not None:
            log.warning("dropped a second connection claiming to be rank %d", rank)
            conn.close()
            continue
        state.conn = conn
        by_conn[conn] = rank
        conn.send(Assignment(rank, state.spec, cluster, link_interface(state.spec)))
        for relay in state.pending:
            conn.send(relay)
        state.pending.clear()


def _handle(rank: int, message: Any, states: list[_RankState], on_report: Callable[[int, Any], None]) -> None:
    state = states[rank]
    state.heard_at = time.monotonic()
    if isinstance(message, Alive):
        return
    if isinstance(message, Report):
        on_report(rank, message.payload)
    elif isinstance(message, Relay):
        target = states[message.dst]
        if target.result is not None:
            return  # it has finished: nobody will read the message
        if target.conn is None:
            target.pending.append(message)
        else:
            # it may be finishing (its result not read yet) or gone (its end of the line reports that): a message
            # it will never read is dropped, and the run goes on to read what it said last
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                target.conn.send(message)
    elif isinstance(message, Finished):
        state.result = RankResult(rank, state.spec.name, message.result, message.peak_rss_mb)
    elif isinstance(message, Failed):
        state.failure = RankFailed(rank, state.spec.name, f"failed: {message.error}")
        state.failure.waited = message.waited


def _stop_services(hub: Hub, states: list[_RankState], by_conn: dict[Connection, int], cluster: Cluster,
                   on_report: Callable[[int, Any], None], link_interface: Callable[[RankSpec], str | None]) -> None:
    """Ask every service to report its peak memory and exit (also one that connects only now)."""
    services = [i for i, s in enumerate(states) if s.spec.service and s.result is None]
    stopped: set[int] = set()
    end = time.monotonic() + _STOP_GRACE_S
    while any(states[r].result is None for r in services) and time.monotonic() < end:
        for rank in services:
            if states[rank].conn is not None and rank not in stopped:
                stopped.add(rank)
                with contextlib.suppress(OSError):
                    states[rank].conn.send(Stop())
        waiting = [states[r].conn for r in services if states[r].conn is not None and states[r].result is None]
        for conn in wait([hub.wake, *waiting], timeout=_POLL_S):
            if conn is hub.wake:
                _admit(hub, states, by_conn, cluster, link_interface)
                continue
            rank = by_conn[conn]
            try:
                _handle(rank, conn.recv(), states, on_report)
            except (EOFError, OSError):  # gone without a word: its peak memory is unknown
                states[rank].result = RankResult(rank, states[rank].spec.name, None, float("nan"))
            if states[rank].failure is not None:
                raise states[rank].failure
    for rank in services:
        if states[rank].result is None:
            states[rank].result = RankResult(rank, states[rank].spec.name, None, float("nan"))


# -- launchers ------------------------------------------------------------------------------------


class Launcher(ABC):
    """Starts the ranks of runs, one run at a time, and tells how it went."""

    name: ClassVar[str]
    #: whether this process coordinates (writes results); under MPI only rank 0 does
    is_coordinator: ClassVar[bool] = True
    #: whether every host of a run is private: its ranks' listeners out of the host network's reach (netns)
    private_hosts: ClassVar[bool] = False
    #: whether it starts the ranks' processes itself (local, netns), rather than finding them started (mpi)
    starts_processes: ClassVar[bool] = True

    @abstractmethod
    def run(self, ranks: list[RankSpec], timeout_s: float, on_report: Callable[[int, Any], None] | None = None,
            label: str = "run", startup_s: float = 0.0) -> list[RankResult]:
        """Run ``ranks`` to the end: every rank's result (in rank order) on the coordinator, [] elsewhere.

        ``timeout_s``: the longest the ranks may all stay silent, ``startup_s`` more until the run's
        first report. ``label`` names the run's logs.
        Raises :class:`RankFailed` naming the rank when one fails or dies; no process of the run is
        left behind either way.
        """

    @classmethod
    def availability(cls) -> str:
        """Whether it can run here, in one line for ``bench info`` (``available ...`` or ``not available: why``),
        found without starting anything."""
        return "available"

    def fabric_transport(self, requested: str) -> str:
        """The UCX transports the fabric must use under this launcher (netns: tcp, whatever was asked)."""
        return requested

    def describe(self) -> dict[str, Any]:
        """How ranks run, for ``meta.json``."""
        return {"launcher": self.name}

    def close(self) -> None:  # noqa: B027 (most launchers hold nothing across runs)
        """Release what the launcher holds across runs."""

    def end_process(self, status: int) -> None:  # noqa: B027 (a launcher that starts its ranks leaves it be)
        """Called once the command is over and the launcher closed: a launcher whose processes are a job's ends
        this one here with ``status``; the others return."""

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
