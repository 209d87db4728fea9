"""Training runs as experiments: the runtime's processes started by a launcher, and their records.

``bench model`` and ``bench scale`` both come here: :func:`prepare` settles the compute mode (for
replayed compute, one process runs the analyzer and times the model once), :func:`train` runs one
job with ``servers`` workers and parameter servers through the launcher, and :func:`model_record`
turns what the ranks measured into a row of ``records.csv``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

import transports
from bench import LOCAL, TF_GRPC
from bench.experiments.models import resolve_model
from bench.launch import Launcher, RankSpec
from bench.launch.local import LocalLauncher
from bench.results import DiskError, ModelRecord, ScaleRecord
from bench.results import lines as catalogue
from bench.runtime.analyzer import Layout, Plan
from bench.runtime.config import RuntimeCopies, StepTimes, TrainConfig, build_model, framework, plan_of, worker_batch
from bench.runtime.framework import DEFAULT_FRAMEWORK
from bench.runtime.local import train_locally
from bench.runtime.ps import run_ps
from bench.runtime.stopping import Stopping
from bench.runtime.worker import run_worker
from transports import fabric
from transports.common import Registry
from transports.memory import HOST

COMPUTE_MODES = {
    "real": "every worker runs the model",
    "replay": "workers wait the compute time measured here once, instead of computing",
    "paper": "workers wait the paper's per-sample compute time (Table 2, a P100 GPU) times the batch size",
}
#: seconds of silence the coordinator allows beyond a run's own timeout (start-up, model building)
_SLACK_S = 120.0


class TrainingError(RuntimeError):
    """A training run could not be set up or did not finish; the message says which and why."""


def model_config(model: str, framework: str = DEFAULT_FRAMEWORK, **settings: Any) -> TrainConfig:
    """A :class:`TrainConfig` for the model called ``model`` (``vgg16``, or ``package.module:ATTRIBUTE``) in
    ``framework``: the name resolved to the definition the runtime is handed."""
    return TrainConfig(model=model, workload=resolve_model(model, framework=framework), **settings)


# -- the processes: what each rank of a training run does ---------------------------------------------------


def rank_job(config: TrainConfig, ctx) -> tuple[str, StepTimes]:
    """One process of a training run: rank ``r < servers`` is worker ``r``, the others parameter servers.

    ``ctx`` is the launcher's view of the run (rank, cluster, ``report``, ``link_bytes``); each worker
    reports ``("step", server, step)`` as its steps begin and ``("loss", server, step, loss, trained_s)``
    after computing one, worker 0 ``("eval", point)`` at each evaluation; a worker measures the traffic
    on its host's link over the timed steps when it has one of its own (netns). With ``config.watch`` the
    transport is the watch's, and what its ``finish()`` says goes to ``extra["watch"]``.
    """
    framework(config).use_cores(cores_per_rank(ctx, config.servers))
    plan = config.plan if config.plan is not None else plan_of(config)
    if plan.servers != config.servers:
        raise TrainingError(f"the plan of {config.model} is laid out for {plan.servers} server(s), the run has "
                            f"{config.servers}: lay it out for the run (Plan.for_servers)")
    layout = plan.layout
    options = {**config.transport_options, "timeout_s": config.timeout_s}
    stopping = Stopping(config, ctx)
    with transports.create(config.transport, **options) as transport:
        transport.start(ctx.cluster, ctx.rank)
        transport.share_cores()  # its waits yield to TensorFlow's compute and the servers' apply
        transport.placement.plan(plan.specs(ctx.rank, config.memory))
        if config.watch is not None:
            transport = config.watch(transport, ctx)
        if ctx.rank < layout.servers:
            server = ctx.rank
            link: dict[str, Any] = {}

            def on_step(step: int) -> None:
                if step in (config.warmup, stopping.end):
                    link[step] = (time.perf_counter(), ctx.link_bytes())
                ctx.report(("step", server, step))

            def on_loss(step: int, loss: float, trained_s: float) -> None:
                ctx.report(("loss", server, step, loss, trained_s))

            times = run_worker(config, transport, plan, server, on_step, on_loss,
                               on_eval=lambda point: ctx.report(("eval", point)), stopping=stopping)
            (t0, bytes0), (t1, bytes1) = link[config.warmup], link[stopping.end]
            if bytes0 is not None:
                times.extra["link_bytes"] = (bytes1[0] - bytes0[0], bytes1[1] - bytes0[1])
                times.extra["link_seconds"] = t1 - t0
            role = "worker"
        else:
            times = run_ps(config, transport, plan, ctx.rank - layout.servers, stopping)
            role = "ps"
        times.extra["fabric"] = transport.describe()
        if config.watch is not None:
            times.extra["watch"] = transport.finish()
        if config.watch is None:  # (a soak's watch reads the launcher's messages itself, and drains them)
            stopping.finish(layout)
    return role, times


def cores_per_rank(ctx, workers: int) -> int:
    """This rank's share of its host's cores for the framework's compute: a worker (ranks ``0..workers-1``) gets
    the cores it may run on over the workers on its host, which compute at the same time in synchronous training;
    a parameter server, whose apply is NumPy's, one."""
    if ctx.rank >= workers:
        return 1
    hosts = [address.rpartition(":")[0] for address in ctx.cluster.addresses[:workers]]  # host:port
    return max(1, len(os.sched_getaffinity(0)) // hosts.count(hosts[ctx.rank]))


def local_job(config: TrainConfig, ctx) -> StepTimes:
    """The "local" line as a process of its own: its peak memory is its own."""
    times, _ = train_locally(config)
    return times


def profile(config: TrainConfig, ctx, steps: int = 5) -> tuple[Plan, float]:
    """The analyzer's plan and one worker's compute seconds per step (median of ``steps``; NaN for 0)."""
    model = build_model(config)
    x, y = worker_batch(config, 0, 0)
    plan = framework(config).analyze(config.model, model, config.workload, np.asarray(x), np.asarray(y),
                                     config.servers, config.batch_size)
    if not steps:
        return plan, float("nan")
    values = framework(config).initial_values(model)
    step_fn = framework(config).step(model, config.workload, list(plan.variables))
    copies = RuntimeCopies()
    seconds = []
    for step in range(2 + steps):  # two warm-up steps: tracing, then first-run allocations
        x, y = worker_batch(config, 0, step)
        started = time.perf_counter()
        result = step_fn(values, x, y, copies)
        float(result.loss)
        seconds.append(time.perf_counter() - started)
        del result
    return plan, float(np.median(seconds[2:]))


def prepare(config: TrainConfig, launcher: Launcher | None = None) -> TrainConfig:
    """``config`` ready to run: for replayed compute, with the analyzer's plan and the seconds to wait.

    ``replay`` builds and times the model once, in one process; ``paper`` takes the paper's time per
    sample (Table 2) times the batch size, and the plan from the same one process.
    """
    if not config.replayed or config.plan is not None:
        return config
    if config.compute == "paper":
        per_sample = getattr(config.workload, "paper_compute_ms_per_sample", None)
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
    results = (launcher or LocalLauncher()).run([RankSpec(functools.partial(local_job, config), LOCAL)],
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
                       runtime_copied_bytes_per_step=0, fabric="none", compute=config.compute,
                       memory=str(config.memory_kind))


#: the ledger's counts of bytes between device and host memory, and device to device (a record's ``*_per_step``)
DEVICE_CROSSINGS = ("device_to_host_bytes", "host_to_device_bytes", "device_to_device_bytes")


def model_record(config: TrainConfig, outcome: dict[int, tuple[str, StepTimes]]) -> ModelRecord:
    """One ``model`` record from what the ranks measured: workers' times averaged, copies and registrations of every
    process per step, peak memory, the fabric and the graph analysis, and the busiest link's throughput."""
    workers = [t for role, t in outcome.values() if role == "worker"]
    servers = [t for role, t in outcome.values() if role == "ps"]
    steps = config.steps
    step_time = float(np.mean([t.total for t in workers])) / steps
    stats = [t.extra["stats"] for _, t in outcome.values()]
    transport_copied = sum(s["copied_bytes"] for s in stats)
    runtime_copied = sum(t.copied_bytes for t in workers)
    described = next((t.extra["fabric"] for t in workers), {})
    hits = sum(s.get("sends_registered", 0) for s in stats)
    misses = sum(s.get("sends_unregistered", 0) for s in stats)
    sites = [t.extra["sites"] for t in workers if "sites" in t.extra]
    links = [t.extra["link_bytes"] + (t.extra["link_seconds"],) for t in workers if "link_bytes" in t.extra]
    return ModelRecord(
        transport=config.label or config.transport, model=config.model, batch_size=config.batch_size,
        servers=config.servers, steps=steps, step_time_s=step_time, throughput_batches_per_s=1.0 / step_time,
        compute_s=float(np.mean([t.compute for t in workers])) / steps,
        comm_s=float(np.mean([t.comm for t in workers])) / steps,
        apply_s=float(np.mean([t.apply for t in servers])) / steps,
        ps_wait_s=float(np.mean([t.comm for t in servers])) / steps,
        worker_cpu_s_per_step=float(np.mean([t.extra["cpu_s"] for t in workers])) / steps,
        ps_cpu_s_per_step=float(np.mean([t.extra["cpu_s"] for t in servers])) / steps,
        worker_peak_rss_mb=max(t.extra["peak_rss_mb"] for t in workers),
        ps_peak_rss_mb=max(t.extra["peak_rss_mb"] for t in servers),
        copied_bytes_per_step=(transport_copied + runtime_copied) / steps,
        runtime_copied_bytes_per_step=runtime_copied / steps,
        # every memory registration (and control message) of every process in the timed steps
        registrations_per_step=sum(s["registrations"] for s in stats) / steps,
        control_messages_per_step=sum(s["control_messages"] for s in stats) / steps,
        model_mb=workers[0].extra.get("model_mb"),
        fabric=fabric.label(described),
        compute=config.compute,
        # per direction: a link's rate applies to each direction of the full-duplex link
        link_peak_MBps=max(max(tx, rx) / seconds for tx, rx, seconds in links) / 2**20 if links else None,
        # the graph analysis (zerocopy: on or off; rdma_cp places receives only) and what it achieved
        analysis=described.get("analysis", ""),
        dynamic_transfers_per_step=sum(s.get("dynamic_transfers", 0) for s in stats) / steps,
        unregistered_sends_per_step=misses / steps,
        registration_hit_rate=hits / (hits + misses) if hits + misses else None,
        site_regions=sum(site["regions"] for site in sites) if sites else None,
        unregistered_tensors=",".join(f"{name}:{count}" for site in sites[:1] for name, count in
                                      site["missed"].items()) if sites else None,
        updates_sent_early_per_step=float(np.mean([t.extra.get("updates_sent_early", 0) for t in workers])) / steps,
        memory=str(config.memory_kind),
        **{f"{crossing}_per_step": sum(s.get(crossing, 0) for s in stats) / steps for crossing in DEVICE_CROSSINGS},
    )


def step_samples(outcome: dict[int, tuple[str, StepTimes]]) -> dict[str, list]:
    """Every timed step of every worker (the ``samples.csv`` columns of a model record): worker, step time."""
    rows = sorted((rank, seconds) for rank, (role, t) in outcome.items() if role == "worker"
                  for seconds in t.steps)
    return {"worker": [rank for rank, _ in rows], "step_time_s": [seconds for _, seconds in rows]}


class ScaleRecords:
    """``bench scale``'s records of training runs: each its model record, ``total_batches_per_s`` and
    ``scaling_efficiency``.

    Efficiency is throughput / (servers x the 1-server throughput of the same transport, model and batch size),
    which it remembers as the 1-server records go by (they come first); NaN without one.
    """

    def __init__(self) -> None:
        self._singles: dict[tuple, float] = {}

    def __call__(self, record: ModelRecord) -> ScaleRecord:
        key = (record.transport, record.model, record.batch_size)
        total = record.throughput_batches_per_s * record.servers
        if record.servers == 1:
            self._singles[key] = total
        base = self._singles.get(key)
        return ScaleRecord(**{**record.row(), "launcher": record.launcher or "", "compute": record.compute or "",
                              "link_rate": record.link_rate or ""}, total_batches_per_s=total,
                           scaling_efficiency=total / (record.servers * base) if base else float(np.nan))


# -- bench model and bench scale: every model x batch size x transport x server count -----------------------


class Trainings:
    """The training runs of a ``bench model`` or ``bench scale`` command, each recorded (with its step times
    as samples) as it finishes. ``failures`` lists the runs that failed, one line each."""

    def __init__(self, experiment: str, args: Any, launcher: Launcher, writer: Any,
                 shape: Callable[[ModelRecord], ModelRecord] = lambda record: record) -> None:
        """``experiment`` names the command in its messages; ``shape`` makes each run's record the experiment's
        (``bench scale``'s: :class:`ScaleRecords`)."""
        self.experiment, self.args, self.launcher, self.writer = experiment, args, launcher, writer
        self.shape = shape
        self.failures: list[str] = []
        self.prepared: dict[tuple[str, int], TrainConfig] = {}

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
        config = model_config(model, getattr(args, "framework", DEFAULT_FRAMEWORK), transport=choice.name,
                              transport_options={}, batch_size=batch, servers=servers, steps=args.steps,
                              warmup=args.warmup, learning_rate=args.learning_rate, timeout_s=args.timeout,
                              label=choice.label, asynchronous=args.asynchronous, compute=args.compute,
                              memory=str(getattr(args, "memory", HOST)))
        if (model, batch) not in self.prepared:
            self.prepared[(model, batch)] = prepare(config, self.launcher)
        ready = self.prepared[(model, batch)]
        # the plan analysed once per model and batch size, laid out for this run's servers (placement and
        # roles follow the plan's layout: a plan of another server count would run other ranks than the config's)
        plan = ready.plan.for_servers(servers) if ready.plan is not None else None  # real compute: each rank's own
        config = dataclasses.replace(config, plan=plan, compute_s=ready.compute_s)
        if problem := config.memory_problem():
            raise ValueError(problem)
        options = choice.constructor_options(args, self.launcher)
        options.pop("timeout_s")  # the runtime's timeout is the config's
        config.transport_options = options
        record, samples = line_of(choice.name).train(config, self.launcher, on_step)
        record.launcher, record.link_rate = self.launcher.name, args.link_rate or ""
        record.framework, record.framework_version = config.framework, framework(config).version()
        return self.shape(record), samples


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


# -- the lines of the training figures: one way in for each -------------------------------------------------


class TrainingLine(ABC):
    """A line of the training figures (``bench model``, ``scale``, ``soak``, ``converge``): what it can do and how
    its run goes. :class:`Trainings` hands every line the same :class:`TrainConfig` and records what it returns;
    a new line is a subclass and its catalogue entry naming it (``Line.training`` in bench/results/lines.py, which
    :data:`REGISTRY` is read from; every transport is a :class:`TransportTraining`)."""

    #: its runs move tensors between processes (``bench soak`` checks them, ``bench converge`` trains over them)
    crosses_processes: ClassVar[bool] = True
    #: one process however many servers (``bench scale`` runs it once, and its figure scales it)
    one_process: ClassVar[bool] = False

    @abstractmethod
    def train(self, config: TrainConfig, launcher: Launcher, on_step: Callable[[int, int], None] | None = None
              ) -> tuple[ModelRecord, dict[str, list] | None]:
        """Run ``config`` through ``launcher``: the ``model`` record and its samples (None when the line has none)."""


class TransportTraining(TrainingLine):
    """The parameter-server runtime over one of our transports (``config.transport``, with its options)."""

    def train(self, config: TrainConfig, launcher: Launcher, on_step: Callable[[int, int], None] | None = None
              ) -> tuple[ModelRecord, dict[str, list] | None]:
        outcome = train(config, launcher, on_step)["outcome"]
        return model_record(config, outcome), step_samples(outcome)


class LocalTraining(TrainingLine):
    """The paper's Local line: the same updates on the same batches in one process, no communication."""

    crosses_processes = False
    one_process = True

    def train(self, config: TrainConfig, launcher: Launcher, on_step: Callable[[int, int], None] | None = None
              ) -> tuple[ModelRecord, dict[str, list] | None]:
        times = train_local(config, launcher)
        return local_record(config, times), {"worker": [0] * len(times.steps), "step_time_s": list(times.steps)}


class TfGrpcTraining(TrainingLine):
    """TensorFlow's own parameter-server training of the same model over its gRPC (it times steps its own way:
    no samples)."""

    def train(self, config: TrainConfig, launcher: Launcher, on_step: Callable[[int, int], None] | None = None
              ) -> tuple[ModelRecord, dict[str, list] | None]:
        return tf_grpc_record(config, launcher), None


#: the training lines that are not one of our transports, in the catalogue's order: its lines that name a training
#: line (bench.results.lines, ``Line.training``); every registered transport is a :class:`TransportTraining`
REGISTRY = Registry("training line", {line.name: line.training for line in catalogue.trained()})


def line_of(name: str) -> TrainingLine:
    """The training line called ``name`` (a transport's, ``local``, ``tf_grpc``, ``torch_rpc`` or ``torch_ddp``)."""
    return REGISTRY.load(name)() if name in REGISTRY else TransportTraining()


def tf_grpc_record(config: TrainConfig, launcher: Launcher) -> ModelRecord:
    """TensorFlow's own parameter-server training of the same model (bench/experiments/tf_grpc.py) as a ``model``
    record."""
    from bench.experiments.tf_grpc import record_row, run_tf_grpc

    if config.replayed:
        raise ValueError("tf_grpc runs TensorFlow's own training: it cannot replay compute (use --compute real)")
    if config.framework != "tensorflow":
        raise ValueError(f"tf_grpc trains TensorFlow models, not {config.framework}'s (torch_rpc is PyTorch's "
                         "parameter server: use it, or --framework tensorflow)")
    definition = config.workload
    record = run_tf_grpc(definition.build, definition.make_batch, definition.loss_fn, batch_size=config.batch_size,
                         servers=config.servers, steps=config.steps, warmup=config.warmup,
                         learning_rate=config.learning_rate, timeout_s=config.timeout_s, launcher=launcher)
    record.update(transport=TF_GRPC, model=config.model, compute="real")
    return record_row(record)
