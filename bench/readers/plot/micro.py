"""Figure 8, the send/receive micro-benchmark: time and throughput per size, and the distribution of transfers."""

from __future__ import annotations

from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from bench.ground.sizes import format_size
from bench.readers.plot.common import (
    _box_entries,
    _box_rows,
    _boxes,
    _column,
    _finish,
    _label,
    _line,
    _log_y,
    _points,
    _size_axis,
    _title,
    _transports_in_order,
    spread_note,
)
from bench.results import Run
from bench.results import lines as catalogue


class Line(NamedTuple):
    """One line of the time figure: a transport's sizes and times, with the spread of each (or None)."""

    transport: str
    label: str
    sizes: pd.Series
    time: pd.Series
    low: pd.Series | None
    high: pd.Series | None


def micro_time_lines(points: pd.DataFrame) -> list[Line]:
    """What the time figure draws, one :class:`Line` per transport in legend order, from a micro run's points
    (:meth:`bench.results.Run.points`, one row per transport and size).

    The time is the median (``p50_us``) with its spread (``p50_us_low``/``_high``). ``ucx_perftest``
    (put_bw) has none, its puts being pipelined: it is drawn from ``mean_us``, size / bandwidth, and labelled
    so (bench/experiments/references/ucx_perftest.py says why it is no latency). ``ucx_perftest_lat`` is drawn
    from its median, half a round trip: the floor of a send/receive.
    """
    lines = []
    for name in _transports_in_order(points):
        rows = points[points["transport"] == name].sort_values("size_bytes")
        from_mean = catalogue.line(name).time_from_mean
        if from_mean and rows["p50_us"].isna().all():
            lines.append(Line(name, from_mean, rows["size_bytes"], rows["mean_us"], None, None))
        else:
            lines.append(Line(name, _label(name), rows["size_bytes"], rows["p50_us"],
                              _column(rows, "p50_us_low"), _column(rows, "p50_us_high")))
    return lines


def micro_time_figure(run: Run) -> Figure:
    """Figure 8 of the paper: time per transfer against size, one line per transport, with the reference
    lines: ucx_perftest put_bw (pipelined: size / bandwidth), put_lat (up to 1MB) and memcpy."""
    points = _points(run).sort_values("size_bytes")
    fig, ax = plt.subplots(figsize=(8, 5))
    for line in micro_time_lines(points):
        _line(ax, line.transport, line.label, line.sizes, line.time, line.low, line.high)
    _log_y(ax)
    _size_axis(ax, points["size_bytes"])
    ax.set_ylabel("time per transfer, median (µs, log scale)")
    ax.grid(True, which="major", alpha=0.3)
    _title(fig, "Send/receive micro-benchmark (Figure 8): time per transfer, lower is better", run,
           [spread_note(points)])
    return _finish(fig, [ax])


def micro_throughput_figure(run: Run) -> Figure:
    """Throughput against size, one line per transport and reference line."""
    points = _points(run).sort_values("size_bytes")
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in _transports_in_order(points):
        rows = points[points["transport"] == name]
        _line(ax, name, _label(name), rows["size_bytes"], rows["throughput_MBps"],
              _column(rows, "throughput_MBps_low"), _column(rows, "throughput_MBps_high"))
    _log_y(ax)
    _size_axis(ax, points["size_bytes"])
    ax.set_ylabel("throughput (MB/s, MB = 2^20 bytes, log scale)")
    ax.grid(True, which="major", alpha=0.3)
    _title(fig, "Send/receive micro-benchmark: throughput, higher is better", run, [spread_note(points)])
    return _finish(fig, [ax])


def micro_distribution_figure(run: Run) -> Figure | None:
    """Per size, each transport's distribution of time per transfer (every timed iteration of every round,
    from ``samples.csv``), transports side by side on a log axis; None for a run that kept no samples."""
    samples = run.samples
    if samples is None or samples.empty or "time_us" not in samples or not samples["time_us"].notna().any():
        return None
    samples = samples[samples["time_us"].notna()]
    sizes = sorted(set(samples["size_bytes"]))
    names = _transports_in_order(samples)
    groups = {key: group["time_us"].to_numpy() for key, group in samples.groupby(["size_bytes", "transport"])}
    fig, rows = _box_rows(sizes, names, 0.22, 8.0, 5.0)
    fewest = []
    for ax, row in rows:
        fewest.append(_boxes(ax, row, names, lambda size, name: groups.get((size, name), np.array([]))))
        _log_y(ax)
        ax.set_xticks(range(len(row)), [format_size(int(s)) for s in row])
        ax.set_ylabel("time per transfer (µs, log scale)")
        ax.grid(True, axis="y", which="major", alpha=0.3)
    rows[-1][0].set_xlabel("tensor size (binary units)")
    fewest = min((n for n in fewest if n), default=0)
    rounds = int(samples["round"].max()) if "round" in samples else 1
    over = f" over {rounds} rounds" if rounds > 1 else ""
    _title(fig, "Send/receive micro-benchmark: distribution of the time per transfer, per size", run,
           [f"box: quartiles, black line: median, whiskers: 1st to 99th percentile, dots: beyond; "
            f"at least {fewest} timed transfers per box{over}"])
    return _finish(fig, [ax for ax, _ in rows], _box_entries(names))


