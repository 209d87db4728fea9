"""The ``nixl`` peer: NVIDIA's NIXL (the inference transfer library of Dynamo) moving host memory over its UCX
backend, as its examples do: both sides make an agent (no progress thread: the caller's checks progress it), the
receiver registers a buffer per tensor and hands its descriptors to the sender, and each transfer is a ``WRITE``
from the sender's registered tensor into the receiver's with a notification (the transfer's number); the sender
waits for the write to complete, the receiver for the notification.

Agents' metadata and the receiver's descriptors go over a TCP stream between the two ranks (the ``socket`` peer's,
authenticated with the run's token), once per tensor, outside the timed transfers (at a tensor's first transfer,
a warm-up one). The sender's tensor is registered at its first send; both sides' registrations are released at
the next tensor's and on close.

With ``--memory cuda`` the tensors are NIXL's ``VRAM`` segments (nixlbench's ``--initiator_seg_type`` and
``--target_seg_type``): each side's in the memory its plan names, registered and written device to device.

Install: NIXL's wheels declare torch and CUDA packages that host memory does not need:
``pip install --no-deps nixl nixl-cu12`` (NIXL's UCX comes inside ``nixl-cu12``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from bench.experiments.micro import RECEIVER, DirectSignals, MicroLine, Point, clock_ns, marker
from bench.experiments.micro.sources import rewriter
from bench.experiments.peers import PeerLine, PeerLineError, PeerLink
from bench.experiments.peers.plain_socket import filled_tensor, open_stream, run_plain_points
from bench.experiments.stream import recv_message, send_message
from bench.launch import RankContext, RankSpec
from transports import Cluster, Key
from transports.memory import Memory, memory_of
from transports.tensors import data_pointer, empty

#: the install line of a missing NIXL
INSTALL = "pip install --no-deps nixl nixl-cu12 (its wheels declare torch and CUDA, which host memory does not need)"


class NixlLink(PeerLink):
    """One side of a NIXL link: an agent each, a WRITE and a notification per transfer."""

    def __init__(self, cluster: Cluster, rank: int, timeout_s: float) -> None:
        super().__init__(timeout_s)
        from nixl._api import nixl_agent, nixl_agent_config

        self._rank = rank
        self._names = ("sender", "receiver")
        self._agent = nixl_agent(self._names[rank], nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        try:
            self._sock = open_stream(cluster, rank, timeout_s)
        except PeerLineError as exc:
            raise PeerLineError(f"nixl: {exc}") from None
        send_message(self._sock, self._agent.get_agent_metadata())
        remote = self._agent.add_remote_agent(recv_message(self._sock))
        self._remote = remote.decode() if isinstance(remote, bytes) else remote  # notifications are keyed by str
        self._tensor_of: str | None = None
        self._notes: set[bytes] = set()  # notifications come in, not yet waited for
        self._registered: Any = None
        self._buffer: np.ndarray | None = None
        self._xfer: Any = None
        self._local: Any = None

    def _open(self, key: Key, tensor: np.ndarray | None = None) -> None:
        """Register ``key``'s tensor (the sender's ``tensor``; a new buffer on the receiver) and, on the sender, make
        the transfer into the receiver's buffer, whose descriptors the receiver sends."""
        if self._tensor_of == key.name:
            return
        self._release()
        if self._rank == RECEIVER:
            shape, dtype, _ = self.planned(key)
            spec = self.placement.spec(key.name, key.src, key.dst)
            tensor = empty(shape, dtype, spec.dst_memory)
            if type(tensor) is np.ndarray:
                tensor.reshape(-1).view(np.uint8)[::4096] = 0  # resident before it is registered
        self._register(tensor)
        self._tensor_of = key.name

    def _register(self, tensor: np.ndarray) -> None:
        """Register ``tensor``: the receiver's buffer, whose descriptors go to the sender, or the sender's tensor,
        with the transfer into the receiver's buffer made."""
        segment = _segment(tensor)
        if self._rank == RECEIVER:
            self._buffer = tensor
            self._registered = self._agent.register_memory([(*_region(tensor), "")], segment)
            descs = self._agent.get_xfer_descs([_region(tensor)], segment)
            # the sender learns of the new registration (its remote keys), then where to write
            send_message(self._sock, self._agent.get_partial_agent_metadata(self._registered, False, ["UCX"]))
            send_message(self._sock, self._agent.get_serialized_descs(descs))
        else:
            self._registered = self._agent.register_memory([(*_region(tensor), "")], segment)
            self._agent.add_remote_agent(recv_message(self._sock))
            remote = self._agent.deserialize_descs(recv_message(self._sock))
            self._local = self._agent.get_xfer_descs([_region(tensor)], segment)
            self._xfer = self._agent.initialize_xfer("WRITE", self._local, remote, self._remote, b"0")

    def send(self, key: Key, tensor: np.ndarray) -> None:
        self._open(key, tensor)
        state = self._agent.transfer(self._xfer, str(key.step + 1).encode())
        deadline = time.monotonic() + self.timeout_s
        while state == "PROC":
            state = self._agent.check_xfer_state(self._xfer)
            if state == "PROC" and time.monotonic() > deadline:
                raise PeerLineError(f"nixl: writing {key} to the receiver did not complete within "
                                    f"{self.timeout_s:.0f} s")
        if state != "DONE":
            raise PeerLineError(f"nixl: writing {key} to the receiver failed ({state})")
        self._sent(tensor)

    def recv(self, key: Key) -> np.ndarray:
        self._open(key)
        want = str(key.step + 1).encode()
        deadline = time.monotonic() + self.timeout_s
        # new notifications only (check_remote_xfer_done keeps a growing map and took 16-24 ms per transfer here)
        while want not in self._notes:
            self._notes.update(self._agent.get_new_notifs().get(self._remote, ()))
            if time.monotonic() > deadline:
                raise PeerLineError(f"nixl: {key}: no notification from the sender within {self.timeout_s:.0f} s")
        self._notes.discard(want)
        self._received(self._buffer)
        return self._buffer

    def describe(self) -> dict[str, Any]:
        return {"fabric": "nixl", "used": ["ucx"]}

    def _release(self) -> None:
        if self._xfer is not None:
            self._agent.release_xfer_handle(self._xfer)
            self._xfer = None
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None
        self._buffer, self._tensor_of = None, None

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the agent goes with the process; a failed release must not hide why
            self._release()
            self._agent.remove_remote_agent(self._remote)
        self._sock.close()


