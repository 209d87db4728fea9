"""The ``socket`` peer: what a plain TCP socket moves, as a user would write it in Python.

The receiver listens on its rank's address; the sender connects (and proves it knows the run's token) once.
A send is one ``sendmsg`` of an 8-byte length and the tensor's bytes (``TCP_NODELAY``: no waiting for more);
a receive reads the length, checks it against the plan, and ``recv_into`` a buffer preallocated per tensor.
No copy in user space on either side (the kernel's are not counted, as for the transports).
"""

from __future__ import annotations

import hmac
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.experiments.micro import RECEIVER
from bench.experiments.peers import PeerError, PeerLine, PeerLink
from transports import Cluster, Key

_LENGTH = struct.Struct("<Q")


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def open_stream(cluster: Cluster, rank: int, timeout_s: float) -> socket.socket:
    """A TCP stream between the sender and the receiver of ``cluster``: the receiver listens on its rank's address
    and takes the first caller that proves it knows the run's token; the sender calls until it is listening."""
    address, token = cluster.addresses[RECEIVER], cluster.token.encode()
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    if rank != RECEIVER:
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=timeout_s)
                sock.sendall(token)
                break
            except ConnectionRefusedError:  # the receiver is not listening yet
                if time.monotonic() > deadline:
                    raise PeerError(f"the receiver at {address} did not listen within {timeout_s:.0f} s") from None
                time.sleep(0.01)
    else:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as server:
            server.settimeout(timeout_s)
            while True:
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    raise PeerError(f"the sender did not connect to {address} within {timeout_s:.0f} s") from None
                sock.settimeout(max(1.0, deadline - time.monotonic()))
                try:
                    said = _recv_exactly(sock, len(token))
                except (OSError, EOFError):
                    said = b""
                if hmac.compare_digest(said, token):
                    break
                sock.close()  # not the run's sender: wait for it
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout_s)
    return sock


def send_message(sock: socket.socket, data: bytes) -> None:
    """A length, then ``data``."""
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket, limit: int = 64 << 20) -> bytes:
    """What :func:`send_message` sent (at most ``limit`` bytes: a length beyond it is a broken peer)."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > limit:
        raise PeerError(f"the peer announced a message of {length} bytes (at most {limit} expected)")
    return _recv_exactly(sock, length)


class SocketLink(PeerLink):
    """One side of a TCP stream between the sender and the receiver."""

    def __init__(self, cluster: Cluster, rank: int, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self._buffers: dict[str, np.ndarray] = {}
        self._peer = cluster.addresses[1 - rank]  # the other side's, for errors
        try:
            self._sock = open_stream(cluster, rank, timeout_s)
        except PeerError as exc:
            raise PeerError(f"socket: {exc}") from None

    def send(self, key: Key, tensor: np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(tensor)).cast("B")
        try:
            sent = self._sock.sendmsg([_LENGTH.pack(view.nbytes), view])
            if sent < _LENGTH.size + view.nbytes:  # the kernel took part: the rest as a stream
                self._sock.sendall(view[sent - _LENGTH.size:] if sent >= _LENGTH.size
                                   else _LENGTH.pack(view.nbytes)[sent:] + bytes(view))
        except (TimeoutError, OSError) as exc:
            raise PeerError(f"socket: sending {key} to the receiver at {self._peer} failed: {exc}") from None
        self._sent(tensor)

    def recv(self, key: Key) -> np.ndarray:
        shape, dtype, nbytes = self.planned(key)
        buffer = self._buffers.get(key.name)
        if buffer is None:
            self._buffers.clear()  # one tensor at a time: the last one's buffer goes
            buffer = self._buffers[key.name] = np.empty(shape, dtype)
        try:
            (length,) = _LENGTH.unpack(_recv_exactly(self._sock, _LENGTH.size))
            if length != nbytes:
                raise PeerError(f"socket: {key} announced {length} bytes, the plan says {nbytes}")
            _recv_into(self._sock, memoryview(buffer.reshape(-1)).cast("B"))
        except (TimeoutError, OSError, EOFError) as exc:
            raise PeerError(f"socket: receiving {key} from the sender at {self._peer} failed: {exc}") from None
        self._received(buffer)
        return buffer

    def describe(self) -> dict[str, Any]:
        return {"fabric": "socket", "used": ["tcp"]}

    def close(self) -> None:
        self._sock.close()


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray(count)
    _recv_into(sock, memoryview(data))
    return bytes(data)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the peer closed the connection")
        got += n


@dataclass
class SocketLine(PeerLine):
    """A plain TCP socket between the two ranks."""

    def link(self, cluster: Cluster, rank: int) -> SocketLink:
        return SocketLink(cluster, rank, self.timeout_s)
