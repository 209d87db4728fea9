"""The fabric's TCP data path: one-sided writes and reads over a stream, checked where the memory is.

UCX's tcp transport cannot be made to check: its target copies a put to whatever address the request names,
with an empty remote key (``uct_tcp_ep_handle_put_req`` in UCX's src/uct/tcp/tcp_ep.c), whatever
``UCX_TCP_PUT_ENABLE`` or the context's features say, so any process that reaches its listener writes
anywhere in the process. The fabric therefore never opens UCX's tcp; over TCP it carries one-sided
operations itself:

- A device listens on one address of the cluster's interfaces (loopback unless told otherwise). Once the run's
  token is set (:meth:`StreamListener.require_token`), a connection proves it first: the listener sends a nonce,
  the connector answers with its HMAC-SHA256 under the token, and a wrong answer ends the connection before any
  request is read. Until its proof, a connection costs a socket and a few dozen bytes, nothing more: one thread
  (the listener's door, ``transports/door.py``, the coordinator's hub's too) accepts and challenges every
  connection, at most :data:`MAX_UNPROVEN` wait for their proof at once (a newcomer past that ends the oldest),
  each for :data:`HANDSHAKE_S` at most, and each refusal is logged with the caller's address. A connection's
  thread and its receive buffer come with its proof.
- A region's remote key over TCP is a capability: 16 random bytes made when the region is first exported
  (:class:`Grants`). The pool keeps what one peer is given to that peer's slots and trailers, so a key names
  exactly what its holder was granted.
- Every request names a key, an address and a length. The target's connection thread looks the key up and
  checks that the range lies inside that key's region before it touches memory. A request that fails the
  check touches nothing, and the writer's next flush reports the refusal. An unknown key is refused the same way,
  so a process outside the run that connects reaches nothing.

Requests on one connection are served in order by one thread: a flush's answer means every write before it is in
the target's memory. A write followed by a trailer is therefore seen data first, then flag (x86 stores are seen in
order). Waits stay the device's own: they poll the flags and counters these threads write, and a waiter asleep
is woken by the thread after each write it lands.

One module: the listener and the channel are the two ends of one wire protocol (the challenge and
its proof, the request and answer structs, the refusals a channel reads back), read side by side; each end checks
what the other may send, and a change to one is a change to both.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from transports.auth import RefusalLog
from transports.common import done_future
from transports.door import Door
from transports.fabric.base import (
    Channel,
    FabricError,
    FabricInterrupted,
    FabricTimeout,
    RemoteRegion,
)
from transports.fabric.plans import CounterPlan, SendPlan

#: a remote key over TCP: a capability this long, random
KEY_BYTES = 16
#: a request: operation, key, the target's address, the length
_REQUEST = struct.Struct("<B3x16sQQ")
#: an answer to a flush or a read: status (0 ok), then the length of the reason that follows
_ANSWER = struct.Struct("<BI")
_WRITE, _READ, _FLUSH, _NOTIFY = 1, 2, 3, 4
#: the longest reason a target sends back (its own words; cut)
MAX_REASON = 512
#: what a connection's thread receives at once: requests and the payloads of small writes
_INBOX_BYTES = 256 * 1024
#: how often a blocked send or receive looks at the device's stop flag
_POLL_S = 0.05
_ADDRESS_PREFIX = b"tcp-stream:"
#: the listener's challenge, and the connector's answer (HMAC-SHA256 of it under the run's token)
_NONCE_BYTES = 16
_PROOF_BYTES = 32
#: how long a connection has to prove the token (the run's ranks prove it as soon as the nonce is in)
HANDSHAKE_S = 10.0
#: connections awaiting their proof at once; a newcomer past these ends the oldest
MAX_UNPROVEN = 64


def _proof(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), b"tensor-bench fabric stream " + nonce, hashlib.sha256).digest()


def stream_address(host: str, port: int) -> bytes:
    """A device's address over TCP, as peers receive it on the control path."""
    return _ADDRESS_PREFIX + f"{host}:{port}".encode()


def parse_stream_address(address: bytes) -> tuple[str, int]:
    """``(host, port)`` of a peer's stream address; FabricError says what is wrong with a malformed one."""
    if not isinstance(address, bytes) or not address.startswith(_ADDRESS_PREFIX) or len(address) > 300:
        raise FabricError("a peer's TCP fabric address is malformed (not one this fabric wrote)")
    host, _, port = address[len(_ADDRESS_PREFIX):].decode(errors="replace").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FabricError(f"a peer's TCP fabric address '{address[:80]!r}' names no host and port")
    return host, int(port)


