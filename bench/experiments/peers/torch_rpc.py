"""The ``torch_rpc`` peer: PyTorch's ``torch.distributed.rpc`` over TensorPipe, as a user carries a tensor to another
process: the sender's ``rpc.rpc_sync(receiver, arrived, args=(tensor,))``, and on the receiver a function
(:func:`arrived`) that takes the tensor and signals that it is here.

The harness's NumPy tensor goes in through ``torch.from_numpy`` (the same memory, no copy); the receiver gets the
tensor TensorPipe made for it and hands its NumPy view (no copy) to the harness, which checks its content. The
TensorPipe transports and channels are given, not left to TensorPipe's choice, and named in every record's
``fabric`` column (``tensorpipe:shm,cma``): ``cma`` for the tensor (the receiver's kernel reads the sender's
tensor: one copy, in the kernel) and, for the messages, ``shm`` (shared-memory rings) where both ranks share a
network namespace, ``uv`` (TCP) where they do not (two emulated hosts of one machine), ``ibv`` where an RDMA port
is up.

The RPC agents' store (rank 0's ``TCPStore``) and TensorPipe's listeners have no token, so the line runs on
private hosts, as Mooncake's and perftest's do (:func:`bench.launch.private.hosts_for_open_listeners`); the store's
port goes to the receiver over the ``socket`` peer's stream, authenticated with the run's token.

Its calibration (``torch_rpc_plain``, ``bench micro --calibrate``) is the same calls in a plain loop
(:func:`plain_loop`). Install: ``pip install -e '.[torch]'``.
"""

from __future__ import annotations

import functools
import os
import queue
import socket
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from bench.experiments.micro import RECEIVER, SENDER, DirectSignals, Point, clock_ns, marker
from bench.experiments.micro.sources import rewriter
from bench.experiments.peers import PeerLine, PeerLineError, PeerLink
from bench.experiments.peers.plain_socket import filled_tensor, open_stream, run_plain_points
from bench.experiments.peers.torch_gloo import INSTALL, bind_here, exchange_port, torch_missing
from bench.experiments.stream import recv_message, send_message
from bench.launch import Launcher, RankContext, RankSpec
from bench.launch.private import PrivateHosts, hosts_for_open_listeners
from transports import Cluster, Key
from transports.common import Availability
from transports.fabric import label

#: the agents' names, by rank
NAMES = ("sender", "receiver")
#: the tensors that arrived at the receiver, in order (:func:`arrived` puts them here)
_ARRIVED: queue.SimpleQueue = queue.SimpleQueue()


def arrived(tensor: Any) -> None:
    """The receiver's function: ``tensor`` is here (what a user's RPC target does: take it, and say so)."""
    _ARRIVED.put(tensor)


def tensorpipe_choice(shared_network: bool) -> tuple[list[str], list[str]]:
    """The TensorPipe transports and channels this line gives: ``cma`` for the tensors (both ranks on one machine);
    for the messages ``ibv`` where an RDMA port is up, else ``shm`` where both ranks share a network namespace (its
    rings meet on an abstract socket, which is the namespace's), else ``uv`` (TCP)."""
    try:
        from transports.fabric.rdma_devices import active_ports, read_devices

        rdma = bool(active_ports(read_devices()))
    except (ImportError, OSError):
        rdma = False
    return (["ibv"] if rdma else ["shm"] if shared_network else ["uv"]), ["cma"]


_NAMESPACE = struct.Struct("<Q")


def shares_network(sock: socket.socket, rank: int) -> bool:
    """Whether both ranks run in one network namespace (each sends its own's number over ``sock``)."""
    own = os.stat("/proc/self/ns/net").st_ino
    if rank == SENDER:
        send_message(sock, _NAMESPACE.pack(own))
        other = _NAMESPACE.unpack(recv_message(sock, _NAMESPACE.size))[0]
    else:
        other = _NAMESPACE.unpack(recv_message(sock, _NAMESPACE.size))[0]
        send_message(sock, _NAMESPACE.pack(own))
    return own == other


