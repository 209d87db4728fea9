"""``bench predict``'s grid (issue 62, items 3 and 4): models x transports x servers x link rates -> records.

Each model is analysed once per batch size, for one server (:func:`analyse`: the framework builds the model and
traces its step, seconds for TensorFlow); a plan for N servers is then the same variables and the same per-worker
updates laid out again by the runtime's own placement (:meth:`bench.runtime.analyzer.Plan.for_servers`, as
``bench scale`` lays out its replayed runs), with no model built again. What :func:`simulate` reads of a plan is its
variables, its server count and worker 0's transfers (each update's bytes), so this is the plan the analyzer would
give at N servers (``tests/test_predict_cli.py`` checks it against one analysed at 2).

Compute per step is the paper's Table 2 time per sample times the batch size (``paper``), or one worker's step
measured here once (``replay``: :func:`bench.experiments.training.profile`, as ``bench scale`` replays it).

Per line (model, batch size, link rate, transport), :func:`saturation` says which resource saturates first and at
how many servers: the first server count whose busiest resource is busy at least :data:`SATURATED` of the step.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.experiments.predict.costs import TransferCost, sizes_needed
from bench.experiments.predict.simulate import Cluster, StepPrediction, simulate_rates
from bench.results.lines import GRPC_RDMA, GRPC_TCP, RDMA_CP, ZERO_COPY
from bench.results.records import PredictRecord
from bench.runtime.analyzer import Plan

#: a resource busy at least this share of a step is saturated: the step cannot shorten without relieving it
SATURATED = 0.9
#: the most servers a prediction takes (the simulation's classes keep it quick; beyond this nobody asked)
MAX_SERVERS = 4096
#: the default grid (issue 62): the paper's six models, its four transports, 1 to 256 servers, 10 to 400 Gb/s
DEFAULT_TRANSPORTS = (ZERO_COPY, RDMA_CP, GRPC_RDMA, GRPC_TCP)
DEFAULT_SERVERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_LINK_RATES = "10gbit,100gbit,400gbit"
#: the smallest size an on-the-spot micro run measures (below it a transfer's host time is taken as flat)
SMALLEST_MEASURED = 1024
#: the share of a step's compute that is the backward pass, over which real training's gradients leave
BACKWARD_FRACTION = 2 / 3
#: ``--compute`` modes bench predict takes (``real`` would need a cluster)
COMPUTE_MODES = ("replay", "paper")


@dataclass(frozen=True)
class LinkRate:
    """A link rate as given (``10gbit``) and in bits per second."""

    text: str
    bps: int


@dataclass(frozen=True)
class ModelPlan:
    """A model analysed once: its plan for one server and one worker's compute seconds per step."""

    model: str
    framework: str
    framework_version: str
    batch_size: int
    plan: Plan
    compute: str
    compute_s: float

    @property
    def backward_fraction(self) -> float:
        """The share of a step's compute over which its gradients leave (:func:`simulate`'s): none with ``replay``,
        as ``bench scale``'s replaying workers post every update once their wait is over; the backward pass's
        (:data:`BACKWARD_FRACTION`) with ``paper``, as the paper's runs trained for real, each gradient sent as the
        backward pass made it (so do ``bench scale``'s with real compute, in the runtime's buckets)."""
        return 0.0 if self.compute == "replay" else BACKWARD_FRACTION


def paper_compute_s(model: str, framework: str, batch_size: int) -> float:
    """The paper's Table 2 compute per step of ``model`` at ``batch_size`` (seconds); ValueError naming the fix."""
    from bench.experiments.models import resolve_model

    per_sample = getattr(resolve_model(model, framework=framework), "paper_compute_ms_per_sample", None)
    if per_sample is None:
        raise ValueError(f"the paper gives no compute time for model '{model}'; use --compute replay")
    return per_sample * batch_size / 1e3


def measured_compute_s(run_dir: str, model: str, framework: str, batch_size: int) -> float:
    """One worker's compute seconds per step of ``model`` at ``batch_size`` as a ``bench scale`` or ``bench model``
    run with replayed compute waited it (the median of its records' ``compute_s``); ValueError naming the fix."""
    from bench.results import ResultsError, load_run

    try:
        records = load_run(Path(run_dir)).records
    except (ResultsError, OSError) as exc:
        raise ValueError(f"--compute-from {run_dir}: {str(exc).splitlines()[0]}") from None
    if "compute_s" not in records or "compute" not in records:
        raise ValueError(f"--compute-from {run_dir} is not a bench scale or bench model run; give one of those")
    rows = records[(records["model"] == model) & (records["batch_size"] == batch_size)
                   & (records["framework"] == framework) & (records["compute"] == "replay")]
    if rows.empty:
        raise ValueError(f"--compute-from {run_dir} has no {framework} {model} at batch size {batch_size} with "
                         f"replayed compute; give a run of it (bench scale {model} --batch-size {batch_size})")
    return float(rows["compute_s"].median())


