"""The cost of one transfer per transport, from a ``bench micro`` run (issue 62, item 1).

A ``bench micro`` point gives, per transport and size B, the median time of a transfer (``p50_us``: from the
sender's ``send`` to the receiver having consumed the tensor) and the CPU each side spent per transfer
(``sender_cpu_us_per_transfer``, ``receiver_cpu_us_per_transfer``). On one host there is no wire: the fabric
moves the bytes through shared memory (or loopback TCP) with a CPU doing the copy, so everything in the p50 is
either a CPU working for the transfer or a side waiting for something that is neither (a thread waking up, a
poll interval). The split, per transport:

* **latency** (``latency_s``, per message, size-independent): the part of the *smallest* size's p50 that is
  longer than the busier side's CPU per transfer, ``max(0, p50 - max(sender_cpu, receiver_cpu))``. A side that
  busy-polls is on a CPU for the whole transfer, so a polling transport gets 0 (nothing here is neither side's
  CPU); a transport that blocks and is woken (gRPC's completion queues) gets its wake-up time. It is at most
  the least p50 of any size (a noisy p50 can fall with size), so no size's host time is negative.
* **host time** at each measured size, per side: the CPU that side spent per transfer, at least its share of
  ``p50 - latency`` (the critical path's CPU work, serialisation, the copies the ledger counts, the fabric's own
  copy, split between the sides in proportion to their CPU) and at most all of it. Both sides work at once (over
  loopback TCP at 512 MB the sender spent 1.0 and the receiver 0.7 of the p50 on a CPU), so what a transfer keeps
  busy is their sum, more than its p50: on a few shared cores (netns runs) the split of the p50 alone predicted
  fcn5's 1-server step 55% too fast, its CPU 11% (issue 62's note). The cap is the p50's host time: beyond it the
  CPU is the harness's loop and a polling side's spinning (it exceeds the p50 at small sizes); in a training step
  one progress thread polls for every tensor in flight, so that spinning is not per-transfer work.
* **wire**: ``bytes * 8 / link_rate_bps`` on each link the transfer crosses (0 on an infinite link).

So ``transfer_s(B, None) = sender_s(B) + receiver_s(B) + latency_s`` is at least the measured p50 at every measured
size (exactly it where each side's CPU is within its share), at most twice its host time: the simulation runs the
sides one after the other, so a transfer alone on idle hosts is predicted up to that much longer, and hosts busy
with many transfers at once are predicted as their CPUs are. Between measured sizes each side's host time is
interpolated linearly in log-size; below the smallest it is the smallest's (flat); beyond the largest it grows
linearly in bytes at the slope of the two largest sizes (per byte: copies and serialisation are linear in size
there).

What this leaves out, on purpose: the fabric's one copy through shared memory is a CPU's work on this host and
counted as host time; over a real RDMA NIC the NIC's DMA would do it, so for the RDMA transports at large sizes a
prediction from a shared-memory run is conservative by up to one copy of the tensor per transfer (a ``bench micro
--fabric-transport tcp`` run puts the kernel's TCP copies in the host time, as a TCP cluster has them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.results import load_run

#: the columns of a micro run's points the cost model needs
NEEDED_COLUMNS = ("p50_us", "sender_cpu_us_per_transfer", "receiver_cpu_us_per_transfer")


@dataclass(frozen=True)
class TransferCost:
    """What one transfer of a transport costs, fitted to a micro run's points at ``sizes`` (bytes, ascending).

    ``sender_s``/``receiver_s`` are each side's host time at those sizes (seconds), ``latency_s`` the per-message
    latency and ``p50_s`` the measured p50 the split reproduces (see the module for how p50 is split).
    """

    transport: str
    sizes: tuple[int, ...]
    sender_s: tuple[float, ...]
    receiver_s: tuple[float, ...]
    latency_s: float
    p50_s: tuple[float, ...]

    def host_s(self, nbytes: int) -> tuple[float, float]:
        """The CPU time (seconds) a transfer of ``nbytes`` occupies on the sender and on the receiver."""
        return _interpolate(self.sizes, self.sender_s, nbytes), _interpolate(self.sizes, self.receiver_s, nbytes)

    def wire_s(self, nbytes: int, link_rate_bps: float | None) -> float:
        """The time ``nbytes`` take on one link of ``link_rate_bps`` bits per second (None: an infinite link)."""
        return 0.0 if link_rate_bps is None else nbytes * 8 / link_rate_bps

    def transfer_s(self, nbytes: int, link_rate_bps: float | None = None) -> float:
        """One transfer end to end on an otherwise idle link: both sides' host time, the latency and the wire."""
        sender, receiver = self.host_s(nbytes)
        return sender + receiver + self.latency_s + self.wire_s(nbytes, link_rate_bps)


