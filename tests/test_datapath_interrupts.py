"""An interrupt (SIGTERM in a rank: SystemExit) that lands while the micro-benchmark's harness waits for a signal
ends the rank as the interrupt says, not with a BufferError from closing memory the unwinding wait still views."""

from __future__ import annotations

import mmap
import signal
import socket

import numpy as np
import pytest

from bench.experiments.micro.loops import DirectSignals


def _signals_over_a_ring() -> DirectSignals:
    """The harness's signals over a ring of words in memory of their own (as two ranks on one host share it)."""
    signals = DirectSignals.__new__(DirectSignals)
    signals.sock, other = socket.socketpair()
    other.close()
    signals.poll_s, signals._taken, signals._buffer = 0.0, 0, bytearray(DirectSignals._SIGNAL.size)
    signals._map = mmap.mmap(-1, 8 * (2 + DirectSignals.RING))
    signals._ring = np.frombuffer(signals._map, np.int64, 2 + DirectSignals.RING)
    return signals


def test_an_interrupt_during_a_wait_for_a_signal_ends_as_the_interrupt_says():
    def interrupt(signum, frame):
        raise SystemExit(128 + signum)  # as a rank's SIGTERM handler (bench/launch/rank.py)

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.2)  # no signal ever comes: the wait is interrupted
    try:
        with pytest.raises(SystemExit) as raised, _signals_over_a_ring() as signals:
            signals.recv()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert raised.value.code == 128 + signal.SIGALRM
    assert signals._map is None and signals.sock.fileno() == -1
