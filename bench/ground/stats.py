"""Statistics that take constant memory however long a run goes on (written once, for ``bench soak``).

A soak runs for minutes or hours to find what grows: a list of every transfer's time would grow by
itself and hide a leak or fake one. So the soak measures with:

* :class:`StreamingStats`: count, sum, min and max kept exactly, percentiles from a histogram of
  fixed, logarithmically spaced buckets (each :data:`RATIO` times as wide as the one before, from
  :data:`LOW` to :data:`HIGH`). A percentile is numpy's (linear interpolation between the two order
  statistics around it) with each order statistic replaced by its bucket's geometric middle: for
  values in ``[LOW, HIGH)`` it is within :data:`RELATIVE_ERROR` (``sqrt(RATIO) - 1``, just under 1%)
  of ``np.percentile`` of the same values. Values outside that range are counted in an end bucket
  and represented by the exact min or max. Its size is fixed (about 11 KB), whatever it has seen.
* :class:`RssTrace`: this process's resident memory over time (not backed by a file: heap and shared
  memory, ``bench.ground.memory.private_mb``; file pages come and go under memory pressure and are no leak),
  at most :attr:`RssTrace.capacity` samples: when full, every other sample goes and the interval
  between samples doubles, so the trace spans the whole run at an ever coarser, still even, spacing.
* :class:`LeakCriterion` judges a trace: memory settles first (the first minute, or the first third
  of a shorter phase: allocator pools, caches and connections fill), then the floor of memory may
  rise at most ``tolerance_mb`` over the judged interval. The floor: the judged interval is cut into
  ``windows`` equal parts, each part's lowest sample is its floor, and the least-squares line through
  the floors gives the rise. What a transfer has in flight (a buffer alive at one sample, gone at the
  next; tens or hundreds of MB while a model's weights are on their way) only ever adds to memory
  above its floor, however often a sample meets it, while what leaks stays and lifts every later
  floor. (A line through all the samples would read buffers in flight more often late in a phase
  as growth.) Memory returns to its floor only when freed memory goes back to the system:
  the soak's processes see to that for large blocks (``bench.ground.memory.return_large_frees``).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from bench.ground.memory import private_mb

#: the histogram's range (in whatever unit the values come in; µs for the soak's transfer times)
LOW, HIGH = 1e-3, 1e9
#: each bucket's upper edge over its lower one
RATIO = 1.02
#: the largest relative difference between a bucket's representative and any value in it
RELATIVE_ERROR = math.sqrt(RATIO) - 1
_LOG_RATIO = math.log(RATIO)
#: buckets between LOW and HIGH, plus one below LOW and one at or above HIGH
_INNER = math.ceil(math.log(HIGH / LOW) / _LOG_RATIO)
BUCKETS = _INNER + 2


def _bucket(value: float) -> int:
    if not value >= LOW:  # NaN and non-positive values too
        return 0
    if value >= HIGH:
        return BUCKETS - 1
    return min(_INNER, int(math.log(value / LOW) / _LOG_RATIO) + 1)


class StreamingStats:
    """Count, sum, min, max and percentiles of a stream of values, in constant memory (see the module)."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf
        self._counts = np.zeros(BUCKETS, dtype=np.int64)

    def add(self, value: float) -> None:
        """Take one value."""
        self.count += 1
        self.total += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        self._counts[_bucket(value)] += 1

    def merge(self, other: StreamingStats) -> None:
        """Take every value ``other`` has seen (as if added here)."""
        self.count += other.count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self._counts += other._counts

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def _representative(self, index: int) -> float:
        """The value standing for every value in bucket ``index``: its geometric middle, within [min, max]."""
        if index == 0:
            middle = self.min
        elif index == BUCKETS - 1:
            middle = self.max
        else:
            middle = LOW * RATIO ** (index - 0.5)
        return min(max(middle, self.min), self.max)

    def _order_statistic(self, rank: int, cumulative: np.ndarray) -> float:
        """The value of the ``rank``-th smallest value seen (0-based), as its bucket's representative."""
        return self._representative(int(np.searchsorted(cumulative, rank, side="right")))

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100) as ``np.percentile`` computes it, within :data:`RELATIVE_ERROR`."""
        if not 0 <= q <= 100:
            raise ValueError(f"percentile {q} is not between 0 and 100")
        if not self.count:
            return math.nan
        position = q / 100 * (self.count - 1)
        below = math.floor(position)
        cumulative = np.cumsum(self._counts)
        low = self._order_statistic(below, cumulative)
        if position == below:
            return low
        high = self._order_statistic(below + 1, cumulative)
        return low + (high - low) * (position - below)

    def summary(self) -> dict[str, float]:
        """``p50_us, p99_us, mean_us, min_us, max_us`` (the names of ``latency_summary``'s columns)."""
        return {"p50_us": self.percentile(50), "p99_us": self.percentile(99), "mean_us": self.mean,
                "min_us": self.min if self.count else math.nan, "max_us": self.max if self.count else math.nan}


# -- memory over time ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeakCriterion:
    """When a process's memory counts as leaking: after settling for ``min(settle_s, settle_share`` of the
    phase``)``, the floor of its resident memory (the lowest sample of each of ``windows`` equal parts of the
    rest, a least-squares line through them) rises more than ``tolerance_mb`` over the rest. A phase with
    fewer than ``min_samples`` samples after settling is too short to judge."""

    settle_s: float = 60.0
    settle_share: float = 1 / 3
    tolerance_mb: float = 2.0
    min_samples: int = 8
    windows: int = 4


@dataclass(frozen=True)
class MemoryVerdict:
    """What a :class:`RssTrace` shows under a :class:`LeakCriterion`.

    ``start_mb``: resident memory once settled (the first sample judged); ``end_mb``: the last sample;
    ``growth_mb``: the floor's rise over the judged ``judged_s`` seconds (``end - start`` when too short
    to judge); ``range_mb``: highest minus lowest sample judged; ``leak``: True or False, None when the
    phase was too short to judge.
    """

    first_mb: float
    start_mb: float
    end_mb: float
    growth_mb: float
    range_mb: float
    judged_s: float
    samples: int
    leak: bool | None

    @property
    def word(self) -> str:
        return {True: "LEAK", False: "flat", None: "too short"}[self.leak]

    def as_dict(self) -> dict[str, float | int | bool | None]:
        return {"first_mb": round(self.first_mb, 2), "start_mb": round(self.start_mb, 2),
                "end_mb": round(self.end_mb, 2), "growth_mb": round(self.growth_mb, 3),
                "range_mb": round(self.range_mb, 2), "judged_s": round(self.judged_s, 1), "samples": self.samples,
                "leak": self.leak}


def _floor_rise(t: np.ndarray, mb: np.ndarray, span: float, windows: int) -> float:
    """How much the floor of ``mb`` (sampled at ``t``, from 0 to ``span``) rises over ``span``: the slope of the
    least-squares line through each window's lowest sample (at the window's middle), times ``span``."""
    part = np.minimum((t / span * windows).astype(int), windows - 1)
    filled = [w for w in range(windows) if np.any(part == w)]
    if len(filled) < 2:
        return float(mb[-1] - mb[0])
    middles = (np.array(filled) + 0.5) * span / windows
    floors = np.array([mb[part == w].min() for w in filled])
    return float(np.polyfit(middles, floors, 1)[0]) * span


class RssTrace:
    """This process's resident memory over time in at most ``capacity`` samples (see the module).

    :meth:`sample` reads the memory when the interval since the last sample has passed (cheap to call
    at every transfer); :meth:`start` (or ``with trace:``) samples from a thread of its own until
    :meth:`stop`, for loops without a place to call it.
    """

    def __init__(self, capacity: int = 256, interval_s: float = 0.25, read=private_mb, clock=time.monotonic) -> None:
        if capacity < 4 or capacity % 2:
            raise ValueError(f"an RssTrace holds an even number of at least 4 samples, not {capacity}")
        self.capacity = capacity
        self.interval_s = self._interval0_s = interval_s
        self._read, self._clock = read, clock
        self._times = np.empty(capacity)
        self._mb = np.empty(capacity)
        self._size = 0
        self._lock = threading.Lock()
        self.last_mb = math.nan
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()

    def sample(self, force: bool = False) -> None:
        """Read the memory now if a sample is due (or ``force``: always, e.g. at the end of a phase)."""
        now = self._clock()
        with self._lock:
            if not force and self._size and now - self._times[self._size - 1] < self.interval_s:
                return
            if self._size == self.capacity:  # every other sample goes, the spacing doubles
                keep = self._size // 2
                self._times[:keep] = self._times[0:self._size:2]
                self._mb[:keep] = self._mb[0:self._size:2]
                self._size = keep
                self.interval_s *= 2
            self.last_mb = self._read()
            self._times[self._size] = now
            self._mb[self._size] = self.last_mb
            self._size += 1

    def restart(self) -> None:
        """Forget every sample so far (and the coarser spacing): the trace begins again now."""
        with self._lock:
            self._size = 0
            self.interval_s = self._interval0_s
        self.sample(force=True)

    def samples(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the sample times (s) and resident memory (MB)."""
        with self._lock:
            return self._times[:self._size].copy(), self._mb[:self._size].copy()

    def judge(self, criterion: LeakCriterion | None = None) -> MemoryVerdict:
        """The trace under ``criterion`` (the default one when None)."""
        criterion = criterion or LeakCriterion()
        times, mb = self.samples()
        if not len(times):
            nan = math.nan
            return MemoryVerdict(nan, nan, nan, nan, nan, 0.0, 0, None)
        settle = min(criterion.settle_s, criterion.settle_share * (times[-1] - times[0]))
        judged = times >= times[0] + settle
        t, m = times[judged], mb[judged]
        span = float(t[-1] - t[0]) if len(t) else 0.0
        if len(t) < max(2, criterion.min_samples) or span <= 0:
            return MemoryVerdict(float(mb[0]), float(mb[0]), float(mb[-1]), float(mb[-1] - mb[0]),
                                 float(mb.max() - mb.min()), span, len(times), None)
        growth = _floor_rise(t - t[0], m, span, criterion.windows)
        return MemoryVerdict(float(mb[0]), float(m[0]), float(m[-1]), growth, float(m.max() - m.min()), span,
                             len(times), growth > criterion.tolerance_mb)

    def start(self) -> RssTrace:
        """Sample from a thread of its own every ``interval_s`` until :meth:`stop` (returns this trace)."""
        if self._watcher is not None:
            raise RuntimeError("this RssTrace is already sampling from a thread")
        self.sample(force=True)
        self._stopping.clear()
        self._watcher = threading.Thread(target=self._watch, name="rss-trace", daemon=True)
        self._watcher.start()
        return self

    def stop(self) -> None:
        """Stop :meth:`start`'s thread, and take a last sample."""
        if self._watcher is not None:
            self._stopping.set()
            self._watcher.join()
            self._watcher = None
        self.sample(force=True)

    def _watch(self) -> None:
        while not self._stopping.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> RssTrace:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
