"""The ``bench`` command: run experiments over the transports, store results, draw them."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import transports
from bench.results import ResultsError, RunWriter, package_versions

EXIT_USAGE = 2
DEFAULT_SIZES = "1KB-1GB"


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


def _signal_of(exc: KeyboardInterrupt) -> tuple[str, int]:
    """(the signal's name, the exit status it gives: 128 + its number)."""
    signum = getattr(exc, "signum", signal.SIGINT)
    return signal.Signals(signum).name, 128 + signum


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line, with where to look, and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _sizes(text: str) -> list[int]:
    from bench.sizes import SizeError, parse_sizes

    try:
        return parse_sizes(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a number of at least {least}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1)


def _non_negative_int(text: str) -> int:
    return _whole_number(text, 0)


#: the longest --timeout (a week): longer waits overflow the clocks of threads and sockets
MAX_SECONDS = 7 * 24 * 3600.0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got '{text}'") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got '{text}'")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_SECONDS:g} seconds (a week), got {value:g}")
    return value


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600}


def _duration(text: str) -> float:
    """Seconds in ``600``, ``90s``, ``10m`` or ``1h``."""
    number = text.strip().lower()
    unit = next((u for u in sorted(_DURATION_UNITS, key=len, reverse=True) if u and number.endswith(u)), "")
    seconds = _seconds(number[: len(number) - len(unit)] if unit else number)
    if seconds * _DURATION_UNITS[unit] > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected at most a week, got '{text}'")
    return seconds * _DURATION_UNITS[unit]


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{text}'")
    return value


def _transport_list(text: str) -> list[str]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    if not chosen:
        raise argparse.ArgumentTypeError(f"expected a comma list of transport names (known: "
                                         f"{', '.join(transports.names())}), got '{text}'")
    for label in chosen:
        name = label.partition(":")[0]
        if name not in transports.REGISTRY:
            raise argparse.ArgumentTypeError(f"unknown transport '{name}' (known: {', '.join(transports.names())})")
        status = transports.availability(name)
        if not status.ok:
            raise argparse.ArgumentTypeError(f"transport '{name}' is not available here: {status.reason}")
        try:
            transports.resolve(label)
        except transports.UnknownTransport as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return list(dict.fromkeys(chosen))


#: the paper's six models, then ours beyond them (embedding: a sparse gradient of dynamic shape)
MODEL_NAMES = ("alexnet", "inception_v3", "vgg16", "lstm", "gru", "fcn5", "embedding")
REFERENCE_RUNS = ("local", "tf_grpc")


def _model_list(text: str) -> list[str]:
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    if not chosen:
        raise argparse.ArgumentTypeError(f"expected a model name or a comma list of them (known: "
                                         f"{', '.join(MODEL_NAMES)}), got '{text}'")
    for name in chosen:
        if name not in MODEL_NAMES and ":" not in name:
            raise argparse.ArgumentTypeError(f"unknown model '{name}' (known: {', '.join(MODEL_NAMES)})")
    return chosen


def _model_transport_list(text: str) -> list[str]:
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    if not chosen:
        known = ", ".join(dict.fromkeys([*transports.names(), *REFERENCE_RUNS]))
        raise argparse.ArgumentTypeError(f"expected a comma list of transport names (known: {known}), got '{text}'")
    others = [t for t in chosen if t not in REFERENCE_RUNS]
    if others:
        _transport_list(",".join(others))
    return list(dict.fromkeys(chosen))


