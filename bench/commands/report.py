"""Put runs beside the paper on one page: every figure of the run directories given (micro, model, scale, converge,
models, analysis and soak runs, in any mix), and beside each the measured ratios (how many times faster zero copy
is than each other transport), the paper's numbers for the same figure, and sentences from each run's meta.json
and records on why they differ (fabric, cores, replayed compute, launcher, batch sizes, servers). The HTML page is
self-contained (figures embedded, no network needed); the Markdown form refers to PNG files written beside it.
Each file is written whole and then renamed into place: on a full disk (exit status 1) a page there before stays. A
directory without meta.json stands for the runs directly inside it. The runs are only read."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import options

HELP = "one page (HTML or Markdown) with every run's figures and its ratios beside the paper's"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench report results', 'one HTML page of every run under results/, beside the paper'),
    ('bench report results/micro-* --format both --out report.html', 'HTML and Markdown'),
)
FORMATS = ("html", "markdown", "both")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results_dirs", nargs="+", type=Path, metavar="RESULTS_DIR",
                        help="run directories (results/<experiment>-<time>/), or directories holding them")
    parser.add_argument("--out", type=options.output_path, default=argparse.SUPPRESS, metavar="PATH",
                        help="where the page goes (default: results/report-<YYYYmmdd-HHMMSS>.html, or .md); with "
                        "--format both, the HTML goes to PATH with the suffix .html and the Markdown with .md")
    parser.add_argument("--format", choices=FORMATS, default=argparse.SUPPRESS,
                        help="html: one self-contained page; markdown: the same tables for a README or an issue, the "
                        "figures as PNG files beside it (<name>-<run>-<figure>.png); both (default: markdown when "
                        "--out ends in .md, else html)")


def outputs(out: Path | None, chosen: str | None) -> tuple[Path | None, Path | None]:
    """(HTML path, Markdown path) for ``--out`` and ``--format``; None for a form not asked for."""
    from bench.readers.report import default_report_path

    if chosen is None:
        chosen = "markdown" if out is not None and out.suffix.lower() == ".md" else "html"
    if out is None:
        out = default_report_path(suffix=".md" if chosen == "markdown" else ".html")
    if chosen == "html":
        return out, None
    if chosen == "markdown":
        return None, out
    return out.with_suffix(".html"), out.with_suffix(".md")


def run(args: argparse.Namespace) -> int:
    from bench.readers.report import ReportError, write_report
    from bench.results import DiskError, LinkError, ResultsError, printable

    html_path, markdown_path = outputs(getattr(args, "out", None), getattr(args, "format", None))
    for path in (html_path, markdown_path):  # before the runs are read and drawn: the page must have somewhere to go
        example = "report.md" if path is markdown_path else "report.html"
        if path is not None and (problem := options.output_file_problem(path, "--out", example=example,
                                                                         makes_dirs=True)):
            return options.fail("report", problem)
    try:
        written = write_report(args.results_dirs, html_path, markdown_path,
                               on_warning=lambda text: print(f"bench report: warning: {printable(text, None)}",
                                                            file=sys.stderr))
    except (ReportError, ResultsError) as exc:
        return options.fail("report", printable(exc, None))
    except LinkError as exc:  # a link planted where the page goes: nothing written through it
        print(f"bench report: error: {printable(exc, None)}", file=sys.stderr)
        return 1
    except DiskError as exc:  # a full or failing disk: the page there before (if any) is left as it was
        print(f"bench report: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        from bench.launch.local import error_with_limit

        if (line := error_with_limit(exc)) is not None:  # a limit of this process (open files), not the folder
            print(f"bench report: error: {line}", file=sys.stderr)
            return 1
        where = exc.filename or html_path or markdown_path
        return options.fail("report", f"cannot write {where}: {exc.strerror or exc}; choose another --out")
    for path in written:
        print(path)
    return 0
