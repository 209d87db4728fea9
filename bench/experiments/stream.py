"""A TCP stream between the two ranks of a micro-benchmark line, opened once and authenticated with the run's
token: the ready signals of every line go over one (:class:`DirectSignals`), and the peer lines use one for their
data (``socket``) or their set-up (``nixl``'s descriptors, ``mooncake``'s addresses).

The receiver listens, the sender calls and first sends the run's token; the receiver takes the first caller that
knows it (a stranger's connection is dropped and the receiver waits on). Nothing on the stream is unpickled.
"""

from __future__ import annotations

import hmac
import socket
import struct
import time

_LENGTH = struct.Struct("<Q")


class StreamError(RuntimeError):
    """The stream could not be opened in time, or the other side broke it; the message says which."""


def host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` (``[v6]:port`` too)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening socket on ``host`` (``port`` 0: any free one)."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)


def accept(server: socket.socket, token: str, timeout_s: float) -> socket.socket:
    """The first connection to ``server`` that proves it knows ``token``, within ``timeout_s``."""
    secret = token.encode()
    deadline = time.monotonic() + timeout_s
    while True:
        server.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            sock, _ = server.accept()
        except TimeoutError:
            host, port = server.getsockname()[:2]
            where = f"{host}:{port}"
            raise StreamError(f"the sender did not connect to {where} within {timeout_s:.0f} s") from None
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        try:
            said = _recv_exactly(sock, len(secret))
        except (OSError, EOFError):
            said = b""
        if hmac.compare_digest(said, secret):
            return _ready(sock)
        sock.close()  # not the run's sender: wait for it


def connect(address: tuple[str, int], token: str, timeout_s: float) -> socket.socket:
    """A connection to the receiver listening at ``address``, calling until it listens (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=timeout_s)
            sock.sendall(token.encode())
            return _ready(sock)
        except ConnectionRefusedError:  # the receiver is not listening yet
            if time.monotonic() > deadline:
                raise StreamError(f"the receiver at {address[0]}:{address[1]} did not listen within "
                                  f"{timeout_s:.0f} s") from None
            time.sleep(0.01)


def _ready(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_message(sock: socket.socket, data: bytes) -> None:
    """A length, then ``data``."""
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket, limit: int = 64 << 20) -> bytes:
    """What :func:`send_message` sent (at most ``limit`` bytes: a length beyond it is a broken peer)."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > limit:
        raise StreamError(f"the other side announced a message of {length} bytes (at most {limit} expected)")
    return _recv_exactly(sock, length)


def recv_length(sock: socket.socket) -> int:
    """The 8-byte length that starts a message."""
    return _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))[0]


def length_prefix(count: int) -> bytes:
    return _LENGTH.pack(count)


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray(count)
    recv_into(sock, memoryview(data))
    return bytes(data)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; EOFError when the other side closed first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the other side closed the connection")
        got += n
