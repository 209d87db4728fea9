"""The page as HTML: self-contained (figures embedded as PNG ``data:`` URIs, no script, no network).

It shows what :class:`bench.readers.report.page.Report` holds and knows no experiment. Nothing is clipped: a table
wider than its column scrolls sideways in a box of its own (the scroll bar right under it), a figure is never shown
at less than half its pixels (:data:`MIN_FIGURE_SCALE`: 8-point text stays 8 CSS pixels high) and one too wide for
the column beside the tables gets the page's width below them.
"""

from __future__ import annotations

import base64
import html
import re
from typing import Any

from bench.ground import paper
from bench.readers.report.page import Figure, Report, Section, Table

#: the page's style sheet: figures beside the numbers, tables that scroll in a box of their own
_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 1.5rem 2rem; color: #1d1d1f;
       background: #ffffff; line-height: 1.4; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.25rem; border-bottom: 2px solid #1f77b4; padding-bottom: 0.2rem; margin-top: 2.2rem; }
h3 { font-size: 1rem; margin: 1rem 0 0.4rem; }
.run { color: #555; font-size: 0.9rem; margin-top: 0; }
.pair { display: flex; flex-wrap: wrap; gap: 1.5rem; align-items: flex-start; }
.figures { flex: 1 1 560px; min-width: 320px; }
.numbers { flex: 1 1 480px; min-width: 320px; }
.run, li, blockquote, figcaption, caption { overflow-wrap: anywhere; }
figure { margin: 0 0 1rem; overflow-x: auto; }
figure img { max-width: 100%; height: auto; border: 1px solid #ddd; box-sizing: border-box; }
figure.wide { margin-top: 0.5rem; }
figcaption { font-size: 0.8rem; color: #666; }
.scroll { overflow-x: auto; max-width: 100%; margin: 0.3rem 0 1rem; }
table { border-collapse: collapse; font-size: 0.85rem; }
caption { text-align: left; font-size: 0.85rem; color: #333; padding-bottom: 0.3rem; caption-side: top; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f0f4f8; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
blockquote { margin: 0.3rem 0 0.6rem; padding: 0.3rem 0.8rem; border-left: 3px solid #ff7f0e; background: #fff8f0;
             font-size: 0.85rem; }
blockquote cite { display: block; color: #666; font-style: normal; font-size: 0.8rem; }
ul.notes { font-size: 0.85rem; padding-left: 1.2rem; }
p.figure-note { color: #a33; font-size: 0.85rem; }
nav ul { columns: 2; font-size: 0.9rem; }
"""


#: cells right-aligned on the page: numbers, ratios, percentages, sizes and ranges of them
_NUMERIC = re.compile(r"^[-+]?[\d.,]+(e[-+]?\d+)?(x|%| ?[KMG]?B| MB)?( to [-+]?[\d.,]+(x|%)?)?( \(.*\))?$|^—$")


def _h(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _html_table(table: Table) -> str:
    """The table in a box of its own that scrolls sideways when the table is wider than the page gives it (the
    scroll bar right under the table, not under the whole column)."""
    head = "".join(f"<th>{_h(c)}</th>" for c in table.header)
    body = "".join("<tr>" + "".join(f'<td class="n">{_h(c)}</td>' if _NUMERIC.match(str(c)) else f"<td>{_h(c)}</td>"
                                    for c in row) + "</tr>" for row in table.rows)
    return (f'<div class="scroll"><table data-table="{_h(table.name)}"><caption>{_h(table.caption)}</caption>'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


#: figures are drawn at 150 dots per inch; shown at their drawn size a dot is this many CSS pixels (96 per inch)
_PIXELS_PER_DOT = 96 / 150
#: never shown smaller than this share of their dots: 8-point text (legends) stays 8 CSS pixels high; a figure that
#: would have to shrink more scrolls sideways instead
MIN_FIGURE_SCALE = 0.5
#: a figure wider than this (in dots) cannot be shown at MIN_FIGURE_SCALE beside the tables: it gets the page's width
WIDE_FIGURE_DOTS = 1300


def _png_width(data: bytes) -> int | None:
    """The width in pixels of a PNG (from its IHDR chunk), or None when ``data`` is not one."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big")


def _html_figure(figure: Figure) -> tuple[str, bool]:
    """The figure embedded as a PNG ``data:`` URI, sized to be readable; whether it is wide."""
    png = figure.png.read_bytes()
    data = base64.b64encode(png).decode("ascii")
    width = _png_width(png)
    wide = width is not None and width > WIDE_FIGURE_DOTS
    size = (f' style="width: {round(width * _PIXELS_PER_DOT)}px; min-width: {round(width * MIN_FIGURE_SCALE)}px"'
            if width else "")
    kind = ' class="wide"' if wide else ""
    return (f'<figure{kind}><img src="data:image/png;base64,{data}" '
            f'alt="{_h(figure.stem)}" data-figure="{_h(figure.stem)}"{size}>'
            f"<figcaption>{_h(figure.stem)}</figcaption></figure>"), wide


def _anchor(index: int, section: Section) -> str:
    return f"s{index}-{section.key}"


def render_html(report: Report) -> str:
    """The page: an overview of the runs and the paper's setup, then one block per section, figures on the left
    (PNG as data: URIs) and the paper's words, the ratio tables and the notes on the right."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             "<title>bench report: measured against Xue et al., EuroSys '19</title>",
             f"<style>{_CSS}</style></head><body>",
             "<h1>Measured here against <i>Fast Distributed Deep Learning over RDMA</i></h1>",
             f'<p class="run">{_h(paper.CITATION)}<br>Report made {_h(report.created)} from {len(report.runs)} '
             "run(s). Ratios are speed-ups: how many times faster (or higher in throughput) RDMA.zerocp is.</p>"]
    parts.append("<h2 id=\"overview\">Runs and setup</h2>")
    for table in report.overview:
        parts.append(_html_table(table))
    parts.append("<nav><ul>" + "".join(
        f'<li><a href="#{_anchor(i, s)}">{_h(s.title)}</a> <span class="run">({_h(s.run_label)})</span></li>'
        for i, s in enumerate(report.sections)) + "</ul></nav>")
    for index, section in enumerate(report.sections):
        parts.append(f'<section id="{_anchor(index, section)}" data-section="{_h(section.key)}">')
        parts.append(f"<h2>{_h(section.title)}</h2>")
        if section.run is not None:
            parts.append(f'<p class="run">run {_h(section.run_label)}: {_h(section.run.path)} · '
                         f"{_h(section.run.experiment)} · {_h(section.run.meta.get('status', '?'))} · started "
                         f"{_h(section.run.meta.get('start_time', '?'))}</p>")
        parts.append('<div class="pair">')
        drawn = [_html_figure(figure) for figure in section.figures]
        beside = [html_ for html_, wide in drawn if not wide]
        if beside or section.figure_note:
            parts.append('<div class="figures">')
        parts += beside
        if section.figure_note:
            parts.append(f'<p class="figure-note">{_h(section.figure_note)}</p>')
        if beside or section.figure_note:
            parts.append("</div>")
        parts.append('<div class="numbers">')
        if section.paper:
            parts.append("<h3>The paper</h3>")
            parts += [f"<blockquote>“{_h(quote)}”<cite>{_h(where)}</cite></blockquote>"
                      for quote, where in section.paper]
        parts.append("<h3>Measured here</h3>")
        parts += [_html_table(t) for t in section.tables]
        if section.notes:
            parts.append("<h3>Why the numbers differ</h3><ul class=\"notes\">"
                         + "".join(f"<li>{_h(n)}</li>" for n in section.notes) + "</ul>")
        parts.append("</div></div>")
        parts += [html_ for html_, wide in drawn if wide]  # below the pair, the page's width: readable
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
