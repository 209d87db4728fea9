"""The ``socket`` peer: what a plain TCP socket moves, as a user would write it in Python.

The receiver listens on its rank's address; the sender connects (and proves it knows the run's token) once.
A send is one ``sendmsg`` of an 8-byte length and the tensor's bytes (``TCP_NODELAY``: no waiting for more);
a receive reads the length, checks it against the plan, and ``recv_into`` a buffer preallocated per tensor.
No copy in user space on either side (the kernel's are not counted, as for the transports).

Its calibration (``socket_plain``, ``bench micro --calibrate``) is the same stream in a plain loop
(:func:`plain_loop`): no link, no ledger, no harness loop.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from bench.experiments.micro import (
    RECEIVER,
    SENDER,
    DirectSignals,
    Measured,
    Point,
    bind_timing_thread,
    clock_ns,
    fill,
    marker,
)
from bench.experiments.micro.sources import plain_columns, plain_written, rewriter
from bench.experiments.peers import PeerLine, PeerLineError, PeerLink
from bench.experiments.references.running import record
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
from bench.launch import RankContext, RankSpec
from bench.results import latency_summary
from transports import Cluster, Inbound, Key, Outbound


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


def send_message(sock: socket.socket, parts: list[Any]) -> None:
    """``parts`` (the length, the bytes) in one ``sendmsg``; the rest as a stream where the kernel took part."""
    sent = sock.sendmsg(parts)
    prefix, view = parts
    if sent < len(prefix) + view.nbytes:
        if sent < len(prefix):
            sock.sendall(prefix[sent:])
        sock.sendall(view[max(0, sent - len(prefix)):])


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
        self._send([length_prefix(view.nbytes), view], key)
        self._sent(tensor)

    def recv(self, key: Key) -> np.ndarray:
        buffer = self.buffer(key)
        self._receive(memoryview(buffer.reshape(-1)).cast("B"), key)
        self._received(buffer)
        return buffer

    def _send(self, parts: list[Any], key: Any) -> None:
        """One ``sendmsg`` of ``parts`` (the length, the bytes); the rest as a stream where the kernel took part.
        ``key`` names the tensor in an error."""
        try:
            send_message(self._sock, parts)
        except (TimeoutError, OSError) as exc:
            raise PeerLineError(f"socket: sending {key} to the receiver at {self._peer} failed: {exc}") from None

    def _receive(self, view: memoryview, key: Any) -> None:
        """The length, checked against ``view``'s, then the bytes into ``view``. ``key`` names the tensor in an
        error."""
        try:
            length = recv_length(self._sock)
            if length != view.nbytes:
                raise PeerLineError(f"socket: {key} announced {length} bytes, the plan says {view.nbytes}")
            recv_into(self._sock, view)
        except (TimeoutError, OSError, EOFError) as exc:
            raise PeerLineError(f"socket: receiving {key} from the sender at {self._peer} failed: {exc}") from None

    def describe(self) -> dict[str, Any]:
        return {"fabric": "socket", "used": ["tcp"]}

    # (a subclass that changes send or recv, as the tests' faulty links do, gets them per transfer)
    def outbound(self, name: str, dst: int) -> Outbound:
        return _SocketOutbound(self, name, dst) if type(self) is SocketLink else super().outbound(name, dst)

    def inbound(self, name: str, src: int) -> Inbound:
        return _SocketInbound(self, name, src) if type(self) is SocketLink else super().inbound(name, src)

    def close(self) -> None:
        self._sock.close()


class _Named:
    """A transfer as an error names it (``name`` step ``step``), made into text only when one is raised."""

    __slots__ = ("name", "step")

    def __init__(self, name: str) -> None:
        self.name, self.step = name, 0

    def __str__(self) -> str:
        return f"{self.name} step {self.step}"


class _SocketOutbound(Outbound):
    """The ``socket`` line's send per transfer, as a user's loop writes it: one ``sendmsg`` of the length and the
    tensor's bytes, both made once per tensor (a tensor that is not contiguous goes through ``send``)."""

    __slots__ = ("_link", "_named", "_parts", "_tensor")

    def __init__(self, link: SocketLink, name: str, dst: int) -> None:
        super().__init__(link, name, SENDER, dst)
        self._link, self._named = link, _Named(name)
        self._tensor: np.ndarray | None = None
        self._parts: list[Any] = []

    def send(self, step: int, array: np.ndarray, timeout: float | None = None) -> None:
        if array is not self._tensor:
            if not array.flags.c_contiguous:
                self._link.send(Key(self.name, step, self.src, self.dst), array)
                return
            view = memoryview(array.reshape(-1)).cast("B")
            self._parts, self._tensor = [length_prefix(view.nbytes), view], array
        self._named.step = step
        self._link._send(self._parts, self._named)
        self._link._sent(array)


class _SocketInbound(Inbound):
    """The ``socket`` line's receive per transfer: the length, checked against the plan, then ``recv_into`` the
    tensor's buffer, made at its first receive."""

    __slots__ = ("_buffer", "_link", "_named", "_view")

    def __init__(self, link: SocketLink, name: str, src: int) -> None:
        super().__init__(link, name, src, RECEIVER)
        self._link, self._named = link, _Named(name)
        self._buffer: np.ndarray | None = None
        self._view: memoryview | None = None

    def recv(self, step: int, timeout: float | None = None) -> np.ndarray:
        buffer = self._buffer
        if buffer is None:
            buffer = self._buffer = self._link.buffer(Key(self.name, step, self.src, self.dst))
            self._view = memoryview(buffer.reshape(-1)).cast("B")
        self._named.step = step
        self._link._receive(self._view, self._named)
        self._link._received(buffer)
        return buffer


