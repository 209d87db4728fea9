"""What the commands that write a run share: its directory, its end (complete, failed, interrupted), its figures."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

from bench.options import error_line, run_dir_problem
from bench.results import DiskError, ResultsError, RunWriter, default_run_dir, disk_failed, is_disk_error


def add_framework_option(parser: argparse.ArgumentParser) -> None:
    """``--framework {tensorflow,torch}``: the framework that builds and trains the models (``args.framework``;
    TensorFlow, the paper's, by default). PyTorch asked for where it is not installed is refused before anything
    starts, naming the ``torch`` extra (:func:`extras_of`)."""
    from bench.runtime.framework import DEFAULT_FRAMEWORK, FRAMEWORKS  # imports no framework

    parser.add_argument("--framework", choices=FRAMEWORKS, default=DEFAULT_FRAMEWORK,
                        help=f"the framework that builds and trains the models (default {DEFAULT_FRAMEWORK}, the "
                        "paper's; torch needs the 'torch' extra)")


def extras_of(command: Any, args: argparse.Namespace) -> tuple[str, ...]:
    """The extras (:data:`bench.options.EXTRAS`) a command module needs for ``args``: its ``EXTRAS``, with
    ``--framework torch`` the ``torch`` extra in place of ``models`` (TensorFlow)."""
    extras = tuple(getattr(command, "EXTRAS", ()))
    if getattr(args, "framework", "tensorflow") == "torch":
        extras = tuple(dict.fromkeys("torch" if extra == "models" else extra for extra in extras))
    return extras


def open_run(out: Path | None, experiment: str, settings: dict[str, Any], launcher: Any = None) -> RunWriter | None:
    """The run's results directory (``out``, or ``results/<experiment>-<time>/``), its logs beside it; None
    after an error line when it cannot be made."""
    given = out is not None
    out = out or default_run_dir(experiment)
    if launcher is not None:
        settings = {**settings, "launcher": launcher.describe()}
    fix = "choose another --out" if given else "run bench from a writable directory or give --out DIR"
    try:
        writer = RunWriter(out, experiment, settings)
    except FileExistsError:
        print(f"bench {experiment}: error: {run_dir_problem(out)}", file=sys.stderr)
        return None
    except OSError as exc:
        if is_disk_error(exc):
            fix = "free space there or choose another --out" if given else "free space or give --out DIR elsewhere"
        print(f"bench {experiment}: error: cannot create the results directory {out}: "
              f"{exc.strerror or exc}; {fix}", file=sys.stderr)
        return None
    if launcher is not None:
        launcher.log_dir = out / "logs"
    return writer


def signal_of(exc: KeyboardInterrupt) -> tuple[str, int]:
    """(the signal's name, the exit status it gives: 128 + its number)."""
    signum = getattr(exc, "signum", signal.SIGINT)
    return signal.Signals(signum).name, 128 + signum


def interrupted(writer: RunWriter, experiment: str, what: str, exc: KeyboardInterrupt, **extra: Any) -> int:
    """Mark the run interrupted (by which signal), say where its results are; the exit status."""
    name, status = signal_of(exc)
    writer.finish("interrupted", reason=f"interrupted by {name}", **extra)
    print(f"\nbench {experiment}: interrupted by {name}; {what} so far are in {writer.path}", file=sys.stderr)
    return status


def failed(writer: RunWriter, failures: list[str], exc: BaseException, **extra: Any) -> None:
    """Mark the run failed by an unexpected error (the caller re-raises it)."""
    # the error being raised is what the run died of: should the disk refuse meta.json too, the old one stays
    with contextlib.suppress(DiskError):
        writer.finish("failed", failures=[*failures, error_line(exc)], **extra)


def disk_full(writer: RunWriter, experiment: str, exc: DiskError, failures: list[str], **extra: Any) -> int:
    """A write of the run refused by a full or failing disk: the run stops, marked failed with the reason (if
    meta.json can still be rewritten), with one line naming the file and the fix; the exit status (1). Every point
    written before stays readable (rows are appended whole)."""
    writer.finish("failed", failures=[*failures, str(exc)], **extra)
    print(f"bench {experiment}: error: {exc} (the points measured before are in {writer.path})", file=sys.stderr)
    return 1


def draw(out: Path, experiment: str) -> None:
    """The run's figures; a figure that cannot be drawn is a warning, the records are what count."""
    from bench.readers.plot import plot_run

    if not (out / "records.csv").exists() or disk_failed(out):  # no figures onto a disk that refused a row
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            written = plot_run(out)
    except (ResultsError, ValueError, TypeError, KeyError, OSError) as exc:
        problem = str(exc) if isinstance(exc, DiskError) else error_line(exc)
        print(f"bench {experiment}: warning: no figures: {problem}", file=sys.stderr)
        return
    for path in written:
        if path.suffix == ".png":
            print(f"figure: {path}")
