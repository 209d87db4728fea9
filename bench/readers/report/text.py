"""How the report writes lines, numbers and ratios: what every section shares.

The lines' names as the paper calls them and their order in every table (both the catalogue's,
:mod:`bench.results.lines`), and the cells and phrases made of numbers: ratios (``1.34x``, ``+34%``), ranges,
listings and the paper's claims.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pandas as pd

from bench.ground import paper
from bench.results import lines as catalogue
from bench.results import ratio

ZERO_COPY = catalogue.ZERO_COPY
line_kinds = catalogue.kinds_in
NO_ANALYSIS = catalogue.NO_ANALYSIS
MISSING = "—"


def missing(value: Any) -> bool:
    """None or NaN (a cell the records left empty)."""
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def number(value: float) -> str:
    """A number as the terminal's tables print it, the one format of the report: from 1,000 on with thousands
    separated and no decimals (``1,109``), below with at most three significant digits (``74.9``, ``2.33``, ``8``,
    ``0.26``): never in exponent notation (``1.11e+03``) but for what is below 0.0001."""
    value = float(value)
    if not math.isfinite(value):
        return "inf" if value > 0 else "-inf" if value < 0 else MISSING
    if abs(value) >= 999.5:
        return f"{value:,.0f}"
    text = f"{value:.3g}"
    return text if "e" not in text else f"{value:.2g}"


def times(ratio: float | None) -> str:
    """A ratio as ``10.0x``, ``1.23x``, ``123x``, ``1,234x``; a dash when there is none."""
    if missing(ratio) or not math.isfinite(ratio):
        return MISSING
    if abs(ratio) >= 100:
        return f"{ratio:,.0f}x"
    if abs(ratio) >= 10:
        return f"{ratio:.1f}x"
    return f"{ratio:.2f}x"


def percent(ratio: float | None) -> str:
    """A ratio as the improvement it is: 2.3 -> ``+130%``."""
    if missing(ratio) or not math.isfinite(ratio):
        return MISSING
    return f"{(ratio - 1) * 100:+,.0f}%"


def num(value: Any) -> str:
    """A number as a cell (:func:`number`), a string as it is, a dash when there is none."""
    if missing(value):
        return MISSING
    if isinstance(value, str):
        return value
    return number(value)


def spread_cell(value: Any, low: Any, high: Any, show: Callable[[float], str] = times) -> str:
    """A value with its range, ``1.34x (0.97x to 1.79x)``, when the range shows apart from it; else the value."""
    if missing(value):
        return MISSING
    if missing(low) or missing(high) or show(low) == show(value) == show(high):
        return show(value)
    return f"{show(value)} ({show(low)} to {show(high)})"


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
    return spread_cell(measured.value, measured.low, measured.high)


def column_cell(row: Any, column: str, show: Callable[[float], str] = times) -> str:
    """A point's ``column`` (a row of ``Run.points()``) with its range across rounds where it has one."""
    if row is None:
        return MISSING
    return spread_cell(row.get(column), row.get(f"{column}_low"), row.get(f"{column}_high"), show)


def line_name(line: str) -> str:
    """A line as the paper calls it (the catalogue's short name, :mod:`bench.results.lines`), else its own name."""
    return catalogue.line(line).paper


def both_names(line: str) -> str:
    """A line by both its names, as the report names it once: ``RDMA.zerocp (zerocopy)``; one where they agree."""
    paper_name = line_name(line)
    return paper_name if paper_name == line else f"{paper_name} ({line})"


def naming(frames: Iterable[pd.DataFrame]) -> str:
    """The sentence that names every line of the runs but zero copy (the lead names it) by both names once, the
    paper's first, in the tables' order; empty when no line has two."""
    found: dict[str, str] = {}
    for frame in frames:
        if "transport" in frame:
            found.update(line_kinds(frame))
    named = [both_names(line) for line in ordered(found, found)
             if not line_name(line).startswith(line) and line != ZERO_COPY]
    if not named:
        return ""
    return ("Lines are named as the paper names them, after this with one name; bench's own names (--transports, "
            f"records.csv) are in brackets: {', '.join(named)}.")


def ordered(lines: Iterable[str], kinds: dict[str, str] | None = None) -> list[str]:
    """The lines once each, in the order of every table (:func:`bench.results.lines.table_order`)."""
    return catalogue.table_order(lines, kinds)




def lines_of(frame: pd.DataFrame, *kinds: str) -> list[str]:
    """The lines of ``frame`` of the given kinds, in the tables' order."""
    found = line_kinds(frame)
    return ordered((name for name, kind in found.items() if kind in kinds), found)


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
