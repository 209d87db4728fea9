"""Writing a report: the HTML page and/or the Markdown document with its figures as PNG files beside it."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.readers.report.build import build_report
from bench.readers.report.html_page import render_html
from bench.readers.report.markdown_page import render_markdown
from bench.readers.report.page import ReportError
from bench.results import default_run_dir, replace_file


def default_report_path(root: Path = Path("results"), suffix: str = ".html") -> Path:
    """``results/report-<YYYYmmdd-HHMMSS><suffix>``, made unique if the name is taken."""
    return default_run_dir("report", root, suffix)


def write_report(paths: Sequence[Path], html_path: Path | None = None, markdown_path: Path | None = None,
                 on_warning: Callable[[str], None] | None = None) -> list[Path]:
    """Write the report of the runs at ``paths`` as HTML and/or Markdown (its PNGs beside it); the files written.

    ReportError or ResultsError for a path that is not a run; OSError when a file cannot be written.
    """
    if html_path is None and markdown_path is None:
        raise ReportError("no output asked for; give an HTML or a Markdown path")
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        report = build_report(paths, Path(tmp))
        for warning in report.warnings:
            if on_warning:
                on_warning(warning)
        if html_path is not None:
            html_path.parent.mkdir(parents=True, exist_ok=True)
            # written whole, then renamed over the old page: a full disk keeps the old page, not half a new one
            replace_file(html_path, render_html(report))
            written.append(html_path)
        if markdown_path is not None:
            markdown_path.parent.mkdir(parents=True, exist_ok=True)
            names: dict[Path, str] = {}
            for section in report.sections:
                for figure in section.figures:
                    if figure.png in names:
                        continue
                    run_dir = figure.png.parent.name  # the run's number
                    name = f"{markdown_path.stem}-{run_dir}-{_safe(figure.stem)}.png"
                    replace_file(markdown_path.parent / name, figure.png.read_bytes())
                    names[figure.png] = name
                    written.append(markdown_path.parent / name)
            replace_file(markdown_path, render_markdown(report, names))
            written.insert(1 if html_path is not None else 0, markdown_path)
    return written


def _safe(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem)
