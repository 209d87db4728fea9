"""Table 2 as a figure: each model's size and compute here beside the paper's."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from bench.ground.paper import model_name
from bench.readers.plot.common import (
    _entries,
    _finish,
    _title,
)
from bench.results import Run

# -- models: Table 2 -----------------------------------------------------------------------------------------

_HERE = "#1f77b4"
_PAPER = "#c7c7c7"


def models_vs_paper_figure(run: Run) -> Figure:
    """The paper's Table 2 measured here, beside the paper's: model size, variable tensors and computation
    time per sample, a pair of bars per model (one per batch size measured for the time)."""
    records = run.records
    models = list(dict.fromkeys(records["model"]))
    batches = sorted(set(records["batch_size"]))
    fig, axes = plt.subplots(3, 1, figsize=(max(7.0, 1.25 * len(models) * max(1, len(batches)) + 2), 8.5),
                             sharex=True)
    first = records.drop_duplicates("model").set_index("model")

    def pair(ax: Axes, here: dict[str, list[float]], paper: list[float], fmt: str) -> None:
        series = [*here.items(), ("the paper (Table 2)", paper)]
        width = 0.8 / len(series)
        for i, (label, heights) in enumerate(series):
            is_paper = i == len(series) - 1
            color = _PAPER if is_paper else (_HERE if len(here) == 1 else plt.cm.Blues(0.45 + 0.5 * i / len(here)))
            bars = ax.bar([j - 0.4 + width * (i + 0.5) for j in range(len(models))], heights, width,
                          color=color, hatch="//" if is_paper else None, edgecolor="white", linewidth=0.5,
                          label=label)
            ax.bar_label(bars, labels=["" if h != h else fmt.format(h) for h in heights], fontsize=7, padding=2)
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.12)
        ax.grid(True, axis="y", alpha=0.3)

    def column(name: str) -> list[float]:
        return [float(first.loc[m, name]) if name in first and pd.notna(first.loc[m, name]) else float("nan")
                for m in models]

    pair(axes[0], {"measured here": column("model_mb")}, column("paper_model_mb"), "{:.1f}")
    axes[0].set_ylabel("model size (MB)")
    axes[0].set_title("model size: all variable tensors, the bytes each worker pulls and pushes per step",
                      fontsize=9)
    pair(axes[1], {"measured here": column("variables")}, column("paper_variables"), "{:.0f}")
    axes[1].set_ylabel("variable tensors")
    axes[1].set_title("variable tensors", fontsize=9)
    compute: dict[str, list[float]] = {}
    for batch in batches:
        rows = records[records["batch_size"] == batch].drop_duplicates("model").set_index("model")
        label = "measured here" + (f", batch {batch}" if len(batches) > 1 else "")
        compute[label] = [float(rows.loc[m, "compute_ms_per_sample"]) if m in rows.index else float("nan")
                          for m in models]
    pair(axes[2], compute, column("paper_compute_ms_per_sample"), "{:.1f}")
    axes[2].set_ylabel("computation per sample (ms)")
    at = f"batch {batches[0]}" if len(batches) == 1 else "the batch sizes shown"
    axes[2].set_title(f"computation time per sample, one process (forward and backward): here on this machine's "
                      f"CPU at {at}, the paper on a Tesla P100 GPU", fontsize=9)
    axes[2].set_xticks(range(len(models)), [model_name(m) for m in models])
    axes[2].set_xlim(-0.5, len(models) - 0.5)
    _title(fig, "The benchmark models (the paper's Table 2): measured here beside the paper", run)
    return _finish(fig, axes, _entries([axes[2], axes[0]]))


