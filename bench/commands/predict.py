"""Predict the step time, throughput and scaling efficiency of training MODEL on 1 to 256 servers over each transport
and link rate, from a `bench micro` run of this machine (--from, or a short one made first) and the model's plan:
each transfer costs its measured host time plus its bytes on the link, and a parameter-server step is simulated
event by event (every host one NIC and its cores). Nothing is trained: the records are of kind 'predicted'. The
summary says, per line, the fractions of a step that are compute, host work, wire and waiting, and which resource
saturates first, and at how many servers. Compute: --compute paper waits the paper's Table 2 time (a P100 GPU)
times the batch size; replay the step measured here once."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from bench import options
from bench.commands.common import add_framework_option, disk_full, draw, failed, interrupted, open_run
from bench.experiments.predict import grid
from bench.results import DiskError
from bench.results.records import PredictRecord

HELP = "predicted throughput at 1 to 256 servers and 10 to 400 Gb/s links, per transport, from a micro run"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ("bench predict --from results/micro-<time> --compute paper",
     "the paper's six models, four transports, 1 to 256 servers, 10, 100 and 400 Gb/s"),
    ("bench predict vgg16 --from results/micro-<time> --servers 1,2,4,8 --link-rate 100gbit --compute paper",
     "VGG16 on the paper's cluster (100 Gb/s, P100 compute): Figure 11 predicted"),
)
STARTS_RANKS = False

#: the optional part of the install it needs (checked before anything starts): the framework that builds the model
EXTRAS = ("models",)


def link_rates(text: str) -> list[grid.LinkRate]:
    """``--link-rate``: a comma list of rates as ``--launcher netns`` takes one (``10gbit,100gbit``), each once."""
    from bench.ground.sizes import parse_rate

    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected a link rate or a comma list of them, e.g. 10gbit,100gbit, got "
                                         f"'{text}'")
    try:
        return list(dict.fromkeys(grid.LinkRate(part, parse_rate(part)) for part in parts))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def server_counts(text: str) -> list[int]:
    """``--servers``: a comma list of server counts, 1 to :data:`grid.MAX_SERVERS`."""
    counts = options.int_list(text)
    if (large := [n for n in counts if n > grid.MAX_SERVERS]):
        raise argparse.ArgumentTypeError(f"{large[0]} servers is more than the {grid.MAX_SERVERS} a prediction takes; "
                                         f"give at most {grid.MAX_SERVERS}")
    return counts


def oversubscription(text: str) -> float:
    """``--oversubscription``: the switch's ratio, ``4`` or ``4:1``, at least 1 (1: non-blocking)."""
    over, _, under = text.partition(":")
    try:
        ratio = float(over) / float(under or 1)
    except (ValueError, ZeroDivisionError):
        ratio = math.nan
    if not math.isfinite(ratio) or ratio < 1:
        raise argparse.ArgumentTypeError(f"expected a ratio of at least 1, e.g. 4 or 4:1 (1: a non-blocking switch), "
                                         f"got '{text}'")
    return ratio


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.ground.paper import SCALE_BATCH_SIZE

    parser.add_argument("models", nargs="?", type=options.model_list, default=None, metavar="MODEL[,MODEL]",
                        help="which models (default: the paper's six)")
    parser.add_argument("--transport", "--transports", dest="transports", type=_transports,
                        default=list(grid.DEFAULT_TRANSPORTS),
                        help=f"comma list of transports, each measured in the micro run (default: "
                        f"{','.join(grid.DEFAULT_TRANSPORTS)})")
    parser.add_argument("--servers", dest="server_counts", type=server_counts,
                        default=list(grid.DEFAULT_SERVERS),
                        help=f"comma list of server counts, each a worker and a parameter server on a host of its "
                        f"own, up to {grid.MAX_SERVERS} (default: {','.join(map(str, grid.DEFAULT_SERVERS))})")
    parser.add_argument("--link-rate", dest="link_rates", type=link_rates, default=grid.DEFAULT_LINK_RATES,
                        metavar="RATE[,RATE]",
                        help=f"comma list of link rates, as --launcher netns takes one, e.g. 10gbit, 500mbit: each "
                        f"host's NIC, full duplex, a non-blocking switch (default: {grid.DEFAULT_LINK_RATES})")
    parser.add_argument("--from", dest="micro_run", type=options.output_path, default=None, metavar="RUN",
                        help="the bench micro run of this machine the transfers' costs come from (results/micro-...; "
                        "it must have every --transport at sizes spanning the model's tensors; default: a short one "
                        "made now at the sizes the models need, into micro/ of this run)")
    parser.add_argument("--compute", choices=list(grid.COMPUTE_MODES), default="replay",
                        help="replay: one worker's step measured here once; paper: the paper's Table 2 time per "
                        "sample (a P100 GPU) times the batch size")
    parser.add_argument("--compute-from", type=options.output_path, default=None, metavar="RUN",
                        help="with --compute replay: take each model's compute seconds per step from a bench scale "
                        "or bench model run of it with replayed compute (the median of its records'), instead of "
                        "timing the step again: to check the predictions against that run's communication alone")
    parser.add_argument("--batch-size", type=options.positive_int, default=SCALE_BATCH_SIZE,
                        help=f"per-worker mini-batch size (default {SCALE_BATCH_SIZE}, the paper's Figure 11)")
    parser.add_argument("--cores-per-host", type=options.positive_int, default=None, metavar="N",
                        help=f"each host's cores for host work (its worker's and its parameter server's transfers "
                        f"and applies; default {PredictRecord.DEFAULT_CORES_PER_HOST})")
    parser.add_argument("--shared-cores", type=options.positive_int, default=None, metavar="N",
                        help="every host's work on one pool of N cores: hosts emulated on one machine, as bench "
                        "scale --launcher netns runs them; to predict this machine's netns runs, give this machine's "
                        f"cores (here --shared-cores {len(os.sched_getaffinity(0))}); not with --cores-per-host")
    parser.add_argument("--oversubscription", type=oversubscription, default=1.0, metavar="X",
                        help="the switch's oversubscription, 4 or 4:1: its bisection carries servers / X links at "
                        "once (default 1: non-blocking)")
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="asynchronous parameter servers: each worker's gradient applied as it comes and the "
                        "values sent back to that worker alone (default: synchronous)")
    add_framework_option(parser)
    options.add_out(parser, "predict")
    options.add_no_plot(parser)


