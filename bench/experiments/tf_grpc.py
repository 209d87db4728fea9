"""The ``tf_grpc`` reference run: TensorFlow's own parameter-server training over its C++ gRPC runtime.

This is what users run today, drawn beside our transports in the model figures. It is not a
``Transport``: TensorFlow moves every tensor itself.

Topology, as in the paper: ``servers`` servers, each with one worker and one parameter server
(PS). The run is one launcher run (``bench.launch``) of ``2 * servers + 1`` ranks: rank 0 the
*chief*, ranks ``1..N`` PS tasks ``0..N-1`` and ranks ``N+1..2N`` worker tasks ``0..N-1``, PS and
worker ``i`` on host (server) ``i``, the chief on host 0. Every server rank is a service: it starts a
``tf.distribute.Server`` with the cluster spec built from the run's addresses (jobs ``chief``,
``ps``, ``worker``), tells the chief it is serving and joins until the launcher stops it. The chief
runs ``tf.distribute.experimental.ParameterServerStrategy`` with a
``tf.distribute.coordinator.ClusterCoordinator`` and a custom training loop (``model.fit`` does not
work with this strategy under Keras 3), and returns the record as its result. The strategy places
the variables round-robin over the PS tasks (no partitioner). One step is one
``coordinator.schedule`` per worker of a ``tf.function`` that reads the weights from the PS tasks,
computes the gradients of one batch and applies plain SGD (``w -= lr * g``) on the PS tasks, then
``coordinator.join()``.

Timing: every step is timed on the chief from its first schedule to the end of its last closure,
as in synchronous training; ``warmup`` steps are left out. The chief reports each step to the
launcher, so ``timeout_s`` bounds silence, not the length of the run; a chief that stays silent
dumps its Python stacks into its log just before, and the timeout's error ends with them. Start-up,
until the run's first report, may be silent :data:`STARTUP_S` longer: every process imports TensorFlow
first, which on a busy machine takes longer than any silence after it.

Data: ``make_batch(batch_size, seed=0)`` is called once on the chief and becomes a repeated
``tf.data`` dataset that ``coordinator.create_per_worker_dataset`` builds on every worker; the
batch travels to the workers once, inside the dataset's graph, and no step pays for generating it.

Isolation: ``tf.distribute.Server`` listens on every interface whatever the cluster spec says.
Under ``--launcher netns`` that is the emulated host's own interfaces. With no launcher or a local
one, the ranks run in one private emulated host instead (a ``NetnsLauncher`` without a link rate,
every rank on host 0), out of reach of the host's interfaces. Where namespaces cannot be made,
TensorFlow's servers would listen on every interface of the host (it binds ``0.0.0.0``, whatever the
cluster spec says, and has no option to bind elsewhere), so the run is refused while the launcher's bind
address is loopback (the default): one line that says why and what to do. Given a bind address that is
not loopback (``--bind ADDRESS|INTERFACE``: the ranks are meant to be reachable from the network), the
run falls back to the local launcher on that address, and the record says so (``isolated_network``
false, ``isolation_note`` why). ``--launcher mpi`` refuses service ranks; its error says which launchers
to use.

Processes, peak memory, failures and cleanup are the launcher's: a rank that fails, dies or falls
silent ends the run with :class:`TfGrpcError` naming it, and no process is left behind.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench import TF_GRPC
from bench.launch import Launcher, LauncherUnavailable, RankContext, RankFailed, RankSpec
from bench.launch.private import private_hosts
from bench.launch.wire import WireError, encode_message

if TYPE_CHECKING:
    from bench.results import ModelRecord

TRANSPORT = TF_GRPC
_NAN = float("nan")
_KINDS = ("ps", "worker")


#: seconds of silence allowed beyond ``timeout_s`` until the run's first report: every process imports TensorFlow
STARTUP_S = 120.0


class TfGrpcError(RuntimeError):
    """The tf_grpc reference run failed; the message names the failing rank (and ends with its log tail)."""


class TfGrpcTimeout(TfGrpcError, TimeoutError):
    """No process of the tf_grpc run said anything for ``timeout_s``."""


def run_tf_grpc(
    build_model: Callable[[], Any],
    make_batch: Callable[[int, int], tuple[Any, Any]],
    loss_fn: Callable[[], Any],
    batch_size: int,
    servers: int,
    steps: int,
    warmup: int = 2,
    learning_rate: float = 0.01,
    timeout_s: float = 600,
    launcher: Launcher | None = None,
) -> dict[str, Any]:
    """Train with TensorFlow's ParameterServerStrategy over gRPC and return one ``model`` record.

    ``build_model()`` returns an uncompiled ``keras.Model``, ``make_batch(batch_size, seed)`` an
    ``(x, y)`` pair of numpy arrays and ``loss_fn()`` a Keras loss; all three must travel on the run's
    channels (``bench.launch.wire``: module-level functions marked ``@wire_value``, or methods of a dataclass of
    the project's or of a module named in ``TENSOR_BENCH_WIRE_MODULES``; the chief's process imports them by
    name). ``servers`` workers and as
    many PS tasks run ``warmup`` untimed steps, then ``steps`` timed ones; ``timeout_s`` is the
    longest the run's processes may all stay silent (:data:`STARTUP_S` more until the first report).
    ``launcher``: see the module docstring.

    The record has the ``model`` columns of ``bench.results`` (``step_time_s`` is the median
    seconds per step, ``throughput_batches_per_s`` the batches per second one worker sees,
    ``compute_s`` and ``comm_s`` NaN: TensorFlow does not split them) plus diagnostics:
    ``isolated_network`` and ``isolation_note``, peak memory (MB) of worker, PS, chief and of every
    process, ``variable_devices`` (variable path -> device of its value), ``worker_batches_last_step``
    (batches taken so far by the workers that ran the last step's closures: all ``warmup + steps`` when every
    step gave each worker one; TensorFlow's coordinator hands a closure to whichever worker is free, so on a
    busy machine one worker may take two of a step and another none: [4, 6] for 2 workers and 5 steps),
    losses, the cluster and versions. ``record_row`` keeps only
    the columns ``records.csv`` takes.

    Raises ``TfGrpcError`` naming the failing rank (``TfGrpcTimeout`` when the run fell silent);
    a launcher that cannot run the servers (mpi) raises its own ``LaunchError``.
    """
    _check_arguments(batch_size, servers, steps, warmup, timeout_s)
    spec = {"build_model": build_model, "make_batch": make_batch, "loss_fn": loss_fn,
            "batch_size": int(batch_size), "servers": int(servers), "steps": int(steps), "warmup": int(warmup),
            "learning_rate": float(learning_rate), "timeout_s": float(timeout_s)}
    try:
        encode_message(spec)
    except WireError as exc:
        raise TfGrpcError(
            f"tf_grpc: build_model, make_batch and loss_fn must be module-level callables that travel on the run's "
            f"channels by name (the chief's process imports them: a lambda or a local function cannot): {exc}"
        ) from None
    try:
        chosen, own, isolated, note = private_hosts(launcher, "tf.distribute.Server")
    except LauncherUnavailable as exc:
        raise TfGrpcError(f"tf_grpc: {exc}") from None
    private = own and isolated  # our one private emulated host holds every rank
    ranks = [RankSpec(functools.partial(_chief, spec), "chief")]
    ranks += [RankSpec(functools.partial(_server, kind, i), f"{kind} {i}", host=0 if private else i, service=True)
              for kind in _KINDS for i in range(servers)]
    try:
        results = chosen.run(ranks, timeout_s, label=f"tf_grpc-b{batch_size}-s{servers}", startup_s=STARTUP_S)
    except RankFailed as exc:
        raise (TfGrpcTimeout if exc.kind == "silent" else TfGrpcError)(f"tf_grpc: {exc}") from None
    finally:
        if own:
            chosen.close()
    record = results[0].result
    peaks = {r.name: r.peak_rss_mb for r in results}
    record["worker_peak_rss_mb"] = max(peaks[f"worker {i}"] for i in range(servers))
    record["ps_peak_rss_mb"] = max(peaks[f"ps {i}"] for i in range(servers))
    record["chief_peak_rss_mb"] = peaks["chief"]
    record["peak_rss_mb_per_process"] = peaks
    record["isolated_network"] = isolated
    record["isolation_note"] = note
    return record


def record_row(record: dict[str, Any]) -> ModelRecord:
    """The ``model`` record of a run's result: the columns ``records.csv`` takes (the rest stays in the result)."""
    from bench.results import ModelRecord

    return ModelRecord.from_row({k: v for k, v in record.items() if k in ModelRecord.columns()})


