"""Figures 9 and 12, training throughput and step time per model and transport; the copy overhead of the analysis."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bench.ground.paper import model_name
from bench.readers.plot.common import (
    _bar,
    _box_entries,
    _box_rows,
    _boxes,
    _column,
    _finish,
    _grid,
    _integer_log_axis,
    _label,
    _line,
    _log_y,
    _notes,
    _points,
    _title,
    _transports_in_order,
    spread_note,
)
from bench.results import Run
from bench.results import lines as catalogue


def _model_panels(points: pd.DataFrame) -> list[tuple[str, int | None, pd.DataFrame]]:
    """``(model, servers or None, rows)`` per panel: one per model, or per model and server count when the
    run has several server counts (a line through both would zig-zag)."""
    several = points["servers"].nunique() > 1
    panels = []
    for model in dict.fromkeys(points["model"]):
        rows = points[points["model"] == model]
        if several:
            panels += [(model, int(n), rows[rows["servers"] == n]) for n in sorted(set(rows["servers"]))]
        else:
            panels.append((model, None, rows))
    return panels


def _panel_title(model: str, servers: int | None) -> str:
    return model_name(model) + (f", {servers} server(s)" if servers is not None else "")


def model_throughput_figure(run: Run) -> Figure:
    """Figure 9 of the paper: training throughput per model, one panel each. A panel with one batch size
    is a bar per transport; with several, a line per transport against the batch size. Axes from zero."""
    points = _points(run).sort_values("batch_size")
    panels = _model_panels(points)
    fig, axes = _grid(len(panels), 4 if len(panels) > 6 else 3, 4.2, 3.6)
    for ax, (model, servers, rows) in zip(axes, panels, strict=True):
        names = _transports_in_order(rows)
        batches = sorted(set(rows["batch_size"]))
        if len(batches) == 1:
            for i, name in enumerate(names):
                bar = rows[rows["transport"] == name]
                _bar(ax, name, [i], bar["throughput_batches_per_s"], 0.8,
                     _column(bar, "throughput_batches_per_s_low"), _column(bar, "throughput_batches_per_s_high"))
            ax.set_xticks([])
            ax.set_xlim(-0.6, len(names) - 0.4)
            ax.set_xlabel(f"mini-batch size {int(batches[0])} per worker")
        else:
            for name in names:
                line = rows[rows["transport"] == name]
                _line(ax, name, _label(name), line["batch_size"], line["throughput_batches_per_s"],
                      _column(line, "throughput_batches_per_s_low"), _column(line, "throughput_batches_per_s_high"))
            _integer_log_axis(ax, batches, "mini-batch size per worker")
        ax.set_ylim(bottom=0)
        ax.set_ylabel("mini-batches / s per worker")
        ax.set_title(_panel_title(model, servers), fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    servers = ", ".join(str(s) for s in sorted(set(points["servers"])))
    _title(fig, "Training throughput (Figure 9), higher is better", run,
           [f"{servers} server(s)", _notes(run.records), spread_note(points)])
    return _finish(fig, axes)


def _grouped_bars(ax: Axes, groups: Sequence[Any], names: Sequence[str],
                  value: Callable[[Any, str], tuple[float, float, float]]) -> float:
    """Bars grouped along x, one per transport in each group; ``value(group, name)`` is (value, low, high).
    Returns the bar width."""
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        triples = [value(g, name) for g in groups]
        _bar(ax, name, [j - 0.4 + width * (i + 0.5) for j in range(len(groups))], [t[0] for t in triples], width,
             [t[1] for t in triples], [t[2] for t in triples])
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    return width


def _point_value(rows: pd.DataFrame, column: str) -> tuple[float, float, float]:
    if rows.empty or column not in rows:
        return (float("nan"),) * 3
    row = rows.iloc[0]
    value = float(row[column])
    low = float(row[f"{column}_low"]) if f"{column}_low" in rows else value
    high = float(row[f"{column}_high"]) if f"{column}_high" in rows else value
    return value, low, high


def model_step_time_figure(run: Run) -> Figure:
    """Figure 12's mini-batch time, for every transport: per model a group of bars per batch size, one bar per
    transport, split into the worker's computation (the pale lower part) and the rest of the step
    (communication and waiting, full colour); error bars on the whole step."""
    points = _points(run).sort_values("batch_size")
    panels = _model_panels(points)
    fig, axes = _grid(len(panels), 4 if len(panels) > 6 else 3, 4.2, 3.6)
    for ax, (model, servers, rows) in zip(axes, panels, strict=True):
        batches = sorted(set(rows["batch_size"]))
        names = _transports_in_order(rows)
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            x, step, low, high, compute = [], [], [], [], []
            for j, batch in enumerate(batches):
                at = rows[(rows["transport"] == name) & (rows["batch_size"] == batch)]
                value, lo, hi = _point_value(at, "step_time_s")
                x.append(j - 0.4 + width * (i + 0.5))
                step.append(value)
                low.append(lo)
                high.append(hi)
                computed = float(at["compute_s"].iloc[0]) if len(at) and "compute_s" in at else float("nan")
                # tf_grpc does not split its step: no pale part
                compute.append(computed if 0 <= computed <= value else 0.0)
            _bar(ax, name, x, step, width, low, high)
            if any(compute):
                ax.bar(x, compute, width, color="white", alpha=0.55, linewidth=0)  # pales the computation
        ax.set_xticks(range(len(batches)), [f"batch {int(b)}" for b in batches])
        ax.set_xlim(-0.5, len(batches) - 0.5)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("mini-batch time (s)")
        ax.set_title(_panel_title(model, servers), fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    _title(fig, "Mini-batch time per model, lower is better", run,
           ["pale lower part of a bar: the worker's computation; full colour: communication and waiting",
            _notes(run.records), spread_note(points)])
    return _finish(fig, axes)


def model_step_distribution_figure(run: Run) -> Figure | None:
    """Per model (batch size, servers), each transport's distribution of step times (every worker's every
    timed step, from ``samples.csv``); None for a run that kept no samples."""
    samples = run.samples
    if samples is None or samples.empty or "step_time_s" not in samples or not samples["step_time_s"].notna().any():
        return None
    samples = samples[samples["step_time_s"].notna()]
    keys = ["model", "batch_size", "servers"]
    groups = list(dict.fromkeys(samples[keys].itertuples(index=False, name=None)))
    names = _transports_in_order(samples)
    by_point = {key: g["step_time_s"].to_numpy() for key, g in samples.groupby([*keys, "transport"])}
    several = samples["servers"].nunique() > 1
    fig, rows = _box_rows(groups, names, 0.3, 7.0, 4.8)
    fewest = []
    for ax, row in rows:
        fewest.append(_boxes(ax, row, names, lambda group, name: by_point.get((*group, name), np.array([]))))
        _log_y(ax)
        ax.set_xticks(range(len(row)), [f"{_panel_title(m, s if several else None)}\nbatch {b}"
                                        for m, b, s in row], fontsize=9)
        ax.set_ylabel("mini-batch time (s, log scale)")
        ax.grid(True, axis="y", which="major", alpha=0.3)
    fewest = min((n for n in fewest if n), default=0)
    _title(fig, "Mini-batch time: every worker's every timed step", run,
           [_notes(run.records), f"box: quartiles, black line: median, whiskers: 1st to 99th percentile, "
                                 f"dots: beyond; at least {fewest} steps per box"])
    return _finish(fig, [ax for ax, _ in rows], _box_entries(names))


#: Figure 12's bars: the analysis on, off, and the paper's "without analysis" (the sender's copy)
COPY_OVERHEAD = (catalogue.ZERO_COPY, catalogue.NO_ANALYSIS, catalogue.RDMA_CP)


def copy_overhead_figure(run: Run) -> Figure | None:
    """Figure 12 of the paper: mini-batch time per model with the graph analysis on and off, and per step the
    payload bytes copied and the tensors sent from memory that was not registered (at the smallest batch);
    None unless the run has zerocopy with the analysis both on and off."""
    points = _points(run)
    if not {catalogue.ZERO_COPY, catalogue.NO_ANALYSIS} <= set(points["transport"]):
        return None
    points = points[points["batch_size"] == points["batch_size"].min()]
    names = [n for n in COPY_OVERHEAD if n in set(points["transport"])]
    models = list(dict.fromkeys(points[points["transport"].isin(names)]["model"]))
    fig, (time_ax, copy_ax, miss_ax) = plt.subplots(3, 1, figsize=(max(8.0, 1.3 * len(models) + 2), 10.5),
                                                    sharex=True)

    def rows(model: str, name: str) -> pd.DataFrame:
        return points[(points["model"] == model) & (points["transport"] == name)]

    def value(model: str, name: str, column: str, scale: float = 1.0) -> tuple[float, float, float]:
        v, low, high = _point_value(rows(model, name), column)
        return v * scale, low * scale, high * scale

    width = _grouped_bars(time_ax, models, names, lambda m, n: value(m, n, "step_time_s"))
    _grouped_bars(copy_ax, models, names, lambda m, n: value(m, n, "copied_bytes_per_step", 2**-20))
    _grouped_bars(miss_ax, models, names, lambda m, n: value(m, n, "unregistered_sends_per_step"))
    time_ax.set_ylabel("mini-batch time (s)")
    copy_ax.set_ylabel("payload copied per step\n(MB, all processes)")
    miss_ax.set_ylabel("tensors sent from\nunregistered memory per step")
    miss_ax.set_xticks(range(len(models)), [model_name(m) for m in models])
    for j, model in enumerate(models):  # the gain of the analysis, above each model's bars
        on, _, _ = value(model, catalogue.ZERO_COPY, "step_time_s")
        off, _, off_high = value(model, catalogue.NO_ANALYSIS, "step_time_s")
        if on == on and off == off and on > 0:
            time_ax.annotate(f"{(off / on - 1) * 100:+.0f}%", (j - 0.4 + width * 1.5, max(off, off_high)),
                             xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    time_ax.set_ylim(top=time_ax.get_ylim()[1] * 1.1)  # room for the labels
    time_ax.set_title("mini-batch time (label: with the analysis off, against on)", fontsize=9)
    copy_ax.set_title("copies in user space", fontsize=9)
    miss_ax.set_title("registration-cache misses", fontsize=9)
    servers = ", ".join(str(s) for s in sorted(set(points["servers"])))
    _title(fig, "The graph analysis (Figure 12): zero copy with it and without it", run,
           [f"batch size {int(points['batch_size'].min())}, {servers} server(s)", _notes(run.records),
            spread_note(points[points["transport"].isin(names)])])
    return _finish(fig, [time_ax])


