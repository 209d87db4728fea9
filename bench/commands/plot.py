"""Draw the figures of a results directory (PNG and SVG) beside its records: micro (time and throughput against
size, and the distribution of every transfer's time), model (throughput per model and transport, mini-batch time,
copy overhead), scale, converge, models (Table 2) and analysis (tensor sizes) runs. A directory without meta.json
stands for the runs directly inside it (bench plot results/): each is drawn in turn, one that cannot be drawn is
named in a warning and the others still drawn. The files written are printed, one a line."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from bench import options

HELP = "draw the figures of a run directory (or of every run in a directory) beside their records"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench plot results/micro-20260101-120000', "a run's figures, beside its records"),
    ('bench plot results', 'every run under results/'),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results_dir", type=Path, metavar="RESULTS_DIR",
                        help="a run directory (results/<experiment>-<time>/), or a directory holding them "
                        "(results/): each run in it is drawn")


class _Failed(Exception):
    """A run that could not be drawn: the one line saying why, and the exit status it gives alone."""

    def __init__(self, problem: str, status: int = options.EXIT_USAGE) -> None:
        super().__init__(problem)
        self.status = status


def _draw(run: Path) -> list[Path]:
    """The figures of one run, drawn beside its records; a :class:`_Failed` says why they could not be."""
    from bench.readers.plot import PlotError, plot_run
    from bench.results import DiskError, LinkError, ResultsError

    try:
        with warnings.catch_warnings():  # matplotlib's complaints about odd values would break the one-line error
            warnings.simplefilter("ignore")
            return plot_run(run)
    except (ResultsError, PlotError) as exc:
        raise _Failed(str(exc)) from None
    except DiskError as exc:  # a full or failing disk: figures there before are left as they were
        raise _Failed(str(exc), status=1) from None
    except LinkError as exc:  # a link planted where a figure goes: nothing written through it
        raise _Failed(str(exc), status=1) from None
    except OSError as exc:
        raise _Failed(f"cannot write the figures into {run}: {exc.strerror or exc}; copy the run somewhere writable "
                      "and plot it there") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise _Failed(f"the records of {run} cannot be drawn ({options.error_line(exc)}); were they edited by "
                      "hand?") from None


def run(args: argparse.Namespace) -> int:
    from bench.readers.report import ReportError, find_runs
    from bench.results import printable

    skipped: list[str] = []
    try:
        runs = find_runs([args.results_dir], skipped)
    except ReportError as exc:
        return options.fail("plot", printable(exc, None))
    for line in skipped:  # runs of the directory that recorded nothing: the others are drawn
        print(f"bench plot: warning: {line}", file=sys.stderr)
    alone = runs == [args.results_dir]  # the run itself, not a directory of runs
    drawn = 0
    for path in runs:
        try:
            written = _draw(path)
        except _Failed as failed:
            # a run of a directory that cannot be drawn leaves the others to draw; a failing disk fails them all
            if alone or failed.status != options.EXIT_USAGE:
                print(f"bench plot: error: {printable(failed, None)}", file=sys.stderr)
                return failed.status
            print(f"bench plot: warning: {printable(failed, None)}", file=sys.stderr)
            continue
        drawn += 1
        print(*written, sep="\n")
    if not drawn:
        where = printable(args.results_dir, None)
        return options.fail("plot", f"none of the {len(runs) + len(skipped)} run(s) in {where} could be drawn (the "
                            "warnings above say why); plot a run directory of bench micro, model, scale, converge, "
                            "models or analyze")
    return 0