def _check_arguments(batch_size: int, servers: int, steps: int, warmup: int, timeout_s: float) -> None:
    for name, value, least in (("batch_size", batch_size, 1), ("servers", servers, 1), ("steps", steps, 1),
                               ("warmup", warmup, 0)):
        if int(value) != value or value < least:
            raise ValueError(f"tf_grpc: {name} must be an integer >= {least}, got {value!r}")
    if not timeout_s > 0:
        raise ValueError(f"tf_grpc: timeout_s must be positive, got {timeout_s!r}")


# -- in the ranks' processes ------------------------------------------------------------------


def _cluster_spec(ctx: RankContext) -> dict[str, list[str]]:
    """TensorFlow's cluster spec from the run's addresses: rank 0 chief, then the PS tasks, then the workers."""
    addresses = list(ctx.cluster.addresses)
    servers = (len(addresses) - 1) // 2
    return {"chief": addresses[:1], "ps": addresses[1:1 + servers], "worker": addresses[1 + servers:]}


def _server(kind: str, index: int, ctx: RankContext) -> None:
    """A PS or worker task: a ``tf.distribute.Server`` that serves until the launcher stops the rank."""
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    import tensorflow as tf

    server = tf.distribute.Server(tf.train.ClusterSpec(_cluster_spec(ctx)), job_name=kind, task_index=index,
                                  protocol="grpc", start=True)
    ctx.report(("serving", ctx.name, os.getpid()))
    ctx.send_to(0, ctx.name)
    server.join()


