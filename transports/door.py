"""A listener's door: one thread that accepts every connection and takes its proof of the run's token before the
connection costs anything more.

Written once for the run's listeners that speak their own protocol over a socket: the fabric's tcp stream listener
(``transports/fabric/stream.py``) and the coordinator's hub (``bench/launch/hub.py``). Each gives the door what to
send a newcomer (its challenge) and the exact bytes a member of the run answers; the door sends the one and reads
the other, never a byte past it, for every connection on its one thread. Until its proof a connection costs a
socket and a few dozen bytes: no thread, no buffer. At most ``cap`` connections wait for their proof at once (a
newcomer past that ends the oldest), each for ``handshake_s`` at most; every connection ended unproven is logged
with the caller's address (:class:`transports.auth.RefusalLog`, so a flood cannot fill the disk). A proven
connection, blocking again, goes to the listener's ``proven`` (which gives it a thread of its own).
"""

from __future__ import annotations

import contextlib
import hmac
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from transports.auth import RefusalLog

#: how long the door waits before accepting again when accept() fails (out of descriptors)
_RETRY_S = 0.05


class Door:
    """One thread accepting ``listening``'s connections and checking each one's proof (see the module's docstring).

    ``challenge()``: ``(what to send, the exact answer expected)`` for a new connection, or None to pass it on
    unchallenged. ``proven(connection, peer)``: takes a proven connection (blocking again). ``limits()``:
    ``(handshake_s, cap)``, read as they are needed.
    """

    def __init__(self, listening: socket.socket, name: str, challenge: Callable[[], tuple[bytes, bytes] | None],
                 proven: Callable[[socket.socket, str], None], refusals: RefusalLog,
                 limits: Callable[[], tuple[float, int]]) -> None:
        self._listening = listening
        self._challenge, self._proven, self._refusals, self._limits = challenge, proven, refusals, limits
        listening.setblocking(False)
        #: connections ended before their proof (counted before each ends: whoever sees it end sees it counted)
        self.unproven = 0
        self._closed = False
        self._bell, self._bell_rung = socket.socketpair()  # close() wakes the door through this pair
        self._bell.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listening, selectors.EVENT_READ)
        selector.register(self._bell, selectors.EVENT_READ)
        waiting: dict[socket.socket, _Unproven] = {}  # oldest first
        try:
            while not self._closed:
                # accepted in order, each given as long: the oldest is the first due
                timeout = max(0.0, next(iter(waiting.values())).deadline - time.monotonic()) if waiting else None
                for key, _ in selector.select(timeout):
                    if key.fileobj is self._listening:
                        self._admit(selector, waiting)
                    elif key.fileobj in waiting:  # (not the bell, nor one dropped since select returned)
                        self._hear(selector, waiting, waiting[key.fileobj])
                now = time.monotonic()
                while waiting and next(iter(waiting.values())).deadline <= now:
                    oldest = next(iter(waiting.values()))
                    self._refuse(selector, waiting, oldest,
                                 f"it did not prove the run's token within {oldest.allowed_s:g} s")
        finally:
            for connection in waiting:
                connection.close()
            selector.close()

    def _admit(self, selector: selectors.BaseSelector, waiting: dict[socket.socket, _Unproven]) -> None:
        """Accept what is queued: each connection is sent its challenge and waits here for its proof."""
        while not self._closed:
            try:
                connection, address = self._listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or closed: the door looks again a moment later
                time.sleep(_RETRY_S)
                return
            peer = peer_name(connection, address)
            challenge = self._challenge()
            if challenge is None:  # nothing to prove (not yet part of a run): passed on as it is
                connection.setblocking(True)
                self._proven(connection, peer)
                continue
            sent, expected = challenge
            try:
                connection.setblocking(False)
                if connection.send(sent) != len(sent):  # a new connection's buffer takes a few dozen bytes at once
                    raise OSError("the challenge did not go out whole")
            except OSError as exc:
                self.unproven += 1
                self._refusals.refused("a connection", peer, f"its challenge could not be sent ({exc})")
                connection.close()
                continue
            handshake_s, cap = self._limits()
            while len(waiting) >= max(1, cap):
                self._refuse(selector, waiting, next(iter(waiting.values())),
                             f"it was the oldest of {cap} connections awaiting their proof of the run's token "
                             "when another came")
            waiting[connection] = _Unproven(connection, peer, expected, handshake_s)
            selector.register(connection, selectors.EVENT_READ)

    def _hear(self, selector: selectors.BaseSelector, waiting: dict[socket.socket, _Unproven],
              entry: _Unproven) -> None:
        """Read what the connection sent of its proof (never a byte past it); proven, it is passed on."""
        try:
            count = entry.connection.recv_into(memoryview(entry.answer)[entry.got:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._refuse(selector, waiting, entry, f"the connection failed before its proof ({exc})")
            return
        if not count:
            self._refuse(selector, waiting, entry, "it closed the connection before proving the run's token")
            return
        entry.got += count
        if entry.got < len(entry.answer):
            return
        if not hmac.compare_digest(bytes(entry.answer), entry.expected):
            self._refuse(selector, waiting, entry, "its proof of the run's token is wrong")
            return
        selector.unregister(entry.connection)
        del waiting[entry.connection]
        entry.connection.setblocking(True)
        self._proven(entry.connection, entry.peer)

    def _refuse(self, selector: selectors.BaseSelector, waiting: dict[socket.socket, _Unproven], entry: _Unproven,
                why: str) -> None:
        selector.unregister(entry.connection)
        del waiting[entry.connection]
        self.unproven += 1  # counted before the connection ends: whoever sees it end sees it counted
        self._refusals.refused("a connection", entry.peer, why)
        entry.connection.close()

    def close(self) -> None:
        """Stop accepting; the connections still owing their proof end. The listening socket stays the owner's."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._bell_rung.send(b"x")
        self._thread.join(timeout=5)
        self._bell.close()
        self._bell_rung.close()


class _Unproven:
    """A connection the door has challenged: what it must answer, what it sent so far, until when it may."""

    __slots__ = ("allowed_s", "answer", "connection", "deadline", "expected", "got", "peer")

    def __init__(self, connection: socket.socket, peer: str, expected: bytes, allowed_s: float) -> None:
        self.connection, self.peer, self.expected, self.allowed_s = connection, peer, expected, allowed_s
        self.deadline = time.monotonic() + allowed_s
        self.answer = bytearray(len(expected))
        self.got = 0


_PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_name(connection: socket.socket, address: object) -> str:
    """The caller, for a log line: ``host:port`` (``[host]:port`` over IPv6), or over a Unix socket its process."""
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
    try:  # a Unix socket's caller has no address: its process id names it (Linux)
        pid, uid, _ = _PEER_CREDENTIALS.unpack(connection.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size))
        return f"local process {pid} (uid {uid})"
    except (AttributeError, OSError, struct.error):
        return "a local process"
