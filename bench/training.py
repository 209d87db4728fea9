"""Training runs as experiments: the runtime's processes started by a launcher, and their records.

``bench model`` and ``bench scale`` both come here: :func:`prepare` settles the compute mode (for
replayed compute, one process runs the analyzer and times the model once), :func:`train` runs one
job with ``servers`` workers and parameter servers through the launcher, and :func:`model_record`
turns what the ranks measured into a row of ``records.csv``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.launch import Launcher, RankSpec
from bench.launch.local import LocalLauncher
from bench.runtime.analyzer import Layout
from bench.runtime.ps import StepTimes, TrainConfig, local_job, profile, rank_job, resolve_model, summarize
from transports import fabric

COMPUTE_MODES = {
    "real": "every worker runs the model",
    "replay": "workers wait the compute time measured here once, instead of computing",
    "paper": "workers wait the paper's per-sample compute time (Table 2, a P100 GPU) times the batch size",
}
#: seconds of silence the coordinator allows beyond a run's own timeout (start-up, model building)
_SLACK_S = 120.0


class TrainingError(RuntimeError):
    """A training run could not be set up or did not finish; the message says which and why."""


def prepare(config: TrainConfig, launcher: Launcher | None = None) -> TrainConfig:
    """``config`` ready to run: for replayed compute, with the analyzer's plan and the seconds to wait.

    ``replay`` builds and times the model once, in one process; ``paper`` takes the paper's time per
    sample (Table 2) times the batch size, and the plan from the same one process.
    """
    if not config.replayed or config.plan is not None:
        return config
    if config.compute == "paper":
        per_sample = getattr(resolve_model(config.model), "paper_compute_ms_per_sample", None)
        if per_sample is None:
            raise TrainingError(f"the paper gives no compute time for model '{config.model}'; "
                                "use --compute replay or real")
    results = (launcher or LocalLauncher()).run(
        [RankSpec(functools.partial(profile, config, steps=5 if config.compute == "replay" else 0), "profiler")],
        config.timeout_s + _SLACK_S,
        label=f"profile-{config.model}-b{config.batch_size}")
    if not results:  # not the coordinator (MPI): the coordinator assigns the prepared config
        return config
    plan, measured = results[0].result
    seconds = measured if config.compute == "replay" else per_sample * config.batch_size / 1e3
    return dataclasses.replace(config, plan=plan, compute_s=seconds)


def rank_specs(config: TrainConfig) -> list[RankSpec]:
    """Worker ``i`` is rank ``i``, parameter server ``i`` rank ``servers + i``; both on host (server) ``i``."""
    layout = Layout(config.servers)
    job = functools.partial(rank_job, config)
    return ([RankSpec(job, f"worker {s}", host=s) for s in range(layout.servers)]
            + [RankSpec(job, f"ps {s}", host=s) for s in range(layout.servers)])


def train(config: TrainConfig, launcher: Launcher | None = None,
          on_step: Callable[[int, int], None] | None = None,
          on_progress: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Run one distributed training job; returns per-rank ``(role, StepTimes)`` (peak memory in ``extra``).

    ``on_step(server, step)`` follows the workers; ``on_progress(payload)`` gets their other reports
    (losses and evaluations, see ``rank_job``) as they come. On ranks of an MPI job other than the
    coordinator it returns an empty outcome.
    """
    def on_report(rank: int, payload: Any) -> None:
        if payload[0] == "step":
            if on_step is not None:
                on_step(payload[1], payload[2])
        elif on_progress is not None:
            on_progress(payload)

    label = f"{config.model}-{config.label or config.transport}-b{config.batch_size}-s{config.servers}"
    results = (launcher or LocalLauncher()).run(rank_specs(config), config.timeout_s + _SLACK_S, on_report,
                                                label=label)
    outcome = {}
    for result in results:
        role, times = result.result
        times.extra["peak_rss_mb"] = result.peak_rss_mb
        outcome[result.rank] = (role, times)
    return {"layout": Layout(config.servers), "outcome": outcome}


