"""Figure 11 predicted (``bench predict``): throughput and efficiency against servers, a line per transport."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure

from bench.ground.paper import SCALE_BATCH_SIZE, SCALE_OVER_ONE_SERVER, SCALE_SERVERS, model_name
from bench.readers.plot.common import (
    _finish,
    _grid,
    _integer_log_axis,
    _label,
    _line,
    _notes,
    _points,
    _style,
    _title,
    _transports_in_order,
)
from bench.results import Run
from bench.results.records import PredictRecord

#: how the paper's Figure 11 points are told apart from the predicted lines
_PAPER_MARKER = {"marker": "*", "markersize": 11, "linestyle": "none", "markeredgecolor": "black"}


def _paper_points(ax, model: str, name: str) -> bool:
    """The paper's own Figure 11 point of ``name`` on ``model`` on the efficiency panel: its 8-server speed-up over
    one server (:data:`SCALE_OVER_ONE_SERVER`), over 8; a "more than" claim drawn as its lower bound. The paper
    states its other Figure 11 numbers as ratios between lines, not as throughput: those are not drawn."""
    claim = SCALE_OVER_ONE_SERVER.get((model, name))
    if claim is None:
        return False
    bound = " (lower bound)" if claim.bound == "more than" else ""
    ax.plot([SCALE_SERVERS], [claim.low / SCALE_SERVERS], label=f"{_label(name)}: paper, batch {SCALE_BATCH_SIZE}"
            f"{bound}", color=_style(name).get("color"), **_PAPER_MARKER)
    return True


def _cluster(records) -> str:
    """The cluster the run predicted for in words, where it is not the default (:meth:`PredictRecord.describe_cluster`;
    a run from before the columns: the default)."""
    columns = [c for c in ("cores_per_host", "shared_cores", "oversubscription", "asynchronous") if c in records]
    if not columns:
        return ""
    rows = records[columns].drop_duplicates().to_dict("records")
    return "; ".join(dict.fromkeys(text for row in rows if (text := PredictRecord.describe_cluster(**row))))


def _predict_figure(run: Run, column: str, ylabel: str, title: str) -> Figure | None:
    """``column`` against servers, a panel per model, batch size and link rate, a line per transport."""
    points = _points(run)
    if points.empty:
        return None
    points = points.sort_values("servers")
    # a row per model (in the run's order), its link rates slowest first
    models = {model: i for i, model in enumerate(dict.fromkeys(run.records["model"]))}
    bps = dict(zip(points["link_rate"], points["link_rate_bps"], strict=True))
    panels = sorted(set(zip(points["model"], points["batch_size"], points["link_rate"], strict=True)),
                    key=lambda panel: (models[panel[0]], panel[1], bps[panel[2]]))
    fig, axes = _grid(len(panels), 3, 4.8, 3.8)
    paper = False
    for ax, (model, batch, rate) in zip(axes, panels, strict=True):
        subset = points[(points["model"] == model) & (points["batch_size"] == batch) & (points["link_rate"] == rate)]
        for name in _transports_in_order(subset):
            line = subset[subset["transport"] == name]
            _line(ax, name, _label(name), line["servers"], line[column])
            if column == "scaling_efficiency":
                paper |= _paper_points(ax, model, name)
        _integer_log_axis(ax, subset["servers"], "servers (each a worker and a parameter server)")
        ax.set_ylim(bottom=0)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{model_name(model)}, batch {batch}, {rate} links", fontsize=10)
        ax.grid(True, alpha=0.3)
    notes = ["PREDICTED from a micro run of this machine (bench predict), not measured", _notes(run.records)]
    if paper:
        notes.append("stars: the paper's measured 8-server speed-up over 1 server, over 8 (Figure 11)")
    cluster = _cluster(run.records)
    _title(fig, f"{title} ({cluster})" if cluster else title, run, notes)
    _finish(fig, axes)
    # above the panels, not on the top row's titles (the layout leaves a tall grid's title where it was)
    fig.suptitle(fig.get_suptitle(), y=1.0, va="bottom", fontsize=10)
    return fig


def predict_throughput_figure(run: Run) -> Figure | None:
    """Figure 11 predicted: total mini-batches per second against servers, per transport."""
    return _predict_figure(run, "total_batches_per_s", "total mini-batches / s (predicted)",
                           "Scalability predicted: throughput against servers, higher is better")


def predict_efficiency_figure(run: Run) -> Figure | None:
    """Predicted scaling efficiency: throughput / (servers x the same transport's 1-server throughput)."""
    return _predict_figure(run, "scaling_efficiency", "scaling efficiency (predicted)\n"
                           "(throughput / servers x 1-server)", "Scaling efficiency predicted, 1 is perfect")
