"""Train MODEL with synthetic data: SERVERS servers, each a worker and a parameter server, variables placed
round-robin, synchronous SGD; every transfer goes through the transport. 'local' trains in one process without
communication; 'tf_grpc' is TensorFlow's own ParameterServerStrategy over its C++ gRPC runtime. Records
mini-batches per second per worker and a step-time breakdown; every timed step of every worker goes to
samples.csv."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench import LOCAL, options
from bench.commands.common import (
    add_framework_option,
    draw,
    failed,
    interrupted,
    open_run,
)
from bench.experiments.training_memory import memory_problem
from bench.results.lines import NO_ANALYSIS, ZERO_COPY

if TYPE_CHECKING:
    from bench.results import ModelRecord

HELP = "parameter-server training of the paper's models over transports (its Figures 9 and 12)"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench model vgg16 --transport zerocopy,grpc_tcp', "VGG16 over zero copy and gRPC (the paper's Figure 9)"),
    ('bench model fcn5 --transport zerocopy,grpc_tcp,local --steps 10', 'a quick one, with the Local line'),
    ('bench model alexnet,vgg16 --batch-size 1,4 --compute replay', 'replayed compute: only the transfers run'),
    ('bench model vgg16 --framework torch --transport zerocopy,grpc_tcp,torch_rpc,torch_ddp',
     "VGG16 in PyTorch, beside PyTorch's own training lines"),
)
STARTS_RANKS = True

#: the optional part of the install it needs (checked before anything starts)
EXTRAS = ("models",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_training_options(parser, "model", ZERO_COPY, steps=20, compute="real")
    add_framework_option(parser)
    add_memory_option(parser)
    parser.add_argument("--servers", type=options.positive_int, default=None,
                        help="servers, each a worker and a PS (default 1; under --launcher mpi or slurm, half the "
                        "ranks)")
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="asynchronous SGD: each PS applies every worker's gradients as they arrive")


def memory_kind(text: str) -> Any:
    """``--memory`` of a training run: ``host``, ``cuda`` or ``cuda:N`` (one kind: a run's every tensor lives there)."""
    from transports.memory import Memory

    try:
        return Memory.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_memory_option(parser: argparse.ArgumentParser) -> None:
    """``--memory``: where a run's weights, gradients and received tensors live."""
    parser.add_argument("--memory", type=memory_kind, default="host", metavar="KIND",
                        help="where the weights, gradients and received tensors live: host, cuda (device 0) or "
                        "cuda:N. With a GPU, PyTorch's model computes there and the parameter servers apply SGD "
                        "there; zerocopy and rdma_cp move device memory to device memory, the others stage it "
                        "through the host, each crossing counted (records: memory, *_bytes_per_step). --framework "
                        "torch only; refused before any rank starts where there is no GPU (default: host)")


def run(args: argparse.Namespace, launcher: Any) -> int:
    # a job started by mpirun or srun has its size already: a server (a worker and a PS) per two of its ranks
    servers = args.servers or (launcher.world // 2 if not launcher.starts_processes else 1)
    return run_trainings(args, launcher, "model", [max(1, servers)])


def device_memory_problem(args: argparse.Namespace) -> str | None:
    """Why ``--memory`` cannot be had by this framework on this machine (the framework's, or the GPU's), in one line;
    None for host memory, or when it can."""
    from bench.runtime.framework import framework_named
    from transports.memory import HOST

    memory = getattr(args, "memory", HOST)
    return None if not memory.is_device else framework_named(args.framework).memory_problem(memory)


def run_trainings(args: argparse.Namespace, launcher: Any, experiment: str, server_counts: list[int],
                  shape: Callable[[ModelRecord], ModelRecord] | None = None, scaled_local: bool = False) -> int:
    """``bench model`` and ``bench scale``: every model x batch size x transport x server count, a record each,
    made the experiment's by ``shape``. With ``scaled_local`` the Local line is measured beside the others once,
    with one server (it is one process: the figure draws it times the number of servers)."""
    from bench.experiments.training import Trainings, line_of

    chosen = list(args.transports)
    if args.no_analysis:
        chosen = [options.choose(NO_ANALYSIS) if c.label == ZERO_COPY else c for c in chosen]
    if scaled_local and not any(line_of(c.name).one_process for c in chosen):
        chosen.append(options.choose(LOCAL))  # the Local line of the figure
    chosen = list(dict.fromkeys(chosen))
    runs = [(m, b, c, n) for m in args.models for b in args.batch_sizes for c in chosen for n in server_counts]
    if scaled_local:
        runs = list(dict.fromkeys((m, b, c, 1 if line_of(c.name).one_process else n) for m, b, c, n in runs))
    if problem := options.batch_problem(args.models, args.batch_sizes):
        return options.fail(experiment, problem)
    if problem := memory_problem(args.models, server_counts, args.compute, launcher):  # before any rank starts
        return options.fail(experiment, problem)
    if problem := device_memory_problem(args):
        return options.fail(experiment, problem)
    spread = [n for _, _, c, n in runs if not line_of(c.name).one_process]  # a job of too few processes
    if spread and (problem := launcher.ranks_problem(2 * max(spread), f"a worker and a parameter server for each of "
                                                                      f"{max(spread)} servers")):
        return options.fail(experiment, problem)
    labels = options.labels(chosen)
    settings = {"models": args.models, "framework": args.framework, "transports": labels,
                "batch_sizes": args.batch_sizes,
                "servers": server_counts, "steps": args.steps, "warmup": args.warmup,
                "learning_rate": args.learning_rate, "asynchronous": args.asynchronous, "compute": args.compute,
                "memory": str(getattr(args, "memory", "host")),
                **options.fabric_settings(args, launcher)}
    writer = open_run(args.out, experiment, settings, launcher)
    if writer is None:
        return options.EXIT_USAGE
    print(f"bench {experiment}: {len(runs)} runs ({', '.join(args.models)} over {', '.join(labels)}, batch "
          f"{','.join(map(str, args.batch_sizes))}, {','.join(map(str, server_counts))} server(s), {args.compute} "
          f"compute, launcher {launcher.name}) -> {writer.path}")
    trainings = Trainings(experiment, args, launcher, writer, *([shape] if shape else []))
    try:
        trainings.run(runs)
    except KeyboardInterrupt as exc:
        return interrupted(writer, experiment, "the runs finished", exc, failures=trainings.failures,
                           launcher=launcher.describe())
    except BaseException as exc:
        failed(writer, trainings.failures, exc, launcher=launcher.describe())
        raise
    writer.finish("failed" if trainings.failures else "complete", failures=trainings.failures,
                  launcher=launcher.describe(),
                  compute_s={f"{m}-b{b}": c.compute_s for (m, b), c in trainings.prepared.items() if c.replayed})
    from bench.readers.summary import print_training

    print_training(writer.path, args.warmup)
    if not args.no_plot:
        draw(writer.path, experiment)
    return 1 if trainings.failures else 0
