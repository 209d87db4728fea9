"""Build each model, count its variables and bytes, and time its forward and backward pass on this machine:
the paper's Table 2 measured here, beside the paper's numbers (a Tesla P100 GPU there). Prints a row per model
as it is measured and writes them as a run ('bench report' sets them beside the paper's Table 2)."""

from __future__ import annotations

import argparse

from bench import options
from bench.commands.common import add_framework_option, disk_full, open_run
from bench.results import DiskError

HELP = "the paper's Table 2 measured here: model size, variables, local compute time per sample"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench models', "the paper's Table 2 measured here (variables, size, compute per sample)"),
    ('bench models vgg16,fcn5 --batch-size 4', 'two models at batch size 4'),
    ('bench models --framework torch', "the same table for the models in PyTorch"),
)

#: the optional part of the install it needs (checked before anything starts; ``torch`` with --framework torch)
EXTRAS = ("models",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="?", type=options.model_list, default=None, metavar="MODEL[,MODEL]",
                        help="which models (default: the paper's six)")
    parser.add_argument("--batch-size", type=options.positive_int, default=1, help="batch size for the compute time")
    parser.add_argument("--steps", type=options.positive_int, default=3, help="timed forward+backward steps per model")
    add_framework_option(parser)
    options.add_out(parser, "models")


def run(args: argparse.Namespace) -> int:
    from bench.experiments.models import MODELS, get_model, models_table, row_line, table_header
    from bench.runtime.framework import DEFAULT_FRAMEWORK, framework_named

    framework = getattr(args, "framework", DEFAULT_FRAMEWORK)
    try:
        names = [get_model(name, framework=framework).name for name in (args.models or MODELS)]
    except ValueError as exc:
        return options.fail("models", str(exc))
    writer = open_run(args.out, "models", {"models": names, "framework": framework, "batch_size": args.batch_size,
                                           "steps": args.steps})
    if writer is None:
        return options.EXIT_USAGE
    print(f"{framework} {framework_named(framework).version()}: forward+backward at batch size {args.batch_size}, "
          f"{args.steps} timed steps after one warm-up, on this machine; paper: Table 2 of Xue et al. (EuroSys '19), "
          "on a Tesla P100 GPU", flush=True)
    print("\n".join(table_header()), flush=True)

    def measured(record) -> None:
        writer.add(record)
        print(row_line(record.row()), flush=True)

    try:
        models_table(names, args.batch_size, steps=args.steps, on_row=measured, framework=framework)
    except DiskError as exc:
        return disk_full(writer, "models", exc, [])
    except BaseException as exc:
        writer.finish("failed", failures=[options.error_line(exc)])
        raise
    writer.finish("complete")
    print(f"results: {writer.path}")
    return 0
