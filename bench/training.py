"""Training runs as experiments: the runtime's processes started by a launcher, and their records.

``bench model`` and ``bench scale`` both come here: :func:`prepare` settles the compute mode (for
replayed compute, one process runs the analyzer and times the model once), :func:`train` runs one
job with ``servers`` workers and parameter servers through the launcher, and :func:`model_record`
turns what the ranks measured into a row of ``records.csv``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from bench import LOCAL, TF_GRPC
from bench.launch import Launcher, RankSpec
from bench.launch.local import LocalLauncher
from bench.results import DiskError, ModelRecord, ScaleRecord, SoakRecord
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


def local_record(config: TrainConfig, times: StepTimes) -> ModelRecord:
    """The ``model`` record of the ``local`` line (one process, no communication)."""
    step = times.total / config.steps
    return ModelRecord(transport=LOCAL, model=config.model, batch_size=config.batch_size, servers=config.servers,
                       steps=config.steps, step_time_s=step, throughput_batches_per_s=1.0 / step,
                       compute_s=times.compute / config.steps, comm_s=0.0, apply_s=times.apply / config.steps,
                       worker_peak_rss_mb=times.extra["peak_rss_mb"], copied_bytes_per_step=0,
                       runtime_copied_bytes_per_step=0, fabric="none", compute=config.compute)


def model_record(config: TrainConfig, outcome: dict[int, tuple[str, StepTimes]]) -> ModelRecord:
    """One ``model`` record: the runtime's summary, the compute mode, and the busiest link's throughput."""
    links = [t.extra["link_bytes"] + (t.extra["link_seconds"],) for role, t in outcome.values()
             if role == "worker" and "link_bytes" in t.extra]
    # per direction: a link's rate applies to each direction of the full-duplex link
    peak = max(max(tx, rx) / seconds for tx, rx, seconds in links) / 2**20 if links else None
    return ModelRecord(**summarize(config, outcome), compute=config.compute, link_peak_MBps=peak)


def step_samples(outcome: dict[int, tuple[str, StepTimes]]) -> dict[str, list]:
    """Every timed step of every worker (the ``samples.csv`` columns of a model record): worker, step time."""
    rows = sorted((rank, seconds) for rank, (role, t) in outcome.items() if role == "worker"
                  for seconds in t.steps)
    return {"worker": [rank for rank, _ in rows], "step_time_s": [seconds for _, seconds in rows]}


def scale_record(record: ModelRecord, singles: dict[tuple, float]) -> ScaleRecord:
    """The ``scale`` record of a training run: its model record, ``total_batches_per_s`` and
    ``scaling_efficiency``.

    Efficiency is throughput / (servers x the 1-server throughput of the same transport, model and
    batch size), which ``singles`` remembers as the 1-server records go by (they come first); NaN
    without one.
    """
    key = (record.transport, record.model, record.batch_size)
    total = record.throughput_batches_per_s * record.servers
    if record.servers == 1:
        singles[key] = total
    base = singles.get(key)
    return ScaleRecord(**{**record.row(), "launcher": record.launcher or "", "compute": record.compute or "",
                          "link_rate": record.link_rate or ""}, total_batches_per_s=total,
                       scaling_efficiency=total / (record.servers * base) if base else float(np.nan))


def soak_records(config: TrainConfig, outcome: dict[int, tuple[str, StepTimes]]) -> list[SoakRecord]:
    """The ``soak`` rows of a training run with ``check`` on: one per process (worker, PS), with tensors sent,
    received, corrupted and lost, and resident memory (the process's :class:`~bench.stats.MemoryVerdict`: once
    settled, at the end, and its floor's rise in between)."""
    step_time = summarize(config, outcome)["step_time_s"]
    layout = Layout(config.servers)
    rows = []
    for rank, (role, times) in sorted(outcome.items()):
        check = times.extra["check"]
        memory = check["memory"]
        server = rank if role == "worker" else rank - layout.servers
        rows.append(SoakRecord(phase="model", transport=config.label or config.transport, model=config.model,
                               process=f"{role} {server}", seconds=times.total,
                               transfers=config.warmup + config.steps, tensors_sent=check["tensors_sent"],
                               tensors_received=check["tensors_received"], corrupted=check["corrupted"],
                               lost=check["lost"], rss_start_mb=memory.start_mb, rss_end_mb=memory.end_mb,
                               rss_growth_mb=memory.growth_mb, step_time_s=step_time,
                               fabric=fabric.label(times.extra.get("fabric"))))
    return rows


def soak_memory(config: TrainConfig, outcome: dict[int, tuple[str, StepTimes]]) -> list[Any]:
    """Each process's :class:`~bench.stats.MemoryVerdict` of a training run with ``check`` on, in the order of
    :func:`soak_records`' rows."""
    return [times.extra["check"]["memory"] for _, (_, times) in sorted(outcome.items())]


# -- bench model and bench scale: every model x batch size x transport x server count -----------------------


class Trainings:
    """The training runs of a ``bench model`` or ``bench scale`` command, each recorded (with its step times
    as samples) as it finishes. ``failures`` lists the runs that failed, one line each."""

    def __init__(self, experiment: str, args: Any, launcher: Launcher, writer: Any) -> None:
        self.experiment, self.args, self.launcher, self.writer = experiment, args, launcher, writer
        self.failures: list[str] = []
        self.prepared: dict[tuple[str, int], TrainConfig] = {}
        self._singles: dict[tuple, float] = {}

    def run(self, runs: list[tuple[str, int, Any, int]]) -> None:
        """Train each ``(model, batch size, choice, servers)`` in turn, with a progress bar."""
        from tqdm import tqdm

        from bench.launch import LaunchError

        with tqdm(total=len(runs), unit="run", dynamic_ncols=True, disable=None) as bar:
            for model, batch, choice, servers in runs:
                what = f"{model} {choice.label} b{batch} x{servers}"
                bar.set_postfix_str(what)
                try:
                    record, samples = self._train(model, batch, choice, servers,
                                                  lambda server, step, what=what: bar.set_postfix_str(
                                                      f"{what} step {step}"))
                except (LaunchError, TrainingError, ValueError, RuntimeError) as exc:
                    self.failures.append(f"{what}: {exc}")
                    bar.write(f"bench {self.experiment}: error: {model} over {choice.label}, batch {batch}, "
                              f"{servers} server(s): {exc}", file=sys.stderr)
                else:
                    try:
                        self.writer.add(record)
                        if samples is not None:
                            self.writer.add_samples(record, samples)
                    except DiskError as exc:  # a full or failing disk: stop; the runs recorded before stay
                        self.failures.append(str(exc))
                        bar.write(f"bench {self.experiment}: error: {exc} (the runs recorded before are in "
                                  f"{self.writer.path})", file=sys.stderr)
                        return
                    bar.write(f"{model:12} {choice.label:18} batch {batch:3} x{servers}: "
                              f"{record.throughput_batches_per_s:7.3f} batches/s, step {record.step_time_s:.3f} s "
                              f"(compute {record.compute_s:.3f}, comm {record.comm_s:.3f})" + copy_note(record))
                bar.update(1)

    def _train(self, model: str, batch: int, choice: Any, servers: int, on_step: Callable[[int, int], None]
               ) -> tuple[ModelRecord, dict[str, list] | None]:
        """One run's record and its samples (none for tf_grpc, which times steps its own way)."""
        args = self.args
        config = TrainConfig(model=model, transport=choice.name, transport_options={}, batch_size=batch,
                             servers=servers, steps=args.steps, warmup=args.warmup, learning_rate=args.learning_rate,
                             timeout_s=args.timeout, label=choice.label, asynchronous=args.asynchronous,
                             compute=args.compute)
        if (model, batch) not in self.prepared:
            self.prepared[(model, batch)] = prepare(config, self.launcher)
        ready = self.prepared[(model, batch)]
        config = dataclasses.replace(config, plan=ready.plan, compute_s=ready.compute_s)
        samples = None
        if choice.is_local:
            times = train_local(config, self.launcher)
            record = local_record(config, times)
            samples = {"worker": [0] * len(times.steps), "step_time_s": list(times.steps)}
        elif choice.is_tf_grpc:
            record = tf_grpc_record(config, self.launcher)
        else:
            options = choice.constructor_options(args, self.launcher)
            options.pop("timeout_s")  # the runtime's timeout is the config's
            config.transport_options = options
            outcome = train(config, self.launcher, on_step)["outcome"]
            record, samples = model_record(config, outcome), step_samples(outcome)
        record.launcher, record.link_rate = self.launcher.name, args.link_rate or ""
        if self.experiment == "scale":
            record = scale_record(record, self._singles)
        return record, samples


def copy_note(record: ModelRecord) -> str:
    """What a training record says about copies and registered memory, for its progress line."""
    note = ""
    if isinstance(copied := record.copied_bytes_per_step, int | float) and copied == copied:
        note += f", copied {copied / 2**20:.1f} MB/step"
    if isinstance(rate := record.registration_hit_rate, float):
        note += f", sent from registered memory {rate:.1%}"
    if record.dynamic_transfers_per_step:
        note += f", {record.dynamic_transfers_per_step:g} dynamic/step"
    return note


def tf_grpc_record(config: TrainConfig, launcher: Launcher) -> ModelRecord:
    """TensorFlow's own parameter-server training of the same model (bench/tf_grpc.py) as a ``model`` record."""
    from bench.tf_grpc import record_row, run_tf_grpc

    if config.replayed:
        raise ValueError("tf_grpc runs TensorFlow's own training: it cannot replay compute (use --compute real)")
    definition = resolve_model(config.model)
    record = run_tf_grpc(definition.build, definition.make_batch, definition.loss_fn, batch_size=config.batch_size,
                         servers=config.servers, steps=config.steps, warmup=config.warmup,
                         learning_rate=config.learning_rate, timeout_s=config.timeout_s, launcher=launcher)
    record.update(transport=TF_GRPC, model=config.model, compute="real")
    return record_row(record)
