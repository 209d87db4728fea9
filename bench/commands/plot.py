"""Draw the figures of a results directory (PNG and SVG) beside its records: micro (time and throughput against
size, and the distribution of every transfer's time), model (throughput per model and transport, mini-batch time,
copy overhead), scale, converge, models (Table 2) and analysis (tensor sizes) runs."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from bench import options

HELP = "draw the figures of a results directory beside its records"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results_dir", type=Path, metavar="RESULTS_DIR")


def run(args: argparse.Namespace) -> int:
    from bench.readers.plot import PlotError, plot_run
    from bench.results import DiskError, ResultsError

    try:
        with warnings.catch_warnings():  # matplotlib's complaints about odd values would break the one-line error
            warnings.simplefilter("ignore")
            written = plot_run(args.results_dir)
    except (ResultsError, PlotError) as exc:
        return options.fail("plot", str(exc))
    except DiskError as exc:  # a full or failing disk: figures there before are left as they were
        print(f"bench plot: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        return options.fail("plot", f"cannot write the figures into {args.results_dir}: {exc.strerror or exc}; copy "
                            "the run somewhere writable and plot it there")
    except (ValueError, TypeError, KeyError) as exc:
        return options.fail("plot", f"the records of {args.results_dir} cannot be drawn ({options.error_line(exc)}); "
                            "were they edited by hand?")
    for path in written:
        print(path)
    return 0
