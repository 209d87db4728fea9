"""Send tensors of each size from a sender process to a receiver process, which consumes each with a reduce-max
(the paper's Figure 8). Time per transfer runs from the sender's send() call to the receiver having reduced the
tensor (one system-wide monotonic clock); transfers do not overlap. Records p50/p99/mean time, throughput (MB/s,
MB = 2^20 bytes, from the mean), CPU seconds of each side and payload bytes copied per transfer; every timed
transfer's time goes to samples.csv. With --rounds N every size is measured N times, each transport once per
round in turn, so drift on a busy machine lands on every transport alike; the summary gives each transport's
time relative to zerocopy with its range across the rounds."""

from __future__ import annotations

import argparse
import time
from typing import Any

import transports
from bench import options
from bench.commands.common import disk_full, draw, failed, interrupted, open_run
from bench.options import Choice
from bench.results import DiskError
from bench.results import lines as catalogue
from bench.results.records import MICRO_SOURCES

HELP = "send/receive micro-benchmark between two processes (the paper's Figure 8)"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench micro', 'every transport, peer and reference line, 1KB to 1GB (a few minutes)'),
    ('bench micro --sizes 1KB-1MB --transports zerocopy,grpc_tcp --no-peers', 'two transports, small sizes'),
    ('bench micro --sizes 4KB,4MB --rounds 3', 'three interleaved rounds per size: a spread across rounds'),
    ('bench micro --fabric-transport tcp --contend 2', 'over tcp, every point again beside 2 busy processes'),
    ('mpirun -np 2 bench micro --launcher mpi --sizes 1KB-1MB', 'the two sides as ranks of an MPI job'),
    ('bench micro --sizes 1KB-1MB --peers mpi --calibrate', 'the mpi line beside mpi4py in a plain loop'),
    ('bench micro --memory cuda --sizes 1KB-1GB', 'tensors in GPU memory on both sides (the paper\'s Table 3)'),
)
STARTS_RANKS = True
DEFAULT_SIZES = "1KB-1GB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=options.sizes, default=DEFAULT_SIZES,
                        help="tensor sizes, binary units (1KB = 1024 B): a range A-B stepping x4 (A-B:xN for another "
                        "step), or a list such as 1KB,64KB,1MB")
    parser.add_argument("--transports", type=options.transport_choices, default=None,
                        help=f"comma list of transports (known: {', '.join(transports.names())}); a mode as "
                        "name:mode, e.g. grpc_rdma:direct; default: every one available here (grpc_rdma in both "
                        "modes)")
    parser.add_argument("--iters", type=options.positive_int, default=None,
                        help="timed transfers per size (default: about 2 GiB of traffic per size, 5 to 1000)")
    parser.add_argument("--warmup", type=options.non_negative_int, default=None,
                        help="untimed transfers before each size (default: a tenth of --iters, 1 to 10)")
    parser.add_argument("--rounds", type=options.positive_int, default=1,
                        help="measure every size this many times, interleaved: per size, every transport once, "
                        "then again; records one row per round and the spread across rounds (each round of a "
                        "transport is a fresh pair of processes)")
    parser.add_argument("--extra-copy", type=options.transport_choices, default=[], metavar="TRANSPORTS",
                        help="over these transports the sender copies each tensor once more before sending it: a "
                        "known slow-down (counted as a copy), e.g. to check that 'bench compare' catches one")
    parser.add_argument("--source", choices=MICRO_SOURCES, default="fresh",
                        help="fresh: before each transfer the sender writes its whole tensor, outside the timed "
                        "interval, as a backward pass writes a gradient (training never sends an unchanged tensor); "
                        "reused: the same tensor is sent again, as OSU and nccl-tests measure (default: fresh)")
    options.add_memory_option(parser)
    options.add_timeout(parser, 120.0, "one transfer")
    options.add_fabric_options(parser, "the links of the fabric transports (zerocopy, rdma_cp, grpc_rdma): shm "
                               "(shared memory, cma one-sided copies), tcp (the fabric's own stream, checked at the "
                               "target; also across network namespaces), or auto (UCX chooses among shared memory and "
                               "RDMA); the verbs fabric takes only auto")
    options.add_out(parser, "micro")
    parser.add_argument("--no-references", action="store_true",
                        help="skip the reference lines, measured before the transports: the fabric library's "
                        f"own put bandwidth ({_references('throughput')}, by --fabric: the limit and the denominator "
                        f"of the of_reference column) and put latency up to 1MB ({_references('time')}) over the same "
                        f"links, and the lines of every run ({_references(None)})")
    peers = parser.add_mutually_exclusive_group()
    peers.add_argument("--peers", type=peer_names, default=None, metavar="PEERS",
                       help="comma list of the peer lines to measure (known: "
                       f"{', '.join(catalogue.micro_peers())}; default: every one installed here): the libraries "
                       f"a user could pick instead ({_peer_libraries()}), timed exactly like a transport, measured "
                       "after the reference lines and before the transports; every transport's record carries "
                       "of_peer, its p50 over the best peer's p50 at that size")
    peers.add_argument("--no-peers", action=_NotBoth, help="skip the peer lines")
    parser.add_argument("--calibrate", action=_NotBoth,
                        help="measure beside each peer line its library in a plain loop of its own, the ten lines "
                        f"a user writes ({_calibrations()}): how far the harness is from the library's own cost "
                        "(the harness reference line, in every run, is the harness alone)")
    parser.add_argument("--contend", type=options.non_negative_int, default=0, metavar="N",
                        help="measure every point of every line a second time with N busy processes spinning on "
                        "this machine (another job on a shared machine): each record then also carries "
                        "contended_p50_us, contended_p99_us, contended_of_quiet (contended p50 over quiet p50: "
                        "steadiness) and contended_of_peer; the contended pass writes no samples (default: 0, "
                        "quiet only)")
    options.add_no_plot(parser)
    options.add_launch_options(parser)


