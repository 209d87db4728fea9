"""Figure 10: loss against time and the metric against steps, per transport."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from bench.readers.plot.common import (
    PlotError,
    _finish,
    _label,
    _log_y,
    _style,
    _title,
    _transports_in_order,
)
from bench.results import Run


def _converge_figure(run: Run, x: str, xlabel: str, against: str) -> Figure:
    """Training loss and the held-out metric against ``x`` (wall-clock seconds or steps), per transport."""
    records = run.records
    steps = records[records["kind"] == "step"].sort_values("step")
    evals = records[records["kind"] == "eval"].sort_values("step")
    if steps.empty and evals.empty:
        raise PlotError(f"{run.path}: the converge run has no step or evaluation records to draw")
    settings = run.meta.get("settings") or {}
    metric = evals["metric"].dropna().iloc[0] if not evals.empty else settings.get("metric", "metric")
    target = settings.get("target")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
    for name in _transports_in_order(records[records["kind"].isin(["step", "eval"])]):
        style = {**_style(name), "marker": None}
        line = steps[steps["transport"] == name]
        left.plot(line[x], line["train_loss"], label=_label(name), linewidth=1.2, **style)
        points = evals[evals["transport"] == name]
        right.plot(points[x], points["metric_value"], label=_label(name), **{**_style(name), "markersize": 4})
    _log_y(left)
    left.set_ylabel("training loss (mean over the workers' batches, log)")
    right.set_ylabel(f"held-out {metric}")
    if metric == "perplexity":
        _log_y(right)
    if target and str(target).startswith(f"{metric}="):
        right.axhline(float(str(target).partition("=")[2]), color="#444444", linestyle=":", linewidth=1,
                      label=f"target {target}")
    for ax in (left, right):
        ax.set_xlabel(xlabel)
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3)
    _title(fig, f"Convergence (Figure 10) of {settings.get('task', '?')} against {against}", run)
    return _finish(fig, [right, left])


def converge_loss_vs_time_figure(run: Run) -> Figure:
    """Figure 10 of the paper: loss and held-out metric against wall-clock time, per transport."""
    return _converge_figure(run, "wall_s", "seconds trained (evaluation left out)", "time")


def converge_metric_vs_step_figure(run: Run) -> Figure:
    """The same against steps, where the curves of every transport must coincide: transports change how long
    training takes, not what it learns."""
    return _converge_figure(run, "step", "step", "steps (the curves coincide)")


