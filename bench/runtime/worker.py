"""A worker's side of parameter-server training: its loop, its step's sends, its compute (real or replayed).

Replayed compute (``compute`` ``replay`` or ``paper``): a worker waits
``compute_s`` per step instead of running the model, then sends
gradient-shaped tensors (built once in memory from ``transport.placement.allocate``);
the parameter servers start from seeded random weights of the variables'
shapes. Nobody builds the model: the variables come from the analyzer, run
once beforehand (:func:`bench.experiments.training.profile`), which also measures the compute time that
``replay`` waits. Every transfer, ledger entry and runtime copy is the same as
with real compute; only the CPU the model would take is left out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from bench.runtime.analyzer import Plan, gradient_key, update_keys, weight_key
from bench.runtime.config import RuntimeCopies, StepTimes, TrainConfig, build_model, framework, worker_batch
from bench.runtime.framework import SparseGradient
from bench.runtime.sites import AllocationSites
from bench.runtime.stopping import Stopping
from bench.runtime.workload import RealData
from transports import Key, TensorSpec
from transports.ledger import Ledger
from transports.tensors import to_device, to_host


def run_worker(config: TrainConfig, transport, plan: Plan, server: int,
               on_step: Callable[[int], None] = lambda step: None,
               on_loss: Callable[[int, float, float], None] | None = None,
               on_eval: Callable[[dict[str, Any]], None] | None = None,
               stopping: Stopping | None = None) -> StepTimes:
    """A worker's training loop; returns the timings of the timed steps.

    Every step it receives every variable's value (weights and state, :attr:`Plan.variables`), computes,
    and sends each variable's update to its PS (:func:`update_keys`: a gradient, a sparse gradient's two
    parts, or a state's new value). In the first step it traces where the tensors it sends were produced
    (:class:`AllocationSites`), when the transport sends from registered memory without copies.

    Dense gradients are sent as soon as TensorFlow has computed their bucket, while the rest of the backward pass
    runs (:class:`StepSends`): the parameter server applies them and sends their next values meanwhile, as
    TensorFlow's own dataflow overlaps a step's transfers with its compute; the other updates are sent once the
    step's compute is done. ``times.compute`` is the step's compute with the sends it posted; ``comm`` the rest.

    ``on_step(step)`` is called as each step begins, and with the number of steps run at the end.
    ``on_loss(step, loss, trained_s)`` gets each step's training loss (real compute only) and the
    seconds trained before the step began (leaving out evaluations). Worker 0 evaluates the held-out
    set every ``config.evaluate_every`` steps and at the last, on the weights of that step, and hands
    ``on_eval`` the task's numbers with ``step`` and ``wall_s``.
    """
    layout = plan.layout
    rank = layout.worker(server)
    variables = list(plan.variables)
    copies = RuntimeCopies()
    if config.replayed:
        compute = replayed_compute(config, transport, plan, rank)
    else:
        compute = _model_compute(config, transport, plan, server)
    # (device memory: a gradient is registered where it lies, the allocator's regions are not traced)
    tracing = transport.placement.zero_copy_sends and not config.memory_kind.is_device
    sites = AllocationSites(transport, plan, rank) if tracing else None
    stopping = stopping or Stopping(config)
    evaluating_here = config.evaluate_every and server == 0 and on_eval is not None
    evaluate = _evaluator(config, len(plan.trainable)) if evaluating_here else None
    times = StepTimes()
    stats0, cpu0 = transport.stats(), time.process_time()
    began, evaluating = time.perf_counter(), 0.0
    step = 0
    while step < stopping.poll():
        trained_s = time.perf_counter() - began - evaluating
        if server == 0:
            stopping.decide(step, trained_s)
        on_step(step)
        if step == config.warmup:
            times = StepTimes()
            copies.bytes = 0
            stats0, cpu0 = transport.stats(), time.process_time()
        started = time.perf_counter()
        values = transport.recv_many([Key(weight_key(v), step, layout.ps_of(v), rank) for v in variables])
        received = time.perf_counter()
        evaluated = 0.0  # seconds evaluating in this step: not training, left out of every time
        if evaluate is not None and (step % config.evaluate_every == 0 or step + 1 == stopping.poll()):
            on_eval({"step": step, "wall_s": trained_s, **evaluate(values[:len(plan.trainable)])})
            evaluated = time.perf_counter() - received
            evaluating += evaluated
        sends = StepSends(transport, plan, rank, step)
        loss, updates = compute(step, values, copies, sends)
        computed = time.perf_counter()
        sends.post_rest(updates)
        if on_loss is not None and loss is not None:
            on_loss(step, float(loss), trained_s)
        sends.wait(config.timeout_s)
        times.extra["updates_sent_early"] = times.extra.get("updates_sent_early", 0) + sends.early
        if sites is not None:  # where TensorFlow put what was sent: its regions registered for the next steps
            misses = transport.stats().sends_unregistered
            if step == 0 or misses > sites.misses_seen:  # nothing missed: nothing to look up (the steady state)
                sites.trace(updates, first=step == 0)
            sites.misses_seen = misses
        done = time.perf_counter()
        times.total += done - started - evaluated
        if not config.constant_memory:  # a soak keeps no list that grows with its steps (its records want the mean)
            times.steps.append(done - started - evaluated)
        times.compute += computed - received - evaluated
        times.comm += (received - started) + (done - computed)
        step += 1
    on_step(step)
    times.extra["steps_run"] = step
    times.copied_bytes = copies.bytes
    times.extra["model_mb"] = sum(v.nbytes for v in plan.trainable) / 2**20
    times.extra["stats"] = (transport.stats() - stats0).as_dict()
    times.extra["cpu_s"] = time.process_time() - cpu0  # every thread of the process, in the timed steps
    if sites is not None:
        times.extra["sites"] = sites.summary()
    return times


#: what a worker's compute gives: the loss (None when replayed), and per variable the tensors to send
Updates = list[list[tuple[str, np.ndarray]]]


class StepSends:
    """One step's sends of a worker's updates, each posted as soon as it is ready: dense gradients by TensorFlow's
