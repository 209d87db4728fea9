"""The text of a comparison (:meth:`bench.readers.compare.Comparison.format`): the header naming both runs, the
table of points and of references, the points only one run has, the summary per transport and the last line that
says what got slower."""

from __future__ import annotations

import math
from collections.abc import Iterable

from bench.readers.compare import (
    ADDED,
    FASTER,
    NOT_CALLED,
    NOT_COMPARED,
    REMOVED,
    ROUNDS_TO_CALL,
    SAME,
    SLOWER,
    SPREAD_WORDS,
    Comparison,
    Row,
    Value,
    column_title,
    key_text,
    point_text,
)
from bench.results import Run
from bench.results.records import MICRO_SOURCES, OLD_FRAMEWORK, framework_title


def _number(x: float) -> str:
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf"
    size = abs(x)
    if size >= 1e6:  # a ratio or value out of all measure: its magnitude, not hundreds of digits
        return f"{x:.3g}"
    if size >= 100 or x == 0:
        return f"{x:.0f}"
    if size >= 10:
        return f"{x:.1f}"
    if size >= 0.1:
        return f"{x:.2f}"
    return f"{x:.2g}"


def _scale(metric: str) -> list[tuple[float, str]]:
    """(factor, unit) choices for a metric's values, smallest unit first: a value is shown in the largest
    unit it reaches 1 in."""
    if metric.endswith("_us"):
        return [(1, "µs"), (1e3, "ms"), (1e6, "s")]
    if metric.endswith("_ms_per_sample"):
        return [(1, "ms")]
    if metric.endswith("_s"):
        return [(1e-6, "µs"), (1e-3, "ms"), (1, "s")]
    if metric.endswith("MBps"):
        return [(1, "MB/s"), (1024, "GB/s")]
    if metric.endswith("per_s"):
        return [(1, "/s")]
    if "bytes" in metric:
        return [(1, "B"), (1024, "KB"), (1024**2, "MB"), (1024**3, "GB")]
    return [(1, "")]


def _value_text(value: Value | None, metric: str) -> str:
    if value is None:
        return ""
    if math.isinf(value.value):
        return "not reached" if metric == "time_to_target_s" else "inf"
    if not value.measured:
        return "-"
    units = _scale(metric)
    factor, unit = units[0]
    for f, u in units:
        if abs(value.value) >= f:
            factor, unit = f, u
    text = _number(value.value / factor) + (f" {unit}" if unit else "")
    if value.low != value.high:
        text += f" [{_number(value.low / factor)}, {_number(value.high / factor)}]"
    return text


def _ratio_text(row: Row) -> str:
    if not row.compared or math.isnan(row.ratio):
        return "-" if row.compared or row.state == NOT_COMPARED else ""
    text = _number(row.ratio)
    if (row.ratio_low, row.ratio_high) != (row.ratio, row.ratio) and not math.isnan(row.ratio_low):
        text += f" [{_number(row.ratio_low)}, {_number(row.ratio_high)}]"
    return text


def _table(comparison: Comparison, rows: list[Row]) -> list[str]:
    header = ["", *(column_title(c) for c in comparison.key), "base", "new", "ratio", ""]
    body = [[row.marker, *(key_text(v, c) for v, c in zip(row.point, comparison.key, strict=True)),
             _value_text(row.base, comparison.metric), _value_text(row.new, comparison.metric), _ratio_text(row),
             row.note] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in [header, *body]]


def _describe_run(label: str, run: Run, values: Iterable[Value]) -> str:
    values = list(values)
    spreads = sorted({v.spread for v in values})
    rounds = sorted({v.rounds for v in values})
    meta = run.meta
    commit = str(meta.get("git_commit", "unknown"))
    commit = commit[:12] + ("-dirty" if commit.endswith("-dirty") else "") if commit != "unknown" else commit
    details = [f"commit {commit}", str(meta.get("start_time") or "no start time")]
    if meta.get("status") not in (None, "complete"):
        details.append(str(meta["status"]))
    if rounds and rounds != [1]:
        details.append(f"{'/'.join(map(str, rounds))} rounds")
    details.append("ranges: " + ("; ".join(SPREAD_WORDS.get(s, s) for s in spreads) if spreads else "none"))
    return f"{label:<5} {run.path}  ({', '.join(details)})"


def _source_note(c: Comparison) -> str:
    """For micro runs whose senders used different sources (``bench micro --source``, in meta.json's settings), a
    line that says so: the times then differ by more than the code; '' otherwise."""
    if c.experiment != "micro":
        return ""
    sources = [(run.meta.get("settings") or {}).get("source") for run in (c.base, c.new)]
    if sources[0] == sources[1]:
        return ""
    base, new = (source if source in MICRO_SOURCES else "not recorded (before --source: reused)"
                 for source in sources)
    return (f"note: the runs' senders used different sources (base {base}, new {new}; bench micro --source): a "
            "fresh tensor is written whole before each transfer, a reused one is not, so the times differ by more "
            "than the code")