def _region(array: Any) -> tuple[int, int, int]:
    """NIXL's descriptor of a tensor: address, length, device (0 for host memory)."""
    return data_pointer(array), array.nbytes, memory_of(array).device


def _segment(array: Any) -> str:
    """NIXL's segment type of a tensor's memory: DRAM or VRAM."""
    return "VRAM" if memory_of(array).is_device else "DRAM"


@dataclass
class NixlLine(PeerLine):
    """NIXL's WRITE with a notification, over its UCX backend."""

    module: ClassVar[str] = "nixl"
    install: ClassVar[str] = INSTALL

    def link(self, cluster: Cluster, rank: int) -> NixlLink:
        return NixlLink(cluster, rank, self.timeout_s)

    def memory_problem(self, memory: tuple[Memory, Memory]) -> str | None:
        return None  # DRAM or VRAM segments on each side


# -- the calibration: the same writes as a user's plain loop writes them ---------------------------------------


def plain_loop(link: NixlLink, signals: DirectSignals, tensor: np.ndarray, total: int,
               written: np.ndarray | None = None) -> np.ndarray:
    """``total`` transfers of ``tensor`` (registered, the sender's transfer made: :meth:`NixlLink._register`) in
    the lines a user writes with NIXL's agent, and every line's ready signal: the sender's clock at each
    ``transfer``, or the receiver's once it consumed the tensor. No ledger, no deadline checks, no key. With
    ``written`` (a fresh source), the sender writes the whole tensor before each transfer, outside the timed
    interval, and keeps there when each write ended."""
    agent, xfer, remote = link._agent, link._xfer, link._remote
    times, kind = np.zeros(total, np.int64), tensor.dtype
    rewrite = rewriter(tensor) if written is not None else None
    notes: set[bytes] = set()
    for i in range(total):
        note = str(i + 1).encode()
        if link._rank == RECEIVER:
            signals.send(i)
            while note not in notes:
                notes.update(agent.get_new_notifs().get(remote, ()))
            notes.discard(note)
            if tensor.max() != marker(i, kind):
                raise PeerLineError(f"nixl_plain: transfer {i} of {tensor.nbytes} bytes arrived wrong")
            times[i] = clock_ns()
        else:
            signals.recv()
            if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
                rewrite()
                written[i] = clock_ns()
            tensor[-1] = marker(i, kind)
            times[i] = clock_ns()
            state = agent.transfer(xfer, note)
            while state == "PROC":
                state = agent.check_xfer_state(xfer)
            if state != "DONE":
                raise PeerLineError(f"nixl_plain: transfer {i} failed ({state})")
    return times


def _plain_job(line: PlainNixlLine, points: list[Point], ctx: RankContext) -> None:
    """One side of the nixl line's plain loop: the agents and registrations made as the line makes them, outside
    the loop; the receiver reports a record per point."""
    with NixlLink(ctx.cluster, ctx.rank, line.timeout_s) as link:

        def registered(point: Point) -> np.ndarray:
            tensor = filled_tensor(point)
            link._release()
            link._register(tensor)
            return tensor

        run_plain_points(ctx, line.name, points, "nixl", link._sock, registered,
                         functools.partial(plain_loop, link))


@dataclass
class PlainNixlLine(NixlLine):
    """The ``nixl`` line's calibration (``bench micro --calibrate``): its writes in a plain loop
    (:func:`plain_loop`), measured beside it and never a candidate for ``of_peer``."""

    name: str = "nixl_plain"
    time_reference: ClassVar[bool] = False
    #: its loop writes and reads host memory (the calibration of host runs)
    memory_problem = MicroLine.memory_problem

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        return self.pair_ranks(_plain_job, points)