def analyse(model: str, framework: str, batch_size: int, compute: str,
            compute_s: float | None = None) -> ModelPlan:
    """``model`` built and its step traced once, in this process, for one server; its compute timed here
    (``replay``: the median of 5 steps after 2 warm-up ones, at ``batch_size``) or the paper's (``paper``).

    With the paper's compute the step is traced at batch size 1 first (PyTorch's trace runs the step: VGG16 at
    batch 32 took 51 s here, at 1 two): a plan whose every tensor is static and dense has the variables' shapes,
    the same at any batch size, so it is that plan; a model with a sparse or dynamic tensor is traced again at
    ``batch_size``. ``compute_s`` (``replay`` only): the seconds to take instead of timing the step (a run's,
    :func:`measured_compute_s`)."""
    from bench.experiments.training import model_config, profile
    from bench.runtime.framework import framework_named

    def traced(batch: int, steps: int) -> tuple[Plan, float]:
        config = model_config(model, framework=framework, transport=ZERO_COPY, transport_options={},
                              batch_size=batch, servers=1, compute=compute)
        return profile(config, None, steps=steps)

    version = framework_named(framework).version()
    if compute == "replay" and compute_s is not None:  # the compute of a run to check against, not timed again
        return ModelPlan(model, framework, version, batch_size, traced(batch_size, 0)[0], compute, compute_s)
    if compute == "replay":
        plan, measured = traced(batch_size, 5)
        return ModelPlan(model, framework, version, batch_size, plan, compute, measured)
    seconds = paper_compute_s(model, framework, batch_size)
    plan, _ = traced(1, 0)
    if batch_size != 1:
        plan = replace(plan, batch_size=batch_size) if batch_independent(plan) else traced(batch_size, 0)[0]
    return ModelPlan(model, framework, version, batch_size, plan, compute, seconds)


def batch_independent(plan: Plan) -> bool:
    """Whether ``plan`` is the same at every batch size: no sparse variable and every tensor's shape static (then
    each is a variable's value or its gradient or new state, of the variable's shape)."""
    return not any(v.sparse for v in plan.variables) and all(t.static for t in plan.transfers)


def micro_sizes(plans: list[Plan]) -> list[int]:
    """What a ``bench micro`` made for ``plans`` on the spot measures: from the smallest tensor (at least
    :data:`SMALLEST_MEASURED`) in steps of x4, up to the first size at or past the largest; the costs interpolate
    between them (:mod:`.costs`)."""
    needed = sorted({size for plan in plans for size in sizes_needed(plan)}) or [SMALLEST_MEASURED]
    sizes = [max(SMALLEST_MEASURED, 1 << (needed[0].bit_length() - 1))]
    while sizes[-1] < needed[-1]:
        sizes.append(sizes[-1] * 4)
    return sizes


def _fraction(prediction: StepPrediction, part: str) -> float:
    values = [f[part] for f in prediction.fractions]
    return sum(values) / len(values) if values else 0.0


def record_of(model: ModelPlan, transport: str, servers: int, rate: LinkRate, prediction: StepPrediction,
              single: StepPrediction, micro_run: str, cluster: Cluster | None = None,
              asynchronous: bool = False) -> PredictRecord:
    """The record of one grid point; ``single`` is the same line's 1-server prediction (for the efficiency);
    ``cluster``: any of the grid's clusters (its cores, shared cores and oversubscription are recorded; default:
    :class:`Cluster`'s)."""
    cluster = cluster or Cluster(servers)
    per_worker = prediction.steps_per_s
    total = servers * per_worker
    nic = max((sent + received for sent, received in prediction.nic_bytes.values()), default=0)
    return PredictRecord(
        transport=transport, framework=model.framework, framework_version=model.framework_version,
        model=model.model, batch_size=model.batch_size, servers=servers, link_rate=rate.text,
        link_rate_bps=float(rate.bps), cores_per_host=cluster.cores_per_host, shared_cores=cluster.shared_cores,
        oversubscription=cluster.oversubscription, asynchronous=asynchronous, compute=model.compute,
        compute_s=model.compute_s, step_time_s=prediction.step_s, throughput_batches_per_s=per_worker,
        total_batches_per_s=total, scaling_efficiency=total / (servers * single.steps_per_s),
        compute_fraction=_fraction(prediction, "compute"), host_fraction=_fraction(prediction, "host"),
        wire_fraction=_fraction(prediction, "wire"), wait_fraction=_fraction(prediction, "waiting"),
        saturated=prediction.saturated, saturated_utilisation=prediction.utilisation, nic_bytes_per_step=int(nic),
        classes=prediction.classes, micro_run=micro_run)


