"""The ``torch_gloo`` peer: PyTorch's ``torch.distributed`` over its gloo backend, as a user moves a CPU tensor
between two processes: ``dist.send`` on the sender, ``dist.recv`` into a preallocated tensor on the receiver.

The harness's NumPy tensors go in and out through ``torch.from_numpy`` (the same memory, no copy), made once per
tensor. The process group's store (a ``TCPStore``) is the receiver's; its port goes to the sender over a TCP stream
between the two ranks (the ``socket`` peer's, authenticated with the run's token). Neither the store nor gloo's
pairs have a token, and the store listens on every interface, so the line runs on private hosts, as Mooncake's and
perftest's do (:func:`bench.launch.private.hosts_for_open_listeners`).

Its calibration (``torch_gloo_plain``, ``bench micro --calibrate``) is the same calls in a plain loop
(:func:`plain_loop`). Install: ``pip install -e '.[torch]'``.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np

from bench.experiments.micro import RECEIVER, SENDER, DirectSignals, Point, clock_ns, marker
from bench.experiments.micro.sources import rewriter
from bench.experiments.peers import PeerLine, PeerLineError, PeerLink
from bench.experiments.peers.plain_socket import filled_tensor, open_stream, run_plain_points
from bench.experiments.stream import recv_message, send_message
from bench.launch import Launcher, RankContext, RankSpec
from bench.launch.addresses import interface_of
from bench.launch.private import PrivateHosts, hosts_for_open_listeners
from transports import Cluster, Inbound, Key, Outbound
from transports.common import Availability
from transports.fabric import label

_PORT = struct.Struct("<H")
INSTALL = "pip install -e '.[torch]'"


def torch_missing(backend: str) -> str | None:
    """None where torch and its ``backend`` (``gloo``, ``tensorpipe``) can be used here, else one line saying why."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        return f"torch is not installed here ({exc}; {INSTALL}; or leave it out with --peers/--no-peers)"
    if not dist.is_available():
        return f"this torch has no torch.distributed (a build without it; {INSTALL})"
    if backend == "gloo" and not dist.is_gloo_available():
        return "this torch has no gloo backend (a build without it); leave the line out with --peers"
    if backend == "tensorpipe":
        try:
            from torch.distributed.rpc import TensorPipeRpcBackendOptions  # noqa: F401
        except ImportError as exc:
            return f"this torch has no TensorPipe RPC ({exc}); leave the line out with --peers"
    return None


def bind_here(cluster: Cluster, rank: int) -> str:
    """This rank's host address; gloo's pairs and TensorPipe's uv listener told to use its interface, as a user does
    (``GLOO_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME``; left as they are where no interface has it)."""
    host = cluster.addresses[rank].rpartition(":")[0].strip("[]")
    if (interface := interface_of(host)) is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"] = interface
    return host


def exchange_port(sock: Any, rank: int, owner: int, port: int = 0) -> int:
    """``owner``'s port, sent over the authenticated stream ``sock`` to the other rank; returns it on both."""
    if rank == owner:
        send_message(sock, _PORT.pack(port))
        return port
    return _PORT.unpack(recv_message(sock, _PORT.size))[0]


