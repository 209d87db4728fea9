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
- bars start at zero; the title says what is drawn, the subtitle where and when it ran;
- one framework's points are never drawn with another's: a run that trained models in both TensorFlow and
  PyTorch has each figure once per framework (:meth:`bench.results.Run.by_framework`; the PyTorch one's file
  ``<stem>_torch``), and a figure of PyTorch's says so in its title (TensorFlow, the paper's, is named only beside
  another).

One module per experiment's figures (``micro``, ``model``, ``scale``, ``converge``, ``models``, ``analysis``), as
the report has one section per figure; what they share is in ``common``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from bench.readers.plot.analysis import analysis_tensor_sizes_figure
from bench.readers.plot.common import BOXES_MAX_WIDTH, Builder, PlotError, spread_note
from bench.readers.plot.converge import converge_loss_vs_time_figure, converge_metric_vs_step_figure
from bench.readers.plot.micro import (
    micro_distribution_figure,
    micro_throughput_figure,
    micro_time_figure,
    micro_time_lines,
)
from bench.readers.plot.model import (
    copy_overhead_figure,
    model_step_distribution_figure,
    model_step_time_figure,
    model_throughput_figure,
)
from bench.readers.plot.models import models_vs_paper_figure
from bench.readers.plot.predict import predict_efficiency_figure, predict_throughput_figure
from bench.readers.plot.scale import scale_efficiency_figure, scale_throughput_figure
from bench.results import Run, load_run, replace_file
from bench.results.records import OLD_FRAMEWORK

__all__ = ["BOXES_MAX_WIDTH", "FIGURES", "FORMATS", "PlotError", "draw", "figures", "micro_time_lines", "plot_run",
           "save_figure", "spread_note"]

FORMATS = ("png", "svg")


def plot_run(path: Path | Run, out_dir: Path | None = None) -> list[Path]:
    """Draw every figure the run's experiment has, as PNG and SVG into ``out_dir`` (default: the run's
    directory); returns the files written. ``path`` is the run's directory, or the run read already (one
    framework's part of one: :meth:`bench.results.Run.by_framework`)."""
    run = path if isinstance(path, Run) else load_run(path)
    path = run.path
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


def _parts(run: Run) -> list[tuple[str, Run]]:
    """``(stem suffix, run)`` per framework the run's figures are drawn for: ``("", run)`` for a run of one, else
    ``_<framework>`` for each but TensorFlow's (the paper's keeps its figures' names)."""
    parts = run.by_framework()
    if len(parts) == 1:
        return [("", parts[0])]
    return [("" if part.framework == OLD_FRAMEWORK else f"_{part.framework}", part) for part in parts]


def figures(run: Run) -> Iterator[tuple[str, Figure]]:
    """``(stem, figure)`` for each figure the run has, drawn one at a time (close each when done): once per
    framework of a run that trained in several."""
    for suffix, part in _parts(run):
        for stem, build in FIGURES.get(run.experiment, ()):
            fig = build(part)
            if fig is not None:
                yield stem + suffix, fig


def draw(run: Run, stem: str) -> Figure | None:
    """The one figure ``stem`` of the run, unsaved (None when the run lacks what it draws); of a run that trained in
    several frameworks, ``stem`` names the framework's (``model_throughput_torch``), TensorFlow's being plain."""
    for suffix, part in _parts(run):
        for name, build in FIGURES.get(run.experiment, ()):
            if name + suffix == stem:
                return build(part)
    names = [name + suffix for suffix, _ in _parts(run) for name, _ in FIGURES.get(run.experiment, ())]
    raise PlotError(f"no figure '{stem}' for experiment '{run.experiment}' (it has: {', '.join(names) or 'none'})")


def save_figure(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    """Save ``fig`` as ``out_dir/stem.png`` and ``.svg`` (cropped to what is drawn, legend included) and close it."""
    written = []
    try:
        for fmt in FORMATS:
            out = Path(out_dir) / f"{stem}.{fmt}"
            drawn = io.BytesIO()
            fig.savefig(drawn, format=fmt, dpi=150, bbox_inches="tight", metadata={"Title": _title_of(fig)})
            replace_file(out, drawn.getvalue())  # a full disk leaves the old figure, never half a new one
            written.append(out)
    finally:
        plt.close(fig)
    return written


def _title_of(fig: Figure) -> str:
    """What the figure shows: the first line of its title (where and when it ran follow), for the file's own title
    (a PNG's ``Title`` text, an SVG's ``<title>``), which ``bench report`` captions the figure with."""
    return fig.get_suptitle().strip().split("\n")[0]


#: the figures of each experiment, by file stem, in the order they are drawn
FIGURES: dict[str, tuple[tuple[str, Builder], ...]] = {
    "micro": (("micro_time", micro_time_figure), ("micro_throughput", micro_throughput_figure),
              ("micro_distribution", micro_distribution_figure)),
    "model": (("model_throughput", model_throughput_figure), ("model_step_time", model_step_time_figure),
              ("model_step_distribution", model_step_distribution_figure),
              ("copy_overhead", copy_overhead_figure)),
    "scale": (("scale_throughput", scale_throughput_figure), ("scale_efficiency", scale_efficiency_figure)),
    "predict": (("predict_throughput", predict_throughput_figure), ("predict_efficiency", predict_efficiency_figure)),
    "converge": (("converge_loss_vs_time", converge_loss_vs_time_figure),
                 ("converge_metric_vs_step", converge_metric_vs_step_figure)),
    "models": (("models_vs_paper", models_vs_paper_figure),),
    "analysis": (("analysis_tensor_sizes", analysis_tensor_sizes_figure),),
}
