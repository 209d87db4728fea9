"""The ``socket`` peer: what a plain TCP socket moves, as a user would write it in Python.

The receiver listens on its rank's address; the sender connects (and proves it knows the run's token) once.
A send is one ``sendmsg`` of an 8-byte length and the tensor's bytes (``TCP_NODELAY``: no waiting for more);
a receive reads the length, checks it against the plan, and ``recv_into`` a buffer preallocated per tensor.
No copy in user space on either side (the kernel's are not counted, as for the transports).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.experiments.micro import RECEIVER
from bench.experiments.peers import PeerLine, PeerLineError, PeerLink
from bench.experiments.stream import (
    StreamError,
    accept,
    connect,
    host_port,
    length_prefix,
    listen,
    recv_into,
    recv_length,
)
from transports import Cluster, Key


def open_stream(cluster: Cluster, rank: int, timeout_s: float) -> socket.socket:
    """A TCP stream between the sender and the receiver of ``cluster``, the receiver listening on its rank's
    address (:mod:`bench.experiments.stream`); ``PeerLineError`` when it cannot be opened in time."""
    address, token = host_port(cluster.addresses[RECEIVER]), cluster.token
    try:
        if rank != RECEIVER:
            sock = connect(address, token, timeout_s)
        else:
            with listen(*address) as server:
                sock = accept(server, token, timeout_s)
    except (StreamError, OSError) as exc:
        raise PeerLineError(str(exc)) from None
    sock.settimeout(timeout_s)
    return sock


class SocketLink(PeerLink):
    """One side of a TCP stream between the sender and the receiver."""

    def __init__(self, cluster: Cluster, rank: int, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self._peer = cluster.addresses[1 - rank]  # the other side's, for errors
        try:
            self._sock = open_stream(cluster, rank, timeout_s)
        except PeerLineError as exc:
            raise PeerLineError(f"socket: {exc}") from None

    def send(self, key: Key, tensor: np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(tensor)).cast("B")
        try:
            prefix = length_prefix(view.nbytes)
            sent = self._sock.sendmsg([prefix, view])
            if sent < len(prefix) + view.nbytes:  # the kernel took part: the rest as a stream
                if sent < len(prefix):
                    self._sock.sendall(prefix[sent:])
                self._sock.sendall(view[max(0, sent - len(prefix)):])
        except (TimeoutError, OSError) as exc:
            raise PeerLineError(f"socket: sending {key} to the receiver at {self._peer} failed: {exc}") from None
        self._sent(tensor)

    def recv(self, key: Key) -> np.ndarray:
        buffer = self.buffer(key)
        try:
            length = recv_length(self._sock)
            if length != buffer.nbytes:
                raise PeerLineError(f"socket: {key} announced {length} bytes, the plan says {buffer.nbytes}")
            recv_into(self._sock, memoryview(buffer.reshape(-1)).cast("B"))
        except (TimeoutError, OSError, EOFError) as exc:
            raise PeerLineError(f"socket: receiving {key} from the sender at {self._peer} failed: {exc}") from None
        self._received(buffer)
        return buffer

    def describe(self) -> dict[str, Any]:
        return {"fabric": "socket", "used": ["tcp"]}

    def close(self) -> None:
        self._sock.close()


@dataclass
class SocketLine(PeerLine):
    """A plain TCP socket between the two ranks."""

    def link(self, cluster: Cluster, rank: int) -> SocketLink:
        return SocketLink(cluster, rank, self.timeout_s)
