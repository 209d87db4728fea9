"""Parameter-server data-parallel training over any transport (the paper's section 5.2 setup).

``servers`` servers each run a worker and a parameter server (PS) process.
Trainable variables are placed round-robin over the PS processes. Every step:

* each PS sends its variables' current values to every worker;
* each worker receives them, computes gradients on its own synthetic batch,
  and sends each gradient to the variable's PS;
* each PS sums the gradients of all workers and applies SGD
  (``w -= lr * mean(g)``): synchronous training. With ``asynchronous`` the PS
  serves each worker on its own, applying every gradient as it arrives, so
  workers never wait for each other.

Zero copy through TensorFlow: received weights enter the model through DLPack
(``keras.Model.stateless_call`` takes tensors instead of variables), so a
weight written by the transport into registered memory is used in place.
Gradients leave from TensorFlow's own buffers through DLPack. Where a tensor
cannot cross without a copy (read-only or misaligned memory: TensorFlow needs
64-byte alignment), the runtime copies it and counts the bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import resource
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import transports
from bench.runtime.analyzer import Layout, Variable, gradient_key, transfer_plan, variables_of, weight_key
from transports import Cluster, Key
from transports.base import aligned_empty

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


@dataclass
class StepTimes:
    """Seconds per step spent in each phase, summed over the timed steps."""

    total: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    apply: float = 0.0
    copied_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class RuntimeCopies:
    """Counts the payload bytes the runtime itself copies to hand tensors to or from TensorFlow."""

    def __init__(self) -> None:
        self.bytes = 0

    def tensor(self, array: np.ndarray):
        """A TensorFlow tensor over ``array``'s memory (DLPack), or over an aligned copy when it must be."""
        import tensorflow as tf

        if not array.flags.writeable or not array.flags.c_contiguous or array.ctypes.data % ALIGNMENT:
            array = aligned_copy(array)
            self.bytes += array.nbytes
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())

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


def _build(config: TrainConfig):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    definition = resolve_model(config.model)
    keras.utils.set_random_seed(config.seed)
    model = definition.build()
    return definition, model


def _step_function(model, loss):
    import tensorflow as tf

    @tf.function(reduce_retracing=True)
    def step(weights, non_trainable, x, y):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            predictions, _ = model.stateless_call(weights, non_trainable, x, training=True)
            value = loss(y, predictions)
        return value, tape.gradient(value, weights)

    return step


def peak_rss_mb() -> float:
    """This process's peak resident memory (MB). VmHWM, since ru_maxrss carries a forking parent's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the roles -----------------------------------------------------------------


def run_worker(config: TrainConfig, transport, layout: Layout, server: int) -> StepTimes:
    """A worker's training loop; returns the timings of the timed steps."""
    definition, model = _build(config)
    variables = variables_of(model)
    step_fn = _step_function(model, definition.loss_fn())
    non_trainable = [v.value for v in model.non_trainable_variables]
    copies = RuntimeCopies()
    rank = layout.worker(server)
    times = StepTimes()
    stats0 = transport.stats()
    for step in range(config.warmup + config.steps):
        if step == config.warmup:
            times = StepTimes()
            copies.bytes = 0
            stats0 = transport.stats()
        started = time.perf_counter()
        weights = [copies.tensor(transport.recv(Key(weight_key(v), step, layout.ps_of(v), rank))) for v in variables]
        received = time.perf_counter()
        x, y = definition.make_batch(config.batch_size, seed=config.seed + 1000 * server + step)
        _, grads = step_fn(weights, non_trainable, x, y)
        grads = [RuntimeCopies.array(g) for g in grads]
        computed = time.perf_counter()
        sends = [transport.send_async(Key(gradient_key(v), step, rank, layout.ps_of(v)), g)
                 for v, g in zip(variables, grads, strict=True)]
        for sending in sends:
            sending.result(config.timeout_s)
        done = time.perf_counter()
        times.total += done - started
        times.compute += computed - received
        times.comm += (received - started) + (done - computed)
    times.copied_bytes = copies.bytes
    times.extra["peak_rss_mb"] = peak_rss_mb()
    times.extra["stats"] = (transport.stats() - stats0).as_dict()
    return times


