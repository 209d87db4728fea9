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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import transports
from bench import options
from bench.commands.common import BASELINE, disk_full, draw, failed, interrupted, open_run, print_relative
from bench.options import Choice
from bench.results import DiskError
from bench.results import lines as catalogue
from bench.results.records import MICRO_SOURCES

if TYPE_CHECKING:
    from bench.experiments.micro import MicroLine

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
                        help="skip the reference lines, measured before the transports: the fabric library's own "
                        "put bandwidth (ucx_perftest ucp_put_bw, or ib_write_bw on --fabric verbs: the limit and the "
                        "denominator of the of_reference column) and put latency up to 1MB (ucp_put_lat or "
                        "ib_write_lat) over the same links, and memcpy in one process")
    peers = parser.add_mutually_exclusive_group()
    peers.add_argument("--peers", type=peer_names, default=None, metavar="PEERS",
                       help="comma list of the peer lines to measure (known: "
                       f"{', '.join(catalogue.micro_peers())}; default: every one installed here): the libraries "
                       "a user could pick instead (MPI two-sided and one-sided, NVIDIA NIXL, Mooncake, a plain TCP "
                       "socket, PyTorch's torch.distributed over gloo and its RPC over TensorPipe), timed exactly "
                       "like a transport, measured after the reference lines and before the "
                       "transports; every transport's record carries of_peer, its p50 over the best peer's p50 at "
                       "that size")
    peers.add_argument("--no-peers", action=_NotBoth, help="skip the peer lines")
    parser.add_argument("--calibrate", action=_NotBoth,
                        help="measure beside each peer line its library in a plain loop of its own, the ten lines "
                        "a user writes (mpi: mpi_plain, mpi_rma: mpi_rma_plain, socket: socket_plain, nixl: "
                        "nixl_plain, mooncake: mooncake_plain, torch_gloo: torch_gloo_plain, torch_rpc: "
                        "torch_rpc_plain): how far the harness is from the library's own cost "
                        "(the harness reference line, in every run, is the harness alone)")
    parser.add_argument("--contend", type=options.non_negative_int, default=0, metavar="N",
                        help="measure every point of every line a second time with N busy processes spinning on "
                        "this machine (another job on a shared machine): each record then also carries "
                        "contended_p50_us, contended_p99_us, contended_of_quiet (contended p50 over quiet p50: "
                        "steadiness) and contended_of_peer; the contended pass writes no samples (default: 0, "
                        "quiet only)")
    options.add_no_plot(parser)
    options.add_launch_options(parser)


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


#: launchers that start every rank on this host (a job's launchers, mpi and slurm, start one rank per process)
_ALL_RANKS_HERE = frozenset({"local", "netns"})


def memory_needed(size: int, labels: list[str], slowed: set[str], both_sides: bool = True) -> tuple[int, str]:
    """The bytes a point of ``size`` has allocated at once at its most (the line that holds the most), on this
    host: the sender's tensor and the receiver's (one side with ``both_sides`` False), a copy of each on a line
    that copies (the catalogue's ``copying``), the sender's scratch tensor on a line with ``--extra-copy``; and which
    line that is."""
    def held(label: str) -> int:
        per_side = 1 + (1 if catalogue.line(label).copying else 0)
        return per_side * (2 if both_sides else 1) + (1 if label in slowed else 0)

    worst = max(labels, key=held, default="memcpy")
    return max(held(worst), 2 if both_sides else 1) * size, worst


def memory_problem(sizes: list[int], chosen: list[Choice], slowed: set[str], launcher: Any) -> str | None:
    """Why the largest size cannot be measured with the memory available now (``MemAvailable``), before any rank
    starts; None when it fits or the memory available cannot be read."""
    from bench.ground.memory import available_memory_bytes
    from bench.ground.sizes import format_size

    available = available_memory_bytes()
    if available is None or not sizes:
        return None
    here = getattr(launcher, "name", "local") in _ALL_RANKS_HERE
    needed, line = memory_needed(max(sizes), options.labels(chosen), slowed, both_sides=here)
    if needed <= available:
        return None
    held = "the sender's and the receiver's tensor" if here else "this rank's tensor"
    if catalogue.line(line).copying:
        held += f" and {line}'s copy of {'each' if here else 'it'}"
    if line in slowed:
        held += " and the --extra-copy scratch tensor"
    return (f"--sizes: a {format_size(max(sizes))} transfer holds about {needed / 2**30:.1f} GB at once ({held}), "
            f"but {available / 2**30:.1f} GB of memory is available now (MemAvailable); choose smaller sizes or free "
            "memory")


def run(args: argparse.Namespace, launcher: Any) -> int:
    from bench.experiments.micro import plan_points
    from transports.memory import HOST

    chosen: list[Choice] = args.transports or options.default_choices()
    slowed = {choice.label for choice in args.extra_copy}
    if stray := slowed - {choice.label for choice in chosen}:
        return options.fail("micro", f"--extra-copy {', '.join(sorted(stray))}: not among the transports measured "
                            f"({', '.join(options.labels(chosen))})")
    if too_big := memory_problem(args.sizes, chosen, slowed, launcher):  # what the run holds, against what is free
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
    print_summary(out)
    if not args.no_plot:
        draw(out, "micro")
    return 1 if sweep.failures else 0