class SilenceWatch:
    """Should the chief stay silent for most of the run's silence limit, every thread's Python stack goes to
    its log shortly before the launcher ends the run (the timeout's error ends with the log).

    A thread of our own that reads the stacks holding the interpreter's lock. ``faulthandler``'s
    ``dump_traceback_later`` reads them without it, from a C thread, while TensorFlow's threads (the
    coordinator's, autograph's) run and change them: when it fired it crashed the chief with SIGSEGV
    (reproduced by arming it every 50 ms), turning a slow run into a crash with no stack.
    """

    def __init__(self, timeout_s: float, out: Any = None) -> None:
        self.after_s = max(0.8 * timeout_s, timeout_s - 5.0)
        self._out = out
        self._rewound = threading.Event()
        self._closed = False
        self.fired = 0
        self._thread = threading.Thread(target=self._watch, name="silence-watch", daemon=True)
        self._thread.start()

    def rewind(self) -> None:
        """Something was said: the silence starts again."""
        self._rewound.set()

    def close(self) -> None:
        self._closed = True
        self._rewound.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._closed:
            if self._rewound.wait(self.after_s):
                self._rewound.clear()
                continue
            self.fired += 1
            self._write_stacks()

    def _write_stacks(self) -> None:
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        lines = [f"silent for {self.after_s:.0f} s: the stacks of every thread (most recent call last)\n"]
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            lines.append(f"\nthread {names.get(ident, ident)}:\n")
            lines.extend(traceback.format_stack(frame))
        out = self._out or sys.stderr
        out.write("".join(lines))
        out.flush()


def _progress(ctx: RankContext, payload: Any, watch: SilenceWatch) -> None:
    """Report to the launcher, and rewind the chief's silence watch."""
    ctx.report(payload)
    watch.rewind()


