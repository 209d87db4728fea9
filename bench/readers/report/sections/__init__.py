"""The sections of the page, one module per figure or table of the paper, and their registry.

A section module computes its ratios and rows from one run (or, a section across runs, from every run of the page
it reads) and says its prose: it returns a :class:`~bench.readers.report.page.Section` (or None when the runs have
nothing for it) and knows nothing of rendering. :data:`SECTIONS` lists them in the order they stand on the page; a
new experiment's section is one module here and one entry there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.readers.report.page import Section
from bench.readers.report.sections import (
    converge,
    copy_overhead,
    figure11_predicted,
    gpu,
    micro,
    plan,
    predict,
    scale,
    soak,
    table2,
    throughput,
)
from bench.results import Run


@dataclass(frozen=True)
class Kind:
    """One kind of section: where it stands on the page, the runs it reads and how it is made from one."""

    #: its place on the page: sections of one key stand together, by kind, then in the order of their runs (also
    #: the ``data-section`` and anchor its module gives the section)
    key: str
    #: the experiments whose runs it reads
    experiments: tuple[str, ...]
    #: ``make(run, label)``: the section of that run, or None when the run has nothing for it (None for a section
    #: across runs)
    make: Callable[[Run, str], Section | None] | None
    #: the beginnings of the names of the run's figures (:mod:`bench.readers.plot`'s stems) shown beside this
    #: section; a run's other figures go to the first of its sections that shows any
    figures: tuple[str, ...] = ()
    #: one section on the page for every run it reads, not one per run (its tables one after the other): Table 2
    #: describes the models, whichever runs measured them
    once: bool = False
    #: ``across([(label, run), ...])``: one section over every run of the page it reads (predictions beside the
    #: measured runs they predict), made after the sections of each run; None when they have nothing for it
    across: Callable[[list[tuple[str, Run]]], Section | None] | None = None


#: every section, in the order of the page
SECTIONS: tuple[Kind, ...] = (
    Kind("figure8", ("micro",), micro.figure8, figures=("micro_",)),
    Kind("table3", ("micro",), gpu.table3),
    Kind("table2", ("models",), table2.table2, figures=("models_",), once=True),
    Kind("table2", ("model",), table2.model_size, once=True),
    Kind("figure7", ("analysis",), plan.figure7, figures=("analysis_",)),
    Kind("figure9", ("model",), throughput.figure9, figures=("model_",)),
    Kind("figure10", ("converge",), converge.figure10, figures=("converge_",)),
    Kind("figure11", ("scale",), scale.figure11, figures=("scale_",)),
    Kind("figure11-predicted", ("predict",), figure11_predicted.figure11_predicted, figures=("predict_",)),
    Kind("figure11-predicted-measured", ("predict", "scale"), None, across=predict.predicted_against_measured),
    Kind("figure12", ("model",), copy_overhead.figure12, figures=("copy_overhead",)),
    Kind("soak", ("soak",), soak.soak),
)

__all__ = ["SECTIONS", "Kind"]