def _int_list(text: str) -> list[int]:
    values = [_positive_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a whole number or a comma list of them, e.g. 1,2,4, got '{text}'")
    return list(dict.fromkeys(values))


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    from bench.launch import LAUNCHERS

    parser.add_argument("--launcher", choices=list(LAUNCHERS), default="local",
                        help="how ranks start: " + "; ".join(f"{name}: {what}" for name, what in LAUNCHERS.items())
                        + ". Under mpi every rank runs this same command (mpirun -np N bench ... --launcher mpi)")
    parser.add_argument("--bind", default=None, metavar="ADDRESS|INTERFACE",
                        help="where ranks listen (local, mpi): an address or an interface (default: loopback; under "
                        "mpi, the host's address when ranks span hosts)")
    parser.add_argument("--link-rate", default=None, metavar="RATE",
                        help="netns: shape every link to RATE with tc, e.g. 10gbit, 500mbit (default: unshaped)")


def _add_compute_option(parser: argparse.ArgumentParser, default: str) -> None:
    from bench.training import COMPUTE_MODES

    parser.add_argument("--compute", choices=list(COMPUTE_MODES), default=default,
                        help="; ".join(f"{name}: {what}" for name, what in COMPUTE_MODES.items())
                        + ". Replayed records are labelled in the 'compute' column and the figures")


def _task_names() -> dict[str, str]:
    from bench.tasks import TASKS

    return TASKS


def _target(text: str):
    from bench.converge import parse_target

    try:
        return parse_target(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_training_options(parser: argparse.ArgumentParser, experiment: str, transports: list[str], steps: int,
                          compute: str) -> None:
    """What ``bench model`` and ``bench scale`` share: models, transports, batches, steps, compute, launch."""
    parser.add_argument("models", type=_model_list, metavar="MODEL",
                        help="model name or comma list: alexnet, inception_v3, vgg16, lstm, gru, fcn5 (the paper's), "
                        "embedding (a sparse gradient whose shape changes every step)")
    parser.add_argument("--transport", "--transports", dest="transports", type=_model_transport_list,
                        default=transports,
                        help="comma list of transports (name or name:mode), plus 'local' (one process, no "
                        "communication) and 'tf_grpc' (TensorFlow's own parameter-server training)")
    parser.add_argument("--batch-size", dest="batch_sizes", type=_int_list, default=[1],
                        help="per-worker mini-batch sizes, comma list")
    parser.add_argument("--steps", type=_positive_int, default=steps, help="timed steps")
    parser.add_argument("--warmup", type=_non_negative_int, default=2, help="untimed steps first")
    parser.add_argument("--learning-rate", type=_rate, default=0.01, help="SGD learning rate")
    _add_fabric_options(parser, "UCX transports for the fabric transports (netns: always tcp)")
    parser.add_argument("--timeout", type=_seconds, default=600.0,
                        help="seconds one transfer, or one step of a rank, may take before the run fails naming it")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results directory (default: results/{experiment}-<time>/)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the figures at the end")
    parser.add_argument("--no-analysis", action="store_true",
                        help="run zerocopy with the graph analysis off (as zerocopy:no_analysis): no tensor is "
                        "placed ahead, every one goes by dynamic allocation; list both to compare (Figure 12)")
    _add_compute_option(parser, compute)
    _add_launch_options(parser)


def _add_fabric_options(parser: argparse.ArgumentParser, transport_help: str) -> None:
    """``--fabric`` and ``--fabric-transport``: the RDMA device library under the fabric transports, and its links."""
    from transports import fabric

    parser.add_argument("--fabric", choices=fabric.names(), default=fabric.DEFAULT,
                        help="the RDMA device library under the fabric transports (zerocopy, rdma_cp, grpc_rdma): "
                        "ucx (UCX: shared memory and tcp here, RDMA where UCX has it) or verbs (pyverbs on an "
                        "RDMA NIC, chosen with the RDMA_* variables); 'bench info' says which can run here")
    choices = list(dict.fromkeys(t for name in fabric.names() for t in _fabric_transports(name)))
    parser.add_argument("--fabric-transport", choices=choices, default="auto", help=transport_help)


def _fabric_transports(name: str) -> list[str]:
    from transports import fabric

    try:
        return list(fabric.backend(name).fabric_transports)
    except ImportError:
        return ["auto"]


def _fabric_problem(args: argparse.Namespace) -> str | None:
    """Why ``--fabric`` with ``--fabric-transport`` (and ``--launcher``) cannot run here, or None."""
    from transports import fabric

    if args.fabric_transport not in _fabric_transports(args.fabric):
        return (f"--fabric-transport {args.fabric_transport}: the {args.fabric} fabric takes "
                f"{', '.join(_fabric_transports(args.fabric))}")
    if args.fabric != fabric.DEFAULT and getattr(args, "launcher", None) == "netns":
        return (f"--fabric {args.fabric} with --launcher netns: the emulated hosts' veth links carry no RDMA; "
                f"use --fabric {fabric.DEFAULT}, or another launcher")
    status = fabric.availability(args.fabric)
    if not status.ok:
        return f"--fabric {args.fabric}: not available here: {status.reason}"
    return None


def build_parser() -> Parser:
    parser = Parser(
        prog="bench",
        description="Compare tensor transports for distributed deep learning: what does RPC cost, "
        "and what does zero-copy RDMA buy?",
        epilog="Results go to results/<experiment>-<YYYYmmdd-HHMMSS>/ (meta.json + records.csv); "
        "draw them with 'bench plot DIR'.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True

    info = commands.add_parser("info", help="versions, transports, fabrics and launchers: whether each can run here")
    info.set_defaults(func=cmd_info)

    micro = commands.add_parser(
        "micro",
        help="send/receive micro-benchmark between two processes (the paper's Figure 8)",
        description="Send tensors of each size from a sender process to a receiver process, which consumes each "
        "with a reduce-max. Time per transfer runs from the sender's send() call to the receiver having reduced "
        "the tensor (one system-wide monotonic clock); transfers do not overlap. Records p50/p99/mean time, "
        "throughput (MB/s, MB = 2^20 bytes, from the mean), CPU seconds of each side and payload bytes copied "
        "per transfer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    micro.add_argument(
        "--sizes",
        type=_sizes,
        default=DEFAULT_SIZES,
        help="tensor sizes, binary units (1KB = 1024 B): a range A-B stepping x4 (A-B:xN for another step), "
        "or a list such as 1KB,64KB,1MB",
    )
    micro.add_argument(
        "--transports",
        type=_transport_list,
        default=None,
        help=f"comma list of transports (known: {', '.join(transports.names())}); a mode as name:mode, "
        "e.g. grpc_rdma:direct; default: every one available here (grpc_rdma in both modes)",
    )
    micro.add_argument("--iters", type=_positive_int, default=None,
                       help="timed transfers per size (default: about 2 GiB of traffic per size, 5 to 1000)")
    micro.add_argument("--warmup", type=_non_negative_int, default=None,
                       help="untimed transfers before each size (default: a tenth of --iters, 1 to 10)")
    micro.add_argument("--timeout", type=_seconds, default=120.0,
                       help="seconds one transfer may take before the run fails naming the peer")
    _add_fabric_options(micro, "UCX transports for the fabric transports (zerocopy, rdma_cp, grpc_rdma): shm "
                        "(shared memory, cma one-sided copies), tcp (also across network namespaces), or auto (UCX "
                        "chooses); the verbs fabric takes only auto")
    micro.add_argument("--out", type=Path, default=None, help="results directory (default: results/micro-<time>/)")
    micro.add_argument("--no-references", action="store_true",
                       help="skip the reference lines, measured before the transports: the fabric library's own "
                       "put bandwidth (ucx_perftest ucp_put_bw, or ib_write_bw on --fabric verbs: the limit and the "
                       "denominator of the of_reference column) and put latency up to 1MB (ucp_put_lat or "
                       "ib_write_lat) over the same links, and memcpy in one process")
    micro.add_argument("--no-plot", action="store_true", help="do not draw the figures at the end")
    _add_launch_options(micro)
    micro.set_defaults(func=cmd_micro)

    model = commands.add_parser(
        "model",
        help="parameter-server training of the paper's models over transports (its Figures 9 and 12)",
        description="Train MODEL with synthetic data: SERVERS servers, each a worker and a parameter server, "
        "variables placed round-robin, synchronous SGD; every transfer goes through the transport. 'local' "
        "trains in one process without communication; 'tf_grpc' is TensorFlow's own ParameterServerStrategy "
        "over its C++ gRPC runtime. Records mini-batches per second per worker and a step-time breakdown.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_training_options(model, "model", transports=["zerocopy"], steps=20, compute="real")
    model.add_argument("--servers", type=_positive_int, default=None,
                       help="servers, each a worker and a PS (default 1; under --launcher mpi, half the ranks)")
    model.add_argument("--async", dest="asynchronous", action="store_true",
                       help="asynchronous SGD: each PS applies every worker's gradients as they arrive")
    model.set_defaults(func=cmd_model)

    scale = commands.add_parser(
        "scale",
        help="throughput against the number of servers, per transport, with the Local line (the paper's Figure 11)",
        description="Train MODEL on 1, 2, 4, ... servers (each a worker and a parameter server) over each transport "
        "and record the total mini-batches per second and the scaling efficiency (throughput / (servers x the "
        "1-server throughput of the same transport)). The Local line is one process without communication, "
        "times the number of servers. On a machine with few cores, real compute competes with communication "
        "for the CPU: --compute replay (the default here) waits each worker's measured compute time instead.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_training_options(scale, "scale", transports=["zerocopy", "grpc_tcp"], steps=10, compute="replay")
    scale.add_argument("--servers", dest="server_counts", type=_int_list, default=[1, 2, 4],
                       help="comma list of server counts")
    scale.set_defaults(func=cmd_scale, asynchronous=False)

    converge = commands.add_parser(
        "converge",
        help="time to a held-out target on real data, per transport (the paper's Figure 10)",
        description="Data-parallel synchronous training of TASK through the parameter-server runtime on real data, "
        "over each transport in turn: SERVERS servers, each a worker and a parameter server; each worker takes its "
        "own shard of the training set; worker 0 evaluates the held-out set every --eval-every steps. With the "
        "same seed every transport gives the same training loss at every step: only the time differs. Records "
        "every step's training loss, every evaluation (held-out loss and accuracy or perplexity, seconds trained "
        "so far, evaluation time left out) and per transport the time to --target and its speed-up over "
        "grpc_tcp. Tasks (no download needed for the first two): "
        + "; ".join(f"{name}: {what}" for name, what in _task_names().items()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    converge.add_argument("task", nargs="?", default="digits", metavar="TASK",
                          help=f"what to train: {', '.join(_task_names())}")
    converge.add_argument("--transport", "--transports", dest="transports", type=_transport_list,
                          default=["grpc_tcp", "zerocopy"], help="comma list of transports (name or name:mode)")
    converge.add_argument("--servers", type=_positive_int, default=2, help="servers, each a worker and a PS")
    converge.add_argument("--batch-size", type=_positive_int, default=None,
                          help="per-worker mini-batch size (default: the task's, 32)")
    length = converge.add_mutually_exclusive_group()
    length.add_argument("--steps", type=_positive_int, default=None, help="steps to train (default: the task's)")
    length.add_argument("--time", type=_seconds, default=None,
                        help="seconds to train each transport instead of a number of steps (worker 0's clock, "
                        "evaluation left out; at most 100000 steps)")
    converge.add_argument("--target", type=_target, default=None,
                          help="METRIC=VALUE (accuracy, perplexity or heldout_loss) whose first reaching is timed "
                          "(default: the task's: accuracy=0.97 for digits, perplexity=10 for text)")
    converge.add_argument("--data", default=None,
                          help="the data of the tasks that need it: cifar10 DIR (CIFAR-10's Python version), "
                          "seq2seq PREFIX (PREFIX.src and PREFIX.tgt, aligned line by line)")
    converge.add_argument("--learning-rate", type=_rate, default=None, help="SGD learning rate (default: the task's)")
    converge.add_argument("--eval-every", type=_positive_int, default=None,
                          help="steps between held-out evaluations (default: the task's)")
    converge.add_argument("--seed", type=_non_negative_int, default=0, help="the model's initial weights")
    converge.add_argument("--timeout", type=_seconds, default=600.0,
                          help="seconds one step of a rank may take before the run fails naming it")
    _add_fabric_options(converge, "UCX transports for the fabric transports (netns: always tcp)")
    converge.add_argument("--out", type=Path, default=None,
                          help="results directory (default: results/converge-<time>/)")
    converge.add_argument("--no-plot", action="store_true", help="do not draw the figures at the end")
    _add_launch_options(converge)
    converge.set_defaults(func=cmd_converge)

    soak = commands.add_parser(
        "soak",
        help="a long run that checks every tensor: nothing corrupted, nothing lost, memory flat (not for CI)",
        description="For each transport: the micro-benchmark at each of --sizes, transfers going on for a share of "
        "--duration (the duration is split evenly over transports and sizes; 10 minutes in all by default), then "
        "--steps steps of 'bench model MODEL' (1 server; not for 'local', which sends nothing). The content of "
        "every tensor received is checked: the micro-benchmark's receiver compares every element with what the "
        "sender wrote; in training each tensor's CRC-32 travels beside it (through the launcher) and is checked "
        "on arrival. records.csv has one row per process of each point: tensors sent, received, corrupted "
        "(must be 0), lost (must be 0), and resident memory at the start and end (meta.json: the totals, and "
        "this process's own memory). Exit status 1 if any tensor was corrupted or lost or a run failed. Ctrl-C, "
        "SIGTERM or SIGHUP stop it keeping the points checked so far. Not for CI (10 minutes of transfers, then "
        "1000 training steps per transport); '--duration 20s --steps 20' is a quick look.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    soak.add_argument("--transports", type=_transport_list, default=None,
                      help="comma list of transports (name or name:mode); default: every one available here")
    soak.add_argument("--sizes", type=_sizes, default="1KB,4MB", help="micro-benchmark tensor sizes")
    soak.add_argument("--duration", type=_duration, default="10m",
                      help="seconds (or 90s, 10m, 1h) of micro-benchmark transfers in all, split evenly over the "
                      "transports and sizes")
    soak.add_argument("--model", type=_model_list, default="fcn5", help="the model trained after the transfers")
    soak.add_argument("--steps", type=_non_negative_int, default=1000,
                      help="training steps per transport (0: no training)")
    soak.add_argument("--batch-size", type=_positive_int, default=1, help="per-worker mini-batch size")
    soak.add_argument("--timeout", type=_seconds, default=120.0,
                      help="seconds one transfer, or one training step, may take before the run fails naming it")
    _add_fabric_options(soak, "UCX transports for the fabric transports")
    soak.add_argument("--out", type=Path, default=None, help="results directory (default: results/soak-<time>/)")
    _add_compute_option(soak, "real")
    _add_launch_options(soak)
    soak.set_defaults(func=cmd_soak)

    models = commands.add_parser(
        "models", help="the paper's Table 2 measured here: model size, variables, local compute time per sample",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    models.add_argument("models", nargs="?", type=_model_list, default=None, metavar="MODEL[,MODEL]",
                        help="which models (default: all six)")
    models.add_argument("--batch-size", type=_positive_int, default=1, help="batch size for the compute time")
    models.add_argument("--steps", type=_positive_int, default=3, help="timed forward+backward steps per model")
    models.set_defaults(func=_cmd_models)

    analyze = commands.add_parser(
        "analyze", help="the graph analyzer's transfer plan of a model: every cross-process tensor, static or dynamic",
        description="Build MODEL, trace the step function every worker runs, and print the plan the runtime "
        "hands to the transports: every tensor that crosses processes in the parameter-server layout (weights "
        "and state from the PS, gradients and state updates back), whether its shape is static (placed ahead "
        "in registered memory) or only known at run time (dynamic allocation, with its bound), the graph "
        "operation that produces it, and the registered memory each process needs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    analyze.add_argument("model", metavar="MODEL", help=f"a model ({', '.join(MODEL_NAMES)}) or package.module:ATTR")
    analyze.add_argument("--servers", type=_positive_int, default=1, help="servers, each a worker and a PS")
    analyze.add_argument("--batch-size", type=_positive_int, default=1, help="per-worker mini-batch size")
    analyze.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the plan as JSON")
    analyze.add_argument("--all", action="store_true", help="list every tensor (default: the first 40)")
    analyze.add_argument("--no-analysis", action="store_true",
                         help="the plan zerocopy:no_analysis works with: every tensor dynamic")
    analyze.set_defaults(func=cmd_analyze)

    plot = commands.add_parser("plot", help="draw the figures of a results directory beside its records")
    plot.add_argument("results_dir", type=Path, metavar="RESULTS_DIR")
    plot.set_defaults(func=cmd_plot)
    return parser


def cmd_info(args: argparse.Namespace) -> int:
    print("bench: tensor transport benchmarks")
    print("\nversions:")
    for name, version in package_versions().items():
        print(f"  {name:24} {version}")
    print("\ntransports:")
    for name in transports.names():
        status = transports.availability(name)
        print(f"  {name:10} {'available' if status.ok else 'not available: ' + status.reason}")
    print("\nfabric:")
    for line in _fabric_info():
        print(f"  {line}")
    print("\nlaunchers (--launcher):")
    for name, status in _launcher_info().items():
        print(f"  {name:6} {status}")
    return 0


def _launcher_info() -> dict[str, str]:
    """Whether each launcher can run here, without starting anything (MPI is not initialised)."""
    import importlib.util
    import shutil

    from bench.launch import LAUNCHERS
    from bench.launch.hosts import NetnsUnavailable, check_support

    status = dict.fromkeys(LAUNCHERS, "available")
    try:
        check_support()
    except NetnsUnavailable as exc:
        status["netns"] = f"not available: {exc}"
    if importlib.util.find_spec("mpi4py") is None:
        status["mpi"] = "not available: mpi4py is not installed (pip install -e '.[mpi]')"
    else:
        mpirun = shutil.which("mpirun", path=os.pathsep.join([os.path.dirname(sys.executable),
                                                              os.environ.get("PATH", "")]))
        status["mpi"] = f"available (mpirun: {mpirun or 'not on PATH; srun or a system mpirun will do'})"
    return status


def _fabric_info() -> list[str]:
    """Each fabric backend: whether it can run here and why not, its --fabric-transport choices, and for
    one that runs what it offers (UCX: the transports and devices of ``ucx_info -d``)."""
    import re
    import subprocess

    from transports import fabric
    from transports.fabric.base import FabricError

    lines = []
    for name in fabric.names():
        status = fabric.availability(name)
        if not status.ok:
            lines.append(f"{name:6} not available: {status.reason}")
            continue
        backend = fabric.backend(name)
        lines.append(f"{name:6} available (--fabric {name}; --fabric-transport {'|'.join(backend.fabric_transports)})")
        if "ucx_info" not in backend.reference_tools:
            continue
        try:
            tool = backend.tool("ucx_info")
            info = subprocess.run([str(tool.path), "-v"], capture_output=True, text=True, timeout=30,
                                  env=tool.environment)
            version = re.search(r"version:?\s*([\w.]+)", info.stdout)
            lines.append(f"       ucx {version.group(1)}" if version else "")
            info = subprocess.run([str(tool.path), "-d"], capture_output=True, text=True, timeout=30,
                                  env=tool.environment)
        except (OSError, subprocess.SubprocessError, FabricError) as exc:
            lines.append(f"       ucx_info could not run: {exc}")
            continue
        offered: dict[str, list[str]] = {}
        transport = None
        for line in info.stdout.splitlines():
            words = line.strip("# ").split(":", 1)
            if len(words) == 2 and words[0].strip() == "Transport":
                transport = words[1].strip()
            elif len(words) == 2 and words[0].strip() == "Device" and transport:
                offered.setdefault(transport, []).append(words[1].strip())
        lines += [f"       ucx transport {carrier:8} devices: {', '.join(devices)}"
                  for carrier, devices in offered.items()]
    return [line for line in lines if line]


def _open_run(out: Path, experiment: str, settings: dict, launcher, given: bool) -> RunWriter | None:
    """The run's results directory (its logs beside it), or None with an error line when it cannot be made.

    ``given``: whether the user chose ``out`` (--out), which the error's fix then names.
    """
    from bench.results import RunWriter

    settings = {**settings, "launcher": launcher.describe()}
    fix = "choose another --out" if given else "run bench from a writable directory or give --out DIR"
    try:
        writer = RunWriter(out, experiment, settings)
    except FileExistsError:
        print(f"bench {experiment}: error: {out} already exists; choose another --out", file=sys.stderr)
        return None
    except OSError as exc:
        print(f"bench {experiment}: error: cannot create the results directory {out}: "
              f"{exc.strerror or exc}; {fix}", file=sys.stderr)
        return None
    launcher.log_dir = out / "logs"
    return writer


def _interrupted(writer, experiment: str, out: Path, what: str, exc: KeyboardInterrupt, **extra) -> int:
    """Mark the run interrupted (by which signal), say where its results are; the exit status."""
    name, status = _signal_of(exc)
    writer.finish("interrupted", reason=f"interrupted by {name}", **extra)
    print(f"\nbench {experiment}: interrupted by {name}; {what} so far are in {out}", file=sys.stderr)
    return status


def _draw(out: Path, experiment: str) -> None:
    """The run's figures; a figure that cannot be drawn is a warning, the records are what count."""
    from bench.plot import plot_run

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            written = plot_run(out)
    except (ResultsError, ValueError, TypeError, KeyError, OSError) as exc:
        print(f"bench {experiment}: warning: no figures: {_error_line(exc)}", file=sys.stderr)
        return
    for path in written:
        if path.suffix == ".png":
            print(f"figure: {path}")


def _check_sizes(sizes: list[int]) -> str | None:
    """An error line when a tensor cannot fit in this machine's memory (sender and receiver hold one each)."""
    from bench.sizes import format_size

    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    if 2 * max(sizes) > memory:
        return (f"--sizes: {format_size(max(sizes))} does not fit twice (sender and receiver) in this machine's "
                f"{memory / 2**30:.1f} GB of memory; choose smaller sizes")
    return None


def cmd_micro(args: argparse.Namespace, launcher) -> int:
    from tqdm import tqdm

    from bench.micro import MicroError, plan_points, run_transport
    from bench.results import default_run_dir, of_reference
    from bench.sizes import format_size

    chosen = args.transports or default_transports()
    too_big = _check_sizes(args.sizes)
    if too_big:
        print(f"bench micro: error: {too_big}", file=sys.stderr)
        return EXIT_USAGE
    points = plan_points(args.sizes, args.iters, args.warmup)
    out = args.out or default_run_dir("micro")
    settings = {
        "sizes": [p.size_bytes for p in points],
        "transports": chosen,
        "iters": {str(p.size_bytes): p.iters for p in points},
        "warmup": {str(p.size_bytes): p.warmup for p in points},
        "timeout_s": args.timeout,
        "fabric": args.fabric,
        "fabric_transport": launcher.fabric_transport(args.fabric_transport),
    }
    writer = _open_run(out, "micro", settings, launcher, args.out is not None)
    if writer is None:
        return EXIT_USAGE
    span = f"{format_size(points[0].size_bytes)}..{format_size(points[-1].size_bytes)}"
    print(f"bench micro: {len(points)} sizes ({span}) over {', '.join(chosen)}, launcher {launcher.name} -> {out}")
    failures: list[str] = []
    fabrics: dict[str, str] = {}
    started = time.monotonic()
    try:
        # The references first: each transport's record carries its throughput as a fraction of ucx_perftest's
        # at the same size (of_reference), and records are written as they are measured.
        reference_MBps: dict[int, float] = {}
        if not args.no_references and launcher.name == "local":
            reference_MBps = _measure_references(points, args, writer, fabrics)
        total = sum(p.warmup + p.iters for p in points)
        done_before = {p.size_bytes: sum(q.warmup + q.iters for q in points if q.size_bytes < p.size_bytes)
                       for p in points}
        for name in chosen:
            with tqdm(total=total, desc=f"{name:9}", unit="xfer", leave=True, dynamic_ncols=True, disable=None) as bar:

                def progress(size: int, n: int, bar=bar) -> None:
                    bar.set_postfix_str(format_size(size))
                    bar.update(done_before[size] + n - bar.n)

                def record(row: dict, name=name) -> None:
                    row["of_reference"] = of_reference(row["throughput_MBps"], reference_MBps.get(row["size_bytes"]))
                    writer.add(row)
                    fabrics[name] = row["fabric"]

                try:
                    run_transport(name, points, transport_options(name, args, launcher), launcher, record, progress)
                except MicroError as exc:
                    failures.append(str(exc))
                    bar.write(f"bench micro: error: {exc}")
    except KeyboardInterrupt as exc:
        return _interrupted(writer, "micro", out, "the points finished", exc, failures=failures, fabric=fabrics,
                            launcher=launcher.describe())
    except BaseException as exc:
        writer.finish("failed", failures=[*failures, _error_line(exc)], fabric=fabrics, launcher=launcher.describe())
        raise
    writer.finish("failed" if failures else "complete", failures=failures, fabric=fabrics,
                  elapsed_s=round(time.monotonic() - started, 1), launcher=launcher.describe())
    _print_micro_summary(out)
    if not args.no_plot and (out / "records.csv").exists():
        _draw(out, "micro")
    return 1 if failures else 0


def _measure_references(points, args: argparse.Namespace, writer, fabrics: dict[str, str]) -> dict[int, float]:
    """The reference lines of the figure (see bench/reference.py): the fabric library's own put bandwidth and
    latency (UCX's ucx_perftest, or perftest's ib_write_bw and ib_write_lat on verbs) and memcpy in one
    process. Returns the bandwidth line's throughput by size, for of_reference."""
    from bench.reference import ReferenceUnavailable, reference_measures
    from bench.results import of_reference

    by_size = {p.size_bytes: p for p in points}
    references = reference_measures(list(by_size), args.fabric, args.fabric_transport, lambda n: by_size[n].iters,
                                    warmup_for=lambda n: max(1, by_size[n].warmup), timeout_s=args.timeout)
    reference_MBps: dict[int, float] = {}
    for name, measure in references.measures:
        print(f"reference: {name} ...", flush=True)
        try:
            for record in measure():
                if record["transport"] == references.bandwidth_line:
                    reference_MBps[record["size_bytes"]] = record["throughput_MBps"]
                record["of_reference"] = of_reference(record["throughput_MBps"],
                                                      reference_MBps.get(record["size_bytes"]))
                writer.add(record)
                fabrics[name] = record["fabric"]
        except ReferenceUnavailable as exc:
            print(f"bench micro: warning: no {name} line: {exc}", file=sys.stderr)
    return reference_MBps


def default_transports() -> list[str]:
    """Every transport available here, each of its modes as a line of its own."""
    labels = []
    for name in transports.available_names():
        cls = transports.transport_class(name)
        modes = [mode for mode in cls.modes() if mode not in cls.optional_modes]
        labels += [name] if not modes else [name if i == 0 else f"{name}:{mode}" for i, mode in enumerate(modes)]
    return labels


def transport_options(label: str, args: argparse.Namespace, launcher) -> dict[str, object]:
    """Constructor options for transport ``label`` (``name`` or ``name:mode``) from the command line."""
    name, options = transports.resolve(label)
    options["timeout_s"] = args.timeout
    if transports.transport_class(name).uses_fabric:
        options["fabric"] = args.fabric
        options["fabric_transport"] = launcher.fabric_transport(args.fabric_transport)
    return options


def _print_micro_summary(out: Path) -> None:
    from bench.results import load_run
    from bench.sizes import format_size

    try:
        records = load_run(out).records
    except ResultsError:
        return

    def number(value: float, width: int, digits: int) -> str:
        return f"{value:>{width}.{digits}f}" if value == value else f"{'-':>{width}}"  # NaN: not measured

    # ucx_perftest (put_bw) has no per-transfer median: its time is size / bandwidth of a pipelined stream
    print(f"\n{'transport':16} {'size':>6} {'iters':>5} {'p50 µs':>11} {'p99 µs':>11} {'MB/s':>9} {'of ref':>7} "
          f"{'copied/xfer':>12}")
    for row in records.itertuples():
        print(f"{row.transport:16} {format_size(row.size_bytes):>6} {row.iters:>5} {number(row.p50_us, 11, 3)} "
              f"{number(row.p99_us, 11, 3)} {number(row.throughput_MBps, 9, 1)} {number(row.of_reference, 7, 3)} "
              f"{format_size(int(row.copied_bytes_per_transfer)):>12}")
    print(f"\nresults: {out}")


def cmd_soak(args: argparse.Namespace, launcher) -> int:
    """``bench soak``: every transport's micro-benchmark and a training run, every tensor checked."""
    from bench.launch import LaunchError
    from bench.memory import rss_mb
    from bench.micro import MicroError, Point, run_transport, soak_records
    from bench.results import default_run_dir
    from bench.runtime.ps import TrainConfig
    from bench.sizes import format_size
    from bench.training import TrainingError, prepare, train
    from bench.training import soak_records as model_soak_records

    chosen = args.transports or default_transports()
    too_big = _check_sizes(args.sizes)
    if too_big:
        print(f"bench soak: error: {too_big}", file=sys.stderr)
        return EXIT_USAGE
    model = args.model[0]
    share = args.duration / (len(chosen) * len(args.sizes))
    points = [Point(size, warmup=10, iters=0, seconds=share, check=True) for size in args.sizes]
    trained = [label for label in chosen
               if args.steps and not transports.transport_class(transports.resolve(label)[0]).same_process_only]
    out = args.out or default_run_dir("soak")
    settings = {"transports": chosen, "sizes": args.sizes, "seconds_per_point": share, "model": model,
                "steps": args.steps, "batch_size": args.batch_size, "compute": args.compute,
                "timeout_s": args.timeout, "fabric": args.fabric,
                "fabric_transport": launcher.fabric_transport(args.fabric_transport)}
    writer = _open_run(out, "soak", settings, launcher, args.out is not None)
    if writer is None:
        return EXIT_USAGE
    print(f"bench soak: {', '.join(chosen)}: {', '.join(map(format_size, args.sizes))} for {share:g} s each, then "
          f"{args.steps} steps of {model} over {', '.join(trained) or 'none'} -> {out}", flush=True)
    failures: list[str] = []
    rows: list[dict] = []
    own_rss = {"start": round(rss_mb(), 1)}  # this process's (the coordinator's); the ranks' are in the records

    def record(row: dict) -> None:
        writer.add(row)
        rows.append(row)

    try:
        for label in chosen:
            print(f"soak: {label}: micro-benchmark ...", flush=True)
            try:
                run_transport(label, points, transport_options(label, args, launcher), launcher, record,
                              record_of=soak_records)
            except MicroError as exc:
                failures.append(str(exc))
                print(f"bench soak: error: {exc}", file=sys.stderr)
        for label in trained:
            print(f"soak: {label}: {args.steps} steps of {model} ...", flush=True)
            config = TrainConfig(model=model, transport=label.partition(":")[0], transport_options={},
                                 batch_size=args.batch_size, servers=1, steps=args.steps, warmup=2,
                                 timeout_s=args.timeout, label=label, compute=args.compute, check=True)
            try:
                config = prepare(config, launcher)
                config.transport_options = transport_options(label, args, launcher)
                config.transport_options.pop("timeout_s")
                for row in model_soak_records(config, train(config, launcher)["outcome"]):
                    record(row)
            except (LaunchError, TrainingError, ValueError, RuntimeError) as exc:
                failures.append(f"{model} over {label}: {exc}")
                print(f"bench soak: error: {model} over {label}: {exc}", file=sys.stderr)
    except KeyboardInterrupt as exc:
        return _interrupted(writer, "soak", out, "the points checked", exc, failures=failures,
                            launcher=launcher.describe())
    except BaseException as exc:
        writer.finish("failed", failures=[*failures, _error_line(exc)], launcher=launcher.describe())
        raise
    bad = [row for row in rows if row["corrupted"] or row["lost"]]
    totals = {key: sum(int(row[key]) for row in rows) for key in ("tensors_sent", "corrupted", "lost")}
    own_rss["end"] = round(rss_mb(), 1)
    writer.finish("failed" if failures or bad else "complete", failures=failures, launcher=launcher.describe(),
                  coordinator_rss_mb=own_rss, **totals)
    print(f"\n{'transport':18} {'phase':5} {'size/model':>10} {'process':>9} {'sent':>9} {'received':>9} "
          f"{'corrupt':>7} {'lost':>5} {'RSS MB start':>12} {'end':>8}")
    for row in rows:
        what = format_size(int(row["size_bytes"])) if row["phase"] == "micro" else row["model"]
        print(f"{row['transport']:18} {row['phase']:5} {what:>10} {row['process']:>9} {row['tensors_sent']:>9} "
              f"{row['tensors_received']:>9} {row['corrupted']:>7} {row['lost']:>5} {row['rss_start_mb']:>12.1f} "
              f"{row['rss_end_mb']:>8.1f}")
    print(f"{'(this process)':18} {'':5} {'':>10} {'bench':>9} {'':>9} {'':>9} {'':>7} {'':>5} "
          f"{own_rss['start']:>12.1f} {own_rss['end']:>8.1f}")
    print(f"\n{totals['tensors_sent']} tensors sent, {totals['corrupted']} corrupted, {totals['lost']} lost"
          + (f"; {len(failures)} run(s) failed" if failures else ""))
    print(f"results: {out}")
    return 1 if failures or bad else 0


def cmd_converge(args: argparse.Namespace, launcher) -> int:
    """``bench converge``: each transport trains the task to its target; records, a summary, figures."""
    from bench.converge import BASELINE, PAPER_SPEEDUP, converge, losses_agree, parse_target
    from bench.results import default_run_dir
    from bench.tasks import get_task

    try:
        task = get_task(args.task, args.data)
    except ValueError as exc:  # TaskDataError too: one line naming the path and what is wrong
        print(f"bench converge: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    unsupported = [label for label in args.transports if label in ("local", "tf_grpc")]
    if unsupported:
        print(f"bench converge: error: --transport {unsupported[0]}: converge trains through the parameter-server "
              f"runtime over the registered transports ({', '.join(transports.names())})", file=sys.stderr)
        return EXIT_USAGE
    args.task = task.name
    args.batch_size = args.batch_size or task.default_batch_size
    args.learning_rate = args.learning_rate or task.default_learning_rate
    args.eval_every = args.eval_every or task.default_eval_every
    if args.time is not None:
        args.steps = 100_000
    args.steps = args.steps or task.default_steps
    target = args.target or (parse_target(task.default_target) if task.default_target else None)
    out = args.out or default_run_dir("converge")
    settings = {"task": task.name, "data": args.data, "transports": args.transports, "servers": args.servers,
                "batch_size": args.batch_size, "steps": args.steps, "time_s": args.time,
                "learning_rate": args.learning_rate, "eval_every": args.eval_every, "seed": args.seed,
                "target": str(target) if target else None, "metric": task.metric, "fabric": args.fabric,
                "fabric_transport": launcher.fabric_transport(args.fabric_transport)}
    writer = _open_run(out, "converge", settings, launcher, args.out is not None)
    if writer is None:
        return EXIT_USAGE
    print(f"bench converge: {task.name} ({task.description}) over {', '.join(args.transports)}, {args.servers} "
          f"server(s), batch {args.batch_size}, " + (f"{args.time:g} s" if args.time else f"{args.steps} steps")
          + f", target {target or 'none'} -> {out}")

    def options_for(label: str) -> dict[str, object]:
        options = transport_options(label, args, launcher)
        options.pop("timeout_s")
        return options

    try:
        failures, losses = converge(args, launcher, writer, args.transports, task, target, options_for)
    except KeyboardInterrupt as exc:
        return _interrupted(writer, "converge", out, "the transports finished", exc, launcher=launcher.describe())
    except BaseException as exc:
        writer.finish("failed", failures=[_error_line(exc)], launcher=launcher.describe())
        raise
    agreement = losses_agree(losses)
    writer.finish("failed" if failures else "complete", failures=failures, launcher=launcher.describe(),
                  loss_max_relative_difference=agreement)
    if agreement:
        print("training loss per step, largest relative difference from " + f"{next(iter(losses))}: "
              + ", ".join(f"{label} {value:.1e}" for label, value in agreement.items()))
    if (out / "records.csv").exists():  # a run whose every transport failed recorded nothing
        _print_converge_summary(out, BASELINE, PAPER_SPEEDUP.get(task.name))
    print(f"results: {out}")
    if not args.no_plot and (out / "records.csv").exists():
        _draw(out, "converge")
    return 1 if failures else 0


def _print_converge_summary(out: Path, baseline: str, paper: float | None) -> None:
    from bench.results import load_run

    records = load_run(out).records
    if "kind" not in records:
        return
    rows = records[records["kind"] == "summary"]
    if rows.empty:
        return
    print(f"\n{'transport':18} {'target':18} {'steps':>6} {'seconds':>9} {'speed-up vs ' + baseline:>20}"
          + ("  paper (zerocopy)" if paper else ""))
    for row in rows.itertuples():
        steps = "-" if row.steps_to_target != row.steps_to_target else f"{int(row.steps_to_target)}"
        seconds = "not reached" if row.time_to_target_s != row.time_to_target_s else f"{row.time_to_target_s:.1f}"
        ratio = "-" if row.speedup_vs_grpc_tcp != row.speedup_vs_grpc_tcp else f"{row.speedup_vs_grpc_tcp:.2f}x"
        print(f"{row.transport:18} {row.target:18} {steps:>6} {seconds:>9} {ratio:>20}"
              + (f"  {paper:.1f}x" if paper and row.transport == "zerocopy" else ""))


def cmd_model(args: argparse.Namespace, launcher) -> int:
    servers = args.servers or (launcher.world // 2 if launcher.name == "mpi" else 1)
    return _train_runs(args, launcher, "model", [max(1, servers)])


def cmd_scale(args: argparse.Namespace, launcher) -> int:
    return _train_runs(args, launcher, "scale", sorted(set(args.server_counts)))


def _train_runs(args: argparse.Namespace, launcher, experiment: str, server_counts: list[int]) -> int:
    """``bench model`` and ``bench scale``: every model x batch size x transport x server count, a record each."""
    from tqdm import tqdm

    from bench.launch import LaunchError
    from bench.results import default_run_dir
    from bench.runtime.ps import TrainConfig
    from bench.training import TrainingError, efficiency, prepare

    out = args.out or default_run_dir(experiment)
    labels = list(args.transports)
    if args.no_analysis:
        labels = list(dict.fromkeys("zerocopy:no_analysis" if label == "zerocopy" else label for label in labels))
    if experiment == "scale" and "local" not in labels:
        labels.append("local")  # the Local line of the figure
    runs = [(m, b, t, n) for m in args.models for b in args.batch_sizes for t in labels for n in server_counts]
    if experiment == "scale":  # the Local line is one process, drawn times the number of servers
        runs = list(dict.fromkeys((m, b, t, 1 if t == "local" else n) for m, b, t, n in runs))
    settings = {"models": args.models, "transports": labels, "batch_sizes": args.batch_sizes,
                "servers": server_counts, "steps": args.steps, "warmup": args.warmup,
                "learning_rate": args.learning_rate, "asynchronous": args.asynchronous, "compute": args.compute,
                "fabric": args.fabric, "fabric_transport": launcher.fabric_transport(args.fabric_transport)}
    writer = _open_run(out, experiment, settings, launcher, args.out is not None)
    if writer is None:
        return EXIT_USAGE
    print(f"bench {experiment}: {len(runs)} runs ({', '.join(args.models)} over {', '.join(labels)}, batch "
          f"{','.join(map(str, args.batch_sizes))}, {','.join(map(str, server_counts))} server(s), {args.compute} "
          f"compute, launcher {launcher.name}) -> {out}")
    failures: list[str] = []
    prepared: dict[tuple[str, int], TrainConfig] = {}
    singles: dict[tuple, float] = {}
    try:
        with tqdm(total=len(runs), unit="run", dynamic_ncols=True, disable=None) as bar:
            for model, batch, label, servers in runs:
                what = f"{model} {label} b{batch} x{servers}"
                bar.set_postfix_str(what)
                config = TrainConfig(model=model, transport=label.partition(":")[0], transport_options={},
                                     batch_size=batch, servers=servers, steps=args.steps, warmup=args.warmup,
                                     learning_rate=args.learning_rate, timeout_s=args.timeout, label=label,
                                     asynchronous=args.asynchronous, compute=args.compute)
                try:
                    if (model, batch) not in prepared:
                        prepared[(model, batch)] = prepare(config, launcher)
                    ready = prepared[(model, batch)]
                    config = dataclasses.replace(config, plan=ready.plan, compute_s=ready.compute_s)
                    record = _train_record(config, label, args, launcher,
                                           lambda server, step, what=what: bar.set_postfix_str(f"{what} step {step}"))
                except (LaunchError, TrainingError, ValueError, RuntimeError) as exc:
                    failures.append(f"{what}: {exc}")
                    bar.write(f"bench {experiment}: error: {model} over {label}, batch {batch}, "
                              f"{servers} server(s): {exc}")
                else:
                    record.update(launcher=launcher.name, link_rate=args.link_rate or "")
                    if experiment == "scale":
                        efficiency(record, singles)
                    writer.add(record)
                    bar.write(f"{model:12} {label:18} batch {batch:3} x{servers}: "
                              f"{record['throughput_batches_per_s']:7.3f} batches/s, "
                              f"step {record['step_time_s']:.3f} s (compute {record['compute_s']:.3f}, "
                              f"comm {record['comm_s']:.3f})" + _copy_note(record))
                bar.update(1)
    except KeyboardInterrupt as exc:
        return _interrupted(writer, experiment, out, "the runs finished", exc, failures=failures,
                            launcher=launcher.describe())
    except BaseException as exc:
        writer.finish("failed", failures=[*failures, _error_line(exc)], launcher=launcher.describe())
        raise
    writer.finish("failed" if failures else "complete", failures=failures, launcher=launcher.describe(),
                  compute_s={f"{m}-b{b}": c.compute_s for (m, b), c in prepared.items() if c.replayed})
    print(f"results: {out}")
    if not args.no_plot and (out / "records.csv").exists():
        _draw(out, experiment)
    return 1 if failures else 0


def _copy_note(record: dict[str, object]) -> str:
    """What a training record says about copies and registered memory, for its progress line."""
    note = ""
    if isinstance(copied := record.get("copied_bytes_per_step"), int | float) and copied == copied:
        note += f", copied {copied / 2**20:.1f} MB/step"
    if isinstance(rate := record.get("registration_hit_rate"), float):
        note += f", sent from registered memory {rate:.1%}"
    if record.get("dynamic_transfers_per_step"):
        note += f", {record['dynamic_transfers_per_step']:g} dynamic/step"
    return note


def _train_record(config, label: str, args: argparse.Namespace, launcher, on_step) -> dict[str, object]:
    """One training run over ``label`` (a transport, ``local`` or ``tf_grpc``) and its record."""
    from bench.training import local_record, model_record, train, train_local

    if label == "local":
        return local_record(config, train_local(config, launcher))
    if label == "tf_grpc":
        return _tf_grpc_record(config, launcher)
    config.transport_options = transport_options(label, args, launcher)
    config.transport_options.pop("timeout_s")
    return model_record(config, train(config, launcher, on_step)["outcome"])


def _tf_grpc_record(config, launcher) -> dict[str, object]:
    from bench.runtime.ps import resolve_model
    from bench.tf_grpc import record_row, run_tf_grpc

    if config.replayed:
        raise ValueError("tf_grpc runs TensorFlow's own training: it cannot replay compute (use --compute real)")
    definition = resolve_model(config.model)
    record = run_tf_grpc(definition.build, definition.make_batch, definition.loss_fn, batch_size=config.batch_size,
                         servers=config.servers, steps=config.steps, warmup=config.warmup,
                         learning_rate=config.learning_rate, timeout_s=config.timeout_s, launcher=launcher)
    record.update(transport="tf_grpc", model=config.model, compute="real")
    return record_row(record)


def cmd_analyze(args: argparse.Namespace) -> int:
    from bench.runtime.analyzer import format_plan
    from bench.runtime.ps import TrainConfig, plan_of

    if args.model not in MODEL_NAMES and ":" not in args.model:
        print(f"bench analyze: error: unknown model '{args.model}' (known: {', '.join(MODEL_NAMES)})", file=sys.stderr)
        return EXIT_USAGE
    config = TrainConfig(model=args.model, transport="zerocopy", transport_options={}, batch_size=args.batch_size,
                         servers=args.servers)
    try:
        plan = plan_of(config)
    except (ImportError, AttributeError) as exc:
        print(f"bench analyze: error: cannot load model '{args.model}': {_error_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    if args.no_analysis:
        plan = plan.without_analysis()
    print(f"bench analyze: {args.model}, batch {args.batch_size}, {args.servers} server(s)"
          + (" (analysis off)" if args.no_analysis else ""))
    print(format_plan(plan, limit=None if args.all else 40))
    if args.json is not None:
        try:
            args.json.write_text(plan.dumps() + "\n")
        except OSError as exc:
            print(f"bench analyze: error: cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"plan: {args.json}")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from bench.models import cmd_models

    return cmd_models(args)


def cmd_plot(args: argparse.Namespace) -> int:
    from bench.plot import PlotError, plot_run

    try:
        with warnings.catch_warnings():  # matplotlib's complaints about odd values would break the one-line error
            warnings.simplefilter("ignore")
            written = plot_run(args.results_dir)
    except (ResultsError, PlotError) as exc:
        print(f"bench plot: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"bench plot: error: cannot write the figures into {args.results_dir}: {exc.strerror or exc}; "
              "copy the run somewhere writable and plot it there", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError, KeyError) as exc:
        print(f"bench plot: error: the records of {args.results_dir} cannot be drawn ({_error_line(exc)}); "
              "were they edited by hand?", file=sys.stderr)
        return EXIT_USAGE
    for path in written:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    # models given as package.module:ATTRIBUTE are found from the current directory, as with python -m; under
    # MPI every process needs that before the coordinator's first assignment arrives
    sys.path.insert(0, os.getcwd())
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    if hasattr(args, "fabric") and (problem := _fabric_problem(args)):
        print(f"bench {args.command}: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if not hasattr(args, "launcher"):
            return args.func(args)
        from bench.launch import LaunchError, create

        try:
            launcher = create(args.launcher, bind=args.bind, link_rate=args.link_rate)
        except LaunchError as exc:
            print(f"bench {args.command}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        with launcher:
            if not launcher.is_coordinator:  # under MPI: serve the runs the coordinator (rank 0) starts
                return launcher.serve()
            for signum in STOP_SIGNALS:  # SIGTERM and SIGHUP stop a run as Ctrl-C does
                signal.signal(signum, _stop)
            return args.func(args, launcher)
    except KeyboardInterrupt as exc:  # outside a run (its results, if any, are marked by the command)
        name, status = _signal_of(exc)
        print(f"\nbench {args.command}: interrupted by {name}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