def lines_of(args: argparse.Namespace, launcher: Any, chosen: list[Choice], slowed: set[str]) -> list[MicroLine]:
    """The run's lines, in the order they are measured: the reference lines of its fabric (unless
    --no-references: of_reference needs each size's bandwidth reference first), the peer lines (unless
    --no-peers: of_peer needs each size's best peer first), then the transports."""
    from bench.experiments.micro import TransportLine
    from bench.experiments.peers import calibration_lines, peer_lines
    from bench.experiments.references import reference_lines

    lines: list[MicroLine] = []
    if not args.no_references:
        lines += reference_lines(args.fabric, launcher.fabric_transport(args.fabric_transport), args.timeout)
    if not args.no_peers:
        lines += peer_lines(args.peers, args.timeout)
        if args.calibrate:
            lines += calibration_lines(args.peers, args.timeout)
    for choice in chosen:
        lines.append(TransportLine(choice.label, choice.constructor_options(args, launcher),
                                   extra_copies=1 if choice.label in slowed else 0))
    return lines


def print_summary(out: Path) -> None:
    """What people read of a run: the p50 of every line at every size in one table (sizes down, lines across;
    rounds folded into their median; again beside the busy processes with --contend), then each transport's time
    relative to zerocopy's at the same size, with its range, and zerocopy's over the best peer's. Every column of
    every point is in records.csv."""
    from bench.ground.sizes import format_size
    from bench.results import ResultsError, load_run

    try:
        run = load_run(out)
    except ResultsError:
        return
    points = run.points()
    if not len(points):
        print(f"\nresults: {out}")
        return
    rounds = int(points["rounds"].max())
    sizes = list(dict.fromkeys(points["size_bytes"]))
    cell = {(row.transport, row.size_bytes): row for row in points.itertuples()}
    timed = [name for name in dict.fromkeys(points["transport"])  # put_bw has no per-transfer time
             if any(_finite(getattr(cell.get((name, size)), "p50_us", None)) for size in sizes)]
    contend = int(points["contend"].max()) if "contend" in points and points["contend"].notna().any() else 0
    columns = [("p50_us", f"p50 µs per transfer{f' (median of {rounds} rounds)' if rounds > 1 else ''}")]
    if contend:
        columns.append(("contended_p50_us", f"p50 µs beside {contend} busy processes"))
    for column, title in columns:
        print(f"\n{title}:")
        widths = [max(len(name), 8) for name in timed]
        print(f"{'size':>6}  " + "  ".join(f"{name:>{width}}" for name, width in zip(timed, widths, strict=True)))
        for size in sizes:
            values = [_short(getattr(cell.get((name, size)), column, None)) for name in timed]
            print(f"{format_size(int(size)):>6}  "
                  + "  ".join(f"{value:>{width}}" for value, width in zip(values, widths, strict=True)))
    baseline = list(points.loc[points["transport"] == BASELINE, "size_bytes"])
    others = [t for t in dict.fromkeys(points["transport"])
              if t != BASELINE and t.partition(":")[0] in transports.REGISTRY]  # transports, not reference lines
    # zerocopy against the best peer (p50 over p50) and the fabric library's put bandwidth (throughput fraction)
    headings = {"of_peer": f"{BASELINE} / best peer", "of_reference": f"{BASELINE} of put bw"}
    extra = tuple((heading, lambda rows, column=column: _short(rows[BASELINE].get(column), 2))
                  for column, heading in headings.items()
                  if column in points and points.loc[points["transport"] == BASELINE, column].notna().any())
    if baseline and (others or extra):
        what = "range across rounds" if rounds > 1 else "range: 95% interval of each median"
        print_relative(f"time per transfer relative to {BASELINE} (p50 / {BASELINE}'s p50; {what})",
                       "size", [(format_size(int(size)), {row.transport: row._asdict() for row in points[
                           points["size_bytes"] == size].itertuples()}) for size in baseline],
                       others, BASELINE, "p50_us", extra)
    if line := _crossings_line(points):
        print(f"\n{line}")
    print(f"\nresults: {out} (every column of every point: records.csv)")


def _crossings_line(points: Any) -> str:
    """For a run on device memory: where the tensors lived, and each line's crossings of the bus per transfer
    (device to host plus host to device, both sides, over the size: 2 is staged through the host at each end)."""
    if "sender_memory" not in points or "host_to_device_bytes_per_transfer" not in points:
        return ""
    device = points[(points["sender_memory"] != "host") | (points["receiver_memory"] != "host")]
    if not len(device):
        return ""
    first = device.iloc[0]
    crossings = {}
    for row in device.itertuples():
        moved = (row.device_to_host_bytes_per_transfer, row.host_to_device_bytes_per_transfer)
        if all(_finite(value) for value in moved) and row.size_bytes:
            crossings.setdefault(row.transport, []).append(sum(moved) / row.size_bytes)
    counted = ", ".join(f"{name} {max(values):g}" for name, values in crossings.items())
    return (f"tensors in {first.sender_memory} -> {first.receiver_memory} memory; crossings of the bus per "
            f"transfer (2: staged through host memory at both ends, 0: device to device): {counted or 'none counted'}")


def _finite(value: Any) -> bool:
    return value is not None and value == value  # NaN: not measured


def _short(value: Any, digits: int | None = None) -> str:
    """A time for a table: three significant digits or so, '-' where nothing was measured."""
    if not _finite(value):
        return "-"
    if digits is not None:  # a ratio: small ones keep a digit that is not zero
        return f"{value:.{digits + 1 if value < 0.1 else digits}f}"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:,.0f}"
