"""Data-parallel synchronous training of TASK through the parameter-server runtime on real data, over each
transport in turn: SERVERS servers, each a worker and a parameter server; each worker takes its own shard of the
training set; worker 0 evaluates the held-out set every --eval-every steps. With the same seed every transport
gives the same training loss at every step: only the time differs. Records every step's training loss, every
evaluation (held-out loss and accuracy or perplexity, seconds trained so far, evaluation time left out) and per
transport the time to --target and its speed-up over grpc_tcp."""

from __future__ import annotations

import argparse
from typing import Any

import transports
from bench import options
from bench.commands.common import add_framework_option, draw, failed, interrupted, open_run

HELP = "time to a held-out target on real data, per transport (the paper's Figure 10)"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench converge digits --steps 200', 'train to a metric over grpc_tcp and zerocopy (Figure 10)'),
    ('bench converge text --time 60 --target perplexity=12', 'a minute each, time to a held-out perplexity of 12'),
)
STARTS_RANKS = True


def _task_names() -> dict[str, str]:
    from bench.experiments.tasks import TASKS

    return TASKS


def _target(text: str) -> Any:
    from bench.experiments.converge import parse_target

    try:
        return parse_target(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

#: the optional part of the install it needs (checked before anything starts)
EXTRAS = ("models",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (parser.description or "") + " Tasks (no download needed for the first two): " + "; ".join(
        f"{name}: {what}" for name, what in _task_names().items())
    parser.add_argument("task", nargs="?", default="digits", metavar="TASK",
                        help=f"what to train: {', '.join(_task_names())}")
    parser.add_argument("--transport", "--transports", dest="transports", type=options.transport_choices,
                        default="grpc_tcp,zerocopy", help="comma list of transports (name or name:mode)")
    parser.add_argument("--servers", type=options.positive_int, default=2, help="servers, each a worker and a PS")
    parser.add_argument("--batch-size", type=options.positive_int, default=None,
                        help="per-worker mini-batch size (default: the task's, 32)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=options.positive_int, default=None, help="steps to train (default: the task's)")
    length.add_argument("--time", type=options.seconds, default=None,
                        help="seconds to train each transport instead of a number of steps (worker 0's clock, "
                        "evaluation left out; at most 100000 steps)")
    parser.add_argument("--target", type=_target, default=None,
                        help="METRIC=VALUE whose first reaching is timed: the task's metric (accuracy for digits "
                        "and cifar10, perplexity for text and seq2seq) or heldout_loss "
                        "(default: the task's: accuracy=0.97 for digits, perplexity=10 for text)")
    parser.add_argument("--data", default=None,
                        help="the data of the tasks that need it: cifar10 DIR (CIFAR-10's Python version), "
                        "seq2seq PREFIX (PREFIX.src and PREFIX.tgt, aligned line by line)")
    parser.add_argument("--learning-rate", type=options.rate, default=None,
                        help="SGD learning rate (default: the task's)")
    parser.add_argument("--eval-every", type=options.positive_int, default=None,
                        help="steps between held-out evaluations (default: the task's)")
    parser.add_argument("--seed", type=options.non_negative_int, default=0, help="the model's initial weights")
    add_framework_option(parser)
    options.add_timeout(parser, 600.0, "one step of a rank")
    options.add_fabric_options(parser, "UCX transports for the fabric transports (netns: always tcp)")
    options.add_out(parser, "converge")
    options.add_no_plot(parser)
    options.add_launch_options(parser)


def run(args: argparse.Namespace, launcher: Any) -> int:
    """Each transport trains the task to its target; records, a summary, figures."""
    from bench.experiments.converge import (
        BASELINE,
        converge,
        losses_agree,
        paper_speedup,
        parse_target,
        target_problem,
    )
    from bench.experiments.tasks import get_task

    try:
        task = get_task(args.task, args.data)
    except ValueError as exc:  # TaskDataError too: one line naming the path and what is wrong
        return options.fail("converge", str(exc))
    from bench.experiments.training import line_of

    if local := next((c for c in args.transports if not line_of(c.name).crosses_processes), None):
        others = ", ".join(n for n in transports.names() if line_of(n).crosses_processes)
        return options.fail("converge", f"--transport {local}: converge trains through the parameter-server runtime "
                            f"over the transports that cross processes ({others})")
    if args.target is not None and (problem := target_problem(args.target, task.name, task.metric)):
        return options.fail("converge", problem)
    args.task = task.name
    args.batch_size = args.batch_size or task.default_batch_size
    args.learning_rate = args.learning_rate or task.default_learning_rate
    args.eval_every = args.eval_every or task.default_eval_every
    if args.time is not None:
        args.steps = 100_000
    args.steps = args.steps or task.default_steps
    target = args.target or (parse_target(task.default_target) if task.default_target else None)
    labels = options.labels(args.transports)
    settings = {"task": task.name, "framework": args.framework, "data": args.data, "transports": labels,
                "servers": args.servers,
                "batch_size": args.batch_size, "steps": args.steps, "time_s": args.time,
                "learning_rate": args.learning_rate, "eval_every": args.eval_every, "seed": args.seed,
                "target": str(target) if target else None, "metric": task.metric,
                **options.fabric_settings(args, launcher)}
    writer = open_run(args.out, "converge", settings, launcher)
    if writer is None:
        return options.EXIT_USAGE
    out = writer.path
    print(f"bench converge: {task.name} ({task.description}) over {', '.join(labels)}, {args.servers} "
          f"server(s), batch {args.batch_size}, " + (f"{args.time:g} s" if args.time else f"{args.steps} steps")
          + f", target {target or 'none'} -> {out}")

    def options_for(choice: options.Choice) -> dict[str, object]:
        constructor = choice.constructor_options(args, launcher)
        constructor.pop("timeout_s")  # the runtime's timeout is the config's
        return constructor

    try:
        failures, losses = converge(args, launcher, writer, args.transports, task, target, options_for)
    except KeyboardInterrupt as exc:
        return interrupted(writer, "converge", "the transports finished", exc, launcher=launcher.describe())
    except BaseException as exc:
        failed(writer, [], exc, launcher=launcher.describe())
        raise
    agreement = losses_agree(losses)
    writer.finish("failed" if failures else "complete", failures=failures, launcher=launcher.describe(),
                  loss_max_relative_difference=agreement)
    if agreement:
        print("training loss per step, largest relative difference from " + f"{next(iter(losses))}: "
              + ", ".join(f"{label} {value:.1e}" for label, value in agreement.items()))
    if (out / "records.csv").exists():  # a run whose every transport failed recorded nothing
        from bench.readers.summary import print_converge

        print_converge(out, BASELINE, paper_speedup(task.name))
    print(f"results: {out}")
    if not args.no_plot:
        draw(out, "converge")
    return 1 if failures else 0
