"""The ``bench`` command: run experiments over the transports, store results, draw, report and compare them.

Each command is a module of ``bench.commands`` (its arguments and its run); this module assembles the parser,
makes the launcher of the commands that start ranks, and turns signals into a clean stop.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from types import ModuleType

from bench.commands import COMMANDS
from bench.commands.common import extras_of, signal_of
from bench.ground import quiet_tensorflow
from bench.options import (
    EXIT_USAGE,
    HelpFormatter,
    Parser,
    VersionAction,
    examples_epilog,
    extras_problem,
    fabric_problem,
    memory_kinds_problem,
)


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C), SIGTERM or SIGHUP: the run stops, keeps what it measured, and says so."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: the signals that stop a run the way Ctrl-C does
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop(signum: int, frame: object) -> None:
    # the first signal interrupts; later ones would cut short the cleanup it started (ranks get seconds to
    # close), so they are ignored: should that cleanup hang, SIGKILL still works and the ranks die with us
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signum)


def command_module(name: str) -> ModuleType:
    return importlib.import_module(f"bench.commands.{name}")


def build_parser() -> Parser:
    parser = Parser(
        prog="bench",
        description="Compare tensor transports for distributed deep learning: what does RPC cost, "
        "and what does zero-copy RDMA buy?",
        epilog="Results go to results/<experiment>-<YYYYmmdd-HHMMSS>/ (meta.json, records.csv, samples.csv); "
        "draw them with 'bench plot DIR', put runs beside the paper with 'bench report DIR...', and see what got "
        "faster or slower with 'bench compare BASE NEW'. 'bench COMMAND --help' for each command's options.",
    )
    parser.add_argument("--version", action=VersionAction)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True
    for name in COMMANDS:
        module = command_module(name)
        sub = commands.add_parser(name, help=module.HELP, description=module.__doc__,
                                  epilog=examples_epilog(module.EXAMPLES), formatter_class=HelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else list(argv)
    # every command stops on SIGTERM and SIGHUP as on Ctrl-C: their default action ends the process at once, and no
    # ``finally`` or context manager would remove what the command made (a report's temporary directory, ...)
    saved = _stop_on_signals()
    try:
        return _main(raw, saved)
    except KeyboardInterrupt as exc:  # outside a run (its results, if any, are marked by the command)
        name, status = signal_of(exc)
        print(f"\nbench{_command_of(raw)}: interrupted by {name}", file=sys.stderr)
        return status
    except (OSError, MemoryError, RuntimeError) as exc:
        from bench.launch.local import error_with_limit

        if (line := error_with_limit(exc)) is None:
            raise
        # a resource limit of this process (too few open files, address space): one line naming it and the fix
        print(f"bench{_command_of(raw)}: error: {line}", file=sys.stderr)
        return 1
    finally:
        _restore(saved)


def _stop_on_signals() -> dict[int, object]:
    """Turn :data:`STOP_SIGNALS` into :class:`Interrupted`; the handlers they had (none off the main thread)."""
    saved: dict[int, object] = {}
    with contextlib.suppress(ValueError):  # not the main thread (bench called from a thread): signals are not ours
        for signum in STOP_SIGNALS:
            saved[signum] = signal.signal(signum, _stop)
    return saved


def _restore(saved: dict[int, object]) -> None:
    for signum, handler in saved.items():
        if handler is not None:
            signal.signal(signum, handler)


def _command_of(raw: list[str]) -> str:
    """`` COMMAND`` when the arguments name one, else ''."""
    command = next((arg for arg in raw if not arg.startswith("-")), "")
    return f" {command}" if command in COMMANDS else ""


def _main(raw: list[str], saved: dict[int, object]) -> int:
    # models given as package.module:ATTRIBUTE are found from the current directory, as with python -m; under
    # MPI every process needs that before the coordinator's first assignment arrives
    sys.path.insert(0, os.getcwd())
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    quiet_tensorflow.install()
    args = build_parser().parse_args(raw)
    module = args.module
    problem = extras_problem(args.command, extras_of(module, args))
    if problem or (hasattr(args, "fabric") and (problem := fabric_problem(args))) \
            or (hasattr(args, "memory_kinds") and (problem := memory_kinds_problem(args.memory_kinds))):
        print(f"bench {args.command}: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if not getattr(module, "STARTS_RANKS", False):
        return module.run(args)
    from bench.launch import LaunchError, create

    if (problem := submit_problem(args)) is not None:
        print(f"bench {args.command}: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.nodes:
        return _submit(args, raw)
    # the launcher starts, and a job's serving process serves, with the handlers bench was started with, as before
    # (MPI_Init may set its own); the coordinator stops on signals again below
    _restore(saved)
    try:
        launcher = create(args.launcher, bind=args.bind, link_rate=args.link_rate)
    except LaunchError as exc:
        print(f"bench {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    with launcher:
        if not launcher.is_coordinator:  # under mpi or slurm: serve the runs the coordinator (rank 0) starts
            status = launcher.serve()
        else:
            for signum in STOP_SIGNALS:  # SIGTERM and SIGHUP stop a run as Ctrl-C does
                signal.signal(signum, _stop)
            status = module.run(args, launcher)
    launcher.end_process(status)  # a job's process (mpi, slurm) ends here
    return status


def submit_problem(args: argparse.Namespace) -> str | None:
    """Why ``--nodes``, ``--tasks`` or ``--dry-run`` do not apply here, or None."""
    from bench.launch.slurm_step import in_step

    given = [flag for flag, value in (("--nodes", args.nodes), ("--tasks", args.tasks), ("--dry-run", args.dry_run))
             if value]
    if not given:
        return None
    if args.launcher != "slurm":
        return f"{' '.join(given)} submit(s) a Slurm job: use with --launcher slurm"
    if not args.nodes:
        return f"{' '.join(given)} only go with --nodes N (submitting a job)"
    if in_step():
        return ("--nodes submits a job, and this is already a task of a Slurm step: leave --nodes out here "
                "(srun gives the step its nodes)")
    return None


def _submit(args: argparse.Namespace, raw: list[str]) -> int:
    """``--launcher slurm --nodes N`` outside a step: submit this command as a batch job and follow it."""
    from pathlib import Path

    from bench.launch.sbatch import Submission, strip_submit_options, submit
    from bench.results import default_run_dir

    out = (getattr(args, "out", None) or default_run_dir(args.command)).resolve()
    submission = Submission(strip_submit_options(raw), args.nodes, args.tasks or max(2, args.nodes), out,
                            Path.cwd())
    return submit(submission, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