def run_ps(config: TrainConfig, transport, layout: Layout, server: int) -> StepTimes:
    """A parameter server's loop: serve its variables, gather gradients, apply SGD."""
    _, model = _build(config)
    rank = layout.ps(server)
    mine = [v for v in variables_of(model) if layout.ps_of(v) == rank]
    weights: dict[int, np.ndarray] = {}
    for variable in mine:  # the initial values, in memory the transport can send from without copies
        spec = next(s for s in transfer_plan([variable], layout) if s.src == rank)
        weights[variable.index] = transport.allocate(spec)
        weights[variable.index][...] = np.asarray(model.trainable_variables[variable.index].value)
    del model
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
        times = _serve(config, transport, rank, mine, weights, workers, update)
    times.extra["peak_rss_mb"] = peak_rss_mb()
    times.extra["final_weights"] = {index: w.copy() for index, w in weights.items()}
    return times


def _serve(config: TrainConfig, transport, rank: int, mine: list[Variable], weights: dict[int, np.ndarray],
           workers: list[int], update: threading.Lock) -> StepTimes:
    """Every step: send the weights to ``workers``, gather their gradients, apply SGD (under ``update``)."""
    times = StepTimes()
    stats0 = transport.stats()
    for step in range(config.warmup + config.steps):
        if step == config.warmup:
            times = StepTimes()
            stats0 = transport.stats()
        started = time.perf_counter()
        # no lock around the sends: asynchronous SGD reads weights while other workers' updates land
        # (as TensorFlow's PS does by default); holding it while a send waits for its receiver could
        # deadlock across parameter servers
        sends = [transport.send_async(Key(weight_key(v), step, rank, worker), weights[v.index])
                 for v in mine for worker in workers]
        for sending in sends:
            sending.result(config.timeout_s)
        gradients = {v.index: [transport.recv(Key(gradient_key(v), step, worker, rank)) for worker in workers]
                     for v in mine}
        received = time.perf_counter()
        with update:
            for variable in mine:
                apply_sgd(variable, weights[variable.index], gradients[variable.index], config.learning_rate)
        done = time.perf_counter()
        times.extra["gradients_applied"] = times.extra.get("gradients_applied", 0) + len(mine) * len(workers)
        times.total += done - started
        times.comm += received - started
        times.apply += done - received
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


def apply_sgd(variable: Variable, weight: np.ndarray, gradients: list[np.ndarray], learning_rate: float) -> None:
    """``weight -= learning_rate * mean(gradients)``, after checking every gradient's shape."""
    for gradient in gradients:
        if gradient.shape != weight.shape or gradient.dtype != weight.dtype:
            raise ValueError(
                f"gradient for '{variable.path}' (variable {variable.index}) has {gradient.dtype} {gradient.shape}, "
                f"expected {weight.dtype} {weight.shape}"
            )
    # in slices: a whole-tensor temporary of hundreds of MB would be fresh memory every step
    scale = learning_rate / len(gradients)
    flat = weight.reshape(-1)
    for start in range(0, flat.size, _SLICE):
        stop = start + _SLICE
        update = np.multiply(gradients[0].reshape(-1)[start:stop], scale)
        for gradient in gradients[1:]:
            update += scale * gradient.reshape(-1)[start:stop]
        flat[start:stop] -= update