threads the moment the backward pass has computed their bucket (``Framework.step``'s ``on_gradients``), the
    others by :meth:`post_rest` once the step's compute is done. Each array is held until its send is done. A send
    that fails to start on TensorFlow's threads is not raised into TensorFlow: its error waits in :meth:`wait`."""

    def __init__(self, transport, plan: Plan, rank: int, step: int) -> None:
        self._transport, self._rank, self.step = transport, rank, step
        self._variables, self._layout = plan.variables, plan.layout
        #: (variable position, update name) -> the send, and the array it reads
        self._posted: dict[tuple[int, str], tuple[Future, np.ndarray]] = {}
        self._lock = threading.Lock()
        #: how many were posted before the step's compute was done
        self.early = 0

    def post(self, position: int, name: str, array: np.ndarray) -> None:
        """Send update ``name`` of the variable at ``position`` of the plan's variables, now."""
        key = Key(name, self.step, self._rank, self._layout.ps_of(self._variables[position]))
        try:
            sending = self._transport.send_async(key, array)
        except BaseException as exc:  # raised by wait(), in the worker's own thread
            sending = Future()
            sending.set_exception(exc)
        with self._lock:
            self._posted[(position, name)] = (sending, array)

    def post_rest(self, updates: Updates) -> None:
        """The step's compute is done: send every update of ``updates`` not sent yet."""
        self.early = len(self._posted)
        for position, parts in enumerate(updates):
            for name, array in parts:
                if (position, name) not in self._posted:
                    self.post(position, name, array)

    def wait(self, timeout_s: float) -> None:
        """Until every send is done (each may take ``timeout_s``)."""
        for sending, _ in self._posted.values():
            sending.result(timeout_s)


def _model_compute(config: TrainConfig, transport, plan: Plan,
                   server: int) -> Callable[[int, list[np.ndarray], RuntimeCopies, StepSends], tuple[Any, Updates]]:
    """One forward and backward pass of the real model on the values received (entering the framework through
    DLPack): ``compute(step, values, copies, sends) -> (loss, updates)``; dense gradients go to ``sends`` as soon as
    their bucket is computed."""
    memory = config.memory_kind
    model = build_model(config, memory)
    under_way: StepSends | _Unsent = _Unsent()  # the sends of the step under way, for the gradients' hand-over

    def hand_over(positions: list[int], gradients: list[np.ndarray]) -> None:
        for position, gradient in zip(positions, gradients, strict=True):
            under_way.post(position, gradient_key(plan.trainable[position]), gradient)

    step_fn = framework(config).step(model, config.workload, list(plan.variables), on_gradients=hand_over)
    rows = SparseRows(transport, plan, plan.layout.worker(server))
    if isinstance(config.workload, RealData):  # trace the step now: a convergence run's clock leaves the tracing out
        values = [to_device(value, memory, Ledger()) for value in framework(config).initial_values(model)]
        step_fn(values, *worker_batch(config, server, 0), RuntimeCopies())

    def compute(step: int, values: list[np.ndarray], copies: RuntimeCopies,
                sends: StepSends) -> tuple[Any, Updates]:
        nonlocal under_way
        x, y = worker_batch(config, server, step)
        under_way = sends
        try:
            result = step_fn(values, x, y, copies)
        finally:
            under_way = _Unsent()
        return result.loss, rows.updates(plan, result.gradients, result.new_state)

    return compute


class _Unsent:
    """Where the gradients of a step that sends nothing go (the tracing step): nowhere."""

    def post(self, position: int, name: str, array: np.ndarray) -> None:
        pass


class SparseRows:
    """A worker's memory for its sparse gradients' distinct rows: allocated once per variable, at the bound
    the analyzer found, from the transport (registered memory where the transport sends without copies);
    each step's rows are written there (:func:`distinct_rows`) and sent as a view of the rows used."""

    def __init__(self, transport, plan: Plan, rank: int) -> None:
        self.buffers: dict[int, list[np.ndarray]] = {}
        for variable in plan.trainable:
            if variable.sparse:
                ps = plan.layout.ps_of(variable)
                transfers = [plan.transfer(name, rank, ps) for name in update_keys(variable)]
                place = transport.placement
                self.buffers[variable.index] = [place.allocate(TensorSpec(t.name, t.bound, t.dtype, rank, ps))
                                                for t in transfers]

    def updates(self, plan: Plan, grads: list[np.ndarray | SparseGradient], new_state: list[np.ndarray]) -> Updates:
        """What to send for every variable, from the step's gradients and new state."""
        updates: Updates = []
        for variable, gradient in zip(plan.trainable, grads, strict=True):
            if variable.sparse:
                values, indices = distinct_rows(gradient.values, gradient.indices, *self.buffers[variable.index])
                updates.append(list(zip(update_keys(variable), (values, indices), strict=True)))
            else:
                updates.append([(gradient_key(variable), gradient)])
        for variable, value in zip(plan.state, new_state, strict=True):
            updates.append([(gradient_key(variable), value)])
        return updates


def distinct_rows(values: np.ndarray, indices: np.ndarray, values_out: np.ndarray,
                  indices_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sparse gradient as its distinct rows, duplicates summed (as TensorFlow's optimizers do), written into
    ``values_out`` and ``indices_out``; returns the views of them that hold it (how many rows changes)."""
    unique, inverse = np.unique(indices, return_inverse=True)
    count = unique.size
    if count > len(indices_out) or values.shape[1:] != values_out.shape[1:]:
        raise ValueError(f"a sparse gradient of {count} rows of {values.shape[1:]} does not fit the "
                         f"{len(indices_out)} rows of {values_out.shape[1:]} planned for it")
    rows = values_out[:count]
    rows[...] = 0
    np.add.at(rows, inverse.reshape(-1), values)
    indices_out[:count] = unique
    return rows, indices_out[:count]


def _evaluator(config: TrainConfig, trainable: int) -> Callable[[list[np.ndarray]], dict[str, float]]:
    """The task's held-out loss and metric for given weights (a model of its own, inference only)."""
    predictor = framework(config).predictor(build_model(config), config.workload, trainable)

    def evaluate(weights: list[np.ndarray]) -> dict[str, float]:  # (on the host: device weights copied off)
        return config.workload.evaluate(predictor([to_host(w, Ledger()) for w in weights]))

    return evaluate


def replayed_compute(config: TrainConfig, transport, plan: Plan,
                      rank: int) -> Callable[[int, list[np.ndarray], RuntimeCopies], tuple]:
    """Wait the compute time instead of computing; the updates are tensors built once where they are sent from
    (a sparse gradient: half its bound of distinct rows)."""
    layout = plan.layout
    updates: Updates = []
    for variable in plan.variables:
        parts = []
        for name in update_keys(variable):
            transfer = plan.transfer(name, rank, layout.ps_of(variable))
            shape = transfer.shape if transfer.shape is not None else transfer.bound
            if shape is None:
                raise ValueError(f"replayed compute needs a bound on the shape of dynamic tensor '{name}'")
            tensor = transport.placement.allocate(TensorSpec(name, shape, transfer.dtype, rank, transfer.dst,
                                                             config.memory, config.memory))
            if transfer.shape is None:  # a sparse gradient's distinct rows
                tensor = tensor[:max(1, min(shape[0] // 2, variable.shape[0]))]
            if name.endswith(".indices"):
                tensor[...] = np.arange(len(tensor))
            else:
                tensor[...] = 1e-3 if np.dtype(transfer.dtype).kind == "f" else 0
            parts.append((name, tensor))
        updates.append(parts)

    def compute(step: int, values: list[np.ndarray], copies: RuntimeCopies, sends: StepSends) -> tuple[None, Updates]:
        for value in values:  # what entering TensorFlow would copy, it copies here too (the stricter framework)
            copies.adoptable(value)
        time.sleep(config.compute_s)
        return None, updates

    return compute