def train_local(config: TrainConfig, launcher: Launcher | None = None) -> StepTimes | None:
    """The "local" line in a process of its own (its peak memory is its own); None off the coordinator."""
    results = (launcher or LocalLauncher()).run([RankSpec(functools.partial(local_job, config), "local")],
                                                config.timeout_s + _SLACK_S, label=f"{config.model}-local")
    if not results:
        return None
    times = results[0].result
    times.extra["peak_rss_mb"] = results[0].peak_rss_mb
    return times


def local_record(config: TrainConfig, times: StepTimes) -> dict[str, Any]:
    """The ``model`` record of the "local" line."""
    step = times.total / config.steps
    return {"transport": "local", "model": config.model, "batch_size": config.batch_size,
            "servers": config.servers, "steps": config.steps, "step_time_s": step,
            "throughput_batches_per_s": 1.0 / step, "compute_s": times.compute / config.steps, "comm_s": 0.0,
            "apply_s": times.apply / config.steps, "worker_peak_rss_mb": times.extra["peak_rss_mb"],
            "copied_bytes_per_step": 0, "runtime_copied_bytes_per_step": 0, "fabric": "none",
            "compute": config.compute}


def model_record(config: TrainConfig, outcome: dict[int, tuple[str, StepTimes]]) -> dict[str, Any]:
    """One ``model`` record: the runtime's summary, the compute mode, and the busiest link's throughput."""
    record = summarize(config, outcome)
    record["compute"] = config.compute
    links = [t.extra["link_bytes"] + (t.extra["link_seconds"],) for role, t in outcome.values()
             if role == "worker" and "link_bytes" in t.extra]
    if links:
        # per direction: a link's rate applies to each direction of the full-duplex link
        record["link_peak_MBps"] = max(max(tx, rx) / seconds for tx, rx, seconds in links) / 2**20
    return record


def efficiency(record: dict[str, Any], singles: dict[tuple, float]) -> None:
    """Add ``total_batches_per_s`` and ``scaling_efficiency`` to a ``scale`` record.

    Efficiency is throughput / (servers x the 1-server throughput of the same transport, model and
    batch size), which ``singles`` remembers as the 1-server records go by (they come first); NaN
    without one.
    """
    key = (record["transport"], record["model"], record["batch_size"])
    total = record["throughput_batches_per_s"] * record["servers"]
    record["total_batches_per_s"] = total
    if record["servers"] == 1:
        singles[key] = total
    base = singles.get(key)
    record["scaling_efficiency"] = total / (record["servers"] * base) if base else float(np.nan)


def soak_records(config: TrainConfig, outcome: dict[int, tuple[str, StepTimes]]) -> list[dict[str, Any]]:
    """The ``soak`` rows of a training run with ``check`` on: one per process (worker, PS), with tensors sent,
    received, corrupted and lost, and resident memory at the start of the timed steps and at the end."""
    step_time = summarize(config, outcome)["step_time_s"]
    layout = Layout(config.servers)
    rows = []
    for rank, (role, times) in sorted(outcome.items()):
        check = times.extra["check"]
        server = rank if role == "worker" else rank - layout.servers
        rows.append({"phase": "model", "transport": config.label or config.transport, "model": config.model,
                     "process": f"{role} {server}", "seconds": times.total, "transfers": config.warmup + config.steps,
                     "tensors_sent": check["tensors_sent"], "tensors_received": check["tensors_received"],
                     "corrupted": check["corrupted"], "lost": check["lost"],
                     "rss_start_mb": check["rss_start_mb"], "rss_end_mb": check["rss_end_mb"],
                     "rss_growth_mb": check["rss_end_mb"] - check["rss_start_mb"], "step_time_s": step_time,
                     "fabric": fabric.label(times.extra.get("fabric"))})
    return rows