def train_locally(config: TrainConfig) -> tuple[StepTimes, dict[int, np.ndarray]]:
    """The "local" line: one process, no communication, the same SGD on the same batches."""
    definition, model = _build(config)
    step_fn = _step_function(model, definition.loss_fn())
    non_trainable = [v.value for v in model.non_trainable_variables]
    variables = variables_of(model)
    weights = [aligned_copy(np.asarray(v.value)) for v in model.trainable_variables]
    copies = RuntimeCopies()
    times = StepTimes()
    for step in range(config.warmup + config.steps):
        if step == config.warmup:
            times = StepTimes()
        started = time.perf_counter()
        batches = [definition.make_batch(config.batch_size, seed=config.seed + 1000 * s + step)
                   for s in range(config.servers)]
        grads_per_server = []
        for x, y in batches:
            _, grads = step_fn([copies.tensor(w) for w in weights], non_trainable, x, y)
            grads_per_server.append([RuntimeCopies.array(g) for g in grads])
        computed = time.perf_counter()
        for variable, weight in zip(variables, weights, strict=True):
            apply_sgd(variable, weight, [g[variable.index] for g in grads_per_server], config.learning_rate)
        done = time.perf_counter()
        times.total += done - started
        times.compute += computed - started
        times.apply += done - computed
    times.extra["peak_rss_mb"] = peak_rss_mb()
    return times, dict(enumerate(weights))


# -- launching -----------------------------------------------------------------


def _role(config: TrainConfig, cluster: Cluster, rank: int, results: mp.Queue) -> None:
    layout = Layout(config.servers)
    try:
        # the plan needs the variables' shapes: the analyzer reads them off the model
        _, model = _build(config)
        plan = [s for s in transfer_plan(variables_of(model), layout) if rank in (s.src, s.dst)]
        del model
        options = {**config.transport_options, "timeout_s": config.timeout_s}
        with transports.create(config.transport, **options) as transport:
            transport.start(cluster, rank)
            transport.plan(plan)
            if rank < layout.servers:
                times = run_worker(config, transport, layout, rank)
                role = "worker"
            else:
                times = run_ps(config, transport, layout, rank - layout.servers)
                role = "ps"
            times.extra["fabric"] = transport.describe()
        results.put(("done", rank, role, times))
    except BaseException as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
        results.put(("error", rank, f"{type(exc).__name__}: {exc}{at}"))
        raise SystemExit(1) from None


class TrainingError(RuntimeError):
    """A training process failed; the message names its rank and role."""


def train(config: TrainConfig) -> dict[str, Any]:
    """Run one distributed training job; returns per-role timings, ledgers and the PS's final weights."""
    layout = Layout(config.servers)
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    cluster = Cluster.on_loopback(layout.size)
    procs = [ctx.Process(target=_role, args=(config, cluster, rank, results), daemon=True)
             for rank in range(layout.size)]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[str, StepTimes]] = {}
    deadline = time.monotonic() + config.timeout_s + 120
    try:
        while len(outcome) < layout.size:
            try:
                message = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    try:
                        message = results.get(timeout=2.0)
                    except queue.Empty:
                        raise TrainingError(f"a training process died (exit code {dead[0].exitcode})") from None
                elif time.monotonic() > deadline:
                    raise TrainingError(f"training made no progress within {config.timeout_s + 120:.0f} s") from None
                else:
                    continue
            if message[0] == "error":
                role = "worker" if message[1] < layout.servers else "ps"
                raise TrainingError(f"{config.transport}: {role} rank {message[1]} failed: {message[2]}")
            _, rank, role, times = message
            outcome[rank] = (role, times)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    return {"layout": layout, "outcome": outcome}


def summarize(config: TrainConfig, outcome: dict[int, tuple[str, StepTimes]]) -> dict[str, Any]:
    """One ``model`` record from the per-process timings (workers averaged)."""
    workers = [t for role, t in outcome.values() if role == "worker"]
    servers = [t for role, t in outcome.values() if role == "ps"]
    steps = config.steps
    step_time = float(np.mean([t.total for t in workers])) / steps
    stats = [t.extra["stats"] for _, t in outcome.values()]
    transport_copied = sum(s["copied_bytes"] for s in stats)
    runtime_copied = sum(t.copied_bytes for t in workers)
    fabric = next((t.extra["fabric"] for t in workers), {})
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
        "fabric": fabric.get("fabric", "none"),
    }
