"""Waiting on memory that peers write: flags and counters in registered memory, polled from Python.

A one-sided write raises no event at its target, so a receiver learns of it by looking at the
memory. These waits spin for a moment (:data:`SPIN_S`, yielding the GIL on every round), then nap
in growing steps up to :data:`MAX_NAP_S` (``time.sleep`` releases the GIL), so an idle waiter burns
no core. Each takes a ``threading.Event`` that :meth:`Device.interrupt_waits` sets: the wait then
raises FabricInterrupted. They are ``Device``'s default waits (``base.py``): any backend without waits of its
own (in C, as UCX has) uses them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from transports.fabric.errors import FabricInterrupted
from transports.fabric.plans import FlagSet

#: how long a wait spins, holding its core, before it sleeps: a transfer that lands within it is seen at once
DEFAULT_SPIN_S = 0.0005
#: ... where the process shares the machine's cores with compute (``Device.share_cores``): a moment, then the
#: core goes back to the compute and the wait is woken by the write (a doorbell) or its naps
SHARED_SPIN_S = 0.00002
#: how long a waiter polls without sleeping (unless its device says otherwise: ``Device.spin_s``)
SPIN_S = DEFAULT_SPIN_S
#: the first nap after the spin, doubled on every idle round up to MAX_NAP_S
FIRST_NAP_S = 0.00005
MAX_NAP_S = 0.001

T = TypeVar("T")


def poll_until(check: Callable[[], T | None], timeout: float, stop: threading.Event, who: str,
               spin_s: float = SPIN_S) -> T | None:
    """``check()``'s first result that is not None, or None after ``timeout`` seconds (polled without sleeping for
    ``spin_s`` first).

    FabricInterrupted (naming ``who``, the backend) once ``stop`` is set.
    """
    start = time.monotonic()
    deadline = start + max(timeout, 0.0)
    spin_until = start + spin_s
    nap = FIRST_NAP_S
    while True:
        if stop.is_set():
            raise FabricInterrupted(f"{who}: the wait was interrupted (the device is closing)")
        found = check()
        if found is not None:
            return found
        now = time.monotonic()
        if now >= deadline:
            return None
        if now < spin_until:
            time.sleep(0)
        else:
            time.sleep(min(nap, deadline - now))
            nap = min(nap * 2, MAX_NAP_S)


def wait_counter(counter: np.ndarray, above: int, timeout: float, stop: threading.Event, who: str,
                 spin_s: float = SPIN_S) -> bool:
    """Whether the uint64 ``counter[0]`` exceeded ``above`` within ``timeout`` seconds."""
    return poll_until(lambda: True if int(counter[0]) > above else None, timeout, stop, who, spin_s) is not None


def wait_counters(counters: list[np.ndarray], above: list[int], timeout: float, stop: threading.Event,
                  who: str, spin_s: float = SPIN_S) -> int | None:
    """The index of a counter that exceeds its ``above`` (the first such), or None after ``timeout``."""
    if len(counters) != len(above):
        raise ValueError(f"{len(counters)} counters but {len(above)} thresholds")

    def raised() -> int | None:
        for index, (counter, limit) in enumerate(zip(counters, above, strict=True)):
            if int(counter[0]) > limit:
                return index
        return None

    return poll_until(raised, timeout, stop, who, spin_s)


class PolledFlagSet(FlagSet):
    """Flag bytes (one-byte views of registered memory; a nonzero byte is raised) polled together."""

    def __init__(self, flags: list[np.ndarray], stop: threading.Event, who: str, spin_s: float = SPIN_S) -> None:
        self._flags = flags
        self._done = [False] * len(flags)
        self._stop = stop
        self._who = who
        self._spin_s = spin_s

    def _raised(self) -> int | None:
        for index, flag in enumerate(self._flags):
            if not self._done[index] and flag[0]:
                return index
        return None

    def wait_any(self, timeout: float) -> int | None:
        return poll_until(self._raised, timeout, self._stop, self._who, self._spin_s)

    def done(self, index: int) -> None:
        self._done[index] = True

    def reset(self) -> None:
        self._done = [False] * len(self._flags)