def _peer_libraries() -> str:
    """The peer lines ``bench micro`` measures as ``--help`` names them: each one's name in the paper's tables."""
    return ", ".join(catalogue.line(name).paper for name in catalogue.micro_peers())


def _calibrations() -> str:
    """Each peer line and the line of its plain loop (``--calibrate``), from the catalogue: ``mpi: mpi_plain, ...``."""
    return ", ".join(f"{entry.calibrates}: {entry.name}" for entry in catalogue.calibrations())


def _references(figure: str | None) -> str:
    """The catalogue's reference lines of one micro figure (``throughput``: a fabric's bandwidth, ``time``: its
    latency, one per fabric; None: those of every run, calibrations aside), by name."""
    chosen = [entry.name for entry in catalogue.of_kind("reference") if entry.figure == figure and not entry.calibrates]
    return (" or " if figure else ", ").join(chosen)


class _NotBoth(argparse.Action):
    """``--calibrate`` and ``--no-peers``: each a flag, refused together as the command line is read (before anything
    starts), in either order: --calibrate measures each peer line beside its library's plain loop, and with no peer
    line there would be nothing to calibrate, silently."""

    PAIR = ("calibrate", "no_peers")

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        other = next(name for name in self.PAIR if name != self.dest)
        if getattr(namespace, other, False):
            parser.error("--calibrate with --no-peers: --calibrate measures each peer line beside its library's "
                         "plain loop, and --no-peers measures no peer line; drop one of them (--peers NAMES "
                         "chooses the peer lines to calibrate)")
        setattr(namespace, self.dest, True)


