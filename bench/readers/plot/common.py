"""What every figure shares: a line's look and label (the catalogue's), titles and subtitles, the legend below
the axes, error bars from a point's spread, log axes of sizes, box plots, and the notes a figure carries."""

from __future__ import annotations

import textwrap
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from bench.ground.sizes import format_size
from bench.results import Run
from bench.results import lines as catalogue
from bench.results.records import framework_title

#: one colour per model in the figures that draw models as lines (Figure 7)
_MODEL_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf")

class PlotError(ValueError):
    """Nothing to draw, or an experiment this command cannot draw."""


Builder = Callable[[Run], Figure | None]


def _style(name: str) -> dict[str, Any]:
    """The look of a line (the catalogue's, or a spare colour for a name it does not know)."""
    return dict(catalogue.line(name).style)


def _label(name: str) -> str:
    return catalogue.line(name).label


def _transports_in_order(records: pd.DataFrame) -> list[str]:
    return catalogue.order(records["transport"])


def _subtitle(run: Run) -> str:
    host = run.meta.get("host", "?")
    cpu = run.meta.get("cpu", "?")
    when = (run.meta.get("start_time") or "")[:16].replace("T", " ")
    settings = run.meta.get("settings") or {}
    backend, links = settings.get("fabric", "ucx"), settings.get("fabric_transport")  # runs before --fabric: ucx
    text = f"{host} · {cpu} · {when} UTC" + (f" · fabric: {backend} ({links})" if links else "")
    status = run.meta.get("status")
    if status not in (None, "complete"):
        text += f" · run {status}: incomplete"
    return text


#: the id of a figure's details: the small print under it (notes, and where and when it ran)
DETAILS_GID = "bench-details"


def _title(fig: Figure, what: str, run: Run, notes: Iterable[str] = ()) -> None:
    """The title, one short line: what is drawn (of one framework's records, that framework's name first: PyTorch's
    points are never mistaken for TensorFlow's). The notes (spread, compute replayed, ...), then where and when it
    ran, go under the figure in small print (below its legend: :func:`_finish`), wrapped to its width."""
    if run.framework is not None:  # one framework's part of a run (Run.by_framework): named first
        what = f"{framework_title(run.framework)}: {what}"
    fig.suptitle(what, fontsize=10)
    width = max(60, int(fig.get_figwidth() * 19))  # characters of 7 points that fit across the figure
    # wrapped: the host, CPU and fabric come from meta.json, however long someone made them
    details = textwrap.fill(" · ".join([*(n for n in notes if n), _subtitle(run)]), width)
    fig.text(0.5, 0.0, details, fontsize=7, color="#444444", ha="center", va="top", gid=DETAILS_GID)


def details_of(fig: Figure) -> str:
    """The small print under a figure (:func:`_title`), empty when it has none."""
    return next((text.get_text() for text in fig.texts if text.get_gid() == DETAILS_GID), "")


def figure_text(fig: Figure) -> str:
    """Everything a figure says about itself: its title, then its details."""
    title = fig.get_suptitle()
    return f"{title}\n{details_of(fig)}" if details_of(fig) else title


def _entries(axes: Iterable[Axes]) -> dict[str, Artist]:
    """Legend entries of all ``axes``, each label once, in order of appearance."""
    entries: dict[str, Artist] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    return entries


