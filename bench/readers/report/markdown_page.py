"""The page as Markdown: the same tables as the HTML page, figures referred to as PNG files beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.ground import paper
from bench.readers.report.page import Report, Table


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _md_table(table: Table) -> list[str]:
    lines = [f"*{_md(table.caption)}*", "", "| " + " | ".join(_md(c) for c in table.header) + " |",
             "|" + "|".join("---" for _ in table.header) + "|"]
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in table.rows]
    return [*lines, ""]


def render_markdown(report: Report, figure_names: dict[Path, str]) -> str:
    """The same page in Markdown; each figure refers to ``figure_names[png]``, a file beside the document."""
    lines = ["# Measured here against *Fast Distributed Deep Learning over RDMA*", "", paper.CITATION, "",
             f"Report made {report.created} from {len(report.runs)} run(s). Ratios are speed-ups: how many times "
             "faster (or higher in throughput) RDMA.zerocp is.", "", "## Runs and setup", ""]
    for table in report.overview:
        lines += _md_table(table)
    for section in report.sections:
        lines += [f"## {section.title}", ""]
        for label, run in section.runs:
            lines += [f"Run {label}: `{run.path}` ({run.experiment}, {run.meta.get('status', '?')}).", ""]
        for figure in section.figures:
            lines += [f"![{figure.stem}]({figure_names[figure.png]})", ""]
        if section.figure_note:
            lines += [f"*{section.figure_note}*", ""]
        for quote, where in section.paper:
            lines += [f"> “{quote}” ({where})", ""]
        for table in section.tables:
            lines += _md_table(table)
        if section.notes:
            lines += ["Why the numbers differ:", ""] + [f"- {_md(n)}" for n in section.notes] + [""]
    return "\n".join(lines)