def _transports(text: str) -> list[str]:
    """``--transport``: a comma list of names, each once (checked against the micro run, which has the costs)."""
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of transports, e.g. zerocopy,grpc_tcp, got '{text}'")
    return names


def run(args: argparse.Namespace) -> int:
    from bench.experiments.models import MODELS, get_model
    from bench.experiments.predict.costs import costs_from_run

    problem = options.run_dir_problem(args.out)
    if problem is not None:
        return options.fail("predict", problem)
    if args.shared_cores is not None and args.cores_per_host is not None:
        return options.fail("predict", "--shared-cores and --cores-per-host exclude each other: give --shared-cores "
                            "for hosts emulated on one machine (netns), --cores-per-host for a cluster's hosts")
    cluster = {"cores_per_host": args.cores_per_host, "shared_cores": args.shared_cores,
               "oversubscription": args.oversubscription}
    cluster = {name: value for name, value in cluster.items() if value is not None}
    described = PredictRecord.describe_cluster(**cluster, asynchronous=args.asynchronous)
    try:
        names = [get_model(name, framework=args.framework).name if ":" not in name else name
                 for name in (args.models or MODELS)]
        if args.micro_run is not None:
            costs = costs_from_run(args.micro_run, args.transports)
        else:  # measured once the plans say which sizes: each transport known and available here first
            for name in args.transports:
                options.choose(name)
        if args.compute == "paper":
            for name in names:
                grid.paper_compute_s(name, args.framework, args.batch_size)
        if args.compute_from is not None and args.compute != "replay":
            raise ValueError(f"--compute-from takes a run's replayed compute: it goes with --compute replay, not "
                             f"{args.compute}")
        measured = {name: grid.measured_compute_s(str(args.compute_from), name, args.framework, args.batch_size)
                    for name in names} if args.compute_from is not None else {}
    except (ValueError, argparse.ArgumentTypeError) as exc:
        return options.fail("predict", str(exc).splitlines()[0])
    micro_run = str(args.micro_run) if args.micro_run is not None else "a bench micro run made now"
    print(f"bench predict: {len(names)} model(s) x {len(args.transports)} transport(s) x "
          f"{len(args.server_counts)} server count(s) x {len(args.link_rates)} link rate(s), costs from {micro_run}; "
          f"analysing the models ({args.framework}, batch size {args.batch_size}, compute {args.compute}"
          f"{', ' + described if described else ''})", flush=True)
    def analysed_model(name: str) -> grid.ModelPlan:
        return grid.analyse(name, args.framework, args.batch_size, args.compute, measured.get(name))

    try:  # the first model analysed before anything is written; the others as the simulations of it run
        first = analysed_model(names[0])
    except ValueError as exc:
        return options.fail("predict", str(exc).splitlines()[0])
    settings = {"models": names, "transports": args.transports, "servers": args.server_counts,
                "link_rates": [rate.text for rate in args.link_rates], "compute": args.compute,
                "framework": args.framework, "batch_size": args.batch_size,
                "micro_run": str(args.micro_run) if args.micro_run is not None else "micro (made now)",
                "compute_from": str(args.compute_from) if args.compute_from is not None else None,
                "cores_per_host": args.cores_per_host or PredictRecord.DEFAULT_CORES_PER_HOST,
                "shared_cores": args.shared_cores, "oversubscription": args.oversubscription,
                "asynchronous": args.asynchronous}
    writer = open_run(args.out, "predict", settings)
    if writer is None:
        return options.EXIT_USAGE
    if args.micro_run is None:
        micro_run = str(writer.path / "micro")
        models = [first, *(analysed_model(name) for name in names[1:])]
        problem = measure_costs(writer.path / "micro", args.transports, grid.micro_sizes([m.plan for m in models]))
        if problem is None:
            try:
                costs = costs_from_run(micro_run, args.transports)
            except ValueError as exc:
                problem = str(exc).splitlines()[0]
        if problem is not None:
            writer.finish("failed", failures=[problem])
            print(f"bench predict: error: {problem}", file=sys.stderr)
            return 1
    else:
        models = None
    records = []
    try:
        from tqdm import tqdm

        def analysed():
            yield first
            for name in names[1:]:
                yield analysed_model(name)

        total = grid.grid_size(len(names), list(costs), args.server_counts, args.link_rates)
        with tqdm(total=total, unit="step", desc="simulating", dynamic_ncols=True, disable=None) as bar:
            for record in grid.predict(models or analysed(), costs, args.server_counts, args.link_rates, micro_run,
                                       on_prediction=bar.update, processes=len(os.sched_getaffinity(0)),
                                       asynchronous=args.asynchronous, **cluster):
                writer.add(record)
                records.append(record)
    except DiskError as exc:
        return disk_full(writer, "predict", exc, [])
    except KeyboardInterrupt as exc:
        return interrupted(writer, "predict", "the predictions", exc)
    except BaseException as exc:
        failed(writer, [], exc)
        raise
    writer.finish("complete")
    summary(records, list(costs))
    if not args.no_plot:
        draw(writer.path, "predict")
    print(f"results: {writer.path}")
    return 0