def _legend_below(fig: Figure, entries: dict[str, Artist]) -> Legend | None:
    """A legend under the whole figure (after its layout is done): it can cover no data, however many
    entries it has. As many columns as its longest label allows."""
    if not entries:
        return None
    longest = max(len(label) for label in entries)
    per_row = int(fig.get_figwidth() * 14 // (longest + 6))  # about 14 characters per inch at 8 points
    rows = -(-len(entries) // max(1, per_row))
    columns = -(-len(entries) // rows)  # rows as even as they can be
    return fig.legend(list(entries.values()), list(entries), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                      ncol=columns, fontsize=8, frameon=False)


def _finish(fig: Figure, axes: Iterable[Axes], entries: dict[str, Artist] | None = None) -> Figure:
    """Lay the figure out, then put the legend (of ``entries``, or of every axes) below it."""
    axes = list(axes)
    fig.tight_layout()
    legend = _legend_below(fig, entries if entries is not None else _entries(axes))
    details = next((text for text in fig.texts if text.get_gid() == DETAILS_GID), None)
    if legend is not None and details is not None:  # the small print below the legend
        box = legend.get_window_extent(fig.canvas.get_renderer()).transformed(fig.transFigure.inverted())
        details.set_y(box.y0 - 0.01)
    return fig


def _points(run: Run) -> pd.DataFrame:
    """The run's points (rounds folded, with their spread), pandas' indexing advice kept off the console."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pd.errors.PerformanceWarning)
        return run.points()


def _column(frame: pd.DataFrame, name: str) -> pd.Series | None:
    return frame.get(name)


def _yerr(values: Any, low: Any, high: Any) -> np.ndarray | None:
    """Error bars (below, above) from a point's value and its spread; None when there is no spread to draw."""
    if low is None or high is None:
        return None
    values, low, high = (np.asarray(v, dtype=float) for v in (values, low, high))
    with np.errstate(invalid="ignore"):
        below = np.clip(np.nan_to_num(values - low), 0, None)
        above = np.clip(np.nan_to_num(high - values), 0, None)
        tiny = 1e-9 * np.nan_to_num(np.abs(values))  # a spread of rounding only (a scaled value) is none
    below[below <= tiny], above[above <= tiny] = 0, 0
    if not ((below > 0) | (above > 0)).any():
        return None
    return np.vstack([below, above])


def spread_note(points: pd.DataFrame) -> str:
    """What the error bars of ``points`` are, for the figure's title: the range across the rounds, or the 95%
    confidence interval of the median from the samples; or that there are none."""
    if "spread" not in points or points.empty:
        return ""
    kinds = points["spread"]
    rounds = sorted({int(n) for n in points.loc[kinds == "rounds", "rounds"]})
    parts = []
    if rounds:
        counts = "/".join(map(str, rounds))
        parts.append(f"each point the median of its {counts} rounds, error bars the range across them")
    if (kinds == "samples").any():
        parts.append("error bars: 95% confidence interval of the median, from each point's timed iterations")
    if not parts:
        return "each point measured once, no samples kept: no error bars"
    return "; ".join(parts)


def _notes(records: pd.DataFrame) -> str:
    """How the workers computed, when not for real, and how ranks were launched: replayed records are never
    to be mistaken for real ones."""
    modes = sorted(set(records["compute"].dropna())) if "compute" in records else []
    notes = {"replay": "compute REPLAYED (workers wait the time measured here)",
             "paper": "compute REPLAYED at the paper's P100 times (Table 2)"}
    parts = [notes[m] for m in modes if m in notes]
    if "launcher" in records and records["launcher"].notna().any():
        parts.append("launcher " + ", ".join(sorted(set(records["launcher"].dropna().astype(str)))))
    if "link_rate" in records and records["link_rate"].notna().any():
        rates = sorted(set(records["link_rate"].dropna().astype(str)) - {""})
        if rates:
            parts.append("links " + ", ".join(rates))
    return " · ".join(parts)


def _line(ax: Axes, name: str, label: str, x: Any, y: Any, low: Any = None, high: Any = None) -> None:
    """One transport's line, with error bars where it has a spread."""
    # always an errorbar container (with or without bars), so the legend keeps the order lines were drawn in
    ax.errorbar(x, y, yerr=_yerr(y, low, high), label=label, capsize=3, elinewidth=1, **_style(name))


def _bar(ax: Axes, name: str, x: Any, heights: Any, width: float, low: Any = None, high: Any = None,
         label: str | None = None) -> None:
    """Bars of one transport: its colour, hatched for a reference that moves nothing, error bars if any."""
    color = _style(name).get("color")
    yerr = _yerr(heights, low, high)
    ax.bar(x, heights, width, label=label if label is not None else _label(name), color=color,
           edgecolor="#dddddd" if catalogue.line(name).hatched else "white", linewidth=0.5,
           hatch="//" if catalogue.line(name).hatched else None, yerr=yerr, capsize=2 if yerr is not None else 0,
           error_kw={"elinewidth": 1, "ecolor": "#222222"})


def _log_y(ax: Axes) -> None:
    """A log y axis; over less than three decades its ticks read as plain numbers (0.3, 2), not 3x10^-1."""
    ax.set_yscale("log")
    ax.autoscale_view()
    low, high = ax.get_ylim()
    if low > 0 and high / low < 1000:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))


def _approximate_size(nbytes: float) -> str:
    """A size to three figures in binary units: 48566916 -> '46.3MB'."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g}{unit}"
    return f"{int(nbytes)}B"


def _minor_label(value: float, _pos: int) -> str:
    """Minor log ticks labelled at 2 and 5 times a power of ten only."""
    if value <= 0:
        return ""
    leading = round(value / 10 ** np.floor(np.log10(value)))
    return f"{value:g}" if leading in (2, 5) else ""


def _size_axis(ax: Axes, sizes: Iterable[float], label: str = "tensor size (binary units)") -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    if len(ticks) > 12:
        ticks = ticks[:: -(-len(ticks) // 12)]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_size(int(v))))
    ax.set_xlabel(label)


def _integer_log_axis(ax: Axes, values: Iterable[float], label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(values))))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{round(v)}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(label)


def _grid(count: int, columns: int, width: float, height: float) -> tuple[Figure, list[Axes]]:
    """A grid of ``count`` panels (the spare ones hidden)."""
    columns = max(1, min(columns, count))
    rows = -(-count // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[count:]:
        ax.set_visible(False)
    return fig, flat[:count]


def _boxes(ax: Axes, groups: Sequence[Any], names: Sequence[str], values: Callable[[Any, str], np.ndarray]) -> int:
    """Box plots grouped by ``groups`` along x, one box per transport side by side (its colour); returns the
    fewest values behind a box. Box: quartiles, line: median, whiskers: 1st and 99th percentile, dots beyond."""
    width = 0.8 / max(1, len(names))
    fewest = 0
    for i, name in enumerate(names):
        color = _style(name).get("color")
        data, positions = [], []
        for j, group in enumerate(groups):
            vals = np.asarray(values(group, name), dtype=float)
            vals = vals[np.isfinite(vals)]
            if len(vals):
                data.append(vals)
                positions.append(j - 0.4 + width * (i + 0.5))
                fewest = len(vals) if not fewest else min(fewest, len(vals))
        if not data:
            continue
        ax.boxplot(data, positions=positions, widths=width * 0.8, whis=(1, 99), patch_artist=True,
                   manage_ticks=False, showfliers=True,
                   boxprops={"facecolor": color, "alpha": 0.45, "edgecolor": color},
                   medianprops={"color": "#111111", "linewidth": 1.2},
                   whiskerprops={"color": color}, capprops={"color": color},
                   flierprops={"marker": ".", "markersize": 2, "markerfacecolor": color, "markeredgecolor": color,
                               "alpha": 0.6})
    for j in range(1, len(groups)):
        ax.axvline(j - 0.5, color="#cccccc", linewidth=0.8)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    return fewest


#: the widest a figure of boxes is drawn (inches): groups beyond it wrap onto further rows, so that at a page's width
#: (the report's, some 1250 CSS pixels) its 8-point text stays legible
BOXES_MAX_WIDTH = 16.0


def _box_rows(groups: Sequence[Any], names: Sequence[str], box: float, least: float,
              height: float) -> tuple[Figure, list[tuple[Axes, list[Any]]]]:
    """A figure for :func:`_boxes`, ``box`` inches per box and ``least`` inches wide at least: the groups on as few
    rows as keep it within :data:`BOXES_MAX_WIDTH`, the rows as even as they can be; each row's axes and groups."""
    per_group = box * max(1, len(names))
    fit = max(1, int((BOXES_MAX_WIDTH - 2) // per_group))
    count = -(-len(groups) // fit)
    per_row = -(-len(groups) // count)
    width = min(BOXES_MAX_WIDTH, max(least, per_group * per_row + 2))
    fig, axes = _grid(count, 1, width, height if count == 1 else 0.75 * height)
    return fig, [(ax, list(groups[k * per_row:(k + 1) * per_row])) for k, ax in enumerate(axes)]


def _box_entries(names: Sequence[str]) -> dict[str, Artist]:
    return {_label(n): Patch(facecolor=_style(n).get("color"), alpha=0.45, edgecolor=_style(n).get("color"))
            for n in names}