def _interpolate(sizes: tuple[int, ...], values: tuple[float, ...], nbytes: int) -> float:
    """``values`` at ``nbytes``: linear in log-size between ``sizes``, flat below, linear in bytes above."""
    if nbytes <= sizes[0] or len(sizes) == 1:
        if nbytes > sizes[0]:  # one size only: scale linearly in bytes above it
            return values[0] * nbytes / sizes[0]
        return values[0]
    if nbytes >= sizes[-1]:
        slope = max(0.0, (values[-1] - values[-2]) / (sizes[-1] - sizes[-2]))
        return values[-1] + slope * (nbytes - sizes[-1])
    return float(np.interp(math.log(nbytes), [math.log(s) for s in sizes], values))


def cost_from_points(transport: str, rows: Iterable[dict[str, Any]], source: str = "the run") -> TransferCost:
    """A transport's cost from its micro points (dicts with ``size_bytes`` and :data:`NEEDED_COLUMNS`)."""
    points = sorted(rows, key=lambda r: int(r["size_bytes"]))
    if not points:
        raise ValueError(f"{source} has no point of transport '{transport}'; measure it with "
                         f"`bench micro --transports {transport} --sizes ...`")
    for row in points:
        for column in NEEDED_COLUMNS:
            value = row.get(column)
            if value is None or not math.isfinite(float(value)):
                raise ValueError(f"{source} has no {column} for {transport} at {int(row['size_bytes'])} bytes; "
                                 f"measure it again with a `bench micro` of this version")
    sizes = tuple(int(r["size_bytes"]) for r in points)
    p50 = [float(r["p50_us"]) * 1e-6 for r in points]
    sender_cpu = [float(r["sender_cpu_us_per_transfer"]) * 1e-6 for r in points]
    receiver_cpu = [float(r["receiver_cpu_us_per_transfer"]) * 1e-6 for r in points]
    # no more than any size's p50, so that every size keeps a host time >= 0 (a noisy p50 can fall with size)
    latency = min(max(0.0, p50[0] - max(sender_cpu[0], receiver_cpu[0])), min(p50))
    senders, receivers = [], []
    for time, cs, cr in zip(p50, sender_cpu, receiver_cpu, strict=True):
        host = max(0.0, time - latency)
        share = cs / (cs + cr) if cs + cr > 0 else 0.5
        # each side's own CPU, where it measured more than its share of the p50 (both busy at once), capped at
        # the p50's host time (what is beyond it is spinning)
        senders.append(max(host * share, min(cs, host)))
        receivers.append(max(host - host * share, min(cr, host)))
    return TransferCost(transport, sizes, tuple(senders), tuple(receivers), latency, tuple(p50))


def costs_from_run(path: Path | str, transports: Iterable[str] | None = None) -> dict[str, TransferCost]:
    """Each transport's :class:`TransferCost` from the ``bench micro`` run at ``path`` (all its transports' lines
    when ``transports`` is None). A missing transport or column is one ``ValueError`` line naming the run and the
    fix."""
    run = load_run(Path(path))
    if run.experiment != "micro":
        raise ValueError(f"{path} is a {run.experiment} run, not a micro run; give a `bench micro` run directory")
    points = run.points()
    missing = [c for c in ("transport", "size_bytes", *NEEDED_COLUMNS) if c not in points.columns]
    if missing:
        raise ValueError(f"{path} lacks the columns {', '.join(missing)}; measure again with `bench micro` "
                         f"of this version")
    if "line_kind" in points.columns and transports is None:
        points = points[points["line_kind"].isin(["transport"])]
    present = list(dict.fromkeys(points["transport"]))
    wanted = list(transports) if transports is not None else present
    absent = [t for t in wanted if t not in present]
    if absent:
        raise ValueError(f"{path} has no points of {', '.join(absent)} (it has: {', '.join(present) or 'none'}); "
                         f"measure them with `bench micro --transports {','.join(absent)}`")
    return {t: cost_from_points(t, points[points["transport"] == t].to_dict("records"), str(path))
            for t in wanted}


def sizes_needed(plan: Any) -> list[int]:
    """The distinct tensor sizes (bytes, ascending) a plan moves: a dynamic tensor at its bound, an unbounded one
    left out (the simulation merges tensors by summing their per-tensor costs, so these sizes are all it needs)."""
    return sorted({t.nbytes for t in plan.transfers if t.nbytes is not None})