def peer_names(text: str) -> list[str]:
    """``--peers``: known peer names, comma separated."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no peer named; pass --no-peers to measure none")
    if unknown := [name for name in names if name not in catalogue.micro_peers()]:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(map(repr, unknown))} (known: "
                                         f"{', '.join(catalogue.micro_peers())})")
    return list(dict.fromkeys(names))


def run(args: argparse.Namespace, launcher: Any) -> int:
    from bench.experiments.micro import plan_points
    from bench.experiments.micro.plan import lines_of, memory_problem
    from transports.memory import HOST

    chosen: list[Choice] = args.transports or options.default_choices()
    slowed = {choice.label for choice in args.extra_copy}
    if stray := slowed - {choice.label for choice in chosen}:
        return options.fail("micro", f"--extra-copy {', '.join(sorted(stray))}: not among the transports measured "
                            f"({', '.join(options.labels(chosen))})")
    # what the run holds, against what is free
    if too_big := memory_problem(args.sizes, options.labels(chosen), slowed, launcher):
        return options.fail("micro", too_big)
    if any(not transports.transport_class(c.name).same_process_only for c in chosen) and (
            problem := launcher.ranks_problem(2, "sender, receiver")):  # a job of too few processes (mpirun -np 1)
        return options.fail("micro", problem)
    memory = args.memory_kinds
    points = plan_points(args.sizes, args.iters, args.warmup, memory, args.source)
    settings = {
        "sizes": [p.size_bytes for p in points],
        "memory": [str(side) for side in memory],
        "transports": options.labels(chosen),
        "iters": {str(p.size_bytes): p.iters for p in points},
        "warmup": {str(p.size_bytes): p.warmup for p in points},
        "rounds": args.rounds,
        "extra_copy": sorted(slowed),
        "source": args.source,
        "peers": [] if args.no_peers else (args.peers or list(catalogue.micro_peers())),
        "contend": args.contend,
        "calibrate": args.calibrate,
        "timeout_s": args.timeout,
        **options.fabric_settings(args, launcher),
    }
    writer = open_run(args.out, "micro", settings, launcher)
    if writer is None:
        return options.EXIT_USAGE
    out = writer.path
    from bench.ground.sizes import format_size

    span = f"{format_size(points[0].size_bytes)}..{format_size(points[-1].size_bytes)}"
    print(f"bench micro: {len(points)} sizes ({span}) over {', '.join(options.labels(chosen))}"
          + (f", {args.rounds} rounds interleaved" if args.rounds > 1 else "")
          + (f", each point again beside {args.contend} busy processes" if args.contend else "")
          + (f", tensors in {memory[0]} -> {memory[1]} memory" if memory != (HOST, HOST) else "")
          + f", source {args.source}, launcher {launcher.name} -> {out}",
          flush=True)  # before any line on stderr, in a log too
    from bench.experiments.micro.sweep import Sweep, SweepSettings

    sweep = Sweep(SweepSettings(args.rounds, args.contend, args.timeout, memory), launcher, writer,
                  lines_of(args, launcher, chosen, slowed))
    sweep.say_left_out(out)
    started = time.monotonic()
    try:
        sweep.measure(points)
        writer.finish("failed" if sweep.failures else "complete", failures=sweep.failures, fabric=sweep.fabrics,
                      elapsed_s=round(time.monotonic() - started, 1), launcher=launcher.describe(),
                      left_out=sweep.left_out)
    except KeyboardInterrupt as exc:
        return interrupted(writer, "micro", "the points finished", exc, failures=sweep.failures,
                           fabric=sweep.fabrics, launcher=launcher.describe(), left_out=sweep.left_out)
    except DiskError as exc:  # a full or failing disk: one line, the run marked failed, its points kept
        return disk_full(writer, "micro", exc, sweep.failures, fabric=sweep.fabrics, launcher=launcher.describe(),
                         left_out=sweep.left_out)
    except BaseException as exc:
        failed(writer, sweep.failures, exc, fabric=sweep.fabrics, launcher=launcher.describe(),
               left_out=sweep.left_out)
        raise
    finally:
        sweep.close()
    from bench.readers.summary import print_micro

    print_micro(out)
    if not args.no_plot:
        draw(out, "micro")
    return 1 if sweep.failures else 0
