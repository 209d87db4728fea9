"""Figures drawn from a results directory, saved as PNG and SVG beside its records (or into another directory).

Each experiment has its figures (:data:`FIGURES`): a builder per file stem takes the run and returns a
matplotlib ``Figure``, or None when the run lacks what that figure draws (a run without ``samples.csv`` has
no distribution figure). :func:`plot_run` saves each as PNG and SVG (each file written whole, then renamed
into place, so a full disk leaves the old figure rather than half a new one); :func:`figures` and
:func:`draw` hand back the figures unsaved, for tests and for reports that lay them out themselves.

Every figure keeps to the same rules:

- a measured point is drawn once: the rounds of a point are folded (:meth:`bench.results.Run.points`: the
  median over the rounds) and their spread drawn as error bars, which the title names (the range across
  N rounds, or the 95% confidence interval of the median from the point's samples);
- a line looks the same everywhere: its style and label are the catalogue's (:mod:`bench.results.lines`);
- the legend sits below the axes, never on the data;
- bars start at zero; the title says what is drawn, the subtitle where and when it ran.
"""

from __future__ import annotations

import io
import textwrap
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

from bench import LOCAL

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator, PercentFormatter

from bench.ground.paper import model_name
from bench.ground.sizes import format_size
from bench.results import Run, load_run, replace_file
from bench.results import lines as catalogue

FORMATS = ("png", "svg")
#: one colour per model in the figures that draw models as lines (Figure 7)
_MODEL_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf")

class PlotError(ValueError):
    """Nothing to draw, or an experiment this command cannot draw."""


Builder = Callable[[Run], Figure | None]


def plot_run(path: Path, out_dir: Path | None = None) -> list[Path]:
    """Draw every figure the run's experiment has, as PNG and SVG into ``out_dir`` (default: the run's
    directory); returns the files written."""
    run = load_run(path)
    if run.records.empty:
        raise PlotError(f"{path}: the run has no records to draw")
    if run.experiment not in FIGURES:
        raise PlotError(f"{path}: no figures are defined for experiment '{run.experiment}'")
    target = Path(out_dir) if out_dir is not None else run.path
    written: list[Path] = []
    for stem, fig in figures(run):
        written += save_figure(fig, target, stem)
    if not written:
        raise PlotError(f"{path}: the {run.experiment} run has nothing its figures draw")
    return written


def figures(run: Run) -> Iterator[tuple[str, Figure]]:
    """``(stem, figure)`` for each figure the run has, drawn one at a time (close each when done)."""
    for stem, build in FIGURES.get(run.experiment, ()):
        fig = build(run)
        if fig is not None:
            yield stem, fig


def draw(run: Run, stem: str) -> Figure | None:
    """The one figure ``stem`` of the run, unsaved (None when the run lacks what it draws)."""
    for name, build in FIGURES.get(run.experiment, ()):
        if name == stem:
            return build(run)
    raise PlotError(f"no figure '{stem}' for experiment '{run.experiment}' "
                    f"(it has: {', '.join(n for n, _ in FIGURES.get(run.experiment, ())) or 'none'})")


def save_figure(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    """Save ``fig`` as ``out_dir/stem.png`` and ``.svg`` (cropped to what is drawn, legend included) and close it."""
    written = []
    try:
        for fmt in FORMATS:
            out = Path(out_dir) / f"{stem}.{fmt}"
            drawn = io.BytesIO()
            fig.savefig(drawn, format=fmt, dpi=150, bbox_inches="tight")
            replace_file(out, drawn.getvalue())  # a full disk leaves the old figure, never half a new one
            written.append(out)
    finally:
        plt.close(fig)
    return written


# -- shared pieces -------------------------------------------------------------------------------------------


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


def _title(fig: Figure, what: str, run: Run, notes: Iterable[str] = ()) -> None:
    """The title: what is drawn, notes (spread, compute replayed, ...), then where and when it ran."""
    width = max(60, int(fig.get_figwidth() * 13))  # characters of 10 points that fit across the figure
    # the subtitle is wrapped too: the host, CPU and fabric come from meta.json, however long someone made them
    lines = [what, *(textwrap.fill(n, width) for n in notes if n), textwrap.fill(_subtitle(run), width)]
    fig.suptitle("\n".join(lines), fontsize=10)


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
    _legend_below(fig, entries if entries is not None else _entries(axes))
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


# -- micro: Figure 8 -----------------------------------------------------------------------------------------


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
    so (bench/experiments/reference.py says why it is no latency). ``ucx_perftest_lat`` is drawn from its median, half a
    round trip: the floor of a send/receive.
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


# -- model: Figures 9 and 12 ---------------------------------------------------------------------------------


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
    _title(fig, f"Training throughput (Figure 9), {servers} server(s), higher is better", run,
           [_notes(run.records), spread_note(points)])
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
    _title(fig, "Distribution of the mini-batch time, every worker's every timed step", run,
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
    _title(fig, f"The graph analysis: zero copy against the same transport without it (Figure 12), batch size "
                f"{int(points['batch_size'].min())}, {servers} server(s)", run,
           [_notes(run.records), spread_note(points[points["transport"].isin(names)])])
    return _finish(fig, [time_ax])


# -- scale: Figure 11 ----------------------------------------------------------------------------------------


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


# -- converge: Figure 10 -------------------------------------------------------------------------------------


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


# -- analysis: Figure 7 --------------------------------------------------------------------------------------


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


#: the figures of each experiment, by file stem, in the order they are drawn
FIGURES: dict[str, tuple[tuple[str, Builder], ...]] = {
    "micro": (("micro_time", micro_time_figure), ("micro_throughput", micro_throughput_figure),
              ("micro_distribution", micro_distribution_figure)),
    "model": (("model_throughput", model_throughput_figure), ("model_step_time", model_step_time_figure),
              ("model_step_distribution", model_step_distribution_figure),
              ("copy_overhead", copy_overhead_figure)),
    "scale": (("scale_throughput", scale_throughput_figure), ("scale_efficiency", scale_efficiency_figure)),
    "converge": (("converge_loss_vs_time", converge_loss_vs_time_figure),
                 ("converge_metric_vs_step", converge_metric_vs_step_figure)),
    "models": (("models_vs_paper", models_vs_paper_figure),),
    "analysis": (("analysis_tensor_sizes", analysis_tensor_sizes_figure),),
}
