"""For each transport: the micro-benchmark at each of --sizes, transfers going on for a share of --duration (the
duration is split evenly over transports and sizes; 10 minutes in all by default), then --steps steps of 'bench
model MODEL' (1 server; not for 'local', which sends nothing). The content of every tensor received is checked: the
micro-benchmark's receiver compares every element with what the sender wrote; in training each tensor's CRC-32
travels beside it (through the launcher) and is checked on arrival. Every process samples its resident memory as it
goes, and the soak keeps nothing that grows with the transfers (streaming statistics, a bounded trace; large freed
buffers go back to the system at once instead of staying in the allocator's heaps, which slows large transfers: the
soak is no benchmark), so memory can only grow when something leaks: after settling (the first minute of a point or
training run, or its first third when shorter), a process leaks when the floor of its memory (the lowest sample of
each quarter of the rest) rises more than 2 MB. records.csv has one row per process of each point: tensors sent,
received, corrupted (must be 0), lost (must be 0), and resident memory once settled, at the end, and its growth in
between (meta.json: the totals, every process's memory verdict, and this process's own). Exit status 1 if any tensor
was corrupted or lost, a process leaked or a run failed. Ctrl-C, SIGTERM or SIGHUP stop it keeping the points
checked so far. Not for CI (10 minutes of transfers, then 1000 training steps per transport); '--duration 20s
--steps 20' is a quick look."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from bench import options
from bench.commands.common import disk_full, failed, interrupted, open_run
from bench.results import DiskError

HELP = "a long run that checks every tensor: nothing corrupted, nothing lost, memory flat (not for CI)"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench soak --duration 20s --steps 20', 'a quick look: every tensor checked, memory watched'),
    ('bench soak --duration 2h --transports zerocopy', 'a long run of one transport'),
)
STARTS_RANKS = True
#: the optional part of the install it needs (checked before anything starts): its training phase is TensorFlow's
EXTRAS = ("models",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transports", type=options.transport_choices, default=None,
                        help="comma list of transports (name or name:mode); default: every one available here")
    parser.add_argument("--sizes", type=options.sizes, default="1KB,4MB", help="micro-benchmark tensor sizes")
    parser.add_argument("--duration", type=options.duration, default="10m",
                        help="seconds (or 90s, 10m, 1h) of micro-benchmark transfers in all, split evenly over the "
                        "transports and sizes")
    parser.add_argument("--model", type=options.model_list, default="fcn5",
                        help="the model trained after the transfers")
    parser.add_argument("--steps", type=options.non_negative_int, default=1000,
                        help="training steps per transport (0: no training)")
    parser.add_argument("--batch-size", type=options.positive_int, default=1, help="per-worker mini-batch size")
    options.add_timeout(parser, 120.0, "one transfer, or one training step,")
    options.add_fabric_options(parser, "UCX transports for the fabric transports")
    options.add_out(parser, "soak")
    options.add_compute_option(parser, "real")
    options.add_launch_options(parser)


def run(args: argparse.Namespace, launcher: Any) -> int:
    """Every transport's micro-benchmark and a training run, every tensor checked, every process's memory judged."""
    from bench.experiments.micro import Point
    from bench.experiments.soak import (
        SoakError,
        checked,
        model_soak_memory,
        model_soak_records,
        run_transport,
        soak_records,
    )
    from bench.experiments.training import TrainingError, line_of, model_config, prepare, train
    from bench.ground.sizes import format_size
    from bench.ground.stats import LeakCriterion, RssTrace
    from bench.launch import LaunchError

    chosen = args.transports or options.default_choices()
    if too_big := options.sizes_problem(args.sizes):
        return options.fail("soak", too_big)
    model = args.model[0]
    share = args.duration / (len(chosen) * len(args.sizes))
    points = [Point(size, warmup=10, iters=0, seconds=share, check=True) for size in args.sizes]
    trained = [choice for choice in chosen if args.steps and line_of(choice.name).crosses_processes]
    criterion = LeakCriterion()
    settings = {"transports": options.labels(chosen), "sizes": args.sizes, "seconds_per_point": share,
                "model": model, "steps": args.steps, "batch_size": args.batch_size, "compute": args.compute,
                "timeout_s": args.timeout, "leak_criterion": dataclasses.asdict(criterion),
                **options.fabric_settings(args, launcher)}
    writer = open_run(args.out, "soak", settings, launcher)
    if writer is None:
        return options.EXIT_USAGE
    out = writer.path
    print(f"bench soak: {', '.join(options.labels(chosen))}: {', '.join(map(format_size, args.sizes))} for "
          f"{share:g} s each, then {args.steps} steps of {model} over "
          f"{', '.join(options.labels(trained)) or 'none'} -> {out}", flush=True)
    failures: list[str] = []
    rows: list[tuple[Any, Any]] = []  # (record, its process's memory verdict)
    own = RssTrace().start()  # this process's (the coordinator's); the ranks' are in the records

    def record(row: Any, memory: Any) -> None:
        writer.add(row)
        rows.append((row, memory))

    try:
        for choice in chosen:
            print(f"soak: {choice}: micro-benchmark ...", flush=True)
            try:
                run_transport(choice.label, points, choice.constructor_options(args, launcher), launcher,
                              lambda point, sender, receiver, label=choice.label: [
                                  record(row, side.memory) for row, side in
                                  zip(soak_records(label, point, sender, receiver), (sender, receiver), strict=True)],
                              criterion)
            except SoakError as exc:
                failures.append(str(exc))
                options.fail("soak", str(exc))
        for choice in trained:
            print(f"soak: {choice}: {args.steps} steps of {model} ...", flush=True)
            config = checked(model_config(model, transport=choice.name, transport_options={},
                                          batch_size=args.batch_size, servers=1, steps=args.steps, warmup=2,
                                          timeout_s=args.timeout, label=choice.label, compute=args.compute))
            try:
                config = prepare(config, launcher)
                config.transport_options = choice.constructor_options(args, launcher)
                config.transport_options.pop("timeout_s")  # the runtime's timeout is the config's
                outcome = train(config, launcher)["outcome"]
                for row, memory in zip(model_soak_records(config, outcome), model_soak_memory(outcome), strict=True):
                    record(row, memory)
            except (LaunchError, TrainingError, ValueError, RuntimeError) as exc:
                failures.append(f"{model} over {choice}: {exc}")
                options.fail("soak", f"{model} over {choice}: {exc}")
    except KeyboardInterrupt as exc:
        own.stop()
        return interrupted(writer, "soak", "the points checked", exc, failures=failures, launcher=launcher.describe())
    except DiskError as exc:  # a full or failing disk: one line, the run marked failed, its points kept
        own.stop()
        return disk_full(writer, "soak", exc, failures, launcher=launcher.describe())
    except BaseException as exc:
        own.stop()
        failed(writer, failures, exc, launcher=launcher.describe())
        raise
    own.stop()
    coordinator = own.judge(criterion)
    bad = [row for row, _ in rows if row.corrupted or row.lost]
    leaks = [f"{row.transport} {row.phase} {_what(row, format_size)} {row.process}" for row, memory in rows
             if memory.leak] + (["the coordinator (bench)"] if coordinator.leak else [])
    totals = {key: sum(int(getattr(row, key)) for row, _ in rows) for key in ("tensors_sent", "corrupted", "lost")}
    memory = [{"transport": row.transport, "phase": row.phase, "what": _what(row, format_size),
               "process": row.process, **verdict.as_dict()} for row, verdict in rows]
    writer.finish("failed" if failures or bad or leaks else "complete", failures=failures,
                  launcher=launcher.describe(), coordinator_rss_mb={"start": round(coordinator.first_mb, 1),
                                                                    "end": round(coordinator.end_mb, 1)},
                  memory=memory, coordinator_memory=coordinator.as_dict(), leaks=leaks, **totals)
    print(f"\n{'transport':18} {'phase':5} {'size/model':>10} {'process':>9} {'sent':>9} {'received':>9} "
          f"{'corrupt':>7} {'lost':>5} {'RSS MB first':>12} {'settled':>8} {'end':>8} {'growth':>7} {'range':>6} "
          f"{'judged s':>8}  memory")
    for row, verdict in rows:
        print(f"{row.transport:18} {row.phase:5} {_what(row, format_size):>10} {row.process:>9} {row.tensors_sent:>9} "
              f"{row.tensors_received:>9} {row.corrupted:>7} {row.lost:>5} " + _memory_columns(verdict))
    print(f"{'(this process)':18} {'':5} {'':>10} {'bench':>9} {'':>9} {'':>9} {'':>7} {'':>5} "
          + _memory_columns(coordinator))
    print(f"\n{totals['tensors_sent']} tensors sent, {totals['corrupted']} corrupted, {totals['lost']} lost, "
          f"{len(leaks)} process(es) leaking (the floor of memory rose more than {criterion.tolerance_mb:g} MB after "
          f"settling)" + (f"; {len(failures)} run(s) failed" if failures else ""))
    for leak in leaks:
        print(f"leak: {leak}")
    print(f"results: {out}")
    return 1 if failures or bad or leaks else 0


def _what(row: Any, format_size: Any) -> str:
    return format_size(int(row.size_bytes)) if row.phase == "micro" else str(row.model)


def _memory_columns(verdict: Any) -> str:
    return (f"{verdict.first_mb:>12.1f} {verdict.start_mb:>8.1f} {verdict.end_mb:>8.1f} {verdict.growth_mb:>+7.2f} "
            f"{verdict.range_mb:>6.2f} {verdict.judged_s:>8.0f}  {verdict.word}")