def measure_costs(out: Path, transports: list[str], sizes: list[int]) -> str | None:
    """A short ``bench micro`` of ``transports`` at ``sizes`` into ``out`` (its progress shown as it goes); None, or
    why it failed in one line."""
    import subprocess

    from bench.ground.sizes import format_size

    command = [sys.executable, "-m", "bench.cli", "micro", "--transports", ",".join(transports), "--sizes",
               ",".join(map(format_size, sizes)), "--no-peers", "--no-references", "--no-plot", "--out", str(out)]
    print(f"bench predict: measuring the costs: {' '.join(['bench', *command[3:]])}", flush=True)
    result = subprocess.run(command, stdout=sys.stderr, check=False)
    if result.returncode != 0:
        return (f"the bench micro run for the costs failed (exit {result.returncode}; its output is above, its "
                f"records in {out}); measure one yourself and give it with --from")
    return None


def summary(records: list[Any], transports: list[str], out: Any = None) -> None:
    """Per model and link rate: total mini-batches/s and efficiency against servers, a column per transport; then
    per line, its step's parts at the most servers, and what saturates first and at how many servers."""
    out = out or sys.stdout
    saturated = grid.saturation(records)
    panels = list(dict.fromkeys((r.model, r.batch_size, r.link_rate) for r in records))
    for model, batch, rate in panels:
        rows = [r for r in records if (r.model, r.batch_size, r.link_rate) == (model, batch, rate)]
        by_point = {(r.transport, r.servers): r for r in rows}
        servers = sorted({r.servers for r in rows})
        cluster = ", ".join(dict.fromkeys(r.cluster for r in rows if r.cluster))
        print(f"\n{model}, batch {batch}, {rate} links{', ' + cluster if cluster else ''}: total mini-batches/s "
              "(scaling efficiency)", file=out)
        cells = [["servers", *transports]]
        for n in servers:
            cells.append([str(n), *(f"{by_point[(t, n)].total_batches_per_s:.4g} "
                                    f"({by_point[(t, n)].scaling_efficiency:.2f})" if (t, n) in by_point else "-"
                                    for t in transports)])
        widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
        for row in cells:
            print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)), file=out)
        for t in transports:
            if (t, servers[-1]) not in by_point:
                continue
            last = by_point[(t, servers[-1])]
            parts = (f"at {servers[-1]} servers a step is {last.compute_fraction:.0%} compute, "
                     f"{last.host_fraction:.0%} host, {last.wire_fraction:.0%} wire, {last.wait_fraction:.0%} waiting")
            first = saturated.get((model, batch, rate, t))
            if first is None:
                busiest = max((r for r in rows if r.transport == t), key=lambda r: r.saturated_utilisation)
                what = (f"nothing saturates up to {servers[-1]} servers (busiest: "
                        f"{PredictRecord.describe_resource(busiest.saturated)}, {busiest.saturated_utilisation:.0%} at "
                        f"{busiest.servers})")
            else:
                what = (f"{PredictRecord.describe_resource(first.resource)} saturates first, at {first.servers} "
                        f"server(s) ({first.utilisation:.0%} busy)")
            print(f"  {t}: {parts}; {what}", file=out)

