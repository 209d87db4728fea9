"""The coordinator's side of a run: the hub every rank joins, and :func:`coordinate`, which watches a run to its
end.

The ranks of a run, how they reach the coordinator, and what they tell it.

A *run* is a list of :class:`RankSpec`: what each rank runs (a callable that travels on the
run's channels, ``bench.launch.wire``: ``job(ctx) -> result``), a name for messages (``sender``, ``ps 1``), the
server (host) it belongs to, and whether it is a service that runs until it is stopped (a
``tf.distribute.Server``). A :class:`Launcher` starts the ranks its own way (processes here,
in network namespaces, under ``mpirun``) and hands every rank the run's :class:`Cluster`: one
address per rank and the run's token.

Every launcher then uses the same *hub*: the coordinator listens on one socket (a Unix socket in
a private directory when every rank runs on this machine, TCP on the bind address under MPI).
A rank connects, both sides prove they know the run's token (an HMAC challenge each way, before
anything is read; a stranger is logged with its address and dropped), the rank says which
rank it is and receives its :class:`Assignment`. Every message is data, never code (see "the wire" below:
a restricted decoder, bounded frames, types checked). From then on they exchange typed messages:
reports (progress, measurements), relayed messages between ranks, and at the end the rank's
result and its peak memory, or its error. The connection is also how each side learns that the
other is gone: a rank whose coordinator vanished exits at once, and a rank whose connection ends
before its result is reported as dead, by name. A run also ends, naming the ranks that have not
finished, when no rank has said anything for ``timeout_s``; every rank's process sends a heartbeat
meanwhile (which is not progress), so the one that stopped answering (stopped, or stuck holding
Python's lock) is named as the silent one, not the healthy ranks waiting on it.

When several ranks fail, one is the cause: a rank that died (its process ended without a word) before
any that failed, and of several deaths the one that came first (:func:`_died_first`);
then the first failure that is the rank's own, not a peer's that vanished or a wait that ran out; the others
follow it in the message ("; then ...").
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError, Pipe
from multiprocessing.connection import Connection, answer_challenge, wait
from typing import Any

from bench.launch.messages import (
    HANDSHAKE_S,
    HEARTBEAT_S,
    Alive,
    Assignment,
    Failed,
    Finished,
    Hello,
    LaunchError,
    RankFailed,
    RankResult,
    RankSpec,
    Relay,
    Report,
    Stop,
)
from bench.launch.wire import WireError, receive_message, send_message, socket_timeouts
from transports import Cluster
from transports.auth import RefusalLog
from transports.door import Door

log = logging.getLogger(__name__)

#: how often the coordinator looks at its ranks' processes while nothing is said
POLL_S = 0.2
#: seconds services get to report their peak memory once the others are done
STOP_GRACE_S = 30.0
#: seconds a rank's failure waits for another rank's death to show, which would be its cause
CAUSE_GRACE_S = 3.0
#: characters of a rank's error the coordinator keeps
ERROR_CHARS = 20_000
#: the most a caller's first message (its Hello) may hold
HELLO_BYTES = 4096
#: callers awaiting their proof of the token at once, at least (4 a rank in a larger run): a run's ranks connect once
#: each and prove the token as soon as its challenge is in, so only a flood of strangers ever fills these
MAX_UNPROVEN = 256
#: ``multiprocessing.connection``'s handshake, whose first half the door runs (``deliver_challenge``'s, legacy
#: HMAC-MD5, which every Python's ``answer_challenge`` takes): its words and the length of its challenge
_CHALLENGE, _WELCOME, _CHALLENGE_BYTES = b"#CHALLENGE#", b"#WELCOME#", 20


def _framed(message: bytes) -> bytes:
    """``message`` as ``Connection.send_bytes`` frames it: its length, 4 bytes big-endian, first."""
    return struct.pack("!i", len(message)) + message

# -- the coordinator's side ---------------------------------------------------------------------


class Hub:
    """The coordinator's listener: authenticates callers and hands over one connection per rank.

    Its door (``transports/door.py``, the fabric stream's too) takes every caller's proof of the token on one
    thread: a caller gets a thread of its own only once proven, at most ``max(MAX_UNPROVEN, 4 * ranks)`` wait at
    once (a run's ranks are never near that many at once: each connects once and answers the challenge at once),
    each for ``HANDSHAKE_S``, and each one ended unproven is logged by address, or by process over a Unix socket.
    The handshake is still ``multiprocessing.connection``'s, so a rank's :func:`bench.launch.context.connect` is
    unchanged: the door runs ``deliver_challenge``'s half, the caller's thread ``answer_challenge``'s.
    """

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
        where = address if isinstance(address, str) else f"{address[0]}:{self.address[1]}"
        # a caller costs a socket and a few dozen bytes until it proves the token; a thread only after
        self._door = Door(self._listener, "hub-door", self._challenge,
                          lambda sock, peer: threading.Thread(target=self._greet, args=(sock, peer), name="hub-greet",
                                                              daemon=True).start(),
                          RefusalLog(f"the run's coordinator at {where}", log),
                          lambda: (HANDSHAKE_S, max(MAX_UNPROVEN, 4 * ranks)))

    @property
    def wake(self) -> Connection:
        """Readable whenever a rank has arrived (for ``multiprocessing.connection.wait``)."""
        return self._wake_reader

    def _challenge(self) -> tuple[bytes, bytes]:
        """The first half of ``multiprocessing.connection``'s handshake, which :func:`bench.launch.context.connect`
        answers: a framed ``#CHALLENGE#`` and random bytes, whose framed HMAC under the token is the proof."""
        message = os.urandom(_CHALLENGE_BYTES)
        digest = hmac.new(self._token, message, "md5").digest()
        return _framed(_CHALLENGE + message), _framed(digest)

    def _greet(self, sock: socket.socket, peer: str) -> None:
        """A proven caller, on a thread of its own: welcomed, the coordinator proves the token in turn, and the
        caller says which rank it is."""
        try:
            socket_timeouts(sock, HANDSHAKE_S)
            conn = Connection(os.dup(sock.fileno()))
            try:
                conn.send_bytes(_WELCOME)
                answer_challenge(conn, self._token)
            except (AuthenticationError, EOFError, OSError) as exc:
                log.warning("dropped a connection to the run's coordinator from %s: it proved the run's token but "
                            "did not take the coordinator's proof (%s)", peer, type(exc).__name__)
                conn.close()
                return
            try:
                hello = receive_message(conn, limit=HELLO_BYTES)
            except WireError as exc:
                log.warning("dropped a connection from %s: %s", peer, exc)
                conn.close()
                return
            if not isinstance(hello, Hello) or type(hello.rank) is not int or not 0 <= hello.rank < self._ranks:
                log.warning("dropped a connection from %s: it did not introduce itself as a rank of the run", peer)
                conn.close()
                return
            socket_timeouts(sock, 0)
        except (OSError, EOFError):
            return
        finally:
            sock.close()  # the Connection holds its own descriptor
        self.arrivals.put((hello.rank, conn))
        with contextlib.suppress(OSError):
            self._wake_writer.send_bytes(b"!")

    @property
    def unproven(self) -> int:
        """Callers ended before they proved the run's token."""
        return self._door.unproven

    def close(self) -> None:
        self._closed = True
        self._door.close()
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
               on_report: Callable[[int, Any], None], exited: Callable[[], dict[int, Any]],
               link_interface: Callable[[RankSpec], str | None] = lambda spec: None,
               startup_s: float = 0.0) -> list[RankResult]:
    """Serve the run's ranks until every non-service rank has finished; returns every rank's result.

    ``exited()`` names the ranks whose process has ended (rank -> how, e.g. "exit code 1", or ``(how, when)``
    with the ``time.monotonic()`` it ended at, where the launcher knows it), as far as the launcher can tell.
    Raises :class:`RankFailed` naming the rank when one fails, dies before its result, or when no rank has
    said anything for ``timeout_s`` (``timeout_s + startup_s`` until the
    first report of the run: start-up, imports and connecting, may take longer than any later silence).
    """
    states = [_RankState(spec) for spec in ranks]
    by_conn: dict[Connection, int] = {}
    silence_s = timeout_s + startup_s
    deadline = time.monotonic() + silence_s
    try:
        while not all(s.result for s in states if not s.spec.service):
            for conn in wait([hub.wake, *by_conn], timeout=POLL_S):
                if conn is hub.wake:  # a rank that joins has said something too
                    _admit(hub, states, by_conn, cluster, link_interface)
                    deadline = time.monotonic() + silence_s
                    continue
                rank = by_conn[conn]
                try:
                    message = receive_message(conn)
                except WireError as exc:
                    raise RankFailed(rank, states[rank].spec.name, f"sent what the coordinator refuses: {exc}"
                                     ) from None
                except (EOFError, OSError):
                    del by_conn[conn]
                    conn.close()
                    if states[rank].result is None:
                        raise _died_first(rank, states, exited, on_report) from None
                    continue
                if isinstance(message, Report):
                    silence_s = timeout_s  # the run is under way
                if not isinstance(message, Alive):
                    deadline = time.monotonic() + silence_s
                _handle(rank, message, states, on_report)
                if states[rank].failure is not None:
                    raise _root_cause(states[rank].failure, states, exited, on_report) from None
            for rank in _exits(exited):
                if states[rank].result is None and not _has_unread(states[rank]):
                    raise _died_first(rank, states, exited, on_report)
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


def _root_cause(failed: RankFailed, states: list[_RankState], exited: Callable[[], dict[int, Any]],
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
                    _handle(states.index(state), receive_message(state.conn), states, on_report)
                except (EOFError, OSError, WireError):  # its end closed (a connection at its end reads as ready): gone
                    state.conn.close()
                    break
            if state.failure is not None and state.failure not in failures:
                failures.append(state.failure)
        for rank in _exits(exited):
            state = states[rank]
            if rank != failed.rank and state.result is None and state.failure is None and not _has_unread(state):
                died = _died_first(rank, states, exited, on_report)
                named = RankFailed(died.rank, died.name, "", "died")
                named.args = (f"{died}; then {failed}",)
                return named
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


def _exits(exited: Callable[[], dict[int, Any]]) -> dict[int, tuple[str, float | None]]:
    """``exited()`` as rank -> (how, when): a launcher may give the time.monotonic() its process ended with how
    (``(how, when)``); without it, when is None."""
    out: dict[int, tuple[str, float | None]] = {}
    for rank, said in exited().items():
        if isinstance(said, tuple) and len(said) == 2:
            out[rank] = (str(said[0]), float(said[1]))
        else:
            out[rank] = (str(said), None)
    return out


def _died_first(seen: int, states: list[_RankState], exited: Callable[[], dict[int, Any]],
                on_report: Callable[[int, Any], None] = lambda rank, payload: None,
                grace_s: float = CAUSE_GRACE_S, patience_s: float = 5.0) -> RankFailed:
    """Rank ``seen`` was seen gone: the death that came first, the others following it ("; then ...").

    One death often brings others (TensorFlow's chief crashes once a server it uses is killed), and the second may
    be seen first: a process killed with much memory takes a while to end, and several connections that close
    together are read in rank order. So every death waits ``grace_s`` for the others to show (and up to
    ``patience_s`` for how the first ended, which the launcher may learn after its connection closed), reading
    what the ranks say meanwhile. They are ordered by when each process ended, where the launcher tells it
    (``exited()`` giving ``(how, when)``); else by when each was seen gone (its connection closed, or the launcher
    saw it end), where deaths seen within one poll of each other are told apart by when each was last heard from
    (a rank that still spoke after another fell silent was alive after it)."""
    start = time.monotonic()
    seen_at: dict[int, float] = {seen: start}
    ended_at: dict[int, float] = {}
    hows: dict[int, str] = {}
    while True:
        now = time.monotonic()
        for rank, state in enumerate(states):  # what the others said before they went; their ends
            while rank not in seen_at and state.result is None and _has_unread(state):
                try:
                    _handle(rank, receive_message(state.conn), states, on_report)
                except (EOFError, OSError, WireError):
                    state.conn.close()
                    seen_at[rank] = now
        for rank, (how, when) in _exits(exited).items():
            state = states[rank]
            if state.result is None and (state.failure is None or rank == seen):
                seen_at.setdefault(rank, now)
                hows[rank] = how
                if when is not None:
                    ended_at[rank] = when
        waited = now - start
        if (waited > grace_s and all(r in hows for r in seen_at)) or waited > max(grace_s, patience_s):
            break
        time.sleep(0.05)
    dead = [r for r in seen_at if states[r].result is None and (states[r].failure is None or r == seen)]

    def order(rank: int) -> tuple[float, float, float]:
        if ended_at and all(r in ended_at for r in dead):
            return (ended_at[rank], 0.0, rank)
        heard = states[rank].heard_at
        # seen within one poll of the first seen: as good as together; then the one last heard from first
        together = seen_at[rank] - min(seen_at.values()) <= POLL_S + 0.05
        return (0.0 if together else seen_at[rank], heard if heard is not None else float("-inf"), rank)

    dead.sort(key=order)
    said = [f"rank {r} ({states[r].spec.name}) died ({hows.get(r, 'its connection to the coordinator closed')})"
            for r in dead]
    first = dead[0]
    named = RankFailed(first, states[first].spec.name, "", "died")
    named.args = ("; then ".join(said),)
    return named


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
        send_message(conn, Assignment(rank, state.spec, cluster, link_interface(state.spec)))
        for relay in state.pending:
            send_message(conn, relay)
        state.pending.clear()


def _handle(rank: int, message: Any, states: list[_RankState], on_report: Callable[[int, Any], None]) -> None:
    state = states[rank]
    state.heard_at = time.monotonic()
    if isinstance(message, Alive):
        return
    if isinstance(message, Report):
        on_report(rank, message.payload)
    elif isinstance(message, Relay):
        if type(message.dst) is not int or not 0 <= message.dst < len(states) or message.src != rank:
            raise RankFailed(rank, state.spec.name, f"sent a message to rank {str(message.dst)[:40]!r} as rank "
                             f"{str(message.src)[:40]!r}, which the coordinator refuses (a run of {len(states)} ranks)")
        target = states[message.dst]
        if target.result is not None:
            return  # it has finished: nobody will read the message
        if target.conn is None:
            target.pending.append(message)
        else:
            # it may be finishing (its result not read yet) or gone (its end of the line reports that): a message
            # it will never read is dropped, and the run goes on to read what it said last
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                send_message(target.conn, message)
    elif isinstance(message, Finished):
        peak = message.peak_rss_mb if isinstance(message.peak_rss_mb, int | float) else float("nan")
        state.result = RankResult(rank, state.spec.name, message.result, float(peak))
    elif isinstance(message, Failed):
        error = message.error if isinstance(message.error, str) else repr(message.error)
        state.failure = RankFailed(rank, state.spec.name, f"failed: {error[:ERROR_CHARS]}")
        state.failure.waited = message.waited is True
    else:
        raise RankFailed(rank, state.spec.name, f"sent a {type(message).__name__}, which is not a message of a rank")


def _stop_services(hub: Hub, states: list[_RankState], by_conn: dict[Connection, int], cluster: Cluster,
                   on_report: Callable[[int, Any], None], link_interface: Callable[[RankSpec], str | None]) -> None:
    """Ask every service to report its peak memory and exit (also one that connects only now)."""
    services = [i for i, s in enumerate(states) if s.spec.service and s.result is None]
    stopped: set[int] = set()
    end = time.monotonic() + STOP_GRACE_S
    while any(states[r].result is None for r in services) and time.monotonic() < end:
        for rank in services:
            if states[rank].conn is not None and rank not in stopped:
                stopped.add(rank)
                with contextlib.suppress(OSError):
                    send_message(states[rank].conn, Stop())
        waiting = [states[r].conn for r in services if states[r].conn is not None and states[r].result is None]
        for conn in wait([hub.wake, *waiting], timeout=POLL_S):
            if conn is hub.wake:
                _admit(hub, states, by_conn, cluster, link_interface)
                continue
            rank = by_conn[conn]
            try:
                _handle(rank, receive_message(conn), states, on_report)
            except WireError as exc:
                raise RankFailed(rank, states[rank].spec.name, f"sent what the coordinator refuses: {exc}") from None
            except (EOFError, OSError):  # gone without a word: its peak memory is unknown
                states[rank].result = RankResult(rank, states[rank].spec.name, None, float("nan"))
            if states[rank].failure is not None:
                raise states[rank].failure
    for rank in services:
        if states[rank].result is None:
            states[rank].result = RankResult(rank, states[rank].spec.name, None, float("nan"))


