"""The sender's tensor as training has it, or as OSU and nccl-tests have it (``bench micro --source``).

``fresh`` (``bench micro``'s default): before each transfer, after the receiver's ready signal and before the sender
reads its clock (``t_send``), so outside the timed interval, the sender writes its whole tensor, as a backward pass
writes a gradient every step: every cache line of the source is modified in the sender's cache, and a transport
that reads it from there (or a receiver whose cache held an unchanged copy from the last transfer) pays what it
pays in training. The write keeps every value (the data check's fill pattern, stamps and marker): an in-place OR
with 0 of the tensor's bits (:func:`rewriter`), which stores every element. Measured here, one 2-core VM, best of
5: 1KB 0.7 µs, 64KB 1.6 µs, 1MB 13 µs, 64MB 2.2 ms, as ``np.multiply(x, 1, out=x)`` (floats only: a
signalling NaN would change), while ``np.copyto(x, x)`` took 0.2 µs at every size: it stores nothing.

``reused``: the tensor is written only where the harness marks it (the marker, a checked transfer's stamps), as OSU's
and nccl-tests' loops send one buffer again and again; the tools with loops of their own (``ucx_perftest``,
perftest's ``ib_write_*``) reuse theirs whatever ``--source`` says, and their records say so.

Each record says which (``source``), how many whole writes the sender made over the point (``source_writes``: one
per transfer, warm-up included, when fresh; 0 reused), and the least time from the end of one to the clock read
that starts its transfer, over the timed transfers (``source_write_lead_min_us``: at or above 0, each write was over
before its transfer's clock started): :func:`source_columns`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.results.records import MICRO_SOURCES
from transports.memory import array_module
from transports.tensors import ready

FRESH, REUSED = MICRO_SOURCES
#: ``bench micro --source``'s default: training never sends an unchanged tensor
DEFAULT_SOURCE = FRESH


def rewriter(tensor: Any) -> Callable[[], None]:
    """The fresh write of ``tensor`` (host or device memory): every element stored in place with the value it holds
    (its bits ORed with 0: exact for every dtype), a device tensor's on its device and waited for."""
    flat = tensor.reshape(-1)
    bits = flat.view(f"u{flat.dtype.itemsize}")
    if type(tensor) is np.ndarray:
        return lambda: np.bitwise_or(bits, 0, out=bits)
    cupy = array_module()

    def write_on_device() -> None:
        with flat.device:
            cupy.bitwise_or(bits, 0, out=bits)
        ready(flat)

    return write_on_device


def source_columns(source: str, starts: Sequence[int] | np.ndarray, written: Sequence[int] | np.ndarray,
                   writes: int | None) -> dict[str, Any]:
    """A record's source columns: ``source``, the whole writes of the point (``writes``; None where a tool's loop
    is not ours), and the least of ``starts - written`` (ns, per timed transfer: the sender's clock read that starts
    it and the end of its fresh write) in µs, None without fresh writes."""
    if len(written) and len(written) != len(starts):
        raise ValueError(f"{len(written)} fresh writes timed for {len(starts)} timed transfers")
    lead = np.asarray(starts, np.int64) - np.asarray(written, np.int64) if len(written) else None
    return {"source": source, "source_writes": writes,
            "source_write_lead_min_us": float(lead.min()) / 1e3 if lead is not None else None}


def plain_written(point: Any, rank: int, sender: int = 0) -> np.ndarray | None:
    """Where a plain loop's sender (rank ``sender``) keeps the end of each transfer's fresh write: zeros, one per
    transfer of ``point``; None on the receiver, and for a reused source."""
    return np.zeros(point.warmup + point.iters, np.int64) if point.fresh and rank == sender else None


def plain_columns(point: Any, starts: np.ndarray, written: np.ndarray) -> dict[str, Any]:
    """A plain loop's :func:`source_columns` for ``point``, from its sender's clock at every transfer (``starts``)
    and the end of each fresh write (``written``: 0 where none was made)."""
    writes = int(np.count_nonzero(written))
    return source_columns(point.source, starts[point.warmup:], written[point.warmup:] if writes else (), writes)