def grid_size(models: int, transports: list[str], servers: list[int], rates: list[LinkRate]) -> int:
    """The predictions :func:`predict` makes for ``models`` models (the 1-server ones the efficiency needs
    included)."""
    counts = set(servers) | {1}
    return models * len(transports) * len(counts) * len(rates)


def _simulate_count(plan: Plan, servers: int, rates: list[LinkRate], costs: dict[str, TransferCost],
                    compute_s: float, cluster: dict[str, Any], asynchronous: bool = False,
                    backward_fraction: float = BACKWARD_FRACTION) -> dict[tuple[str, str], StepPrediction]:
    """Every link rate and transport at one server count: ``plan`` laid out once for it (a job of the pool); the
    rates of a transport together, so that a faster link never predicts a slower step (:func:`simulate_rates`)."""
    laid = plan.for_servers(servers)
    by_transport = {transport: simulate_rates(laid, cost, Cluster(servers, **cluster), [rate.bps for rate in rates],
                                              compute_s, backward_fraction=backward_fraction,
                                              asynchronous=asynchronous)
                    for transport, cost in costs.items()}
    return {(rate.text, transport): by_transport[transport][rate.bps] for rate in rates for transport in costs}


def predict(models: Iterable[ModelPlan], costs: dict[str, TransferCost], servers: list[int], rates: list[LinkRate],
            micro_run: str, on_prediction: Callable[[int], Any] | None = None, processes: int = 1,
            asynchronous: bool = False, **cluster: Any) -> Iterator[PredictRecord]:
    """A record per model, server count (ascending), link rate and transport (in the order of ``costs``); each
    plan laid out once per server count. ``cluster``: more :class:`Cluster` settings (``cores_per_host``,
    ``shared_cores``, ``oversubscription``; a ValueError names one it cannot take); ``asynchronous``: the
    parameter servers apply each worker's gradient as it comes (:func:`simulate`). Both are in every record.

    With ``processes`` > 1 the server counts are simulated by that many processes (one job per model and server
    count), the models taken from ``models`` as the jobs go (it may analyse each as it is asked for: the next
    model is analysed while the pool simulates the last); ``on_prediction(n)`` is told of ``n`` more done."""
    shape = Cluster(1, **cluster)  # checked before any model is asked for
    counts = sorted(set(servers) | {1})
    each = len(rates) * len(costs)

    def done(_future: Any = None) -> None:
        if on_prediction is not None:
            on_prediction(each)

    def records(model: ModelPlan, results: dict[int, dict[tuple[str, str], StepPrediction]]) -> list[PredictRecord]:
        return [record_of(model, transport, n, rate, results[n][(rate.text, transport)],
                          results[1][(rate.text, transport)], micro_run, shape, asynchronous)
                for n in counts if n in servers for rate in rates for transport in costs]

    if processes <= 1:
        for model in models:
            results = {}
            for n in counts:
                results[n] = _simulate_count(model.plan, n, rates, costs, model.compute_s, cluster, asynchronous,
                                             model.backward_fraction)
                done()
            yield from records(model, results)
        return
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = []
        for model in models:
            futures = {}
            for n in reversed(counts):  # the largest first: the longest jobs start soonest
                futures[n] = pool.submit(_simulate_count, model.plan, n, rates, costs, model.compute_s, cluster,
                                         asynchronous, model.backward_fraction)
                futures[n].add_done_callback(done)
            jobs.append((model, futures))
        for model, futures in jobs:
            yield from records(model, {n: future.result() for n, future in futures.items()})


@dataclass(frozen=True)
class Saturation:
    """Where a line saturates first: the server count, the resource and its busy share of the step."""

    servers: int
    resource: str
    utilisation: float


def saturation(records: list[PredictRecord]) -> dict[tuple[str, int, str, str], Saturation | None]:
    """Per line (model, batch size, link rate, transport): the fewest servers at which a resource is busy at least
    :data:`SATURATED` of the step, and which; None where none is at any server count of the grid."""
    lines: dict[tuple[str, int, str, str], Saturation | None] = {}
    for r in sorted(records, key=lambda r: r.servers):
        key = (r.model, r.batch_size, r.link_rate, r.transport)
        lines.setdefault(key, None)
        if lines[key] is None and r.saturated_utilisation >= SATURATED:
            lines[key] = Saturation(r.servers, r.saturated, r.saturated_utilisation)
    return lines