def _chief(spec: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    """Build the model under ParameterServerStrategy and time the steps; returns the record."""
    started = time.perf_counter()
    watch = SilenceWatch(spec["timeout_s"])
    try:
        return _train(spec, ctx, watch, started)
    finally:
        watch.close()


def _train(spec: dict[str, Any], ctx: RankContext, watch: SilenceWatch, started: float) -> dict[str, Any]:
    import keras
    import numpy as np
    import tensorflow as tf

    _progress(ctx, ("started", os.getpid()), watch)
    cluster = _cluster_spec(ctx)
    servers, batch_size = spec["servers"], spec["batch_size"]
    for _ in range(2 * servers):  # each server says when it serves; one that dies ends the run
        _progress(ctx, ("heard", ctx.receive()), watch)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=None)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    _progress(ctx, ("connected",), watch)  # every phase reports: a slow machine's silences stay short

    x, y = spec["make_batch"](batch_size, 0)
    x, y = np.asarray(x), np.asarray(y)
    with strategy.scope():
        model = spec["build_model"]()
        if not isinstance(model, keras.Model):
            raise TypeError(f"build_model() returned {type(model).__name__}, expected an uncompiled keras.Model")
        if not model.built:
            model(x[:1])  # creates the variables now, on the PS tasks, not inside the step function
        loss_object = spec["loss_fn"]()
    _progress(ctx, ("built", model.name), watch)
    trainable = list(model.trainable_variables)
    learning_rate = spec["learning_rate"]

    def dataset_fn() -> tf.data.Dataset:
        # the batch index tells, after the run, how many batches each worker took
        return tf.data.Dataset.zip(tf.data.Dataset.from_tensors((x, y)).repeat(), tf.data.Dataset.range(2**62))

    @tf.function
    def train_step(iterator: Any) -> Any:
        def replica_fn(inputs: Any, labels: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_object(labels, model(inputs, training=True))
            gradients = tape.gradient(loss, trainable)
            for variable, gradient in zip(trainable, gradients, strict=True):
                variable.assign_sub(tf.cast(learning_rate, gradient.dtype) * gradient)
            return loss

        (inputs, labels), index = next(iterator)
        return strategy.run(replica_fn, args=(inputs, labels)), index

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    _progress(ctx, ("training",), watch)
    setup_s = time.perf_counter() - started
    times: list[float] = []
    first = last = None
    for step in range(spec["warmup"] + spec["steps"]):
        begun = time.perf_counter()
        losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(servers)]
        coordinator.join()
        seconds = time.perf_counter() - begun
        if step >= spec["warmup"]:
            times.append(seconds)
        first = first or losses
        last = losses
        _progress(ctx, ("step", step, seconds), watch)
    step_time = float(np.median(times))
    record = {
        "transport": TRANSPORT,
        "model": model.name,
        "batch_size": batch_size,
        "servers": servers,
        "steps": spec["steps"],
        "warmup": spec["warmup"],
        "step_time_s": step_time,
        "throughput_batches_per_s": 1.0 / step_time,
        "compute_s": _NAN,
        "comm_s": _NAN,
        "mean_step_time_s": float(np.mean(times)),
        "min_step_time_s": float(np.min(times)),
        "max_step_time_s": float(np.max(times)),
        "setup_s": setup_s,
        "model_mb": sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.weights) / 2**20,
        "variable_devices": {v.path: v.value.device for v in model.variables},
        "first_loss": _mean_loss(first),
        "last_loss": _mean_loss(last),
        # batches taken by the workers that ran the last step: all warmup + steps when each step gave one per worker
        "worker_batches_last_step": sorted(int(v.fetch()[1]) + 1 for v in last or []),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "cluster": cluster,
    }
    return record


def _mean_loss(remote_values: list[Any] | None) -> float:
    if not remote_values:
        return _NAN
    values = [float(v.fetch()[0]) for v in remote_values]
    return sum(values) / len(values) if all(math.isfinite(v) for v in values) else _NAN
