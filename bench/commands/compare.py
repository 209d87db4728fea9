"""Compare two runs of one experiment (micro, model, scale, converge, models), point by point.

Per point (micro: transport and size; model: transport, model, batch size, servers; converge: each
transport's time to the target), the ratio new/base of the run's headline number (micro: median time
per transfer; model: seconds per step; lower is better) with its range, from the spread each run
measured (across rounds with `bench micro --rounds N`, else the 95% interval of the median of the
timed iterations). A point is "same" when the ranges overlap or the ratio is within --threshold,
otherwise "slower" (+) or "faster" (-); "~" marks a change beyond the noise but within the threshold.
Reference lines (ucx_perftest, memcpy, tf_grpc, ...) are shown apart and never fail the comparison.

Exit status: 0 when nothing got slower and nothing was lost, 1 when a point got slower beyond the threshold and
the noise, or was lost (in BASE but not in NEW, or a row of either's records that could not be read: the last line
says which), for CI; 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.readers.compare import CompareError, compare, parse_threshold
from bench.results.text import printable

HELP = "what got faster or slower between two runs; exit status 1 on a slow-down beyond --threshold or a lost point"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench compare results/micro-A results/micro-B', 'what got faster or slower; exit 1 on a slow-down or a loss'),
    ('bench compare BASE NEW --threshold 5% --only-changed', 'a tighter threshold, changed points only'),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: BASE, NEW, --threshold, --metric, --only-changed."""
    parser.add_argument("base", metavar="BASE", help="the run compared against (a results directory)")
    parser.add_argument("new", metavar="NEW", help="the run to judge (a results directory of the same experiment)")
    # parsed in run(), so a bad value is the same one-line error however the parser reports its own
    parser.add_argument("--threshold", default="10%", metavar="PCT",
                        help="a change smaller than this is 'same': a percentage (10%%) or a fraction (0.1)")
    parser.add_argument("--metric", default=None, metavar="COLUMN",
                        help="the records' column to compare instead of the headline measure (e.g. p99_us, "
                             "throughput_MBps; throughput and efficiency columns are higher-is-better)")
    parser.add_argument("--only-changed", action="store_true",
                        help="leave out the points that are the same or measured by neither run (the summary still "
                             "counts them)")


def run(args: argparse.Namespace) -> int:
    """Print the comparison; 0 when nothing got slower or was lost, 1 when something did or was, 2 for bad input."""
    try:
        threshold = parse_threshold(args.threshold)
        comparison = compare(Path(args.base), Path(args.new), threshold=threshold, metric=args.metric)
    except CompareError as exc:
        print(f"bench compare: error: {printable(exc, None)}", file=sys.stderr)
        return 2
    # every line as it may be shown: what came from the runs' files can hold no terminal escape (read escaped already)
    print("\n".join(printable(line, None) for line in comparison.format(only_changed=args.only_changed).splitlines()))
    return comparison.exit_status()
