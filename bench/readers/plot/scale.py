"""Figure 11: throughput and efficiency as the servers grow."""

from __future__ import annotations

import matplotlib

from bench import LOCAL

matplotlib.use("Agg")
import numpy as np
from matplotlib.figure import Figure

from bench.ground.paper import model_name
from bench.readers.plot.common import (
    _finish,
    _grid,
    _integer_log_axis,
    _label,
    _line,
    _notes,
    _points,
    _title,
    _transports_in_order,
    spread_note,
)
from bench.results import Run


def _scale_figure(run: Run, column: str, ylabel: str, title: str) -> Figure:
    """Figure 11 of the paper: ``column`` against the number of servers, a panel per model and batch size.

    The Local line is one process without communication, times the number of servers: what perfect
    scaling of local training would give. A column's spread is the per-worker throughput's, scaled.
    """
    points = _points(run).sort_values("servers")
    panels = list(dict.fromkeys(zip(points["model"], points["batch_size"], strict=True)))
    fig, axes = _grid(len(panels), 3, 4.8, 3.8)
    for ax, (model, batch) in zip(axes, panels, strict=True):
        subset = points[(points["model"] == model) & (points["batch_size"] == batch)]
        servers = sorted(set(subset["servers"]))
        for name in _transports_in_order(subset):
            line = subset[subset["transport"] == name]
            if name == LOCAL:  # one process: perfect scaling of it is the reference
                single = line["total_batches_per_s"].median()
                values = [single * n for n in servers] if column == "total_batches_per_s" else [1.0] * len(servers)
                _line(ax, LOCAL, _label(LOCAL) + " x servers", servers, values)
                continue
            low = high = None
            if "throughput_batches_per_s_low" in line:  # the same fraction of the value as the per-worker spread
                per_worker = line["throughput_batches_per_s"].replace(0, np.nan)
                low = line[column] * line["throughput_batches_per_s_low"] / per_worker
                high = line[column] * line["throughput_batches_per_s_high"] / per_worker
            _line(ax, name, _label(name), line["servers"], line[column], low, high)
        _integer_log_axis(ax, servers, "servers (each a worker and a parameter server)")
        ax.set_ylim(bottom=0)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{model_name(model)}, batch {batch} per worker", fontsize=10)
        ax.grid(True, alpha=0.3)
    _title(fig, title, run, [_notes(run.records), spread_note(points[points["transport"] != LOCAL])])
    return _finish(fig, axes)


def scale_throughput_figure(run: Run) -> Figure:
    """Figure 11: total mini-batches per second against servers, per transport, and the Local line."""
    return _scale_figure(run, "total_batches_per_s", "total mini-batches / s",
                         "Scalability (Figure 11): throughput against servers, higher is better")


def scale_efficiency_figure(run: Run) -> Figure:
    """Scaling efficiency: throughput / (servers x the same transport's 1-server throughput)."""
    return _scale_figure(run, "scaling_efficiency", "scaling efficiency\n(throughput / servers x 1-server)",
                         "Scaling efficiency, 1 is perfect")


