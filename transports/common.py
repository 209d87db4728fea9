"""Helpers that both the transports and the fabric beneath them use, written once.

This module imports nothing of the project: ``transports/base.py`` (the transport layer) and
``transports/fabric/`` (the layer below it) both build on it.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from typing import Any, NamedTuple

import numpy as np


class Availability(NamedTuple):
    """Whether a transport or a fabric backend can run on this machine, and if not, why."""

    ok: bool
    reason: str = ""


def settle(future: Future, result: Any = None, error: BaseException | None = None) -> bool:
    """Complete ``future`` unless it is already done; returns whether this call completed it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True


def done_future(result: Any = None) -> Future:
    """A future that is already done, with ``result``."""
    future: Future = Future()
    future.set_result(result)
    return future


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an ``alignment``-byte boundary (TensorFlow wants 64)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    backing = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -backing.ctypes.data % alignment
    return backing[start : start + nbytes].view(dtype).reshape(shape)
