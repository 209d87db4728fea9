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

import functools
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from bench.experiments.micro import RECEIVER, DirectSignals, Point, clock_ns, marker
from bench.experiments.micro.sources import rewriter
from bench.experiments.peers import PeerLine, PeerLineError, PeerLink
from bench.experiments.peers.plain_socket import filled_tensor, open_stream, run_plain_points
from bench.experiments.stream import recv_message, send_message
from bench.launch import Launcher, RankContext, RankSpec
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
        self._mark_at = self._mark.ctypes.data
        #: the sender's tensor of the current name and its address (numpy's ``ctypes.data`` costs about 1 µs, in
        #: the timed interval; a plain loop reads it once)
        self._source: np.ndarray | None = None
        self._source_at = 0

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
            shape, dtype, _ = self.planned(key)
            self._place(shape, dtype)
        else:
            self._attach(tensor)
        self._tensor_of = key.name

    def _place(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        """The receiver's side of a new tensor: its buffer (the flag, then the tensor) made and registered, and its
        address sent to the sender."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        self._buffer = np.zeros(_FLAG_BYTES + nbytes, np.uint8)
        self._flag_in = self._buffer[:_FLAG_BYTES].view(np.int64)
        self._data = self._buffer[_FLAG_BYTES:].view(dtype).reshape(shape)
        self._register(self._buffer)
        send_message(self._sock, _WHERE.pack(self._buffer.ctypes.data, self._engine.get_rpc_port()))

    def _attach(self, tensor: np.ndarray) -> None:
        """The sender's side of a new tensor: ``tensor`` registered, and the receiver's buffer address received."""
        self._register(tensor)
        self._source, self._source_at = tensor, tensor.ctypes.data
        self._remote, port = _WHERE.unpack(recv_message(self._sock, _WHERE.size))
        self._target = f"{self._receiver_host}:{port}"

    def send(self, key: Key, tensor: np.ndarray) -> None:
        self._open(key, tensor)
        engine = self._engine
        source = self._source_at if tensor is self._source else tensor.ctypes.data
        if (code := engine.transfer_sync_write(self._target, source, self._remote + _FLAG_BYTES,
                                               tensor.nbytes)) != 0:
            raise PeerLineError(f"mooncake: writing {key} to the receiver at {self._target} failed (code {code})")
        self._mark[0] = key.step + 1
        if (code := engine.transfer_sync_write(self._target, self._mark_at, self._remote, _FLAG_BYTES)) != 0:
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
        self._buffer = self._flag_in = self._data = self._source = None
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


# -- the calibration: the same writes as a user's plain loop writes them ---------------------------------------


def plain_loop(link: MooncakeLink, signals: DirectSignals, tensor: np.ndarray, total: int,
               written: np.ndarray | None = None) -> np.ndarray:
    """``total`` transfers of ``tensor`` (the sender's, registered: :meth:`MooncakeLink._attach`; the receiver's
    buffer: :meth:`MooncakeLink._place`) in the lines a user writes with the engine, and every line's ready signal:
    the sender's clock at each write, or the receiver's once it consumed the tensor. No ledger, no deadline, no
    key. With ``written`` (a fresh source), the sender writes the whole tensor before each transfer, outside the
    timed interval, and keeps there when each write ended."""
    times, kind = np.zeros(total, np.int64), tensor.dtype
    rewrite = rewriter(tensor) if written is not None else None
    if link._rank == RECEIVER:
        flag = link._flag_in
        for i in range(total):
            signals.send(i)
            while flag[0] != i + 1:
                pass
            if tensor.max() != marker(i, kind):
                raise PeerLineError(f"mooncake_plain: transfer {i} of {tensor.nbytes} bytes arrived wrong")
            times[i] = clock_ns()
        return times
    engine, target, mark = link._engine, link._target, link._mark
    source, data_at, flag_at, mark_at, nbytes = tensor.ctypes.data, link._remote + _FLAG_BYTES, link._remote, \
        mark.ctypes.data, tensor.nbytes
    for i in range(total):
        signals.recv()
        if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
            rewrite()
            written[i] = clock_ns()
        tensor[-1] = marker(i, kind)
        times[i] = clock_ns()
        mark[0] = i + 1
        if engine.transfer_sync_write(target, source, data_at, nbytes) != 0 \
                or engine.transfer_sync_write(target, mark_at, flag_at, _FLAG_BYTES) != 0:
            raise PeerLineError(f"mooncake_plain: transfer {i} to the receiver at {target} failed")
    return times


def _plain_job(line: PlainMooncakeLine, points: list[Point], ctx: RankContext) -> None:
    """One side of the mooncake line's plain loop: the engines, registrations and addresses made as the line makes
    them, outside the loop; the receiver reports a record per point."""
    with MooncakeLink(ctx.cluster, ctx.rank, line.timeout_s) as link:

        def registered(point: Point) -> np.ndarray:
            link._release()
            if ctx.rank == RECEIVER:
                link._place(point.spec.shape, point.dtype)
                return link._data
            tensor = filled_tensor(point)
            link._attach(tensor)
            return tensor

        run_plain_points(ctx, line.name, points, "mooncake", link._sock, registered,
                         functools.partial(plain_loop, link))


@dataclass
class PlainMooncakeLine(MooncakeLine):
    """The ``mooncake`` line's calibration (``bench micro --calibrate``): its writes in a plain loop
    (:func:`plain_loop`), measured beside it and never a candidate for ``of_peer``."""

    name: str = "mooncake_plain"
    time_reference: ClassVar[bool] = False

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        return self.pair_ranks(_plain_job, points)
