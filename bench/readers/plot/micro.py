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
    """One line of the time or throughput figure: a transport's sizes and times (or MB/s), with the spread of each
    (or None)."""

    transport: str
    label: str
    sizes: pd.Series
    time: pd.Series
    low: pd.Series | None
    high: pd.Series | None


def micro_time_lines(points: pd.DataFrame) -> list[Line]:
    """What the time figure draws, one :class:`Line` per transport in legend order, from a micro run's points
    (:meth:`bench.results.Run.points`, one row per transport and size).

    The time is the median (``p50_us``) with its spread (``p50_us_low``/``_high``). A bandwidth tool
    (``ucx_perftest`` put_bw: pipelined puts, no time per transfer) is left to the throughput figure;
    ``ucx_perftest_lat`` is drawn from its median, half a round trip: the floor of a send/receive.
    """
    lines = []
    for name in _transports_in_order(points):
        if catalogue.line(name).figure == "throughput":
            continue
        rows = points[points["transport"] == name].sort_values("size_bytes")
        lines.append(Line(name, _label(name), rows["size_bytes"], rows["p50_us"],
                          _column(rows, "p50_us_low"), _column(rows, "p50_us_high")))
    return lines


def micro_throughput_lines(points: pd.DataFrame) -> list[Line]:
    """What the throughput figure draws (MB/s in ``time``): the time figure's statistic, size over the median time,
    with the spread of the median; a bandwidth tool's own bandwidth (``throughput_MBps``: it has no median); a
    latency tool (half a round trip) is left to the time figure."""
    lines = []
    for name in _transports_in_order(points):
        figure = catalogue.line(name).figure
        if figure == "time":
            continue
        rows = points[points["transport"] == name].sort_values("size_bytes")
        megabytes = rows["size_bytes"] / 2**20
        if figure == "throughput" or rows["p50_us"].isna().all():
            lines.append(Line(name, _label(name), rows["size_bytes"], rows["throughput_MBps"],
                              _column(rows, "throughput_MBps_low"), _column(rows, "throughput_MBps_high")))
            continue
        low, high = _column(rows, "p50_us_high"), _column(rows, "p50_us_low")  # the longer time, the lower rate
        lines.append(Line(name, _label(name), rows["size_bytes"], megabytes / (rows["p50_us"] / 1e6),
                          None if low is None else megabytes / (low / 1e6),
                          None if high is None else megabytes / (high / 1e6)))
    return lines


def memory_note(run: Run) -> str:
    """Where the tensors lived, when not in host memory (``--memory``; the paper's Table 3 moves GPU memory)."""
    memory = run.meta.get("settings", {}).get("memory")
    if not isinstance(memory, list) or all(side == "host" for side in memory):
        return ""
    return f"tensors in GPU memory: {' to '.join(map(str, memory))} (lines that move host memory only stage it)"


def micro_time_figure(run: Run) -> Figure:
    """Figure 8 of the paper: time per transfer against size, one line per transport, with the reference
    lines: ucx_perftest put_lat (up to 1MB) and memcpy (the bandwidth tools are in the throughput figure)."""
    points = _points(run).sort_values("size_bytes")
    fig, ax = plt.subplots(figsize=(8, 5))
    for line in micro_time_lines(points):
        _line(ax, line.transport, line.label, line.sizes, line.time, line.low, line.high)
    _log_y(ax)
    _size_axis(ax, points["size_bytes"])
    ax.set_ylabel("time per transfer, median (µs, log scale)")
    ax.grid(True, which="major", alpha=0.3)
    _title(fig, "Send/receive micro-benchmark (Figure 8): time per transfer, lower is better", run,
           [memory_note(run), spread_note(points)])
    return _finish(fig, [ax])


def micro_throughput_figure(run: Run) -> Figure:
    """Throughput against size, one line per transport and bandwidth reference: size over the median time, the
    time figure's statistic (a bandwidth tool: its bandwidth)."""
    points = _points(run).sort_values("size_bytes")
    fig, ax = plt.subplots(figsize=(8, 5))
    for line in micro_throughput_lines(points):
        _line(ax, line.transport, line.label, line.sizes, line.time, line.low, line.high)
    _log_y(ax)
    _size_axis(ax, points["size_bytes"])
    ax.set_ylabel("throughput: size / median time (MB/s, MB = 2^20 bytes, log scale)")
    ax.grid(True, which="major", alpha=0.3)
    _title(fig, "Send/receive micro-benchmark: throughput, higher is better", run,
           [memory_note(run), spread_note(points)])
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


