"""Parameter-server data-parallel training over any transport (the paper's section 5.2 setup).

``servers`` servers each run a worker and a parameter server (PS) process.
Trainable variables are placed round-robin over the PS processes. Every step:

* each PS sends its variables' current values to every worker;
* each worker receives them (all receives of a step posted together,
  ``Transport.recv_many``), computes gradients on its own synthetic batch,
  and sends each gradient to the variable's PS;
* each PS sums the gradients of all workers and applies SGD
  (``w -= lr * mean(g)``): synchronous training. With ``asynchronous`` the PS
  serves each worker on its own, applying every gradient as it arrives, so
  workers never wait for each other.

The PS overlaps what the paper's dataflow graph overlaps: it takes a step's
gradients as they arrive (``Transport.recv_each``), and as soon as one variable
has the gradients of every worker it applies SGD to that variable and sends its
next weights on, while the gradients of other variables are still on their way.

Zero copy through TensorFlow: received weights enter the model through DLPack
(``keras.Model.stateless_call`` takes tensors instead of variables), so a
weight written by the transport into registered memory is used in place.
Gradients leave from TensorFlow's own buffers through DLPack. Where a tensor
cannot cross without a copy (read-only or misaligned memory: TensorFlow needs
64-byte alignment), the runtime copies it and counts the bytes.

Replayed compute (``compute`` ``replay`` or ``paper``): a worker waits
``compute_s`` per step instead of running the model, then sends
gradient-shaped tensors (built once in memory from ``Transport.allocate``);
the parameter servers start from seeded random weights of the variables'
shapes. Nobody builds the model: the variables come from the analyzer, run
once beforehand (:func:`profile`), which also measures the compute time that
``replay`` waits. Every transfer, ledger entry and runtime copy is the same as
with real compute; only the CPU the model would take is left out.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import transports
from bench.memory import return_large_frees
from bench.runtime.analyzer import (
    Plan,
    Variable,
    analyze,
    gradient_key,
    step_function,
    traced_step,
    update_keys,
    weight_key,
)
from bench.runtime.sites import AllocationSites
from bench.stats import RssTrace
from transports import Key, TensorSpec, fabric
from transports.common import aligned_empty

ALIGNMENT = 64
_SLICE = 1 << 20  # elements per slice of an SGD update


@dataclass
class TrainConfig:
    """What to train and how."""

    model: str
    transport: str
    transport_options: dict[str, Any]
    batch_size: int
    servers: int = 1
    steps: int = 20
    warmup: int = 2
    learning_rate: float = 0.01
    seed: int = 0
    timeout_s: float = 600.0
    #: how records name the transport (``grpc_rdma:direct``); defaults to ``transport``
    label: str = ""
    #: asynchronous SGD: each PS applies every worker's gradients as they come, workers never wait for each other
    asynchronous: bool = False
    #: ``real`` runs the model; ``replay`` and ``paper`` wait ``compute_s`` per step instead (see the module)
    compute: str = "real"
    compute_s: float = 0.0
    #: the analyzer's plan (from :func:`profile`); None: each process analyses the model it builds
    plan: Plan | None = None
    #: check the content of every tensor received (the soak): see :class:`CheckedTransport`
    check: bool = False
    #: train a task of ``bench.tasks`` on its real data (``bench converge``) instead of a model on synthetic batches
    task: bool = False
    #: where the task's data is (``--data``), for the tasks that need some
    data: str | None = None
    #: evaluate on the held-out set every this many steps and at the last (worker 0; 0: never)
    evaluate_every: int = 0
    #: stop once worker 0 has trained this many seconds (``steps`` is then the most it runs); None: run ``steps``
    time_s: float | None = None

    @property
    def replayed(self) -> bool:
        return self.compute != "real"


@dataclass
class StepTimes:
    """Seconds per step spent in each phase, summed over the timed steps."""

    total: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    apply: float = 0.0
    copied_bytes: int = 0
    #: each timed step's seconds (workers and the local line; ``total`` is their sum)
    steps: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class RuntimeCopies:
    """Counts the payload bytes the runtime itself copies to hand tensors to or from TensorFlow."""

    def __init__(self) -> None:
        self.bytes = 0

    def adoptable(self, array: np.ndarray) -> np.ndarray:
        """``array``, or an aligned copy when TensorFlow could not adopt its memory (read-only, misaligned)."""
        if not array.flags.writeable or not array.flags.c_contiguous or array.ctypes.data % ALIGNMENT:
            array = aligned_copy(array)
            self.bytes += array.nbytes
        return array

    def tensor(self, array: np.ndarray):
        """A TensorFlow tensor over ``array``'s memory (DLPack), or over an aligned copy when it must be."""
        import tensorflow as tf

        return tf.experimental.dlpack.from_dlpack(self.adoptable(array).__dlpack__())

    @staticmethod
    def array(tensor) -> np.ndarray:
        """A numpy view of a TensorFlow tensor's memory (DLPack), no copy."""
        return np.from_dlpack(tensor)


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A writable, C-contiguous, 64-byte aligned copy of ``array``."""
    out = aligned_empty(array.shape, array.dtype, ALIGNMENT)
    out[...] = array
    return out


def resolve_model(name: str):
    """A model definition by name (``vgg16``), or ``package.module:ATTRIBUTE`` for one defined elsewhere."""
    if ":" in name:
        import importlib

        module, _, attribute = name.partition(":")
        return getattr(importlib.import_module(module), attribute)
    from bench.models import get_model

    return get_model(name)


def definition_of(config: TrainConfig):
    """What ``config`` trains: a task of ``bench.tasks`` (real data), or a model definition (synthetic batches)."""
    if config.task:
        from bench.tasks import get_task

        return get_task(config.model, config.data)
    return resolve_model(config.model)


def _batch(definition, config: TrainConfig, server: int, step: int):
    """Worker ``server``'s batch at ``step``: a task's shard of its training set, or a seeded synthetic batch."""
    if config.task:
        return definition.train_batch(step, server, config.servers, config.batch_size)
    return definition.make_batch(config.batch_size, seed=config.seed + 1000 * server + step)


def _build(config: TrainConfig):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # TensorFlow's BFC allocator on the CPU: it carves tensors out of a few large regions it keeps, so
    # the regions that hold the tensors a worker sends can be registered once (bench.runtime.sites).
    # Every transport and the local line run with it (set before TensorFlow is first imported).
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    import keras

    definition = definition_of(config)
    # Keras names layers with a per-process counter: a fresh session keeps the variables' paths (the plan's) the
    # same however many models this process built before
    keras.backend.clear_session()
    keras.utils.set_random_seed(config.seed)
    model = definition.build()
    return definition, model


def plan_of(config: TrainConfig) -> Plan:
    """The analyzer's plan for ``config``: the model built, its step function traced for the run's batches."""
    definition, model = _build(config)
    x, y = _batch(definition, config, 0, 0)
    return analyze(config.model, model, definition.loss_fn(), np.asarray(x), np.asarray(y), config.servers,
                   config.batch_size)


# -- the roles -----------------------------------------------------------------


class Stopping:
    """Where a run's steps end: ``warmup + steps``, or sooner when it trains for a time (``time_s``).

    Synchronous training stops at one step for every rank. Worker 0 decides: once it has trained
    ``time_s`` seconds it picks an end :data:`MARGIN_STEPS` steps ahead and tells every other rank
    through the launcher, going on only once each has the word in its inbox (``tell``: their hub threads
    confirm it, whatever their loops are doing); they look for it at every step (``poll``). No rank can
    begin a step past the one worker 0 is in before the word is there: each step waits for worker 0's
    gradients (a word merely sent could still be on its way, on a busy machine, when a PS begins the
    step after the end and waits for gradients that never come).
    """

    #: how many steps after worker 0's decision the run ends
    MARGIN_STEPS = 3

    def __init__(self, config: TrainConfig, ctx=None) -> None:
        self.end = config.warmup + config.steps
        self.time_s = config.time_s
        self.timeout_s = config.timeout_s
        self._ctx = ctx

    def poll(self) -> int:
        """The end as far as this rank knows it now (reading worker 0's word if it came)."""
        if self._ctx is not None and self.time_s is not None:
            while (message := self._ctx.poll()) is not None:
                if isinstance(message, tuple) and message[:1] == ("stop",):
                    self.end = min(self.end, int(message[1]))
        return self.end

    def decide(self, step: int, trained_s: float) -> None:
        """Worker 0, as step ``step`` begins after ``trained_s`` seconds of training: end soon if the time is up."""
        if self.time_s is None or trained_s < self.time_s or self.end <= step + self.MARGIN_STEPS:
            return
        self.end = step + self.MARGIN_STEPS
        if self._ctx is not None:
            others = [rank for rank in range(self._ctx.size) if rank != self._ctx.rank]
            self._ctx.tell(others, ("stop", self.end), self.timeout_s)


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
        compute = _replayed_compute(config, transport, plan, rank)
    else:
        compute = _model_compute(config, transport, plan, server)
    sites = AllocationSites(transport, plan, rank) if getattr(transport, "zero_copy_sends", False) else None
    stopping = stopping or Stopping(config)
    evaluate = _evaluator(config) if config.evaluate_every and server == 0 and on_eval is not None else None
    times = StepTimes()
    stats0 = transport.stats()
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
            stats0 = transport.stats()
        started = time.perf_counter()
        values = transport.recv_many([Key(weight_key(v), step, layout.ps_of(v), rank) for v in variables])
        received = time.perf_counter()
        evaluated = 0.0  # seconds evaluating in this step: not training, left out of every time
        if evaluate is not None and (step % config.evaluate_every == 0 or step + 1 == stopping.poll()):
            on_eval({"step": step, "wall_s": trained_s, **evaluate(values[:len(plan.trainable)])})
            evaluated = time.perf_counter() - received
            evaluating += evaluated
        loss, updates = compute(step, values, copies)
        computed = time.perf_counter()
        sends = [transport.send_async(Key(name, step, rank, layout.ps_of(v)), array)
                 for v, parts in zip(variables, updates, strict=True) for name, array in parts]
        if on_loss is not None and loss is not None:
            on_loss(step, float(loss), trained_s)
        for sending in sends:
            sending.result(config.timeout_s)
        if sites is not None:  # where TensorFlow put what was sent: its regions registered for the next steps
            misses = transport.stats().sends_unregistered
            if step == 0 or misses > sites.misses_seen:  # nothing missed: nothing to look up (the steady state)
                sites.trace(updates, first=step == 0)
            sites.misses_seen = misses
        done = time.perf_counter()
        times.total += done - started - evaluated
        if not config.check:  # the soak keeps no list that grows with its steps (its records want the mean)
            times.steps.append(done - started - evaluated)
        times.compute += computed - received - evaluated
        times.comm += (received - started) + (done - computed)
        step += 1
    on_step(step)
    times.extra["steps_run"] = step
    times.copied_bytes = copies.bytes
    times.extra["model_mb"] = sum(v.nbytes for v in plan.trainable) / 2**20
    times.extra["stats"] = (transport.stats() - stats0).as_dict()
    if sites is not None:
        times.extra["sites"] = sites.summary()
    return times


#: what a worker's compute gives: the loss (None when replayed), and per variable the tensors to send
Updates = list[list[tuple[str, np.ndarray]]]


def _model_compute(config: TrainConfig, transport, plan: Plan,
                   server: int) -> Callable[[int, list[np.ndarray], RuntimeCopies], tuple[Any, Updates]]:
    """One forward and backward pass of the real model on the values received (entering TF through DLPack):
    ``compute(step, values, copies) -> (loss, updates)``."""
    definition, model = _build(config)
    step_fn = step_function(model, definition.loss_fn())
    rows = SparseRows(transport, plan, plan.layout.worker(server))
    trainable = len(plan.trainable)
    if config.task:  # trace the step now, so that a convergence run's clock does not count TensorFlow's tracing
        state = [v.value for v in model.non_trainable_variables]
        step_fn([v.value for v in model.trainable_variables], state, *_batch(definition, config, server, 0))

    def compute(step: int, values: list[np.ndarray], copies: RuntimeCopies) -> tuple[Any, Updates]:
        x, y = _batch(definition, config, server, step)
        tensors = [copies.tensor(value) for value in values]
        loss, grads, new_state = step_fn(tensors[:trainable], tensors[trainable:], x, y)
        return loss, rows.updates(plan, grads, new_state)

    return compute


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
                self.buffers[variable.index] = [transport.allocate(TensorSpec(t.name, t.bound, t.dtype, rank, ps))
                                                for t in transfers]

    def updates(self, plan: Plan, grads: list, new_state: list) -> Updates:
        """What to send for every variable, from the step's gradients and new state."""
        updates: Updates = []
        for variable, gradient in zip(plan.trainable, grads, strict=True):
            if variable.sparse:
                values, indices = distinct_rows(RuntimeCopies.array(gradient.values),
                                                RuntimeCopies.array(gradient.indices), *self.buffers[variable.index])
                updates.append(list(zip(update_keys(variable), (values, indices), strict=True)))
            else:
                updates.append([(gradient_key(variable), RuntimeCopies.array(gradient))])
        for variable, value in zip(plan.state, new_state, strict=True):
            updates.append([(gradient_key(variable), RuntimeCopies.array(value))])
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


def _evaluator(config: TrainConfig) -> Callable[[list[np.ndarray]], dict[str, float]]:
    """The task's held-out loss and metric for given weights (a model of its own, inference only)."""
    import tensorflow as tf

    definition, model = _build(config)
    non_trainable = [v.value for v in model.non_trainable_variables]

    @tf.function(reduce_retracing=True)
    def predict(weights, x):
        return model.stateless_call(weights, non_trainable, x, training=False)[0]

    def evaluate(weights: list[np.ndarray]) -> dict[str, float]:
        held = [tf.constant(w) for w in weights]  # a copy: the transport may write the next step's weights
        return definition.evaluate(lambda x: predict(held, x).numpy())

    return evaluate


def _replayed_compute(config: TrainConfig, transport, plan: Plan,
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
            tensor = transport.allocate(TensorSpec(name, shape, transfer.dtype, rank, transfer.dst))
            if transfer.shape is None:  # a sparse gradient's distinct rows
                tensor = tensor[:max(1, min(shape[0] // 2, variable.shape[0]))]
            if name.endswith(".indices"):
                tensor[...] = np.arange(len(tensor))
            else:
                tensor[...] = 1e-3 if np.dtype(transfer.dtype).kind == "f" else 0
            parts.append((name, tensor))
        updates.append(parts)

    def compute(step: int, values: list[np.ndarray], copies: RuntimeCopies) -> tuple[None, Updates]:
        for value in values:  # what entering TensorFlow would copy, it copies here too
            copies.adoptable(value)
        time.sleep(config.compute_s)
        return None, updates

    return compute


def run_ps(config: TrainConfig, transport, plan: Plan, server: int, stopping: Stopping | None = None) -> StepTimes:
    """A parameter server's loop: serve its variables, gather updates, apply them (until ``stopping``'s end)."""
    layout = plan.layout
    rank = layout.ps(server)
    mine = [v for v in plan.variables if layout.ps_of(v) == rank]
    initial = initial_weights(config, mine)
    weights: dict[int, np.ndarray] = {}
    for variable in mine:  # the initial values, in memory the transport can send from without copies
        spec = plan.transfer(weight_key(variable), rank, layout.worker(0)).spec()
        weights[variable.index] = transport.allocate(spec)
        weights[variable.index][...] = initial.pop(variable.index)
    workers = [layout.worker(s) for s in range(layout.servers)]
    update = threading.Lock()
    if config.asynchronous:  # one loop per worker, each applying its own gradients at once
        before = transport.stats()
        with ThreadPoolExecutor(len(workers)) as pool:
            loops = [pool.submit(_serve, config, transport, rank, mine, weights, [w], update) for w in workers]
            times = _merge([loop.result() for loop in loops])
        # the loops overlap, so the ledger is taken over the whole run and scaled to the timed steps
        whole = (transport.stats() - before).as_dict()
        share = config.steps / (config.steps + config.warmup)
        times.extra["stats"] = {name: value * share for name, value in whole.items()}
    else:
        times = _serve(config, transport, rank, mine, weights, workers, update, stopping)
    if not config.check:  # the soak compares no weights: no copy of them (fcn5's: 220 MB) in its memory trace
        times.extra["final_weights"] = {index: w.copy() for index, w in weights.items()}
    return times


def _serve(config: TrainConfig, transport, rank: int, mine: list[Variable], weights: dict[int, np.ndarray],
           workers: list[int], update: threading.Lock, stopping: Stopping | None = None) -> StepTimes:
    """Serve ``mine`` to ``workers``: send values, gather updates, apply them (under ``update``), overlapped.

    The values of step 0 go out first. Then in every step ``s`` the updates of all variables and
    workers are received together (``recv_each``); as soon as one variable has the updates of every
    worker (a sparse gradient: both its parts), the PS waits for that variable's step-``s`` sends to
    finish (the transport may read the array until then, and the update writes it in place), applies
    the update (:func:`apply_update`: SGD, or the workers' mean of a state) and sends its step-``s + 1``
    value to every worker at once, while other variables' updates are still arriving. Updates of one
    variable are applied in the order of ``workers``, whatever order they arrive in, so the result is
    the same as local training's.

    One exception: the last warm-up step sends nothing early; the first timed step begins by sending
    all its values, so the ledger of the timed steps holds exactly ``steps`` steps of sends and of
    receives (``extra["stats"]``).

    Timings of a step: ``total`` runs from waiting for its updates (or from sending its values,
    when the step begins with that) to the last variable applied and its next value posted;
    ``apply`` is the time applying updates alone (including waiting for ``update``); ``comm``
    is the rest, nearly all of it waiting for updates, plus waiting for a variable's previous
    sends to finish and posting the next ones.

    With ``asynchronous`` one such loop runs per worker over shared ``weights`` and no lock is held
    around the sends: asynchronous SGD reads weights while other workers' updates land (as
    TensorFlow's PS does by default); holding ``update`` while a send waits for its receiver could
    deadlock across parameter servers.
    """
    stopping = stopping or Stopping(config)
    times = StepTimes()
    stats0 = transport.stats()
    sending: dict[int, list] = {}  # variable index -> the sends of its value for the current step
    parts = {v.index: len(update_keys(v)) * len(workers) for v in mine}

    def send_weights(variable: Variable, step: int) -> None:
        sending[variable.index] = [transport.send_async(Key(weight_key(variable), step, rank, worker),
                                                        weights[variable.index]) for worker in workers]

    step = 0
    while step < stopping.poll():
        if step == config.warmup:
            times = StepTimes()
            stats0 = transport.stats()
        started = time.perf_counter()
        if step in (0, config.warmup):  # no step before this one sent its values
            for variable in mine:
                send_weights(variable, step)
        keys = {Key(name, step, worker, rank): v for v in mine for worker in workers for name in update_keys(v)}
        arrived: dict[int, dict[tuple[int, str], np.ndarray]] = {v.index: {} for v in mine}
        applying = 0.0
        for key, tensor in transport.recv_each(list(keys)):
            variable = keys[key]
            arrived[variable.index][(key.src, key.name)] = tensor
            if len(arrived[variable.index]) < parts[variable.index]:
                continue
            for sent in sending.pop(variable.index):
                sent.result(config.timeout_s)
            got = arrived.pop(variable.index)
            updates = [[got[(worker, name)] for name in update_keys(variable)] for worker in workers]
            begun = time.perf_counter()
            with update:
                apply_update(variable, weights[variable.index], updates, config.learning_rate)
            applying += time.perf_counter() - begun
            if step + 1 < stopping.poll() and step + 1 != config.warmup:
                send_weights(variable, step + 1)
        done = time.perf_counter()
        times.extra["gradients_applied"] = times.extra.get("gradients_applied", 0) + len(mine) * len(workers)
        times.total += done - started
        times.apply += applying
        times.comm += done - started - applying
        step += 1
    times.extra["stats"] = (transport.stats() - stats0).as_dict()
    return times


def _merge(loops: list[StepTimes]) -> StepTimes:
    """The per-worker loops of an asynchronous PS, as one: times averaged, gradients applied summed."""
    merged = StepTimes()
    for part in loops:
        merged.total += part.total / len(loops)
        merged.comm += part.comm / len(loops)
        merged.apply += part.apply / len(loops)
    merged.extra["gradients_applied"] = sum(part.extra["gradients_applied"] for part in loops)
    return merged


def apply_update(variable: Variable, value: np.ndarray, updates: list[list[np.ndarray]],
                 learning_rate: float) -> None:
    """Apply every worker's update of ``variable`` (in the workers' order) to its ``value``, in place.

    Each update is what :func:`update_keys` names: a gradient (SGD, :func:`apply_sgd`), a sparse
    gradient's distinct rows and their indices (:func:`apply_sparse_sgd`), or a state's new value
    (the workers' mean, :func:`apply_state`).
    """
    if not variable.trainable:
        apply_state(variable, value, [u[0] for u in updates])
    elif variable.sparse:
        apply_sparse_sgd(variable, value, [(u[0], u[1]) for u in updates], learning_rate)
    else:
        apply_sgd(variable, value, [u[0] for u in updates], learning_rate)


def _wrong(variable: Variable, what: str, got: np.ndarray, expected: str) -> ValueError:
    return ValueError(f"{what} for '{variable.path}' (variable {variable.index}) has {got.dtype} {got.shape}, "
                      f"expected {expected}")


def apply_sgd(variable: Variable, weight: np.ndarray, gradients: list[np.ndarray], learning_rate: float) -> None:
    """``weight -= learning_rate * mean(gradients)``, after checking every gradient's shape."""
    for gradient in gradients:
        if gradient.shape != weight.shape or gradient.dtype != weight.dtype:
            raise _wrong(variable, "gradient", gradient, f"{weight.dtype} {weight.shape}")
    # in slices: a whole-tensor temporary of hundreds of MB would be fresh memory every step
    scale = learning_rate / len(gradients)
    flat = weight.reshape(-1)
    for start in range(0, flat.size, _SLICE):
        stop = start + _SLICE
        update = np.multiply(gradients[0].reshape(-1)[start:stop], scale)
        for gradient in gradients[1:]:
            update += scale * gradient.reshape(-1)[start:stop]
        flat[start:stop] -= update


def apply_sparse_sgd(variable: Variable, weight: np.ndarray, gradients: list[tuple[np.ndarray, np.ndarray]],
                     learning_rate: float) -> None:
    """SGD with sparse gradients: ``weight[indices] -= learning_rate / workers * values``, worker by worker,
    after checking each gradient's rows (their width and dtype, one index per row, every index a row)."""
    rows = weight.shape[0]
    for values, indices in gradients:
        if values.ndim != weight.ndim or values.shape[1:] != weight.shape[1:] or values.dtype != weight.dtype:
            raise _wrong(variable, "sparse gradient", values, f"{weight.dtype} rows of {weight.shape[1:]}")
        if indices.shape != values.shape[:1] or indices.dtype.kind not in "iu":
            raise _wrong(variable, "row indices", indices, f"{len(values)} integers")
        if indices.size and not (indices.min() >= 0 and indices.max() < rows):
            raise ValueError(f"row indices for '{variable.path}' (variable {variable.index}) reach outside its "
                             f"{rows} rows")
    scale = learning_rate / len(gradients)
    for values, indices in gradients:
        np.subtract.at(weight, indices, scale * values)


def apply_state(variable: Variable, state: np.ndarray, values: list[np.ndarray]) -> None:
    """A state's new value: the mean of the workers' (a floating-point state), or the first worker's."""
    for value in values:
        if value.shape != state.shape or value.dtype != state.dtype:
            raise _wrong(variable, "state", value, f"{state.dtype} {state.shape}")
    if state.dtype.kind != "f" or len(values) == 1:
        state[...] = values[0]
        return
    total = values[0].copy()
    for value in values[1:]:
        total += value
    np.divide(total, len(values), out=state)


def initial_weights(config: TrainConfig, variables: list[Variable]) -> dict[int, np.ndarray]:
    """The starting values of ``variables``: the model's (seeded), or seeded random ones when compute is replayed."""
    if config.replayed:
        return {v.index: (np.random.default_rng(config.seed + v.index).standard_normal(v.shape) * 0.05).astype(v.dtype)
                for v in variables}
    _, model = _build(config)
    every = list(model.trainable_variables) + list(model.non_trainable_variables)
    return {v.index: np.asarray(every[v.index].value) for v in variables}


def train_locally(config: TrainConfig) -> tuple[StepTimes, dict[int, np.ndarray]]:
    """The "local" line: one process, no communication, the same updates on the same batches."""
    plan = config.plan if config.plan is not None else plan_of(config)
    variables = list(plan.variables)
    values = [aligned_copy(w) for w in initial_weights(config, variables).values()]
    local = _LocalMemory()
    if config.replayed:
        replayed = _replayed_compute(config, local, plan, plan.layout.worker(0))

        def compute(server: int, step: int) -> Updates:
            return replayed(step, values, RuntimeCopies())[1]
    else:
        definition, model = _build(config)
        step_fn = step_function(model, definition.loss_fn())
        trainable = len(plan.trainable)
        copies = RuntimeCopies()
        rows = [SparseRows(local, plan, plan.layout.worker(server)) for server in range(config.servers)]

        def compute(server: int, step: int) -> Updates:
            x, y = _batch(definition, config, server, step)
            tensors = [copies.tensor(v) for v in values]
            _, grads, new_state = step_fn(tensors[:trainable], tensors[trainable:], x, y)
            return rows[server].updates(plan, grads, new_state)

    times = StepTimes()
    for step in range(config.warmup + config.steps):
        if step == config.warmup:
            times = StepTimes()
        started = time.perf_counter()
        per_server = [compute(server, step) for server in range(config.servers)]
        computed = time.perf_counter()
        for position, (variable, value) in enumerate(zip(variables, values, strict=True)):
            apply_update(variable, value, [[array for _, array in updates[position]] for updates in per_server],
                         config.learning_rate)
        done = time.perf_counter()
        times.total += done - started
        times.steps.append(done - started)
        times.compute += computed - started
        times.apply += done - computed
    return times, dict(enumerate(values))


class _LocalMemory:
    """What local training allocates from where a transport would: aligned process memory."""

    @staticmethod
    def allocate(spec: TensorSpec) -> np.ndarray:
        return aligned_empty(spec.shape, spec.dtype, ALIGNMENT)


# -- the content check (the soak) ----------------------------------------------


def checksum(array: np.ndarray) -> int:
    """CRC-32 of the bytes of ``array``."""
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


class CheckedTransport:
    """A transport whose every tensor is checked on arrival.

    Each send first tells the receiving rank, over the launcher (outside the transport), the tensor's
    key and CRC-32; each receive (``recv``, and ``recv_many`` and ``recv_each`` for each tensor as it
    arrives) computes the CRC-32 of what arrived and counts it as corrupted when it differs. Tensors
    announced but never received are counted as lost (:meth:`counts`). Everything else goes to the
    wrapped transport.

    ``memory``: the rank's :class:`~bench.stats.RssTrace`, started afresh when the first tensor of step
    ``timed_from`` arrives, so that it covers the timed steps (the model built and traced, warm-up done).
    """

    def __init__(self, transport, ctx, timeout_s: float, memory: RssTrace | None = None,
                 timed_from: int = 0) -> None:
        self._transport = transport
        self._ctx = ctx
        self._timeout_s = timeout_s
        self._notices: dict[tuple[str, int, int], int] = {}
        self._lock = threading.Lock()
        self.sent = self.received = self.corrupted = 0
        self._memory, self._timed_from = memory, timed_from

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def _announce(self, key: Key, array: np.ndarray) -> None:
        self._ctx.send_to(key.dst, ("crc", key.name, key.step, key.src, checksum(array)))
        with self._lock:
            self.sent += 1

    def send(self, key: Key, array: np.ndarray) -> None:
        self._announce(key, array)
        return self._transport.send(key, array)

    def send_async(self, key: Key, array: np.ndarray):
        self._announce(key, array)
        return self._transport.send_async(key, array)

    def recv(self, key: Key) -> np.ndarray:
        tensor = self._transport.recv(key)
        self._check(key, tensor)
        return tensor

    def recv_each(self, keys: Sequence[Key], timeout: float | None = None) -> Iterator[tuple[Key, np.ndarray]]:
        """The wrapped transport's ``recv_each``, each tensor checked as it arrives."""
        for key, tensor in self._transport.recv_each(keys, timeout):
            self._check(key, tensor)
            yield key, tensor

    #: every tensor of ``keys``, received together and each checked (through :meth:`recv_each`)
    recv_many = transports.Transport.recv_many

    def _check(self, key: Key, tensor: np.ndarray) -> None:
        got = checksum(tensor)
        with self._lock:  # one reader of the notices at a time; a notice is sent before its tensor
            while (key.name, key.step, key.src) not in self._notices:
                self._take(self._ctx.receive(timeout=self._timeout_s))
            want = self._notices.pop((key.name, key.step, key.src))
            self.received += 1
            self.corrupted += got != want
            if self._memory is not None and key.step >= self._timed_from:
                self._memory.restart()
                self._memory = None

    def _take(self, notice: Any) -> None:
        if not (isinstance(notice, tuple) and len(notice) == 5 and notice[0] == "crc"):
            raise RuntimeError(f"rank {self._ctx.rank} ({self._ctx.name}) got {notice!r} where it expected the "
                               "checksum of a tensor")
        self._notices[(notice[1], notice[2], notice[3])] = notice[4]

    def counts(self, drain_s: float = 1.0) -> dict[str, int]:
        """Tensors sent, received, corrupted, and lost (announced to this rank, never received)."""
        with self._lock, contextlib.suppress(Exception):
            while True:
                self._take(self._ctx.receive(timeout=drain_s))
        return {"tensors_sent": self.sent, "tensors_received": self.received, "corrupted": self.corrupted,
                "lost": len(self._notices)}


# -- the processes -------------------------------------------------------------


def rank_job(config: TrainConfig, ctx) -> tuple[str, StepTimes]:
    """One process of a training run: rank ``r < servers`` is worker ``r``, the others parameter servers.

    ``ctx`` is the launcher's view of the run (rank, cluster, ``report``, ``link_bytes``); each worker
    reports ``("step", server, step)`` as its steps begin and ``("loss", server, step, loss, trained_s)``
    after computing one, worker 0 ``("eval", point)`` at each evaluation; a worker measures the traffic
    on its host's link over the timed steps when it has one of its own (netns).
    """
    plan = config.plan if config.plan is not None else plan_of(config)
    layout = plan.layout
    options = {**config.transport_options, "timeout_s": config.timeout_s}
    stopping = Stopping(config, ctx)
    with transports.create(config.transport, **options) as transport:
        transport.start(ctx.cluster, ctx.rank)
        transport.plan(plan.specs(ctx.rank))
        if config.check:
            return_large_frees()  # resident memory follows what is alive (see the function)
            memory = RssTrace().start()  # this process's memory through the timed steps, sampled by a thread
            transport = CheckedTransport(transport, ctx, config.timeout_s, memory, config.warmup)
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
        if config.check:
            memory.stop()
            # the ranks finish at about the same time: a notice still on its way has a second to arrive
            times.extra["check"] = {**transport.counts(), "memory": memory.judge()}
    return role, times


def local_job(config: TrainConfig, ctx) -> StepTimes:
    """The "local" line as a process of its own: its peak memory is its own."""
    times, _ = train_locally(config)
    return times


def profile(config: TrainConfig, ctx, steps: int = 5) -> tuple[Plan, float]:
    """The analyzer's plan and one worker's compute seconds per step (median of ``steps``; NaN for 0)."""
    import tensorflow as tf

    definition, model = _build(config)
    x, y = _batch(definition, config, 0, 0)
    step_fn, concrete = traced_step(model, definition.loss_fn(), np.asarray(x), np.asarray(y))
    plan = analyze(config.model, model, definition.loss_fn(), np.asarray(x), np.asarray(y), config.servers,
                   config.batch_size, concrete)
    if not steps:
        return plan, float("nan")
    state = [v.value for v in model.non_trainable_variables]
    weights = [tf.constant(v.value) for v in model.trainable_variables]
    seconds = []
    for step in range(2 + steps):  # two warm-up steps: tracing, then first-run allocations
        x, y = _batch(definition, config, 0, step)
        started = time.perf_counter()
        value, grads, _ = step_fn(weights, state, x, y)
        float(value)
        seconds.append(time.perf_counter() - started)
        del grads
    return plan, float(np.median(seconds[2:]))


def summarize(config: TrainConfig, outcome: dict[int, tuple[str, StepTimes]]) -> dict[str, Any]:
    """One ``model`` record from the per-process timings (workers averaged; peak memory in ``extra``)."""
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
    return {
        "transport": config.label or config.transport,
        "model": config.model,
        "batch_size": config.batch_size,
        "servers": config.servers,
        "steps": steps,
        "step_time_s": step_time,
        "throughput_batches_per_s": 1.0 / step_time,
        "compute_s": float(np.mean([t.compute for t in workers])) / steps,
        "comm_s": float(np.mean([t.comm for t in workers])) / steps,
        "apply_s": float(np.mean([t.apply for t in servers])) / steps,
        "ps_wait_s": float(np.mean([t.comm for t in servers])) / steps,
        "worker_peak_rss_mb": max(t.extra["peak_rss_mb"] for t in workers),
        "ps_peak_rss_mb": max(t.extra["peak_rss_mb"] for t in servers),
        "copied_bytes_per_step": (transport_copied + runtime_copied) / steps,
        "runtime_copied_bytes_per_step": runtime_copied / steps,
        # every memory registration (and control message) of every process in the timed steps
        "registrations_per_step": sum(s["registrations"] for s in stats) / steps,
        "control_messages_per_step": sum(s["control_messages"] for s in stats) / steps,
        "model_mb": workers[0].extra.get("model_mb"),
        "fabric": fabric.label(described),
        # the graph analysis (zerocopy: on or off; rdma_cp places receives only) and what it achieved
        "analysis": described.get("analysis", ""),
        "dynamic_transfers_per_step": sum(s.get("dynamic_transfers", 0) for s in stats) / steps,
        "unregistered_sends_per_step": misses / steps,
        "registration_hit_rate": hits / (hits + misses) if hits + misses else None,
        "site_regions": sum(site["regions"] for site in sites) if sites else None,
        "unregistered_tensors": ",".join(f"{name}:{count}" for site in sites[:1] for name, count in
                                         site["missed"].items()) if sites else None,
    }