class GlooLink(PeerLink):
    """One side of a two-rank gloo process group: ``dist.send`` and ``dist.recv`` per transfer."""

    def __init__(self, cluster: Cluster, rank: int, timeout_s: float) -> None:
        super().__init__(timeout_s)
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self._rank = torch, dist, rank
        bind_here(cluster, rank)
        host = cluster.addresses[RECEIVER].rpartition(":")[0].strip("[]")
        try:
            self._sock = open_stream(cluster, rank, timeout_s)
        except PeerLineError as exc:
            raise PeerLineError(f"torch_gloo: {exc}") from None
        timeout = timedelta(seconds=timeout_s)
        try:
            if rank == RECEIVER:
                store = dist.TCPStore(host, 0, 2, True, timeout=timeout, wait_for_workers=False)
                exchange_port(self._sock, rank, RECEIVER, store.port)
            else:
                store = dist.TCPStore(host, exchange_port(self._sock, rank, RECEIVER), 2, False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        except (RuntimeError, ValueError, OSError) as exc:
            self._sock.close()
            raise PeerLineError(f"torch_gloo: the gloo process group did not start on {host}: {exc}") from None
        self._store = store

    def send(self, key: Key, tensor: np.ndarray) -> None:
        self._dist.send(self._torch.from_numpy(np.ascontiguousarray(tensor)), dst=RECEIVER)
        self._sent(tensor)

    def recv(self, key: Key) -> np.ndarray:
        buffer = self.buffer(key)
        self._dist.recv(self._torch.from_numpy(buffer), src=SENDER)
        self._received(buffer)
        return buffer

    def describe(self) -> dict[str, Any]:
        return {"fabric": "gloo", "used": ["tcp"]}

    def outbound(self, name: str, dst: int) -> Outbound:
        return _GlooOutbound(self, name, dst) if type(self) is GlooLink else super().outbound(name, dst)

    def inbound(self, name: str, src: int) -> Inbound:
        return _GlooInbound(self, name, src) if type(self) is GlooLink else super().inbound(name, src)

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()
        self._sock.close()


class _GlooOutbound(Outbound):
    """The line's send per transfer, as a user's loop writes it: ``dist.send`` of the tensor's torch view (made
    once per tensor)."""

    __slots__ = ("_link", "_send", "_tensor", "_view")

    def __init__(self, link: GlooLink, name: str, dst: int) -> None:
        super().__init__(link, name, SENDER, dst)
        self._link, self._send = link, link._dist.send
        self._tensor: np.ndarray | None = None
        self._view: Any = None

    def send(self, step: int, array: np.ndarray, timeout: float | None = None) -> None:
        if array is not self._tensor:
            if not array.flags.c_contiguous:
                self._link.send(Key(self.name, step, self.src, self.dst), array)
                return
            self._tensor, self._view = array, self._link._torch.from_numpy(array)
        self._send(self._view, dst=RECEIVER)
        self._link._sent(array)


class _GlooInbound(Inbound):
    """The line's receive per transfer: ``dist.recv`` into the tensor's buffer (made at its first receive)."""

    __slots__ = ("_buffer", "_link", "_recv", "_view")

    def __init__(self, link: GlooLink, name: str, src: int) -> None:
        super().__init__(link, name, src, RECEIVER)
        self._link, self._recv = link, link._dist.recv
        self._buffer: np.ndarray | None = None
        self._view: Any = None

    def recv(self, step: int, timeout: float | None = None) -> np.ndarray:
        if self._buffer is None:
            self._buffer = self._link.buffer(Key(self.name, step, self.src, self.dst))
            self._view = self._link._torch.from_numpy(self._buffer)
        self._recv(self._view, src=SENDER)
        self._link._received(self._buffer)
        return self._buffer


@dataclass
class GlooLine(PeerLine):
    """PyTorch's torch.distributed over gloo: send and recv of a CPU tensor."""

    module: ClassVar[str] = "torch"
    install: ClassVar[str] = INSTALL

    def availability(self) -> Availability:
        why = torch_missing("gloo")
        return Availability(why is None, why or "")

    def hosts(self, launcher: Launcher) -> PrivateHosts:
        return hosts_for_open_listeners(launcher, "torch.distributed's TCPStore (gloo)", "--peers without torch_gloo")

    def link(self, cluster: Cluster, rank: int) -> GlooLink:
        return GlooLink(cluster, rank, self.timeout_s)


# -- the calibration: the same calls as a user's plain loop writes them --------------------------------------------


def plain_loop(link: GlooLink, signals: DirectSignals, tensor: np.ndarray, total: int,
               written: np.ndarray | None = None) -> np.ndarray:
    """``total`` transfers of ``tensor`` with ``dist.send``/``dist.recv`` in the lines a user writes, and every
    line's ready signal: the sender's clock at each send, or the receiver's once it checked the tensor. With
    ``written`` (a fresh source), the sender writes the whole tensor before each send, outside the timed interval,
    and keeps there when each write ended."""
    times, kind, dist = np.zeros(total, np.int64), tensor.dtype, link._dist
    rewrite = rewriter(tensor) if written is not None else None
    view = link._torch.from_numpy(tensor)
    for i in range(total):
        if link._rank == RECEIVER:
            signals.send(i)
            dist.recv(view, src=SENDER)
            if tensor.max() != marker(i, kind):
                raise PeerLineError(f"torch_gloo_plain: transfer {i} of {tensor.nbytes} bytes arrived wrong")
            times[i] = clock_ns()
        else:
            signals.recv()
            if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
                rewrite()
                written[i] = clock_ns()
            tensor[-1] = marker(i, kind)
            times[i] = clock_ns()
            dist.send(view, dst=RECEIVER)
    return times


def _plain_job(line: PlainGlooLine, points: list[Point], ctx: RankContext) -> None:
    """One side of the torch_gloo line's plain loop; the receiver reports a record per point."""
    with GlooLink(ctx.cluster, ctx.rank, line.timeout_s) as link:
        run_plain_points(ctx, line.name, points, label(link.describe()), link._sock, filled_tensor,
                         functools.partial(plain_loop, link))


@dataclass
class PlainGlooLine(GlooLine):
    """The ``torch_gloo`` line's calibration (``bench micro --calibrate``): its calls in a plain loop
    (:func:`plain_loop`), measured beside it and never a candidate for ``of_peer``."""

    name: str = "torch_gloo_plain"
    time_reference: ClassVar[bool] = False

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        return self.pair_ranks(_plain_job, points)
