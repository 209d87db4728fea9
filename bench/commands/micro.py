"""Send tensors of each size from a sender process to a receiver process, which consumes each with a reduce-max
(the paper's Figure 8). Time per transfer runs from the sender's send() call to the receiver having reduced the
tensor (one system-wide monotonic clock); transfers do not overlap. Records p50/p99/mean time, throughput (MB/s,
MB = 2^20 bytes, from the mean), CPU seconds of each side and payload bytes copied per transfer; every timed
transfer's time goes to samples.csv. With --rounds N every size is measured N times, each transport once per
round in turn, so drift on a busy machine lands on every transport alike; the summary gives each transport's
time relative to zerocopy with its range across the rounds."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import transports
from bench import options
from bench.commands.common import BASELINE, disk_full, draw, failed, interrupted, open_run, print_relative
from bench.options import Choice
from bench.results import DiskError
from bench.results import lines as catalogue

HELP = "send/receive micro-benchmark between two processes (the paper's Figure 8)"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench micro', 'every transport, peer and reference line, 1KB to 1GB (a few minutes)'),
    ('bench micro --sizes 1KB-1MB --transports zerocopy,grpc_tcp --no-peers', 'two transports, small sizes'),
    ('bench micro --sizes 4KB,4MB --rounds 3', 'three interleaved rounds per size: a spread across rounds'),
    ('bench micro --fabric-transport tcp --contend 2', 'over tcp, every point again beside 2 busy processes'),
    ('mpirun -np 2 bench micro --launcher mpi --sizes 1KB-1MB', 'the two sides as ranks of an MPI job'),
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
                       f"{', '.join(catalogue.names('peer'))}; default: every one installed here): the libraries "
                       "a user could pick instead (MPI two-sided and one-sided, NVIDIA NIXL, a plain TCP socket), "
                       "timed exactly like a transport, measured after the reference lines and before the "
                       "transports; every transport's record carries of_peer, its p50 over the best peer's p50 at "
                       "that size")
    peers.add_argument("--no-peers", action="store_true", help="skip the peer lines")
    parser.add_argument("--contend", type=options.non_negative_int, default=0, metavar="N",
                        help="measure every point of every line a second time with N busy processes spinning on "
                        "this machine (another job on a shared machine): each record then also carries "
                        "contended_p50_us, contended_p99_us, contended_of_quiet (contended p50 over quiet p50: "
                        "steadiness) and contended_of_peer; the contended pass writes no samples (default: 0, "
                        "quiet only)")
    options.add_no_plot(parser)
    options.add_launch_options(parser)


def peer_names(text: str) -> list[str]:
    """``--peers``: known peer names, comma separated."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no peer named; pass --no-peers to measure none")
    if unknown := [name for name in names if name not in catalogue.names("peer")]:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(map(repr, unknown))} (known: "
                                         f"{', '.join(catalogue.names('peer'))})")
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

    chosen: list[Choice] = args.transports or options.default_choices()
    slowed = {choice.label for choice in args.extra_copy}
    if stray := slowed - {choice.label for choice in chosen}:
        return options.fail("micro", f"--extra-copy {', '.join(sorted(stray))}: not among the transports measured "
                            f"({', '.join(options.labels(chosen))})")
    if too_big := memory_problem(args.sizes, chosen, slowed, launcher):  # what the run holds, against what is free
        return options.fail("micro", too_big)
    points = plan_points(args.sizes, args.iters, args.warmup)
    settings = {
        "sizes": [p.size_bytes for p in points],
        "transports": options.labels(chosen),
        "iters": {str(p.size_bytes): p.iters for p in points},
        "warmup": {str(p.size_bytes): p.warmup for p in points},
        "rounds": args.rounds,
        "extra_copy": sorted(slowed),
        "peers": [] if args.no_peers else (args.peers or list(catalogue.names("peer"))),
        "contend": args.contend,
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
          + f", launcher {launcher.name} -> {out}", flush=True)  # before any line on stderr, in a log too
    sweep = Sweep(args, launcher, writer, lines_of(args, launcher, chosen, slowed))
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


def lines_of(args: argparse.Namespace, launcher: Any, chosen: list[Choice], slowed: set[str]) -> list[Any]:
    """The run's lines, in the order they are measured: the reference lines of its fabric (unless
    --no-references: of_reference needs each size's bandwidth reference first), the peer lines (unless
    --no-peers: of_peer needs each size's best peer first), then the transports."""
    from bench.experiments.micro import TransportLine
    from bench.experiments.peers import peer_lines
    from bench.experiments.reference import reference_lines

    lines: list[Any] = []
    if not args.no_references:
        lines += reference_lines(args.fabric, launcher.fabric_transport(args.fabric_transport), args.timeout)
    if not args.no_peers:
        lines += peer_lines(args.peers, args.timeout)
    for choice in chosen:
        lines.append(TransportLine(choice.label, choice.constructor_options(args, launcher),
                                   extra_copies=1 if choice.label in slowed else 0))
    return lines