@dataclass
class SocketLine(PeerLine):
    """A plain TCP socket between the two ranks."""

    def link(self, cluster: Cluster, rank: int) -> SocketLink:
        return SocketLink(cluster, rank, self.timeout_s)


# -- the calibration: the same stream as a user's plain loop writes it ----------------------------------------


def plain_loop(sock: socket.socket, signals: DirectSignals, rank: int, tensor: np.ndarray, total: int,
               written: np.ndarray | None = None) -> np.ndarray:
    """``total`` transfers of ``tensor`` over ``sock`` in the ten lines a user writes (the ready signal is every
    line's, :class:`DirectSignals`): the sender's clock at each send, or the receiver's once it consumed it. With
    ``written`` (a fresh source), the sender writes the whole tensor before each send, outside the timed interval,
    and keeps there when each write ended."""
    times, kind, rewrite = np.zeros(total, np.int64), tensor.dtype, rewriter(tensor) if written is not None else None
    view = memoryview(tensor.reshape(-1)).cast("B")
    parts = [length_prefix(view.nbytes), view]
    for i in range(total):
        if rank == RECEIVER:
            signals.send(i)
            if recv_length(sock) != view.nbytes:
                raise PeerLineError(f"socket_plain: transfer {i} announced another length than {view.nbytes}")
            recv_into(sock, view)
            if tensor.max() != marker(i, kind):
                raise PeerLineError(f"socket_plain: transfer {i} of {view.nbytes} bytes arrived wrong")
            times[i] = clock_ns()
        else:
            signals.recv()
            if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
                rewrite()
                written[i] = clock_ns()
            tensor[-1] = marker(i, kind)
            times[i] = clock_ns()
            send_message(sock, parts)
    return times


def _plain_job(line: PlainSocketLine, points: list[Point], ctx: RankContext) -> None:
    """One side of the socket line's plain loop; the receiver reports a record per point."""
    with open_stream(ctx.cluster, ctx.rank, line.timeout_s) as sock:
        run_plain_points(ctx, line.name, points, "socket", sock, filled_tensor,
                         lambda signals, tensor, total, written: plain_loop(sock, signals, ctx.rank, tensor, total,
                                                                            written))


def filled_tensor(point: Point) -> np.ndarray:
    """A plain loop's tensor for ``point``, with data in every page, as a user's tensor holds (``np.zeros``' untouched
    pages are one zero page, which a copy reads from the cache)."""
    tensor = np.empty(point.spec.shape, point.dtype)
    fill(tensor)
    return tensor


def run_plain_points(ctx: RankContext, name: str, points: list[Point], fabric: str, sock: socket.socket,
                     tensor_for: Callable[[Point], np.ndarray],
                     loop: Callable[[DirectSignals, np.ndarray, int, np.ndarray | None], np.ndarray]) -> None:
    """One side of plain loop ``name``: the ready signals made and the timing thread bound as every line's; per
    point, its tensor (``tensor_for``: made, and registered where the library wants), ``loop(signals, tensor,
    transfers, written)`` (``written``: the sender's, for a fresh source's writes, else None) and its record
    (:func:`report_plain_point` over ``sock``)."""
    with DirectSignals(ctx) as signals:
        bind_timing_thread(ctx.rank)  # as every line's ranks are
        for point in points:
            tensor = tensor_for(point)
            written = plain_written(point, ctx.rank)
            times = loop(signals, tensor, point.warmup + point.iters, written)
            report_plain_point(sock, ctx, name, point, times, fabric, written)


def report_plain_point(sock: socket.socket, ctx: RankContext, name: str, point: Point, times: np.ndarray,
                       fabric: str, written: np.ndarray | None = None) -> None:
    """After a plain loop's ``point``: the sender's clocks (``times``, then ``written``: the ends of its fresh
    writes, zeros without) go to the receiver over ``sock``, and the receiver reports the point's record as line
    ``name``'s."""
    if ctx.rank == SENDER:
        sock.sendall(times.tobytes())
        sock.sendall((written if written is not None else np.zeros_like(times)).tobytes())
        return
    starts, written = np.zeros_like(times), np.zeros_like(times)
    recv_into(sock, memoryview(starts).cast("B"))
    recv_into(sock, memoryview(written).cast("B"))
    summary = latency_summary((times - starts)[point.warmup:] / 1e3)
    ctx.report(Measured(point.size_bytes, record(
        name, point.size_bytes, point.warmup, point.iters, **summary,
        throughput_MBps=point.size_bytes / 2**20 / (summary["mean_us"] / 1e6),
        sender_cpu_s=float("nan"), receiver_cpu_s=float("nan"), copied_bytes=0, fabric=fabric,
        **plain_columns(point, starts, written))))


@dataclass
class PlainSocketLine(SocketLine):
    """The ``socket`` line's calibration (``bench micro --calibrate``): its stream in a plain loop
    (:func:`plain_loop`), measured beside it and never a candidate for ``of_peer``."""

    name: str = "socket_plain"
    time_reference: ClassVar[bool] = False

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        return self.pair_ranks(_plain_job, points)
