"""The page as HTML: self-contained (figures embedded as PNG ``data:`` URIs, no script, no network).

It shows what :class:`bench.readers.report.page.Report` holds and knows no experiment. A section reads from top to
bottom in bands as wide as the page: the paper's words (side by side), the figures (two to a row, one too wide for
half the page on a row of its own), the tables (side by side where they fit, their cells wrapping where they do
not) and the notes. Figures are scaled down to the width they get, never up; nothing needs a sideways scroll bar
in a window 1300 pixels wide (a table too wide for a narrower window scrolls in a box of its own).
"""

from __future__ import annotations

import base64
import html
import re
from typing import Any

from bench.ground import paper
from bench.readers.report.page import Figure, Report, Section, Table
from bench.results import Run

#: the page's style sheet: bands as wide as the page, figures in a grid, tables side by side
_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 0 auto; padding: 1.5rem 1.5rem 3rem;
       max-width: 1600px; color: #1d1d1f; background: #ffffff; line-height: 1.4; }
h1 { font-size: 1.6rem; margin: 0 0 0.2rem; }
h2 { font-size: 1.25rem; border-bottom: 2px solid #1f77b4; padding-bottom: 0.2rem; margin: 2.4rem 0 0.3rem; }
h3 { font-size: 1rem; margin: 1.1rem 0 0.4rem; }
.run { color: #555; font-size: 0.9rem; margin: 0.1rem 0; }
.run, li, blockquote, figcaption, caption { overflow-wrap: anywhere; }
.quotes { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 22rem), 1fr)); gap: 0.6rem; }
blockquote { margin: 0; padding: 0.4rem 0.8rem; border-left: 3px solid #ff7f0e; background: #fff8f0;
             font-size: 0.85rem; }
blockquote cite { display: block; color: #666; font-style: normal; font-size: 0.8rem; margin-top: 0.2rem; }
.figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 34rem), 1fr)); gap: 1rem 1.5rem;
           margin-top: 1rem; align-items: start; }