def _unchanged(row: Row) -> bool:
    """Same, or measured by neither run."""
    return row.state == SAME or (row.state == NOT_COMPARED and not (row.base and row.base.measured)
                                 and not (row.new and row.new.measured))


def comparison_lines(c: Comparison, only_changed: bool) -> list[str]:
    """The lines of :meth:`Comparison.format`."""
    direction = "higher is better" if c.higher_is_better else "lower is better"
    trained = f" of {framework_title(c.framework)}" if c.framework not in (None, OLD_FRAMEWORK) else ""
    lines = [f"{c.experiment} runs{trained} compared on {c.metric} ({direction}), ratio new/base, "
             f"threshold {c.threshold * 100:g}%"]
    lines.append(_describe_run("base", c.base, [r.base for r in c.rows if r.compared and r.base]))
    lines.append(_describe_run("new", c.new, [r.new for r in c.rows if r.compared and r.new]))
    hosts = (c.base.meta.get("host"), c.new.meta.get("host"))
    if hosts[0] != hosts[1]:
        lines.append(f"note: the runs are from different hosts ({hosts[0]}, {hosts[1]}): the ratios include the "
                     "machines' difference")
    if note := _source_note(c):
        lines.append(note)
    if c.drift > c.threshold:
        lines.append(f"note: the reference lines moved {c.drift * 100:.0f}% between the runs (the median of their "
                     f"points): a change is called only beyond that, not {c.threshold * 100:g}%")
    lines.append("")
    present = [r for r in c.rows if r.state not in (ADDED, REMOVED)]
    shown = [r for r in present if not (only_changed and _unchanged(r))]
    ours = [r for r in shown if not r.reference]
    refs = [r for r in shown if r.reference]
    if ours:
        lines += _table(c, ours)
    elif only_changed:
        lines.append("no point changed beyond the threshold and the noise")
    if refs:
        lines += ["", "references (they measure the machine, not this code: never a failure):"]
        lines += _table(c, refs)
    for state, words in ((REMOVED, "only in base (removed)"), (ADDED, "only in new (added)")):
        points_ = [r for r in c.rows if r.state == state]
        if points_:
            lines += ["", f"{words}: " + ", ".join(point_text(r.point, c.key) for r in points_)]
    lines += ["", f"per {c.group_column} (geometric mean of the ratios):"]
    summaries = c.summaries()
    width = max(len(s.name) for s in summaries)
    for s in summaries:
        counts = ", ".join(f"{n} {state}" for state, n in s.counts.items() if n)
        lines.append(f"  {s.name:<{width}}  {_number(s.geometric_mean):>5}  {counts}"
                     + ("  (reference)" if s.reference else ""))
    uncalled = [r for r in c.rows if r.state == NOT_CALLED and not r.reference]
    if uncalled:
        rounds = {label: "/".join(map(str, sorted({getattr(r, label).rounds for r in uncalled})))
                  for label in ("base", "new")}
        lines.append(f"not called: {len(uncalled)} point(s) measured in fewer than "
                     f"{ROUNDS_TO_CALL[c.experiment]} rounds (base {rounds['base']}, new {rounds['new']}): one "
                     "run's spread does not bound another's; measure both with --rounds "
                     f"{ROUNDS_TO_CALL[c.experiment]} to call a change")
    slowed_refs = [s.name for s in summaries if s.reference and s.counts[SLOWER]]
    if slowed_refs:
        lines.append(f"references slower: {', '.join(slowed_refs)} (the machine changed: weigh the rest with it)")
    slowed = [s for s in summaries if not s.reference and s.counts[SLOWER]]
    compared = {s.name: sum(s.counts[k] for k in (SAME, SLOWER, FASTER, NOT_CALLED)) for s in summaries}
    if slowed:
        named = ", ".join(f"{s.name} ({s.counts[SLOWER]} of {compared[s.name]} points, ratio up to "
                          f"{_number(s.worst)})" for s in slowed)
        lines.append(f"slower beyond {c.threshold * 100:g}%: {named}")
    elif uncalled and not any(r.state in (SAME, FASTER) and not r.reference for r in c.rows):
        lines.append(f"no change called: too few rounds (--rounds {ROUNDS_TO_CALL[c.experiment]} in both runs calls "
                     "one)")
    else:
        faster = [s.name for s in summaries if not s.reference and s.counts[FASTER]]
        lines.append(f"nothing slower beyond {c.threshold * 100:g}%"
                     + (f"; faster: {', '.join(faster)}" if faster else ""))
    if (lost := c.lost) is not None:
        lines.append(lost)
    return lines

