"""Build MODEL, trace the step function every worker runs, and print the plan the runtime hands to the
transports: every tensor that crosses processes in the parameter-server layout (weights and state from the PS,
gradients and state updates back), whether its shape is static (placed ahead in registered memory) or only known
at run time (dynamic allocation, with its bound), the graph operation that produces it, and the registered memory
each process needs. The plan is also written as a run (one record per tensor and direction; 'bench report' and
'bench plot' draw the distribution of tensor sizes, the paper's Figure 7)."""

from __future__ import annotations

import argparse
import sys

from bench import options
from bench.commands.common import add_framework_option, disk_full, draw, open_run
from bench.results import DiskError
from bench.results.lines import ZERO_COPY

HELP = "the graph analyzer's transfer plan of a model: every cross-process tensor, static or dynamic"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench analyze vgg16', "the graph analyzer's transfer plan for VGG16 (Figure 7)"),
    ('bench analyze embedding --servers 2 --json plan.json', 'a dynamic (sparse) gradient, its plan as JSON'),
    ('bench analyze vgg16 --framework torch', "VGG16's plan as PyTorch trains it"),
)

#: the optional part of the install it needs (checked before anything starts)
EXTRAS = ("models",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help=f"a model ({', '.join(options.MODEL_NAMES)}) or package.module:ATTR")
    parser.add_argument("--servers", type=options.positive_int, default=1, help="servers, each a worker and a PS")
    parser.add_argument("--batch-size", type=options.positive_int, default=1, help="per-worker mini-batch size")
    parser.add_argument("--json", type=options.output_path, default=None, metavar="PATH",
                        help="also write the plan as JSON")
    parser.add_argument("--all", action="store_true", help="list every tensor (default: the first 40)")
    parser.add_argument("--no-analysis", action="store_true",
                        help="the plan zerocopy:no_analysis works with: every tensor dynamic")
    add_framework_option(parser)
    options.add_out(parser, "analysis")
    options.add_no_plot(parser)


def run(args: argparse.Namespace) -> int:
    from bench.experiments.training import model_config
    from bench.results import AnalysisRecord
    from bench.runtime.analyzer import format_plan
    from bench.runtime.config import plan_of
    from bench.runtime.framework import framework_named

    if args.model not in options.MODEL_NAMES and ":" not in args.model:
        return options.fail("analyze", f"unknown model '{args.model}' (known: {', '.join(options.MODEL_NAMES)})")
    if args.json is not None and (problem := options.output_file_problem(args.json, "--json", example="plan.json")):
        return options.fail("analyze", problem)  # before the model is built: the plan would have nowhere to go
    if problem := options.run_dir_problem(args.out):
        return options.fail("analyze", problem)  # likewise for the records
    try:
        config = model_config(args.model, args.framework, transport=ZERO_COPY, transport_options={},
                              batch_size=args.batch_size, servers=args.servers)
        plan = plan_of(config)
    except (ImportError, AttributeError) as exc:
        return options.fail("analyze", f"cannot load model '{args.model}': {options.error_line(exc)}")
    if args.no_analysis:
        plan = plan.without_analysis()
    print(f"bench analyze: {args.model} ({args.framework}), batch {args.batch_size}, {args.servers} server(s)"
          + (" (analysis off)" if args.no_analysis else ""))
    print(format_plan(plan, limit=None if args.all else 40))
    if args.json is not None:
        from bench.results import replace_file

        try:
            replace_file(args.json, plan.dumps() + "\n")  # whole or not at all: a full disk keeps the old plan
        except DiskError as exc:
            print(f"bench analyze: error: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            return options.fail("analyze", f"cannot write {args.json}: {exc.strerror or exc}")
        print(f"plan: {args.json}")
    settings = {"model": args.model, "framework": args.framework, "servers": args.servers,
                "batch_size": args.batch_size, "analysis": not args.no_analysis}
    writer = open_run(args.out, "analysis", settings)
    if writer is None:
        return options.EXIT_USAGE
    summary = plan.summary()
    version = framework_named(args.framework).version()
    try:
        for t in plan.transfers:
            writer.add(AnalysisRecord(
                model=args.model, framework=args.framework, framework_version=version, servers=args.servers,
                batch_size=args.batch_size, analysis=plan.analysis,
                tensor=t.name, role=t.role, placement="static" if t.static else "dynamic",
                shape=None if t.shape is None else "x".join(map(str, t.shape)),
                bound=None if t.bound is None else "x".join(map(str, t.bound)), dtype=str(t.dtype), bytes=t.nbytes,
                src=t.src, dst=t.dst, variable=t.variable, site=t.site))
    except DiskError as exc:
        return disk_full(writer, "analyze", exc, [])
    writer.finish("complete", summary=summary)
    print(f"results: {writer.path}")
    if not args.no_plot:
        draw(writer.path, "analysis")
    return 0