def _free_port(host: str) -> int:
    """A port nothing listens on at ``host`` now (the store's master takes it next)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class RpcLink(PeerLink):
    """One side of a two-agent TensorPipe RPC group: ``rpc_sync`` of :func:`arrived` per transfer."""

    def __init__(self, cluster: Cluster, rank: int, timeout_s: float) -> None:
        super().__init__(timeout_s)
        import torch
        from torch.distributed import rpc

        self._torch, self._rpc, self._rank = torch, rpc, rank
        host = bind_here(cluster, rank)
        master = cluster.addresses[SENDER].rpartition(":")[0].strip("[]")
        try:
            self._sock = open_stream(cluster, rank, timeout_s)
        except PeerLineError as exc:
            raise PeerLineError(f"torch_rpc: {exc}") from None
        self.transports, self.channels = tensorpipe_choice(shares_network(self._sock, rank))
        try:
            port = exchange_port(self._sock, rank, SENDER, _free_port(host) if rank == SENDER else 0)
            options = rpc.TensorPipeRpcBackendOptions(
                init_method=f"tcp://{master}:{port}", rpc_timeout=timeout_s, num_worker_threads=4,
                _transports=self.transports, _channels=self.channels)
            rpc.init_rpc(NAMES[rank], rank=rank, world_size=2, rpc_backend_options=options)
        except (RuntimeError, ValueError, OSError) as exc:
            self._sock.close()
            raise PeerLineError(f"torch_rpc: the RPC agents did not start on {host}: {exc}") from None
        self._to = NAMES[RECEIVER]

    def send(self, key: Key, tensor: np.ndarray) -> None:
        self._rpc.rpc_sync(self._to, arrived, args=(self._torch.from_numpy(np.ascontiguousarray(tensor)),))
        self._sent(tensor)

    def recv(self, key: Key) -> np.ndarray:
        try:
            tensor = _ARRIVED.get(timeout=self.timeout_s)
        except queue.Empty:
            raise PeerLineError(f"torch_rpc: {key}: nothing arrived within {self.timeout_s:.0f} s") from None
        received = tensor.numpy()
        _, _, nbytes = self.planned(key)
        if received.nbytes != nbytes:
            raise PeerLineError(f"torch_rpc: {key} arrived with {received.nbytes} bytes, the plan says {nbytes}")
        self._received(received)
        return received

    def describe(self) -> dict[str, Any]:
        return {"fabric": "tensorpipe", "used": [*self.transports, *self.channels]}

    def close(self, graceful: bool = True) -> None:
        """The agent shut down: gracefully (both sides wait for each other) unless this side failed, whose other
        side may wait on it for something else."""
        try:
            self._rpc.shutdown(graceful=graceful, timeout=self.timeout_s)
        finally:
            self._sock.close()

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(graceful=kind is None)


@dataclass
class RpcLine(PeerLine):
    """PyTorch's torch.distributed.rpc over TensorPipe: rpc_sync carrying the tensor."""

    module: ClassVar[str] = "torch"
    install: ClassVar[str] = INSTALL

    def availability(self) -> Availability:
        why = torch_missing("tensorpipe")
        return Availability(why is None, why or "")

    def hosts(self, launcher: Launcher) -> PrivateHosts:
        return hosts_for_open_listeners(launcher, "torch.distributed.rpc's TCPStore and TensorPipe listeners",
                                        "--peers without torch_rpc")

    def link(self, cluster: Cluster, rank: int) -> RpcLink:
        return RpcLink(cluster, rank, self.timeout_s)


# -- the calibration: the same calls as a user's plain loop writes them --------------------------------------------


def plain_loop(link: RpcLink, signals: DirectSignals, tensor: np.ndarray, total: int,
               written: np.ndarray | None = None) -> np.ndarray:
    """``total`` transfers of ``tensor`` with ``rpc_sync`` in the lines a user writes, and every line's ready signal:
    the sender's clock at each call, or the receiver's once it checked what arrived. With ``written`` (a fresh
    source), the sender writes the whole tensor before each call, outside the timed interval, and keeps there when
    each write ended."""
    times, kind = np.zeros(total, np.int64), tensor.dtype
    if link._rank == RECEIVER:
        for i in range(total):
            signals.send(i)
            received = _ARRIVED.get(timeout=link.timeout_s).numpy()
            if received.nbytes != tensor.nbytes or received.max() != marker(i, kind):
                raise PeerLineError(f"torch_rpc_plain: transfer {i} of {tensor.nbytes} bytes arrived wrong")
            times[i] = clock_ns()
        return times
    rewrite = rewriter(tensor) if written is not None else None
    rpc_sync, to, args = link._rpc.rpc_sync, link._to, (link._torch.from_numpy(tensor),)
    for i in range(total):
        signals.recv()
        if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
            rewrite()
            written[i] = clock_ns()
        tensor[-1] = marker(i, kind)
        times[i] = clock_ns()
        rpc_sync(to, arrived, args=args)
    return times


def _plain_job(line: PlainRpcLine, points: list[Point], ctx: RankContext) -> None:
    """One side of the torch_rpc line's plain loop; the receiver reports a record per point."""
    with RpcLink(ctx.cluster, ctx.rank, line.timeout_s) as link:
        run_plain_points(ctx, line.name, points, label(link.describe()), link._sock, filled_tensor,
                         functools.partial(plain_loop, link))


@dataclass
class PlainRpcLine(RpcLine):
    """The ``torch_rpc`` line's calibration (``bench micro --calibrate``): its calls in a plain loop
    (:func:`plain_loop`), measured beside it and never a candidate for ``of_peer``."""

    name: str = "torch_rpc_plain"
    time_reference: ClassVar[bool] = False

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        return self.pair_ranks(_plain_job, points)