class Sweep:
    """The measurements of one ``bench micro`` run: every line at every size (in rounds when asked), each record
    (and its samples) written as it is measured. It asks a line what it can do, never what it is called."""

    def __init__(self, args: argparse.Namespace, launcher: Any, writer: Any, lines: list[Any]) -> None:
        self.args, self.launcher, self.writer = args, launcher, writer
        self.failures: list[str] = []
        self.failed: set[str] = set()  # the lines that failed: not tried again in later rounds
        self.fabrics: dict[str, str] = {}
        self.reference_MBps: dict[int, float] = {}
        self.best_peer_p50_us: dict[tuple[int, int], float] = {}  # (size, round) -> the lowest p50 of a peer line
        self.best_peer_contended_p50_us: dict[tuple[int, int], float] = {}  # the same, with --contend
        self.lines: list[Any] = []
        self.hosts: dict[str, Any] = {}  # line name -> where its ranks run (PrivateHosts)
        self.left_out: dict[str, str] = {}  # an optional line (a reference, a peer) that cannot run here -> why
        for line in lines:
            self._admit(line)

    def _admit(self, line: Any) -> None:
        """Keep ``line`` if it can run here and under the launcher; an optional line (a reference, a peer) that
        cannot is left out, and why is kept for ``say_left_out`` and meta.json (a transport cannot fail so: the
        command checked the transports before)."""
        from bench.launch import LaunchError

        status = line.availability()
        why = None if status.ok else status.reason
        if why is None:
            try:
                self.hosts[line.name] = line.hosts(self.launcher)
            except LaunchError as exc:
                why = str(exc)
        if why is None:
            self.lines.append(line)
        elif line.required:
            self._fail(line, why)
        else:
            self.left_out[line.name] = why

    def say_left_out(self, out: Path) -> None:
        """One line naming the optional lines that cannot run here, and where it says why and how to add each."""
        if self.left_out:
            print(f"bench micro: not available here, left out: {', '.join(self.left_out)} (why, and how to add "
                  f"each: 'left_out' in {out / 'meta.json'}; --no-peers, --no-references to skip them)",
                  file=sys.stderr)

    def close(self) -> None:
        """Release the hosts made for lines (a private emulated host)."""
        for hosts in self.hosts.values():
            if hosts.own:
                hosts.launcher.close()
        self.hosts.clear()

    def measure(self, points: list) -> None:
        """Every line at every point: one launch per line over all sizes, or with --rounds or --contend, per size
        every line once per round (a launch each, and one more beside the busy processes), round after round."""
        from tqdm import tqdm

        from bench.ground.sizes import format_size

        rounds, passes = self.args.rounds, 2 if self.args.contend else 1
        total = sum(p.warmup + p.iters for line in self.lines for p in line.points(points))
        with tqdm(total=total * rounds * passes, unit="xfer", dynamic_ncols=True, disable=None) as bar:
            if rounds == 1 and passes == 1:
                for line in self.lines:
                    started = time.monotonic()
                    self._run(line, line.points(points), 1, bar)
                    self._log_progress(bar, f"{line.name}: {len(line.points(points))} sizes", started)
                return
            for point in points:
                started = time.monotonic()
                for round_ in range(1, rounds + 1):
                    for line in self.lines:
                        if not (mine := line.points([point])):
                            continue
                        if line.name in self.failed:
                            bar.update((point.warmup + point.iters) * passes)  # it failed before: not tried again
                            continue
                        self._run(line, mine, round_, bar)
                self._log_progress(bar, f"{format_size(point.size_bytes)}: every line, {rounds} round(s)", started)

    @staticmethod
    def _log_progress(bar: Any, what: str, started: float) -> None:
        """Where no progress bar is drawn (output to a file or a pipe: a log), a line for each part done."""
        if bar.disable:
            print(f"bench micro: {what} done in {time.monotonic() - started:.0f} s", flush=True)

    def _run(self, line: Any, points: list, round_: int, bar: Any) -> None:
        """``line`` at ``points`` in round ``round_``, each record written once measured; with --contend (one
        point at a time, then) the point again beside the busy processes before its record is written."""
        if not self.args.contend:
            self._pass(line, points, round_, bar, lambda record, times: self._add(line, record, times))
            return
        from bench.ground.contention import busy_processes

        quiet: list = []
        self._pass(line, points, round_, bar, lambda record, times: quiet.append((record, times)))
        contended: dict[int, Any] = {}
        if quiet:
            with busy_processes(self.args.contend):
                self._pass(line, points, round_, bar, lambda record, times: contended.setdefault(record.size_bytes,
                                                                                                  record),
                           " contended")
        for record, times in quiet:
            self._add(line, record, times, contended.get(record.size_bytes))

    def _pass(self, line: Any, points: list, round_: int, bar: Any, keep: Any, phase: str = "") -> None:
        """One launch of ``line`` over ``points``: ``keep(record, times)`` for each point measured."""
        from bench.experiments.micro import MicroError, make_record, run_line, transfer_times
        from bench.ground.sizes import format_size

        base = bar.n
        done_before = {p.size_bytes: sum(q.warmup + q.iters for q in points if q.size_bytes < p.size_bytes)
                       for p in points}
        where = (f" round {round_}" if self.args.rounds > 1 else "") + phase
        bar.set_postfix_str(f"{line.name}{where}")

        def progress(size: int, n: int) -> None:
            bar.set_postfix_str(f"{line.name} {format_size(size)}{where}")
            bar.update(base + done_before[size] + n - bar.n)

        def on_sides(point: Any, sender: Any, receiver: Any) -> None:
            times = transfer_times(sender, receiver)
            keep(make_record(line.name, point, sender, receiver, round_, times), times)

        def on_record(point: Any, record: Any) -> None:
            record.round = round_
            keep(record, None)
            progress(point.size_bytes, point.warmup + point.iters)

        try:
            run_line(line, points, self.hosts[line.name].launcher, self.args.timeout, on_sides, on_record, progress)
        except MicroError as exc:
            if line.required:
                self._fail(line, str(exc), bar)
            else:
                self.failed.add(line.name)
                bar.write(f"bench micro: warning: no {line.name} line: {exc}", file=sys.stderr)
        bar.update(base + sum(p.warmup + p.iters for p in points) - bar.n)

    def _add(self, line: Any, record: Any, times: Any, contended: Any = None) -> None:
        """Write a record (and its samples), its throughput set against the bandwidth reference of its size and
        (a transport's) its p50 against the best peer's at its size and round; with --contend, what the
        ``contended`` record of the same point measured, set against the quiet p50 and the best peer's."""
        from bench.results import of_peer, of_reference

        if line.bandwidth_reference:
            self.reference_MBps[record.size_bytes] = record.throughput_MBps
        record.of_reference = of_reference(record.throughput_MBps, self.reference_MBps.get(record.size_bytes))
        at = (record.size_bytes, record.round)
        if contended is not None:
            record.contend = self.args.contend
            record.contended_p50_us, record.contended_p99_us = contended.p50_us, contended.p99_us
            record.contended_of_quiet = of_peer(contended.p50_us, record.p50_us)  # the same ratio, to the quiet p50
        if line.time_reference and record.p50_us is not None and record.p50_us > 0:
            self.best_peer_p50_us[at] = min(record.p50_us, self.best_peer_p50_us.get(at, float("inf")))
            if record.contended_p50_us is not None and record.contended_p50_us > 0:
                self.best_peer_contended_p50_us[at] = min(record.contended_p50_us,
                                                          self.best_peer_contended_p50_us.get(at, float("inf")))
        elif line.required:
            record.of_peer = of_peer(record.p50_us, self.best_peer_p50_us.get(at))
            record.contended_of_peer = of_peer(record.contended_p50_us, self.best_peer_contended_p50_us.get(at))
        self.writer.add(record)
        if times is not None:
            self.writer.add_samples(record, times)
        self.fabrics[line.name] = record.fabric

    def _fail(self, line: Any, why: str, bar: Any = None) -> None:
        self.failures.append(why)
        self.failed.add(line.name)
        (bar.write if bar is not None else print)(f"bench micro: error: {why}", file=sys.stderr)


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
    print(f"\nresults: {out} (every column of every point: records.csv)")


def _finite(value: Any) -> bool:
    return value is not None and value == value  # NaN: not measured


def _short(value: Any, digits: int | None = None) -> str:
    """A time for a table: three significant digits or so, '-' where nothing was measured."""
    if not _finite(value):
        return "-"
    if digits is not None:  # a ratio: small ones keep a digit that is not zero
        return f"{value:.{digits + 1 if value < 0.1 else digits}f}"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:,.0f}"
