"""The summaries the commands print at the end of a run, read back from its run directory (a command only parses
its arguments, runs, and calls one of these): ``bench micro``'s p50 table and its times relative to zerocopy
(:func:`print_micro`), ``bench model``'s and ``bench scale``'s step times relative to zerocopy
(:func:`print_training`), ``bench converge``'s time to target (:func:`print_converge`); :func:`print_relative` is
the table of ratios two of them share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.ground.sizes import format_size
from bench.results import ResultsError, load_run, ratio
from bench.results import lines as catalogue

#: the line every other is set against (the paper's zero-copy transport)
BASELINE = catalogue.ZERO_COPY


def print_micro(out: Path) -> None:
    """What people read of a run: the p50 of every line at every size in one table (sizes down, lines across;
    rounds folded into their median; again beside the busy processes with --contend), then each transport's time
    relative to zerocopy's at the same size, with its range, and zerocopy's over the best peer's. Every column of
    every point is in records.csv."""
    try:
        run = load_run(out)
    except ResultsError:
        return
    points = run.points()
    if not len(points):
        print(f"\nresults: {out}")
        return
    rounds = int(points["rounds"].max())
    sizes = list(dict.fromkeys(points["size_bytes"]))
    cell = {(row.transport, row.size_bytes): row for row in points.itertuples()}
    timed = [name for name in dict.fromkeys(points["transport"])  # put_bw has no per-transfer time
             if any(_finite(getattr(cell.get((name, size)), "p50_us", None)) for size in sizes)]
    contend = int(points["contend"].max()) if "contend" in points and points["contend"].notna().any() else 0
    columns = [("p50_us", f"p50 µs per transfer{f' (median of {rounds} rounds)' if rounds > 1 else ''}")]
    if contend:
        columns.append(("contended_p50_us", f"p50 µs beside {contend} busy processes"))
    for column, title in columns:
        print(f"\n{title}:")
        widths = [max(len(name), 8) for name in timed]
        print(f"{'size':>6}  " + "  ".join(f"{name:>{width}}" for name, width in zip(timed, widths, strict=True)))
        for size in sizes:
            values = [_short(getattr(cell.get((name, size)), column, None)) for name in timed]
            print(f"{format_size(int(size)):>6}  "
                  + "  ".join(f"{value:>{width}}" for value, width in zip(values, widths, strict=True)))
    baseline = list(points.loc[points["transport"] == BASELINE, "size_bytes"])
    others = [t for t in dict.fromkeys(points["transport"])  # transports (local among them), not reference lines
              if t != BASELINE and _is_transport(t.partition(":")[0])]
    # zerocopy against the best peer (p50 over p50) and the fabric library's put bandwidth (throughput fraction)
    headings = {"of_peer": f"{BASELINE} / best peer", "of_reference": f"{BASELINE} of put bw"}
    extra = tuple((heading, lambda rows, column=column: _short(rows[BASELINE].get(column), 2))
                  for column, heading in headings.items()
                  if column in points and points.loc[points["transport"] == BASELINE, column].notna().any())
    if baseline and (others or extra):
        what = "range across rounds" if rounds > 1 else "range: 95% interval of each median"
        print_relative(f"time per transfer relative to {BASELINE} (p50 / {BASELINE}'s p50; {what})",
                       "size", [(format_size(int(size)), {row.transport: row._asdict() for row in points[
                           points["size_bytes"] == size].itertuples()}) for size in baseline],
                       others, BASELINE, "p50_us", extra)
    if line := _crossings_line(points):
        print(f"\n{line}")
    print(f"\nresults: {out} (every column of every point: records.csv)")


def _crossings_line(points: Any) -> str:
    """For a run on device memory: where the tensors lived, and each line's crossings of the bus per transfer
    (device to host plus host to device, both sides, over the size: 2 is staged through the host at each end)."""
    if "sender_memory" not in points or "host_to_device_bytes_per_transfer" not in points:
        return ""
    device = points[(points["sender_memory"] != "host") | (points["receiver_memory"] != "host")]
    if not len(device):
        return ""
    first = device.iloc[0]
    crossings = {}
    for row in device.itertuples():
        moved = (row.device_to_host_bytes_per_transfer, row.host_to_device_bytes_per_transfer)
        if all(_finite(value) for value in moved) and row.size_bytes:
            crossings.setdefault(row.transport, []).append(sum(moved) / row.size_bytes)
    counted = ", ".join(f"{name} {max(values):g}" for name, values in crossings.items())
    return (f"tensors in {first.sender_memory} -> {first.receiver_memory} memory; crossings of the bus per "
            f"transfer (2: staged through host memory at both ends, 0: device to device): {counted or 'none counted'}")


def _finite(value: Any) -> bool:
    return value is not None and value == value  # NaN: not measured


def _short(value: Any, digits: int | None = None) -> str:
    """A time for a table: three significant digits or so, '-' where nothing was measured."""
    if not _finite(value):
        return "-"
    if digits is not None:  # a ratio: small ones keep a digit that is not zero
        return f"{value:.{digits + 1 if value < 0.1 else digits}f}"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def print_training(out: Path, warmup: int) -> None:
    """What was timed, and each transport's step time relative to zerocopy's in the same model, batch size and
    servers, with its range (``bench model`` and ``bench scale``)."""
    try:
        points = load_run(out).points()
    except ResultsError:
        points = None
    if points is not None and len(points):
        rounds = int(points["rounds"].max())
        steps = int(points["steps"].max())
        print(f"\ntimed: {steps} steps of every worker after {warmup} warm-up steps, per run"
              + (f", {rounds} rounds" if rounds > 1 else ""))
        keys = ["model", "batch_size", "servers"]
        others = [t for t in dict.fromkeys(points["transport"]) if t != BASELINE]
        rows = [(f"{model} b{batch} x{servers}", {row.transport: row._asdict() for row in group.itertuples()})
                for (model, batch, servers), group in points.groupby(keys, sort=False)]
        what = "range across rounds" if rounds > 1 else "range: 95% interval of each median"
        print_relative(f"step time relative to {BASELINE} (step time / {BASELINE}'s; above 1: slower; {what})",
                       "run", rows, others, BASELINE, "step_time_s")
    print(f"\nresults: {out}")


def print_converge(out: Path, baseline: str, paper: float | None) -> None:
    """Per transport: the target, when it was reached, and the speed-up over the baseline (and the paper's)."""
    records = load_run(out).records
    rows = records[records["kind"] == "summary"]
    if rows.empty:
        return
    print(f"\n{'transport':18} {'target':18} {'steps':>6} {'seconds':>9} {'speed-up vs ' + baseline:>20}"
          + ("  paper (zerocopy)" if paper else ""))
    for row in rows.itertuples():
        steps = "-" if row.steps_to_target != row.steps_to_target else f"{int(row.steps_to_target)}"
        seconds = "not reached" if row.time_to_target_s != row.time_to_target_s else f"{row.time_to_target_s:.1f}"
        ratio = "-" if row.speedup_vs_grpc_tcp != row.speedup_vs_grpc_tcp else f"{row.speedup_vs_grpc_tcp:.2f}x"
        print(f"{row.transport:18} {row.target:18} {steps:>6} {seconds:>9} {ratio:>20}"
              + (f"  {paper:.1f}x" if paper and row.transport == catalogue.ZERO_COPY else ""))


def print_relative(title: str, key_name: str, rows: list[tuple[str, dict[str, Any]]], lines: list[str],
                   baseline: str, measure: str,
                   extra: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = ()) -> None:
    """A table of each line's ``measure`` over the ``baseline`` line's at the same point, with the range their
    spreads allow: ``rows`` are (a point's label, its folded rows by line name), ``extra`` more columns (a
    heading, and the cell from a point's rows). A point the baseline did not measure is left out."""
    table = []
    for label, by_line in rows:
        if baseline not in by_line:
            continue
        cells = [_ratio_text(ratio(by_line[line], by_line[baseline], measure)) if line in by_line else "-"
                 for line in lines]
        table.append([label, *cells, *(cell(by_line) for _, cell in extra)])
    if not table or not (lines or extra):  # nothing beside the baseline: nothing to say relative to it
        return
    headings = [key_name, *lines, *(heading for heading, _ in extra)]
    widths = [max(len(heading), *(len(row[i]) for row in table)) for i, heading in enumerate(headings)]
    print(f"\n{title}:")
    for row in [headings, *table]:
        print("  ".join(f"{cell:>{width}}" for cell, width in zip(row, widths, strict=True)))


def _ratio_text(value: Any) -> str:
    """A ratio and its range in a table cell, three significant digits: ``35.6x (35.3-36.0)``."""
    if value.value != value.value:  # NaN: not measured
        return "-"

    def short(x: float) -> str:
        return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"

    if value.low == value.value == value.high:
        return f"{short(value.value)}x"
    return f"{short(value.value)}x ({short(value.low)}-{short(value.high)})"


def _is_transport(name: str) -> bool:
    """Whether ``name`` is one of this suite's transports or local (the catalogue's), not a reference or peer line."""
    return catalogue.known(name) and catalogue.kind_of(name) in ("transport", "local")
