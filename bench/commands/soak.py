"""For each transport: the micro-benchmark at each of --sizes, transfers going on for a share of --duration (the
duration is split evenly over transports and sizes; 10 minutes in all by default), then --steps steps of 'bench
model MODEL' (1 server; not for 'local', which sends nothing). The content of every tensor received is checked:
the micro-benchmark's receiver compares every element with what the sender wrote; in training each tensor's
CRC-32 travels beside it (through the launcher) and is checked on arrival. records.csv has one row per process of
each point: tensors sent, received, corrupted (must be 0), lost (must be 0), and resident memory at the start and
end (meta.json: the totals, and this process's own memory). Exit status 1 if any tensor was corrupted or lost or
a run failed. Ctrl-C, SIGTERM or SIGHUP stop it keeping the points checked so far. Not for CI (10 minutes of
transfers, then 1000 training steps per transport); '--duration 20s --steps 20' is a quick look."""

from __future__ import annotations

import argparse
from typing import Any

from bench import options
from bench.commands.common import failed, interrupted, open_run

HELP = "a long run that checks every tensor: nothing corrupted, nothing lost, memory flat (not for CI)"
STARTS_RANKS = True


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
    """Every transport's micro-benchmark and a training run, every tensor checked."""
    from bench.launch import LaunchError
    from bench.memory import rss_mb
    from bench.micro import MicroError, Point, run_transport, soak_records
    from bench.runtime.ps import TrainConfig
    from bench.sizes import format_size
    from bench.training import TrainingError, prepare, train
    from bench.training import soak_records as model_soak_records

    chosen = args.transports or options.default_choices()
    if too_big := options.sizes_problem(args.sizes):
        return options.fail("soak", too_big)
    model = args.model[0]
    share = args.duration / (len(chosen) * len(args.sizes))
    points = [Point(size, warmup=10, iters=0, seconds=share, check=True) for size in args.sizes]
    trained = [choice for choice in chosen if args.steps and not choice.is_local]
    settings = {"transports": options.labels(chosen), "sizes": args.sizes, "seconds_per_point": share,
                "model": model, "steps": args.steps, "batch_size": args.batch_size, "compute": args.compute,
                "timeout_s": args.timeout, **options.fabric_settings(args, launcher)}
    writer = open_run(args.out, "soak", settings, launcher)
    if writer is None:
        return options.EXIT_USAGE
    out = writer.path
    print(f"bench soak: {', '.join(options.labels(chosen))}: {', '.join(map(format_size, args.sizes))} for "
          f"{share:g} s each, then {args.steps} steps of {model} over "
          f"{', '.join(options.labels(trained)) or 'none'} -> {out}", flush=True)
    failures: list[str] = []
    rows: list[Any] = []
    own_rss = {"start": round(rss_mb(), 1)}  # this process's (the coordinator's); the ranks' are in the records

    def record(row: Any) -> None:
        writer.add(row)
        rows.append(row)

    try:
        for choice in chosen:
            print(f"soak: {choice}: micro-benchmark ...", flush=True)
            try:
                run_transport(choice.label, points, choice.constructor_options(args, launcher), launcher,
                              lambda point, sender, receiver, label=choice.label: [
                                  record(row) for row in soak_records(label, point, sender, receiver)])
            except MicroError as exc:
                failures.append(str(exc))
                options.fail("soak", str(exc))
        for choice in trained:
            print(f"soak: {choice}: {args.steps} steps of {model} ...", flush=True)
            config = TrainConfig(model=model, transport=choice.name, transport_options={},
                                 batch_size=args.batch_size, servers=1, steps=args.steps, warmup=2,
                                 timeout_s=args.timeout, label=choice.label, compute=args.compute, check=True)
            try:
                config = prepare(config, launcher)
                config.transport_options = choice.constructor_options(args, launcher)
                config.transport_options.pop("timeout_s")  # the runtime's timeout is the config's
                for row in model_soak_records(config, train(config, launcher)["outcome"]):
                    record(row)
            except (LaunchError, TrainingError, ValueError, RuntimeError) as exc:
                failures.append(f"{model} over {choice}: {exc}")
                options.fail("soak", f"{model} over {choice}: {exc}")
    except KeyboardInterrupt as exc:
        return interrupted(writer, "soak", "the points checked", exc, failures=failures, launcher=launcher.describe())
    except BaseException as exc:
        failed(writer, failures, exc, launcher=launcher.describe())
        raise
    bad = [row for row in rows if row.corrupted or row.lost]
    totals = {key: sum(int(getattr(row, key)) for row in rows) for key in ("tensors_sent", "corrupted", "lost")}
    own_rss["end"] = round(rss_mb(), 1)
    writer.finish("failed" if failures or bad else "complete", failures=failures, launcher=launcher.describe(),
                  coordinator_rss_mb=own_rss, **totals)
    print(f"\n{'transport':18} {'phase':5} {'size/model':>10} {'process':>9} {'sent':>9} {'received':>9} "
          f"{'corrupt':>7} {'lost':>5} {'RSS MB start':>12} {'end':>8}")
    for row in rows:
        what = format_size(int(row.size_bytes)) if row.phase == "micro" else row.model
        print(f"{row.transport:18} {row.phase:5} {what:>10} {row.process:>9} {row.tensors_sent:>9} "
              f"{row.tensors_received:>9} {row.corrupted:>7} {row.lost:>5} {row.rss_start_mb:>12.1f} "
              f"{row.rss_end_mb:>8.1f}")
    print(f"{'(this process)':18} {'':5} {'':>10} {'bench':>9} {'':>9} {'':>9} {'':>7} {'':>5} "
          f"{own_rss['start']:>12.1f} {own_rss['end']:>8.1f}")
    print(f"\n{totals['tensors_sent']} tensors sent, {totals['corrupted']} corrupted, {totals['lost']} lost"
          + (f"; {len(failures)} run(s) failed" if failures else ""))
    print(f"results: {out}")
    return 1 if failures or bad else 0