figure { margin: 0; min-width: 0; }
figure.wide { grid-column: 1 / -1; }
figure img { display: block; max-width: 100%; height: auto; border: 1px solid #ddd; box-sizing: border-box; }
figcaption { font-size: 0.8rem; color: #666; }
p.figure-note { color: #a33; font-size: 0.85rem; }
.tables { display: flex; flex-wrap: wrap; gap: 0.2rem 2rem; align-items: flex-start; }
.scroll { overflow-x: auto; min-width: 0; max-width: 100%; margin: 0.3rem 0 0.8rem; }
table { border-collapse: collapse; font-size: 0.85rem; }
caption { text-align: left; font-size: 0.85rem; color: #333; padding-bottom: 0.3rem; caption-side: top;
          min-width: 20rem; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f0f4f8; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
ul.notes { font-size: 0.85rem; padding-left: 1.2rem; margin: 0; columns: 2 26rem; column-gap: 2.5rem; }
ul.notes li { break-inside: avoid; margin-bottom: 0.25rem; }
nav ul { columns: 3 18rem; font-size: 0.9rem; }
"""


#: cells right-aligned on the page: numbers, ratios, percentages, sizes and ranges of them
_NUMERIC = re.compile(r"^[-+]?[\d.,]+(e[-+]?\d+)?(x|%| ?[KMG]?B| MB)?( to [-+]?[\d.,]+(x|%)?)?( \(.*\))?$|^—$")


def _h(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _bracketed(cell: Any) -> str:
    """A number cell whose bracketed part (a range, the other spelling) wraps as a whole: ``1.34x`` over
    ``(0.97x to 1.79x)`` when the column is narrow, never ``(0.97x to`` over ``1.79x)``."""
    return re.sub(r"\([^)]*\)", lambda found: found.group().replace(" ", "\N{NO-BREAK SPACE}"), _h(cell))


def _html_table(table: Table) -> str:
    """The table in a box of its own: one too wide for a narrow window scrolls sideways there (the scroll bar right
    under the table), not the page."""
    head = "".join(f"<th>{_h(c)}</th>" for c in table.header)
    body = "".join("<tr>" + "".join(f'<td class="n">{_bracketed(c)}</td>' if _NUMERIC.match(str(c)) else
                                    f"<td>{_h(c)}</td>" for c in row) + "</tr>" for row in table.rows)
    return (f'<div class="scroll"><table data-table="{_h(table.name)}"><caption>{_h(table.caption)}</caption>'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


#: figures are drawn at 150 dots per inch; shown at their drawn size a dot is this many CSS pixels (96 per inch),
#: the most a figure is shown at: scaled down to fit where it stands, never up
_PIXELS_PER_DOT = 96 / 150
#: a figure wider than this (in dots) cannot be read at half the page's width: it gets a row of its own
WIDE_FIGURE_DOTS = 1300


def _png_width(data: bytes) -> int | None:
    """The width in pixels of a PNG (from its IHDR chunk), or None when ``data`` is not one."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big")


def _html_figure(figure: Figure) -> str:
    """The figure embedded as a PNG ``data:`` URI, at most its drawn size; a wide one on a row of its own."""
    png = figure.png.read_bytes()
    data = base64.b64encode(png).decode("ascii")
    width = _png_width(png)
    size = f' style="width: {round(width * _PIXELS_PER_DOT)}px"' if width else ""
    kind = ' class="wide"' if width is not None and width > WIDE_FIGURE_DOTS else ""
    return (f'<figure{kind}><img src="data:image/png;base64,{data}" '
            f'alt="{_h(figure.caption)}" data-figure="{_h(figure.stem)}"{size}>'
            f"<figcaption>{_h(figure.caption)}</figcaption></figure>")


def _anchor(index: int, section: Section) -> str:
    return f"s{index}-{section.key}"


def _run_line(label: str, run: Run) -> str:
    return (f'<p class="run">run {_h(label)}: {_h(run.path)} · {_h(run.experiment)} · '
            f"{_h(run.meta.get('status', '?'))} · started {_h(run.meta.get('start_time', '?'))}</p>")


def _html_section(index: int, section: Section) -> list[str]:
    """One section, in bands: its runs, the paper's words, the figures, the tables measured here, the notes."""
    parts = [f'<section id="{_anchor(index, section)}" data-section="{_h(section.key)}">',
             f"<h2>{_h(section.title)}</h2>"]
    parts += [_run_line(label, run) for label, run in section.runs]
    if section.paper:
        parts.append('<h3>The paper</h3><div class="quotes">')
        parts += [f"<blockquote>“{_h(quote)}”<cite>{_h(where)}</cite></blockquote>" for quote, where in section.paper]
        parts.append("</div>")
    if section.figures:
        parts.append('<div class="figures">')
        parts += [_html_figure(figure) for figure in section.figures]
        parts.append("</div>")
    if section.figure_note:
        parts.append(f'<p class="figure-note">{_h(section.figure_note)}</p>')
    if section.tables:
        parts.append('<h3>Measured here</h3><div class="tables">')
        parts += [_html_table(t) for t in section.tables]
        parts.append("</div>")
    if section.notes:
        parts.append("<h3>Why the numbers differ</h3><ul class=\"notes\">"
                     + "".join(f"<li>{_h(n)}</li>" for n in section.notes) + "</ul>")
    parts.append("</section>")
    return parts


def render_html(report: Report) -> str:
    """The page: an overview of the runs and the paper's setup, then one block per section (the paper's words,
    the figures as PNG data: URIs, the ratio tables and the notes)."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             "<title>bench report: measured against Xue et al., EuroSys '19</title>",
             f"<style>{_CSS}</style></head><body>",
             "<h1>Measured here against <i>Fast Distributed Deep Learning over RDMA</i></h1>",
             f'<p class="run">{_h(paper.CITATION)}<br>{_h(report.lead())}</p>']
    parts.append('<h2 id="overview">Runs and setup</h2><div class="tables">')
    parts += [_html_table(table) for table in report.overview]
    parts.append("</div>")
    parts.append("<nav><ul>" + "".join(
        f'<li><a href="#{_anchor(i, s)}">{_h(s.title)}</a> '
        f'<span class="run">({_h(", ".join(label for label, _ in s.runs))})</span></li>'
        for i, s in enumerate(report.sections)) + "</ul></nav>")
    for index, section in enumerate(report.sections):
        parts += _html_section(index, section)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