class Grants:
    """What this device exported over TCP: key -> the region's bytes. Looked up by the connection threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[bytes, np.ndarray] = {}

    def grant(self, array: np.ndarray) -> bytes:
        """A new key for ``array`` (a region's uint8 bytes): peers holding it reach those bytes and no others."""
        key = secrets.token_bytes(KEY_BYTES)
        with self._lock:
            self._regions[key] = array
        return key

    def revoke(self, key: bytes) -> None:
        with self._lock:
            self._regions.pop(key, None)

    def count(self) -> int:
        with self._lock:
            return len(self._regions)

    def reach(self, key: bytes, addr: int, nbytes: int) -> np.ndarray | str:
        """The bytes ``[addr, addr + nbytes)`` of the region ``key`` grants, or why the access is refused."""
        with self._lock:
            array = self._regions.get(key)
        if array is None:
            return "a remote key this process never granted (or has revoked)"
        start = array.ctypes.data
        if addr < start or addr + nbytes > start + array.nbytes:
            return (f"[{addr:#x}, +{nbytes}) lies outside the region its remote key grants "
                    f"([{start:#x}, +{array.nbytes}))")
        return array[addr - start: addr - start + nbytes]


class StreamListener:
    """A device's TCP listener: one thread (the door) accepts every connection and takes its proof of the run's token,
    then one thread per proven connection serves its requests in order."""

    def __init__(self, host: str, grants: Grants, wake: Callable[[], None]) -> None:
        self.grants = grants
        #: wakes the device's sleeping waiters: called after every write that landed, and for a doorbell
        self._wake = wake
        self._socket = socket.create_server((host, 0), backlog=64)
        self._socket.setblocking(False)
        self.address = stream_address(host, self._socket.getsockname()[1])
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        #: the proven connections' threads (close() waits for them)
        self._servers: list[threading.Thread] = []
        self._closed = False
        #: accesses refused (each a request that touched nothing)
        self.refused = 0
        self._token: str | None = None
        self._refusals = RefusalLog(f"fabric tcp stream at {self.address[len(_ADDRESS_PREFIX):].decode()}")
        # (the limits are read as the door needs them: module attributes a test may set)
        self._door = Door(self._socket, "fabric-tcp-door", self._challenge, lambda connection, peer:
                          self._serve_proven(connection), self._refusals, lambda: (HANDSHAKE_S, MAX_UNPROVEN))

    @property
    def unproven(self) -> int:
        """Connections ended before their first request for want of the run's token."""
        return self._door.unproven

    def require_token(self, token: str) -> None:
        """From now on a connection proves ``token`` (the run's) before anything it sends is read."""
        self._token = token

    def _challenge(self) -> tuple[bytes, bytes] | None:
        """The door's challenge to a newcomer (a nonce) and the proof it must answer; None before a token is set."""
        token = self._token
        if token is None:
            return None
        nonce = secrets.token_bytes(_NONCE_BYTES)
        return nonce, _proof(token, nonce)

    def _serve_proven(self, connection: socket.socket) -> None:
        """A thread of its own for the connection, from now on."""
        with self._lock:
            if self._closed:
                connection.close()
                return
            connection.setblocking(True)
            self._connections.append(connection)
            server = threading.Thread(target=self._serve, args=(connection,), name="fabric-tcp-serve", daemon=True)
            self._servers = [thread for thread in self._servers if thread.is_alive()] + [server]
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server.start()  # under the lock: close() joins only started threads

    def _serve(self, connection: socket.socket) -> None:
        inbox = _Inbox(connection)
        refusal: str | None = None  # the first refusal since the last flush
        landed = False  # a write landed (or a doorbell came) since the waiters were last woken
        try:
            while True:
                if landed and not inbox.pending():  # the batch that came in one piece is done: wake once
                    self._wake()
                    landed = False
                if not inbox.fill(_REQUEST.size):
                    return
                op, key, addr, nbytes = _REQUEST.unpack(inbox.take(_REQUEST.size))
                if op in (_WRITE, _READ):
                    reached = self.grants.reach(key, addr, nbytes)
                    if isinstance(reached, str):
                        with self._lock:
                            self.refused += 1
                        if op == _WRITE:
                            inbox.discard(nbytes)
                            refusal = refusal or f"a write of {reached}"
                        else:
                            _answer(connection, f"a read of {reached}")
                    elif op == _WRITE:
                        if not inbox.into(memoryview(reached)):
                            return
                        landed = True
                    else:
                        connection.sendall(_ANSWER.pack(0, 0))
                        connection.sendall(memoryview(reached))
                elif op == _FLUSH:
                    if landed:
                        self._wake()
                        landed = False
                    _answer(connection, refusal)
                    refusal = None
                elif op == _NOTIFY:
                    landed = True
                else:
                    return  # not this fabric's protocol: the connection ends
        except OSError:
            return
        finally:
            with self._lock:
                if connection in self._connections:
                    self._connections.remove(connection)
            connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        self._door.close()  # the door closes the connections still owing their proof
        self._socket.close()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        # each connection's thread closes its socket and writes into registered memory until it ends: it ends
        # before the device releases that memory, and no descriptor of it outlives close()
        with self._lock:
            servers = list(self._servers)
        for server in servers:
            if server is not threading.current_thread():
                server.join(timeout=5)


def _receive_into(connection: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from the connection; False when it ended first."""
    got = 0
    while got < len(view):
        count = connection.recv_into(view[got:])
        if not count:
            return False
        got += count
    return True


class _Inbox:
    """What a connection sent, received in large pieces: the requests of a small write with its trailer and flush
    come in one receive, not one per field; a large payload goes from the socket straight into its target."""

    def __init__(self, connection: socket.socket, size: int = _INBOX_BYTES) -> None:
        self.connection = connection
        self.view = memoryview(bytearray(size))
        self.start = self.end = 0

    def pending(self) -> int:
        return self.end - self.start

    def fill(self, least: int) -> bool:
        """Until ``least`` bytes (at most the inbox's size) are here; False when the connection ended first."""
        if self.end - self.start >= least:
            return True
        if len(self.view) - self.start < least:  # move what is here to the front, to make room behind it
            count = self.end - self.start
            self.view[:count] = self.view[self.start:self.end]
            self.start, self.end = 0, count
        while self.end - self.start < least:
            count = self.connection.recv_into(self.view[self.end:])
            if not count:
                return False
            self.end += count
        return True

    def take(self, count: int) -> memoryview:
        """The next ``count`` bytes here (valid until the next call)."""
        taken = self.view[self.start:self.start + count]
        self.start += count
        return taken

    def into(self, target: memoryview) -> bool:
        """Fill ``target``: what is here first, the rest straight from the connection; False if it ended first."""
        count = min(len(target), self.end - self.start)
        target[:count] = self.view[self.start:self.start + count]
        self.start += count
        if self.start == self.end:
            self.start = self.end = 0
        return count == len(target) or _receive_into(self.connection, target[count:])

    def discard(self, nbytes: int) -> None:
        count = min(nbytes, self.end - self.start)
        self.start += count
        if self.start == self.end:
            self.start = self.end = 0
        _discard(self.connection, nbytes - count)


def _discard(connection: socket.socket, nbytes: int) -> None:
    scratch = bytearray(min(nbytes, 1 << 20) or 1)
    while nbytes:
        count = connection.recv_into(scratch, min(nbytes, len(scratch)))
        if not count:
            raise OSError("the connection ended")
        nbytes -= count


def _answer(connection: socket.socket, refusal: str | None) -> None:
    if refusal is None:
        connection.sendall(_ANSWER.pack(0, 0))
    else:
        reason = refusal.encode()[:MAX_REASON]
        connection.sendall(_ANSWER.pack(1, len(reason)) + reason)


class StreamChannel(Channel):
    """A connection to a peer's :class:`StreamListener`; each operation completes before it returns."""

    def __init__(self, address: bytes, stopped: Callable[[], bool],
                 wait_counter: Callable[[np.ndarray, int, float], bool], connect_timeout: float = 60.0,
                 token: str | None = None) -> None:
        host, port = parse_stream_address(address)
        self._stopped = stopped
        #: the device's wait for a counter in its memory (a plan's credits)
        self.wait_counter = wait_counter
        try:
            self._socket = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as exc:
            raise FabricError(f"tcp: cannot connect to the peer's fabric at {host}:{port}: {exc}") from None
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if token is not None:  # the listener's challenge, answered under the run's token
            try:
                nonce = bytearray(_NONCE_BYTES)
                if not _receive_into(self._socket, memoryview(nonce)):
                    raise OSError("the peer closed the connection")
                self._socket.sendall(_proof(token, bytes(nonce)))
            except OSError as exc:
                self._socket.close()
                raise FabricError(f"tcp: the peer's fabric at {host}:{port} did not take the run's token: "
                                  f"{exc}") from None
        self._socket.settimeout(_POLL_S)
        self._lock = threading.Lock()
        self._failure: str | None = None
        self.peer = f"{host}:{port}"

    # the wire, under self._lock

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (timeout if timeout is not None else 3600.0)

    def _blocked(self, deadline: float, what: str) -> None:
        if self._stopped():
            raise FabricInterrupted(f"tcp: {what} was interrupted (the device is closing)")
        if time.monotonic() > deadline:
            raise FabricTimeout(f"tcp: {what} to {self.peer} did not complete in time")

    def _send(self, parts: list, deadline: float, what: str) -> None:
        """Send ``parts`` (headers and the payloads themselves, never copied) gathered: one ``sendmsg`` for a small
        write with its trailer and flush, then whatever the socket did not take yet."""
        views = [view for view in (memoryview(part).cast("B") for part in parts) if len(view)]
        while views:
            try:
                sent = self._socket.sendmsg(views)
            except TimeoutError:
                self._blocked(deadline, what)
                continue
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if views:
                views[0] = views[0][sent:]

    def _receive(self, view: memoryview, deadline: float, what: str) -> None:
        got = 0
        while got < len(view):
            try:
                count = self._socket.recv_into(view[got:])
            except TimeoutError:
                self._blocked(deadline, what)
                continue
            if not count:
                raise ConnectionResetError("the peer closed the connection")
            got += count

    def _status(self, deadline: float, what: str) -> None:
        answer = bytearray(_ANSWER.size)
        self._receive(memoryview(answer), deadline, what)
        status, length = _ANSWER.unpack(answer)
        if status == 0 and length == 0:
            return
        if status != 1 or length > MAX_REASON:
            # not an answer of a listener serving this channel: a listener that asks for the run's token sends its
            # nonce first, whose bytes a connector that proved none would otherwise take for "done" 1 time in 256
            raise ConnectionError(f"the peer answered with bytes that are no answer (status {status}, {length} bytes "
                                  "of reason): does its fabric ask for a token this channel did not prove?")
        reason = bytearray(length)
        self._receive(memoryview(reason), deadline, what)
        raise FabricError(f"tcp: the peer at {self.peer} refused {reason.decode(errors='replace')}")

    def _run(self, what: str, timeout: float | None, steps: Callable[[float], None]) -> None:
        """Run ``steps(deadline)`` on the connection; a broken connection fails the channel."""
        with self._lock:
            if self._failure is not None:
                raise FabricError(f"tcp: {what} on a failed connection to {self.peer}: {self._failure}")
            try:
                steps(self._deadline(timeout))
            except (FabricTimeout, FabricInterrupted) as exc:
                self._failure = str(exc)  # the stream is out of step now: nothing more can go over it
                raise
            except OSError as exc:
                self._failure = str(exc) or type(exc).__name__
                raise FabricError(f"tcp: {what} to {self.peer} failed: {self._failure}") from None

    @staticmethod
    def _write_parts(data: np.ndarray, remote: RemoteRegion) -> list:
        if data.nbytes > remote.length:
            raise remote.too_small(data.nbytes, "put")
        header = _REQUEST.pack(_WRITE, _key(remote), remote.addr, data.nbytes)
        return [header, np.ascontiguousarray(data).reshape(-1).view(np.uint8)]

    # the Channel

    def write_flagged(self, data: np.ndarray, remote: RemoteRegion, trailer: np.ndarray | None = None,
                      trailer_remote: RemoteRegion | None = None, timeout: float = 60.0) -> None:
        parts = self._write_parts(data, remote) if data.nbytes else []
        if trailer is not None:
            parts += self._write_parts(trailer, trailer_remote)
        parts.append(_REQUEST.pack(_FLUSH, bytes(KEY_BYTES), 0, 0))

        def steps(deadline: float) -> None:
            self._send(parts, deadline, "put")
            self._status(deadline, "put")
        self._run("put", timeout, steps)

    def write(self, local: np.ndarray, remote: RemoteRegion) -> Future:
        parts = self._write_parts(local, remote)  # a write that cannot fit is the caller's error, raised here
        return self._settled(lambda: self._run("put", None, lambda deadline: self._send(parts, deadline, "put")))

    def send_plan(self, slots: list[RemoteRegion], trailers: list[RemoteRegion], trailer: np.ndarray,
                  credits: np.ndarray, bells: list[RemoteRegion] | None = None) -> StreamSendPlan:
        return StreamSendPlan(self, slots, trailers, trailer, credits)

    def counter_plan(self, local: np.ndarray, remote: RemoteRegion) -> StreamCounterPlan:
        return StreamCounterPlan(self, local, remote)

    def read_now(self, local: np.ndarray, remote: RemoteRegion, timeout: float = 60.0) -> None:
        if not local.nbytes:
            return
        if local.nbytes > remote.length:
            raise remote.too_small(local.nbytes, "get")

        def steps(deadline: float) -> None:
            self._send([_REQUEST.pack(_READ, _key(remote), remote.addr, local.nbytes)], deadline, "get")
            self._status(deadline, "get")
            self._receive(memoryview(local.reshape(-1).view(np.uint8)), deadline, "get")
        self._run("get", timeout, steps)

    def read(self, local: np.ndarray, remote: RemoteRegion) -> Future:
        return self._settled(lambda: self.read_now(local, remote, timeout=None))

    def flush(self) -> Future:
        def steps(deadline: float) -> None:
            self._send([_REQUEST.pack(_FLUSH, bytes(KEY_BYTES), 0, 0)], deadline, "flush")
            self._status(deadline, "flush")
        return self._settled(lambda: self._run("flush", None, steps))

    def notify(self) -> Future:
        return self._settled(lambda: self._run("ringing the doorbell", None, lambda deadline: self._send(
            [_REQUEST.pack(_NOTIFY, bytes(KEY_BYTES), 0, 0)], deadline, "ringing the doorbell")))

    @staticmethod
    def _settled(operation: Callable[[], None]) -> Future:
        """The operation, run now, as a done future (its error in the future, as a failed transfer's)."""
        try:
            operation()
        except (FabricError, ValueError) as exc:
            failed: Future = Future()
            failed.set_exception(exc)
            return failed
        return done_future()

    def failed(self) -> str | None:
        return self._failure

    def fail(self) -> None:
        if self._failure is None:
            self._failure = "the peer is gone"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


class StreamSendPlan(SendPlan):
    """A static tensor's sends over the stream: the credit waited for here, then data and trailer as one
    :meth:`StreamChannel.write_flagged` (the target checks both)."""

    def __init__(self, channel: StreamChannel, slots: list[RemoteRegion], trailers: list[RemoteRegion],
                 trailer: np.ndarray, credits: np.ndarray) -> None:
        if not slots or len(slots) != len(trailers) or trailer.nbytes != 9 or credits.dtype != np.uint64:
            raise ValueError("a send plan takes one trailer per slot, a 9-byte trailer and a uint64 credit count")
        self._channel, self._slots, self._trailers = channel, slots, trailers
        self._trailer, self._credits = trailer, credits

    def send(self, data: np.ndarray, seq: int, step: int, credit_wait: float, timeout: float = 60.0) -> bool:
        slots = len(self._slots)
        if int(self._credits[0]) + slots <= seq + 1 \
                and not self._channel.wait_counter(self._credits, seq + 1 - slots, credit_wait):
            return False
        self._trailer[:8].view(np.int64)[0] = step
        self._trailer[8] = 1 + seq % 255
        self._channel.write_flagged(data, self._slots[seq % slots], self._trailer, self._trailers[seq % slots],
                                    timeout)
        return True


class StreamCounterPlan(CounterPlan):
    """A counter the peer reads, set here and written over the stream each time."""

    def __init__(self, channel: StreamChannel, local: np.ndarray, remote: RemoteRegion) -> None:
        if local.dtype != np.uint64 or local.size != 1 or remote.length != 8 or remote.addr % 8:
            raise ValueError("a counter plan takes one uint64 here and 8 aligned bytes at the peer")
        self._channel, self._local, self._remote = channel, local, remote

    def set(self, value: int, timeout: float = 60.0) -> None:
        self._local[0] = value
        self._channel.write_flagged(self._local.view(np.uint8), self._remote, timeout=timeout)


def _key(remote: RemoteRegion) -> bytes:
    if len(remote.rkey) != KEY_BYTES:
        raise FabricError(f"tcp: a remote key of {len(remote.rkey)} bytes is not one this fabric grants over TCP")
    return remote.rkey
