"""The ``mooncake`` peer: Mooncake's transfer engine (the KV-cache transfer library of Kimi's serving) over its
``tcp`` protocol, as a user would drive it for a tensor and a flag: each transfer is a synchronous write of the
tensor into the receiver's registered buffer, then a synchronous write of an 8-byte flag (the transfer's number)
beside it; the receiver polls the flag.

Both engines start in peer-to-peer handshake mode (no metadata server). The receiver's buffer (flag and tensor)
is registered per tensor and its address goes to the sender over a TCP stream between the two ranks (the
``socket`` peer's, authenticated with the run's token), once per tensor at its first transfer (a warm-up one);
the sender's tensor is registered at its first send.

The engine listens on every interface whatever it is told (its RPC and handshake ports), so the line runs on
private hosts, as perftest's tools do (:func:`bench.launch.private.hosts_for_open_listeners`).

Install: ``pip install -e '.[mooncake]'`` (``mooncake-transfer-engine-non-cuda``: the default wheel needs CUDA's
driver library); at run time it needs ``libibverbs1`` and ``libnl-route-3-200`` (Debian's packages).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from bench.experiments.micro import RECEIVER
from bench.experiments.peers import PeerLine, PeerLineError, PeerLink
from bench.experiments.peers.plain_socket import open_stream
from bench.experiments.stream import recv_message, send_message
from bench.launch import Launcher
from bench.launch.private import PrivateHosts, hosts_for_open_listeners
from transports import Cluster, Key
from transports.common import Availability

#: bytes before the tensor in the receiver's buffer: the flag (the number of the last transfer written, plus one)
_FLAG_BYTES = 8
_WHERE = struct.Struct("<QQ")  # the receiver's buffer address, its RPC port


class MooncakeLink(PeerLink):
    """One side of a Mooncake transfer engine link: a write and a flag write per transfer."""

    def __init__(self, cluster: Cluster, rank: int, timeout_s: float) -> None:
        super().__init__(timeout_s)
        from mooncake.engine import TransferEngine

        self._rank = rank
        host = cluster.addresses[rank].rpartition(":")[0].strip("[]")
        self._engine = TransferEngine()
        if (code := self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "")) != 0:
            raise PeerLineError(f"mooncake: the transfer engine did not start on {host} (code {code})")
        try:
            self._sock = open_stream(cluster, rank, timeout_s)
        except PeerLineError as exc:
            raise PeerLineError(f"mooncake: {exc}") from None
        self._receiver_host = cluster.addresses[RECEIVER].rpartition(":")[0].strip("[]")
        self._registered: list[int] = []  # addresses registered for the current tensor
        self._tensor_of: str | None = None
        self._buffer: np.ndarray | None = None
        self._flag_in: np.ndarray | None = None
        self._data: np.ndarray | None = None
        self._target = ""
        self._remote = 0
        self._mark = np.zeros(1, np.int64)  # the sender's flag, registered once
        self._register(self._mark, keep=True)

    def _register(self, array: np.ndarray, keep: bool = False) -> None:
        if (code := self._engine.register_memory(array.ctypes.data, array.nbytes)) != 0:
            raise PeerLineError(f"mooncake: registering {array.nbytes} bytes failed (code {code})")
        if not keep:
            self._registered.append(array.ctypes.data)

    def _open(self, key: Key, tensor: np.ndarray | None = None) -> None:
        if self._tensor_of == key.name:
            return
        self._release()
        if self._rank == RECEIVER:
            shape, dtype, nbytes = self.planned(key)
            self._buffer = np.zeros(_FLAG_BYTES + nbytes, np.uint8)
            self._flag_in = self._buffer[:_FLAG_BYTES].view(np.int64)
            self._data = self._buffer[_FLAG_BYTES:].view(dtype).reshape(shape)
            self._register(self._buffer)
            send_message(self._sock, _WHERE.pack(self._buffer.ctypes.data, self._engine.get_rpc_port()))
        else:
            self._register(tensor)
            self._remote, port = _WHERE.unpack(recv_message(self._sock, _WHERE.size))
            self._target = f"{self._receiver_host}:{port}"
        self._tensor_of = key.name

    def send(self, key: Key, tensor: np.ndarray) -> None:
        self._open(key, tensor)
        engine = self._engine
        if (code := engine.transfer_sync_write(self._target, tensor.ctypes.data, self._remote + _FLAG_BYTES,
                                               tensor.nbytes)) != 0:
            raise PeerLineError(f"mooncake: writing {key} to the receiver at {self._target} failed (code {code})")
        self._mark[0] = key.step + 1
        if (code := engine.transfer_sync_write(self._target, self._mark.ctypes.data, self._remote,
                                               _FLAG_BYTES)) != 0:
            raise PeerLineError(f"mooncake: writing {key}'s flag to the receiver at {self._target} failed "
                                f"(code {code})")
        self._sent(tensor)

    def recv(self, key: Key) -> np.ndarray:
        self._open(key)
        self.await_flag(self._flag_in, key.step + 1, key)
        self._received(self._data)
        return self._data

    def describe(self) -> dict[str, Any]:
        return {"fabric": "mooncake", "used": ["tcp"]}

    def _release(self) -> None:
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()
        self._buffer = self._flag_in = self._data = None
        self._tensor_of = None

    def close(self) -> None:
        self._release()
        self._sock.close()


@dataclass
class MooncakeLine(PeerLine):
    """Mooncake's transfer engine over tcp: a write and a flag write."""

    module: ClassVar[str] = "mooncake"
    install: ClassVar[str] = ("pip install -e '.[mooncake]' (mooncake-transfer-engine-non-cuda; it needs Debian's "
                              "libibverbs1 and libnl-route-3-200)")

    def availability(self) -> Availability:
        if not (status := super().availability()).ok:
            return status
        try:
            from mooncake.engine import TransferEngine  # noqa: F401 (its libraries load here)
        except ImportError as exc:
            return Availability(False, f"mooncake cannot be loaded here: {exc} ({self.install})")
        return Availability(True)

    def hosts(self, launcher: Launcher) -> PrivateHosts:
        return hosts_for_open_listeners(launcher, "Mooncake's transfer engine", "--peers without mooncake")

    def link(self, cluster: Cluster, rank: int) -> MooncakeLink:
        return MooncakeLink(cluster, rank, self.timeout_s)
