"""What ``bench micro`` measures and how it checks it: the points (a size with its warm-up and timed transfers)
and the data check (see the package's docstring, *the data check*): the fill pattern, each transfer's stamps and
marker, and the comparison of what arrived with what was sent."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.results.records import MICRO_SOURCES
from transports import TensorSpec
from transports.memory import HOST, Memory
from transports.tensors import ready

#: bytes moved per size when --iters is not given; fewer iterations for large sizes
BYTES_PER_POINT = 2 << 30
MIN_ITERS = 5
MAX_ITERS = 1000

#: a transfer of this many bytes or more is checked byte for byte (see the package's docstring)
FULL_CHECK_BYTES = 64 << 10
#: the fill pattern repeats every PERIOD elements (a prime)
PERIOD = 1_048_573
#: the stamps of a checked transfer: one element per this many bytes
STAMP_BYTES = 4096
#: of a stamped point's transfers, one in this many is checked (stamped, then compared byte for byte); it and the
#: one after it, whose caches the check left cold, are not timed (see the package's docstring)
CHECK_EVERY = 8
#: elements filled or compared at a time (a multiple of every stamp stride)
CHUNK = 1 << 20
#: the ranks of the two sides
SENDER, RECEIVER = 0, 1


@dataclass(frozen=True)
class Point:
    """One size to measure, with its warm-up and timed iteration counts.

    ``seconds``: timed transfers go on for this long instead of ``iters`` of them (the soak).
    ``check``: the receiver compares every element of every tensor with what the sender wrote and
    counts the tensors that differ instead of failing at the first (the soak); otherwise it checks every
    byte of transfers of ``FULL_CHECK_BYTES`` or more and the marker (the maximum) of smaller ones.
    ``extra_copies``: the sender copies the tensor this many more times per transfer, after reading the
    clock (``--extra-copy``: a known slow-down, counted as copied bytes, to check that comparisons catch one).
    ``sender_memory``, ``receiver_memory``: where the tensor lives on each side (``--memory``).
    ``source``: ``fresh``, the sender writes its whole tensor before each transfer, outside the timed interval, or
    ``reused``, only its marker and stamps (``--source``, :mod:`.sources`; :func:`plan_points` plans fresh ones,
    ``bench micro``'s default; a point made directly, as the soak's, reuses its tensor).
    """

    size_bytes: int
    warmup: int
    iters: int
    seconds: float | None = None
    check: bool = False
    extra_copies: int = 0
    sender_memory: Memory = HOST
    receiver_memory: Memory = HOST
    source: str = "reused"

    def __post_init__(self) -> None:
        if self.source not in MICRO_SOURCES:
            raise ValueError(f"source {self.source!r}: choose one of {', '.join(MICRO_SOURCES)}")

    @property
    def fresh(self) -> bool:
        """Whether the sender writes its whole tensor before each transfer (``--source fresh``)."""
        return self.source == "fresh"

    @property
    def dtype(self) -> np.dtype:
        # float32 as tensors usually are; bytes when the size is not a whole number of floats
        return np.dtype(np.float32 if self.size_bytes % 4 == 0 else np.uint8)

    @property
    def stamped(self) -> bool:
        """Whether it is large enough for byte-for-byte checks: one transfer in ``CHECK_EVERY`` (every one in the
        soak) stamped by the sender and compared by the receiver (see the package's docstring)."""
        return self.size_bytes >= FULL_CHECK_BYTES

    def checked(self, i: int) -> bool:
        """Whether transfer ``i`` is stamped by the sender and compared byte for byte by the receiver: every one of
        the soak (``check``), one in ``CHECK_EVERY`` of a stamped point (the first of the point among them)."""
        return self.check or (self.stamped and i % CHECK_EVERY == 0)

    def timed(self, i: int) -> bool:
        """Whether transfer ``i`` is timed: past the warm-up, and neither a checked transfer (its stamps are the
        sender's work just before it) nor the one after it (the check read the whole tensor and left the caches
        cold), unless every transfer is checked (the soak times them as they are)."""
        if i < self.warmup:
            return False
        return self.check or not self.stamped or i % CHECK_EVERY > 1

    @property
    def transfers(self) -> int:
        """The transfers a point of ``iters`` timed ones takes, warm-up and checked transfers included."""
        if self.check or not self.stamped:
            return self.warmup + self.iters
        i = timed = 0
        while timed < self.iters:
            timed += self.timed(i)
            i += 1
        return i

    @property
    def spec(self) -> TensorSpec:
        shape = (self.size_bytes // self.dtype.itemsize,)
        return TensorSpec(f"tensor_{self.size_bytes}", shape, self.dtype, SENDER, RECEIVER, self.sender_memory,
                          self.receiver_memory)


def plan_points(sizes: list[int], iters: int | None = None, warmup: int | None = None,
                memory: tuple[Memory, Memory] = (HOST, HOST), source: str = "fresh") -> list[Point]:
    """Iteration counts per size: ``iters`` for all when given, else about 2 GiB of traffic per size; the tensor
    in ``memory`` (the sender's, the receiver's), its ``source`` fresh or reused (``--source``)."""
    points = []
    for size in sizes:
        n = iters if iters is not None else max(MIN_ITERS, min(MAX_ITERS, BYTES_PER_POINT // size))
        w = warmup if warmup is not None else max(1, min(10, n // 10))
        points.append(Point(size, w, n, sender_memory=memory[0], receiver_memory=memory[1], source=source))
    return points


def on_host(tensor: Any) -> np.ndarray:
    """``tensor``'s values in host memory: itself, or a device tensor's copied off its device (outside any timed
    interval: the data check)."""
    return tensor if type(tensor) is np.ndarray else tensor.get()


class DeviceSource:
    """The sender's tensor in device memory, written as :func:`fill` and :func:`prepare` write a host one: they
    write a host mirror, and what changed crosses to the device before the clock is read (the whole tensor for a
    checked transfer, else the marker)."""

    def __init__(self, tensor: Any) -> None:
        self.flat = tensor.reshape(-1)
        self.mirror = np.empty(self.flat.shape, self.flat.dtype)
        fill(self.mirror)
        self.flat.set(self.mirror)

    def mark(self, point: Point, i: int) -> None:
        if point.checked(i):
            prepare(self.mirror, point, i)
            self.flat.set(self.mirror)
        else:
            self.mirror[-1] = marker(i, self.mirror.dtype)
            self.flat[-1:].set(self.mirror[-1:])
        ready(self.flat)  # the copy is done before the clock is read, not by the send's own wait for its tensor


def marker(i: int, dtype: np.dtype) -> float:
    """The value the sender writes into the last element of transfer ``i``: the tensor's maximum."""
    return float(2 + i % 250) if dtype == np.uint8 else float(2 + i)


@functools.cache
def _pattern(dtype: np.dtype) -> np.ndarray:
    """The fill pattern's period, followed by its first ``CHUNK`` elements again: any ``CHUNK`` elements of
    the pattern are one slice of it. Values below 1 (float32) or 0 and 1 (uint8): below every marker."""
    rng = np.random.default_rng(2019)
    if dtype == np.uint8:
        period = rng.integers(0, 2, size=PERIOD, dtype=np.uint8)
    else:
        period = rng.random(PERIOD, dtype=np.float32)
    pattern = np.concatenate([period, period[:CHUNK]])
    pattern.flags.writeable = False
    return pattern


def _stamps(i: int, pages: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The stamps of transfer ``i`` on ``pages`` (indices of its 4 KiB pieces): a hash of the page and the
    transfer, below 1 (float32) or 0 and 1 (uint8), different in every page from transfer ``i - 1``'s."""
    mixed = (pages.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)  # 24 bits
    if dtype == np.uint8:
        return ((mixed + np.uint64(i & 1)) & np.uint64(1)).astype(np.uint8)
    mixed = (mixed + np.uint64((i * 0x3779B1) & 0xFFFFFF)) & np.uint64(0xFFFFFF)
    return mixed.astype(np.float32) / np.float32(1 << 24)


def _stride(dtype: np.dtype) -> int:
    return STAMP_BYTES // dtype.itemsize


def content(point: Point) -> np.ndarray:
    """What the sender puts in the tensor of ``point`` before stamps and marker: the same on both sides.

    The whole tensor at once (for small points and tests); the sender fills its tensor in chunks (:func:`fill`).
    """
    return np.resize(_pattern(point.dtype)[:PERIOD], point.spec.shape[0])


def fill(flat: np.ndarray) -> None:
    """Write the fill pattern into ``flat`` (a 1-D tensor), a chunk at a time."""
    pattern = _pattern(flat.dtype)
    for start in range(0, flat.size, CHUNK):
        count = min(CHUNK, flat.size - start)
        offset = start % PERIOD
        flat[start : start + count] = pattern[offset : offset + count]


def prepare(flat: np.ndarray, point: Point, i: int) -> None:
    """Before transfer ``i``: its stamps (a checked point's) and its marker, into the sender's filled tensor."""
    if point.stamped:
        stride = _stride(flat.dtype)
        flat[::stride] = _stamps(i, np.arange(-(-flat.size // stride)), flat.dtype)
    flat[-1] = marker(i, flat.dtype)


def first_wrong(flat: np.ndarray, point: Point, i: int) -> int | None:
    """The index of the first element of ``flat`` (transfer ``i`` of ``point``, as received) that differs from
    what the sender wrote, or None. Compared as integers (every bit: -0.0 is not 0.0), a chunk at a time."""
    dtype = flat.dtype
    pattern, stride = _pattern(dtype), _stride(dtype)
    bits = np.dtype(f"u{dtype.itemsize}")
    expected = np.empty(min(CHUNK, flat.size), dtype)
    for start in range(0, flat.size, CHUNK):
        count = min(CHUNK, flat.size - start)
        offset = start % PERIOD
        want = expected[:count]
        want[...] = pattern[offset : offset + count]
        if point.stamped:  # chunks start on a stamp: CHUNK is a multiple of the stride
            first = start // stride
            want[::stride] = _stamps(i, np.arange(first, first + -(-count // stride)), dtype)
        if start + count == flat.size:
            want[-1] = marker(i, dtype)
        got = flat[start : start + count]
        if not np.array_equal(got.view(bits), want.view(bits)):
            return start + int(np.flatnonzero(got.view(bits) != want.view(bits))[0])
    return None

