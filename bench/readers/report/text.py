"""How the report writes lines, numbers and ratios: what every section shares.

The lines' names as the paper calls them and their order in every table, and the cells and phrases made of
numbers: ratios (``1.34x``, ``+34%``), ranges, listings and the paper's claims.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pandas as pd

from bench.ground import paper
from bench.results import PEER_NAMES, REFERENCE_NAMES, ratio

#: short names of the lines, as the paper calls them (this suite's labels otherwise)
NAMES = {
    "grpc_tcp": "gRPC.TCP",
    "grpc_rdma": "gRPC.RDMA",
    "grpc_rdma:direct": "gRPC.RDMA direct",
    "rdma_cp": "RDMA.cp",
    "zerocopy": "RDMA.zerocp",
    "zerocopy:no_analysis": "RDMA.zerocp (analysis off)",
    "local": "Local",
    "tf_grpc": "TF gRPC (tf_grpc)",
    "mpi": "MPI Send/Recv",
    "mpi_rma": "MPI one-sided put",
    "nixl": "NIXL",
    "mooncake": "Mooncake TE",
    "socket": "TCP socket",
}
#: the order lines appear in, in every table
ORDER = ("zerocopy", "zerocopy:no_analysis", "rdma_cp", "grpc_rdma", "grpc_rdma:direct", "grpc_tcp", "tf_grpc",
         "local")
#: micro lines that are no transport: the fabric library's limit and a copy in one process (never a ratio's base)
REFERENCE_LINES = REFERENCE_NAMES
#: micro lines of other libraries, timed as transports are (the lines a transport is held against, never one of ours)
PEER_LINES = PEER_NAMES
ZERO_COPY = "zerocopy"
NO_ANALYSIS = "zerocopy:no_analysis"
MISSING = "—"


def missing(value: Any) -> bool:
    """None or NaN (a cell the records left empty)."""
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def times(ratio: float | None) -> str:
    """A ratio as ``10.0x``, ``1.23x``, ``123x``; a dash when there is none."""
    if missing(ratio) or not math.isfinite(ratio):
        return MISSING
    if abs(ratio) >= 100:
        return f"{ratio:.0f}x"
    if abs(ratio) >= 10:
        return f"{ratio:.1f}x"
    return f"{ratio:.2f}x"


def percent(ratio: float | None) -> str:
    """A ratio as the improvement it is: 2.3 -> ``+130%``."""
    if missing(ratio) or not math.isfinite(ratio):
        return MISSING
    return f"{(ratio - 1) * 100:+.0f}%"


def num(value: Any, spec: str = ".3g") -> str:
    """A number as a cell (``spec`` its format), a string as it is, a dash when there is none."""
    if missing(value):
        return MISSING
    if isinstance(value, str):
        return value
    return format(float(value), spec)


def divide(numerator: Any, denominator: Any) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is not above 0."""
    if missing(numerator) or missing(denominator) or not float(denominator) > 0:
        return None
    return float(numerator) / float(denominator)


def ratio_cell(numerator: Any, denominator: Any, column: str) -> str:
    """The ratio of ``column`` between two points (rows of ``Run.points()``), with the range their spreads give
    when they have one (rounds, or the samples' interval of the median): ``1.34x (0.97x to 1.79x)``."""
    if numerator is None or denominator is None:
        return MISSING
    measured = ratio(numerator, denominator, column)
    if missing(measured.value):
        return MISSING
    if times(measured.low) == times(measured.value) == times(measured.high):
        return times(measured.value)
    return f"{times(measured.value)} ({times(measured.low)} to {times(measured.high)})"


def line_name(line: str) -> str:
    """A line as the paper calls it (:data:`NAMES`), else its own label."""
    return NAMES.get(line, line)


def ordered(lines: Iterable[str]) -> list[str]:
    """The lines once each, in :data:`ORDER` (others after them, by name)."""
    present = list(dict.fromkeys(lines))
    return sorted(present, key=lambda t: (ORDER.index(t) if t in ORDER else len(ORDER), t))


def listing(values: Iterable[Any]) -> str:
    """``a, b and c``."""
    items = [str(v) for v in values]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def range_text(values: Sequence[float], show: Callable[[float], str] = times) -> str:
    """The lowest to the highest of ``values`` (one value when they show alike), a dash when there is none."""
    values = [v for v in values if not missing(v)]
    if not values:
        return MISSING
    low, high = min(values), max(values)
    return show(low) if show(low) == show(high) else f"{show(low)} to {show(high)}"


def claim_cell(claim: paper.Claim | None) -> str:
    """The paper's number for a claim, a dash when the paper has none."""
    return claim.text() if claim else MISSING


def quote(claim: paper.Claim) -> tuple[str, str]:
    """A claim's words and where in the paper they stand, as a section quotes them."""
    return (claim.quote, claim.section)


def unique(frame: pd.DataFrame, column: str) -> list[Any]:
    """The distinct values of ``column`` (none when the column is absent), empty cells left out."""
    if column not in frame:
        return []
    return list(dict.fromkeys(v for v in frame[column] if not missing(v) and v != ""))
