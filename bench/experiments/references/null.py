"""The ``harness`` reference line (a null transfer): the harness measuring itself.

A sender and a receiver in two processes run the same loops as every transport and peer line (the ready signal
outside the timed interval, the clock, the reduce-max and the marker's check inside it) over a link whose
transfer moves nothing but the news of it: ``send`` stores the transfer's number into a word of memory both
processes map, ``recv`` spins until it sees it and hands back a tensor filled once, with the transfer's marker
written into it. Its time is what the harness adds to every line's (and a cache line's trip between two cores);
a peer line that does more per transfer than its library shows in its distance to it.

The word lives in memory both map (``bench.experiments.micro.shared``): nothing of it is left however the line
ends.

It runs at the sizes checked by the marker alone (below ``FULL_CHECK_BYTES``): a larger transfer is checked byte
for byte, which a transfer that moved nothing cannot pass, and there the harness's share is small anyway.
"""

from __future__ import annotations

import functools
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.experiments.micro import (
    FULL_CHECK_BYTES,
    RECEIVER,
    SENDER,
    STARTUP_S,
    DirectSignals,
    Point,
    content,
    marker,
)
from bench.experiments.micro.shared import make_shared, open_shared
from bench.experiments.peers import PeerLink, drive
from bench.experiments.references.lines import ReferenceLine
from bench.launch import RankContext, RankSpec
from bench.results import MicroRecord
from transports import Inbound, Key, Outbound

#: the shared word: the number of the last transfer sent, plus one (a page: what mmap maps anyway)
_WORD_BYTES = 4096


class NullLink(PeerLink):
    """A link that moves nothing but the news of a transfer: a word of shared memory (see the module docstring)."""

    def __init__(self, ctx: RankContext, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self._filled: str | None = None
        other = RECEIVER - ctx.rank
        if ctx.rank == RECEIVER:

            def tell(path: str, mapped: mmap.mmap) -> None:
                ctx.send_to(other, path)
                ctx.receive(timeout=STARTUP_S)  # the sender mapped it: nothing needs its name any more

            self._map, _ = make_shared(_WORD_BYTES, "bench-harness-", tell)
        else:
            self._map = open_shared(ctx.receive(timeout=STARTUP_S), _WORD_BYTES)
            ctx.send_to(other, "mapped")
        self._word = np.frombuffer(self._map, np.int64, 1)

    def send(self, key: Key, tensor: np.ndarray) -> None:
        self._word[0] = key.step + 1
        self._sent(tensor)

    def recv(self, key: Key) -> np.ndarray:
        self.await_flag(self._word, key.step + 1, key)
        buffer = self.buffer(key)
        if self._filled != key.name:  # once per tensor, at its first (warm-up) transfer: what the sender fills
            buffer.reshape(-1)[:] = content(Point(buffer.nbytes, 0, 0))
            self._filled = key.name
        buffer.reshape(-1)[-1] = marker(key.step, buffer.dtype)
        self._received(buffer)
        return buffer

    def describe(self) -> dict[str, Any]:
        return {"fabric": "none", "used": ["shared memory word"]}

    def outbound(self, name: str, dst: int) -> Outbound:
        return _NullOutbound(self, name, dst)

    def inbound(self, name: str, src: int) -> Inbound:
        return _NullInbound(self, name, src)

    def close(self) -> None:
        del self._word
        self._map.close()


class _NullOutbound(Outbound):
    """The null send per transfer: the transfer's number into the word (what :meth:`NullLink.send` does, without a
    key), as lean as the leanest line's send, so that the line's time is the harness's, not its link's."""

    __slots__ = ("_link", "_word")

    def __init__(self, link: NullLink, name: str, dst: int) -> None:
        super().__init__(link, name, SENDER, dst)
        self._link, self._word = link, link._word

    def send(self, step: int, array: np.ndarray, timeout: float | None = None) -> None:
        self._word[0] = step + 1
        self._link._sent(array)


class _NullInbound(Inbound):
    """The null receive per transfer: a spin until the word says the transfer came, then the tensor (filled once,
    at its first transfer) with the transfer's marker written into it."""

    __slots__ = ("_buffer", "_flat", "_link", "_word")

    def __init__(self, link: NullLink, name: str, src: int) -> None:
        super().__init__(link, name, src, RECEIVER)
        self._link, self._word = link, link._word
        self._buffer: np.ndarray | None = None
        self._flat: np.ndarray | None = None

    def recv(self, step: int, timeout: float | None = None) -> np.ndarray:
        word, want = self._word, step + 1
        if word[0] != want:
            self._link.await_flag(word, want, Key(self.name, step, self.src, self.dst))
        buffer = self._buffer
        if buffer is None:  # at its first (warm-up) transfer: what the sender fills
            buffer = self._buffer = self._link.buffer(Key(self.name, step, self.src, self.dst))
            self._flat = buffer.reshape(-1)
            self._flat[:] = content(Point(buffer.nbytes, 0, 0))
        self._flat[-1] = marker(step, buffer.dtype)
        self._link._received(buffer)
        return buffer


@dataclass
class NullLine(ReferenceLine):
    """The harness alone: two ranks, as a transport's, over :class:`NullLink` (its ranks report a ``Side`` per
    size and the harness times them, not :meth:`measure`)."""

    #: (not "null": pandas reads that name in a CSV as a missing value)
    name: str = "harness"

    def points(self, points: list[Point]) -> list[Point]:
        return [p for p in points if p.size_bytes < FULL_CHECK_BYTES]

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        job = functools.partial(_null_job, self.timeout_s, points)
        return [RankSpec(job, "sender", host=0), RankSpec(job, "receiver", host=1)]

    def measure(self, point: Point, port: int) -> MicroRecord:  # pragma: no cover (its ranks time it)
        raise NotImplementedError("the null line is timed by the harness, over two ranks")


def _null_job(timeout_s: float, points: list[Point], ctx: RankContext) -> None:
    with NullLink(ctx, timeout_s) as link, DirectSignals(ctx) as signals:
        drive(link, points, ctx.rank, signals, ctx.report)
