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

The model is TensorFlow's or PyTorch's: this module imports neither, and asks the
workload's framework (``bench.runtime.framework``) to build it, analyse it and run
its step. Zero copy through either: received weights enter the model through DLPack
(TensorFlow's ``stateless_call`` takes tensors instead of variables; PyTorch's
parameters are set over the received memory), so a weight written by the transport
into registered memory is used in place. Gradients leave from the framework's own
buffers through DLPack. Where a tensor cannot cross without a copy (read-only or
misaligned memory: TensorFlow needs 64-byte alignment), the runtime copies it and
counts the bytes.

Device memory (``memory`` ``cuda``, PyTorch's models): every tensor of the plan lives on the GPU at both ends
(``Plan.specs(rank, memory)``), so the transport receives weights into device memory, the model computes over them
there and hands its gradients out from autograd's device memory (CuPy arrays through DLPack); a parameter server's
weights are device memory and it applies SGD with CuPy. A transport that moves device memory itself (zerocopy and
rdma_cp where the fabric has UCX's CUDA transports) puts device to device; the others stage through the host, each
crossing counted in the ledger (``device_to_host_bytes``, ``host_to_device_bytes``).

Replayed compute (``compute`` ``replay`` or ``paper``): a worker waits
``compute_s`` per step instead of running the model, then sends
gradient-shaped tensors (built once in memory from ``transport.placement.allocate``);
the parameter servers start from seeded random weights of the variables'
shapes. Nobody builds the model: the variables come from the analyzer, run
once beforehand (:func:`bench.experiments.training.profile`), which also measures the compute time that
``replay`` waits. Every transfer, ledger entry and runtime copy is the same as
with real compute; only the CPU the model would take is left out.

Why one module of 790 lines: the worker, the parameter server and the Local baseline are one runtime;
they share the config, the step times and the update functions, so that the Local line applies exactly the
updates the servers apply.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.runtime.analyzer import Plan, Variable, gradient_key, update_keys, weight_key
from bench.runtime.framework import Framework, SparseGradient, framework_name_of, framework_of
from bench.runtime.sites import AllocationSites
from bench.runtime.workload import RealData, Workload, batch
from transports import Key, TensorSpec
from transports.common import aligned_empty, in_device_memory
from transports.ledger import Ledger
from transports.memory import HOST, Memory, array_module, memory_of
from transports.placement import Placement
from transports.tensors import empty, to_device, to_host

ALIGNMENT = 64
_SLICE = 1 << 20  # elements per slice of an SGD update


@dataclass
class TrainConfig:
    """What to train and how."""

    #: how records name the model (``vgg16``, ``digits``, ``tests.tiny_models:TINY``)
    model: str
    #: what is trained (a model definition, a task): handed in by the experiment, see :mod:`bench.runtime.workload`
    workload: Workload
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
    #: the analyzer's plan (from :func:`bench.experiments.training.profile`); None: each process analyses the model
    #: it builds
    plan: Plan | None = None
    #: keep nothing that grows with the steps (no per-step times, no copy of the final weights): a long soak
    constant_memory: bool = False
    #: ``watch(transport, ctx)`` wraps each rank's transport (the soak's content check): a transport whose
    #: ``finish()`` gives what goes to the rank's ``extra["watch"]`` at the end; must travel on the run's channels
    watch: Callable[[Any, Any], Any] | None = None
    #: evaluate on the held-out set every this many steps and at the last (worker 0; 0: never)
    evaluate_every: int = 0
    #: stop once worker 0 has trained this many seconds (``steps`` is then the most it runs); None: run ``steps``
    time_s: float | None = None
    #: where the weights, gradients and received tensors live (``host``, ``cuda``, ``cuda:N``): with device memory
    #: the model computes on that GPU and the parameter servers apply SGD there (CuPy); see the module
    memory: str = "host"

    @property
    def replayed(self) -> bool:
        return self.compute != "real"

    @property
    def framework(self) -> str:
        """The framework the workload is written in (``tensorflow``, ``torch``)."""
        return framework_name_of(self.workload)

    @property
    def memory_kind(self) -> Memory:
        """:attr:`memory` as a :class:`~transports.memory.Memory`."""
        return Memory.parse(self.memory)

    def memory_problem(self) -> str | None:
        """Why this run cannot keep its tensors in :attr:`memory`, in one line naming the fix; None when it can."""
        memory = self.memory_kind
        if not memory.is_device:
            return None
        if self.plan is not None and any(v.sparse for v in self.plan.trainable):
            return (f"--memory {memory}: {self.model} has a sparse gradient, whose rows the runtime gathers in "
                    "host memory only; train it with --memory host")
        return framework(self).memory_problem(memory)


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
    """Counts the payload bytes the runtime itself copies to hand tensors to or from the framework."""

    def __init__(self) -> None:
        self.bytes = 0

    def adoptable(self, array: np.ndarray, alignment: int = ALIGNMENT) -> np.ndarray:
        """``array``, or an aligned copy when the framework could not adopt its memory (read-only, not contiguous,
        or not at ``alignment``: TensorFlow's 64 bytes). A device array is adopted as it is (DLPack)."""
        if in_device_memory(array):
            return array
        if not array.flags.writeable or not array.flags.c_contiguous or array.ctypes.data % alignment:
            array = aligned_copy(array)
            self.bytes += array.nbytes
        return array


def host_copy(array: Any) -> np.ndarray:
    """A copy of ``array`` in host memory (off its device, for a device array)."""
    return array.copy() if type(array) is np.ndarray else to_host(array, Ledger())


def placed(target: Any, value: np.ndarray, ledger: Any) -> Any:
    """``target`` (memory a transport gave: host or device) holding ``value`` (host memory); a copy onto a device
    is counted in ``ledger``."""
    if type(target) is np.ndarray:
        target[...] = value
        return target
    return to_device(np.ascontiguousarray(value, target.dtype), memory_of(target), ledger, out=target)


def _module_of(array: Any) -> Any:
    """The array module of ``array``: NumPy for host memory, CuPy for a device's."""
    return np if type(array) is np.ndarray else array_module()


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A writable, C-contiguous, 64-byte aligned copy of ``array``."""
    out = aligned_empty(array.shape, array.dtype, ALIGNMENT)
    out[...] = array
    return out


def worker_batch(config: TrainConfig, server: int, step: int):
    """Worker ``server``'s batch at ``step`` (see :func:`bench.runtime.workload.batch`)."""
    return batch(config.workload, config.batch_size, config.servers, config.seed, server, step)


def framework(config: TrainConfig) -> Framework:
    """The framework ``config``'s workload is written in."""
    return framework_of(config.workload)


def build_model(config: TrainConfig, memory: Memory = HOST):
    """The workload's model, built afresh (seeded; variable paths as in the plan), computing in ``memory``."""
    return framework(config).build(config.workload, config.seed, memory)


def plan_of(config: TrainConfig) -> Plan:
    """The analyzer's plan for ``config``: the model built, its step traced for the run's batches."""
    model = build_model(config)
    x, y = worker_batch(config, 0, 0)
    return framework(config).analyze(config.model, model, config.workload, np.asarray(x), np.asarray(y),
                                     config.servers, config.batch_size)


# -- the roles -----------------------------------------------------------------


#: what each parameter server tells each worker once it has every update of the run (:meth:`Stopping.finish`)
RUN_DONE = "run_done"


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
        self._done: set[int] = set()  # the parameter servers that said they have every update (finish)

    def poll(self) -> int:
        """The end as far as this rank knows it now (reading worker 0's word if it came)."""
        if self._ctx is not None and self.time_s is not None:
            while (message := self._ctx.poll()) is not None:
                self._take(message)
        return self.end

    def _take(self, message: Any) -> None:
        if isinstance(message, tuple) and message[:1] == ("stop",):
            self.end = min(self.end, int(message[1]))
        elif isinstance(message, tuple) and message[:1] == (RUN_DONE,):
            self._done.add(int(message[1]))

    def finish(self, layout) -> None:
        """The run's end, after the last step: each PS tells every worker once it has received all their updates,
        and a worker waits to hear it from every PS before it closes its transport. A transport's send can be done
        before its bytes arrive (grpc_tcp's once they are handed to gRPC): a worker that closed and exited at once
        took its last stream with it (fcn5 over grpc_tcp, 4 servers on 1 Gbit/s links: 'Connection reset by peer'
        at its parameter server). Through the launcher, not the transport: a transport's last message has the same
        problem (its sender gone before its receiver asks for it, over grpc_rdma); ``tell`` returns once the word
        is in every worker's inbox."""
        if self._ctx is None:
            return
        workers = [layout.worker(s) for s in range(layout.servers)]
        if self._ctx.rank not in workers:
            self._ctx.tell(workers, (RUN_DONE, self._ctx.rank), self.timeout_s)
            return
        while not {layout.ps(s) for s in range(layout.servers)} <= self._done:
            self._take(self._ctx.receive(self.timeout_s))

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
        compute = _replayed_compute(config, transport, plan, rank)
    else:
        compute = _model_compute(config, transport, plan, server)
    # (device memory: a gradient is registered where it lies, the allocator's regions are not traced)
    tracing = transport.placement.zero_copy_sends and not config.memory_kind.is_device
    sites = AllocationSites(transport, plan, rank) if tracing else None
    stopping = stopping or Stopping(config)
    evaluating_here = config.evaluate_every and server == 0 and on_eval is not None
    evaluate = _evaluator(config, len(plan.trainable)) if evaluating_here else None
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


def run_ps(config: TrainConfig, transport, plan: Plan, server: int, stopping: Stopping | None = None) -> StepTimes:
    """A parameter server's loop: serve its variables, gather updates, apply them (until ``stopping``'s end)."""
    layout = plan.layout
    rank = layout.ps(server)
    mine = [v for v in plan.variables if layout.ps_of(v) == rank]
    initial = initial_weights(config, mine)
    weights: dict[int, np.ndarray] = {}
    for variable in mine:  # the initial values, in memory the transport can send from without copies
        spec = plan.transfer(weight_key(variable), rank, layout.worker(0)).spec(config.memory)
        weights[variable.index] = placed(transport.placement.allocate(spec), initial.pop(variable.index),
                                         transport.ledger)
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
    if not config.constant_memory:  # a soak compares no weights: no copy of them (fcn5's: 220 MB) in its memory
        times.extra["final_weights"] = {index: host_copy(w) for index, w in weights.items()}
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
    xp = _module_of(weight)
    for start in range(0, flat.size, _SLICE):
        stop = start + _SLICE
        update = xp.multiply(gradients[0].reshape(-1)[start:stop], scale)
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
    _module_of(state).divide(total, len(values), out=state)


def initial_weights(config: TrainConfig, variables: list[Variable]) -> dict[int, np.ndarray]:
    """The starting values of ``variables``: the model's (seeded), or seeded random ones when compute is replayed."""
    if config.replayed:
        return {v.index: (np.random.default_rng(config.seed + v.index).standard_normal(v.shape) * 0.05).astype(v.dtype)
                for v in variables}
    every = framework(config).initial_values(build_model(config))
    return {v.index: every[v.index] for v in variables}


def train_locally(config: TrainConfig) -> tuple[StepTimes, dict[int, np.ndarray]]:
    """The "local" line: one process, no communication, the same updates on the same batches."""
    plan = config.plan if config.plan is not None else plan_of(config)
    variables = list(plan.variables)
    memory = config.memory_kind
    values = [to_device(aligned_copy(w), memory, Ledger()) for w in initial_weights(config, variables).values()]
    local = _LocalMemory()
    if config.replayed:
        replayed = _replayed_compute(config, local, plan, plan.layout.worker(0))

        def compute(server: int, step: int) -> Updates:
            return replayed(step, values, RuntimeCopies(), None)[1]
    else:
        step_fn = framework(config).step(build_model(config, memory), config.workload, variables)
        copies = RuntimeCopies()
        rows = [SparseRows(local, plan, plan.layout.worker(server)) for server in range(config.servers)]

        def compute(server: int, step: int) -> Updates:
            x, y = worker_batch(config, server, step)
            result = step_fn(values, x, y, copies)
            return rows[server].updates(plan, result.gradients, result.new_state)

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
    return times, {index: host_copy(value) if memory.is_device else value for index, value in enumerate(values)}


class _AlignedPlacement(Placement):
    """Aligned process memory, where local training builds what a transport's placement would give."""

    def allocate(self, spec: TensorSpec) -> np.ndarray:
        if spec.src_memory.is_device:
            return empty(spec.shape, spec.dtype, spec.src_memory)
        return aligned_empty(spec.shape, spec.dtype, ALIGNMENT)


class _LocalMemory:
    """What local training allocates from where a transport would (its ``placement``)."""

    def __init__(self) -> None:
        self.placement = _AlignedPlacement()
