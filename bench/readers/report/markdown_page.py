"""The page as Markdown: the same tables as the HTML page, figures referred to as PNG files beside it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.ground import paper
from bench.readers.report.page import Report, Table
from bench.results import printable

#: characters that make Markdown (emphasis, links, code, tables, strike-through) backslash-escaped; those of HTML as
#: entities: a name from a run's files shows as written, never as markup or a tag
_MARKDOWN = re.compile(r"([\\`*_\[\]|~])")
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
#: what starts a block (heading, list) at the beginning of a list item (a quote's ``>`` is an entity already)
_BLOCK_START = re.compile(r"^(\s*)([#+-](?=\s|$)|\d+(?=[.)](?:\s|$)))")


def _md(text: Any) -> str:
    """Text (from a run's files or made of it) as Markdown that shows it as it is: one line, no markup, no HTML."""
    shown = printable(str(text).replace("\n", " "), None)  # a line break as a space, other controls escaped
    shown = _MARKDOWN.sub(r"\\\1", shown)
    shown = "".join(_HTML.get(char, char) for char in shown)
    return _BLOCK_START.sub(lambda m: m.group(1) + ("\\" + m.group(2) if not m.group(2).isdigit()
                                                    else m.group(2) + "\\"), shown, count=1)


def _code(text: Any) -> str:
    """``text`` as a code span, its fence longer than any run of backticks in it."""
    shown = printable(text, None)
    fence = "`" * (max((len(run) for run in re.findall("`+", shown)), default=0) + 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") else ""
    return f"{fence}{pad}{shown}{pad}{fence}"


def _md_table(table: Table) -> list[str]:
    lines = [f"*{_md(table.caption)}*", "", "| " + " | ".join(_md(c) for c in table.header) + " |",
             "|" + "|".join("---" for _ in table.header) + "|"]
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in table.rows]
    return [*lines, ""]


def render_markdown(report: Report, figure_names: dict[Path, str]) -> str:
    """The same page in Markdown; each figure refers to ``figure_names[png]``, a file beside the document."""
    lines = ["# Measured here against *Fast Distributed Deep Learning over RDMA*", "", paper.CITATION, "",
             _md(report.lead()), "", "## Runs and setup", ""]
    for table in report.overview:
        lines += _md_table(table)
    for section in report.sections:
        lines += [f"## {_md(section.title)}", ""]
        for label, run in section.runs:
            status = _md(run.meta.get("status", "?"))
            lines += [f"Run {_md(label)}: {_code(run.path)} ({_md(run.experiment)}, {status}).", ""]
        for figure in section.figures:
            lines += [f"![{_md(figure.caption)}]({figure_names[figure.png]})", "", f"*{_md(figure.caption)}*", ""]
        if section.figure_note:
            lines += [f"*{_md(section.figure_note)}*", ""]
        for quote, where in section.paper:
            lines += [f"> “{quote}” ({where})", ""]
        for table in section.tables:
            lines += _md_table(table)
        if section.notes:
            lines += ["Why the numbers differ:", ""] + [f"- {_md(n)}" for n in section.notes] + [""]
    return "\n".join(lines)
