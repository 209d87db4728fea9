"""Figure 7: the sizes of the variable tensors, as a complementary cumulative distribution."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from bench.ground.paper import model_name
from bench.readers.plot.common import (
    _MODEL_COLORS,
    _approximate_size,
    _finish,
    _size_axis,
    _title,
)
from bench.results import Run


def variable_sizes(records: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per model, the bytes of each variable tensor (the plan's ``weight`` rows, each variable once however
    many workers it goes to), for Figure 7."""
    if "role" not in records or "bytes" not in records:
        return {}
    weights = records[(records["role"] == "weight") & records["bytes"].notna()].copy()
    ident = weights["tensor"]
    if "variable" in weights:
        ident = weights["variable"].where(weights["variable"].notna(), weights["tensor"])
    weights["_variable"] = ident
    weights = weights.drop_duplicates(["model", "_variable"])
    return {str(model): np.sort(group["bytes"].to_numpy(dtype=float))
            for model, group in weights.groupby("model", sort=False)}


def analysis_tensor_sizes_figure(run: Run) -> Figure | None:
    """Figure 7 of the paper: the complementary cumulative distribution of variable tensor sizes, one line per
    model; beside it, the share of the model's bytes in tensors larger than a size. None without weights."""
    sizes = variable_sizes(run.records)
    if not sizes:
        return None
    fig, (count_ax, bytes_ax) = plt.subplots(1, 2, figsize=(11, 4.5), sharex=True)
    everything = np.concatenate(list(sizes.values()))
    for i, (model, values) in enumerate(sizes.items()):
        color = _MODEL_COLORS[i % len(_MODEL_COLORS)]
        n = len(values)
        # at each size, the share of tensors (of bytes) at least that large
        at_least = 1 - np.arange(n) / n
        bytes_at_least = np.cumsum(values[::-1])[::-1] / values.sum()
        label = f"{model_name(model)} ({n} tensors, {_approximate_size(values.sum())})"
        # from 100% before the smallest tensor down to 0 after the largest
        x = np.r_[values[0], values, values[-1]]
        count_ax.step(x, np.r_[1.0, at_least, 0.0], where="post", color=color, label=label, linewidth=1.5)
        bytes_ax.step(x, np.r_[1.0, bytes_at_least, 0.0], where="post", color=color, label=label, linewidth=1.5)
    low, high = max(1.0, everything.min()), everything.max()
    ticks = [2.0**k for k in range(0, 41, 5) if low / 32 <= 2.0**k <= high * 32]
    for ax in (count_ax, bytes_ax):
        _size_axis(ax, ticks, "variable tensor size (binary units, log scale)")
        ax.set_xlim(low / 2, high * 2)
        ax.set_ylim(0, 1.02)
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.grid(True, alpha=0.3)
        for mark in (10 * 2**10, 2**20):  # the paper's thresholds: half the tensors above 10KB, a fifth above 1MB
            if low <= mark <= high:
                ax.axvline(mark, color="#999999", linestyle=":", linewidth=1)
    count_ax.set_ylabel("variable tensors at least this large")
    bytes_ax.set_ylabel("bytes of the model in tensors at least this large")
    count_ax.set_title("by number of tensors (the paper's Figure 7)", fontsize=9)
    bytes_ax.set_title("by bytes", fontsize=9)
    _title(fig, "Variable tensor sizes: complementary cumulative distribution (Figure 7)", run,
           ["dotted: 10KB and 1MB (in the paper over 50% of the tensors are larger than 10KB, over 20% larger "
            "than 1MB, and those hold 96% of the bytes)"])
    return _finish(fig, [count_ax])


