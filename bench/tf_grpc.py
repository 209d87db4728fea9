"""The ``tf_grpc`` reference run: TensorFlow's own parameter-server training over its C++ gRPC runtime.

This is what users run today, drawn beside our transports in the model figures. It is not a
``Transport``: TensorFlow moves every tensor itself.

Topology, as in the paper: ``servers`` servers, each with one worker and one parameter server
(PS), here as ``tf.distribute.Server`` processes (one process per task), and a chief process that
runs ``tf.distribute.experimental.ParameterServerStrategy`` with a
``tf.distribute.coordinator.ClusterCoordinator`` and a custom training loop (``model.fit`` does not
work with this strategy under Keras 3). The strategy places the variables round-robin over the
PS tasks (no partitioner). One step is one ``coordinator.schedule`` per worker of a
``tf.function`` that reads the weights from the PS tasks, computes the gradients of one batch and
applies plain SGD (``w -= lr * g``) on the PS tasks, then ``coordinator.join()``: every step is
timed from its first schedule to the end of its last closure, as in synchronous training.

Data: ``make_batch(batch_size, seed=0)`` is called once on the chief and becomes a repeated
``tf.data`` dataset that ``coordinator.create_per_worker_dataset`` builds on every worker; the
batch travels to the workers once, inside the dataset's graph, and no step pays for generating it.

Processes: ``run_tf_grpc`` starts one *job* process in a new session (its own process group),
under ``unshare -n`` when that is permitted, so that it and everything it starts live in a
private network namespace with only ``lo`` up: ``tf.distribute.Server`` listens on every
interface whatever the cluster spec says, and there it cannot be reached from outside. Without
``unshare`` the job runs on loopback ports in the host's namespace and the record says so
(``isolated_network`` false). The job picks free ports on 127.0.0.1, starts the worker and PS
servers, runs the chief itself and writes its result to a JSON file. On success, error,
timeout or ``KeyboardInterrupt`` the whole process group is killed; servers also die with the
job (``PR_SET_PDEATHSIG``) and the job with its caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import math
import os
import pickle
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TRANSPORT = "tf_grpc"
#: characters of a log that an error message quotes
_STDERR_TAIL_CHARS = 2000
_POLL_S = 0.1
#: seconds the job gets to dump its threads' stacks before a timeout kills it
_STACK_DUMP_S = 1.5
_PR_SET_PDEATHSIG = 1
#: lines every TensorFlow process logs at start-up whatever TF_CPP_MIN_LOG_LEVEL says: left out of error messages
_START_UP_NOISE = (
    "All log messages before absl::InitializeLog() is called",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "failed call to cuInit",
)
_NAN = float("nan")
_JOB_LOG = "job.log"
_RESULT_FILE = "result.json"
_SPEC_FILE = "spec.pkl"
_STACKS_FILE = "stacks.txt"


class TfGrpcError(RuntimeError):
    """The tf_grpc reference run failed; the message names the failing process and ends with its stderr tail."""

    def __init__(self, message: str, process_group: int | None = None) -> None:
        super().__init__(message)
        #: the process group of the run (every process it started was in it, and has been killed)
        self.process_group = process_group


class TfGrpcTimeout(TfGrpcError, TimeoutError):
    """The tf_grpc reference run did not finish within its ``timeout_s``."""


# -- public API ------------------------------------------------------------------------------


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
) -> dict[str, Any]:
    """Train with TensorFlow's ParameterServerStrategy over gRPC and return one ``model`` record.

    ``build_model()`` returns an uncompiled ``keras.Model``, ``make_batch(batch_size, seed)`` an
    ``(x, y)`` pair of numpy arrays and ``loss_fn()`` a Keras loss; all three must be picklable
    module-level callables (the chief process imports them by name). ``servers`` workers and as
    many PS tasks run ``warmup`` untimed steps, then ``steps`` timed ones; ``timeout_s`` bounds the
    whole run, start-up included.

    The record has the ``model`` columns of ``bench.results`` (``step_time_s`` is the median
    seconds per step, ``throughput_batches_per_s`` the batches per second one worker sees,
    ``compute_s`` and ``comm_s`` NaN: TensorFlow does not split them) plus diagnostics:
    ``isolated_network`` and ``isolation_note``, peak RSS per process kind (MB),
    ``variable_devices`` (variable path -> device of its value), ``worker_batches_last_step``
    (batches taken so far by the workers that ran the last step: all ``warmup + steps`` when every
    step gave each worker one closure), losses and versions.
    ``record_row`` keeps only the columns ``records.csv`` takes.

    Raises ``TfGrpcError`` (``TfGrpcTimeout`` on timeout) naming the failing process, with its
    stderr tail; no process of the run is left behind, whatever happens.
    """
    _check_arguments(batch_size, servers, steps, warmup, timeout_s)
    try:
        spec = pickle.dumps(
            {
                "build_model": build_model,
                "make_batch": make_batch,
                "loss_fn": loss_fn,
                "batch_size": int(batch_size),
                "servers": int(servers),
                "steps": int(steps),
                "warmup": int(warmup),
                "learning_rate": float(learning_rate),
            }
        )
    except Exception as exc:
        raise TfGrpcError(
            f"tf_grpc: build_model, make_batch and loss_fn must be picklable module-level callables "
            f"(the chief process imports them by name): {type(exc).__name__}: {exc}"
        ) from exc
    isolated, note = network_isolation()
    with tempfile.TemporaryDirectory(prefix="tf_grpc-") as tmp:
        run_dir = Path(tmp)
        (run_dir / _SPEC_FILE).write_bytes(spec)
        record = _run_job(run_dir, isolated, timeout_s)
    record["isolated_network"] = isolated
    record["isolation_note"] = note
    return record


def record_row(record: dict[str, Any]) -> dict[str, Any]:
    """The columns of ``record`` that a ``model`` ``records.csv`` takes (``bench.results.COLUMNS``)."""
    from bench.results import COLUMNS

    return {k: v for k, v in record.items() if k in COLUMNS["model"]}


_ISOLATION: tuple[bool, str] | None = None


def network_isolation() -> tuple[bool, str]:
    """Whether the job can run in a private network namespace (``unshare -n``), and a note saying why (not)."""
    global _ISOLATION
    if _ISOLATION is None:
        _ISOLATION = _probe_isolation()
    return _ISOLATION


def _probe_isolation() -> tuple[bool, str]:
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        return False, f"no {' or '.join(missing)} here: servers listen on every interface of the host (loopback ports)"
    try:
        probe = subprocess.run(
            ["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"unshare -n failed ({exc}): servers listen on every interface of the host (loopback ports)"
    if probe.returncode != 0:
        why = probe.stderr.strip().splitlines()[-1:] or [f"exit code {probe.returncode}"]
        return False, (
            f"unshare -n not permitted ({why[0]}); run as root or allow unprivileged user namespaces to isolate: "
            "servers listen on every interface of the host (loopback ports)"
        )
    return True, "private network namespace (unshare -n), only lo up"


def _check_arguments(batch_size: int, servers: int, steps: int, warmup: int, timeout_s: float) -> None:
    for name, value, least in (("batch_size", batch_size, 1), ("servers", servers, 1), ("steps", steps, 1),
                               ("warmup", warmup, 0)):
        if int(value) != value or value < least:
            raise ValueError(f"tf_grpc: {name} must be an integer >= {least}, got {value!r}")
    if not timeout_s > 0:
        raise ValueError(f"tf_grpc: timeout_s must be positive, got {timeout_s!r}")


# -- the caller's side: one job process, killed as a group -----------------------------------


def _child_env() -> dict[str, str]:
    """The environment of every process of the run: quiet TF, the caller's import path."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env["PYTHONUNBUFFERED"] = "1"
    # the chief imports the caller's callables by name, so it needs the caller's sys.path
    path = [p for p in sys.path if p] + [str(Path(__file__).resolve().parent.parent)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    return env


def _python_command(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from bench.tf_grpc import _child_main; _child_main(sys.argv[1:])",
            *args]


def _run_job(run_dir: Path, isolated: bool, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    command = _python_command("job", str(run_dir), str(os.getpid()), "1" if isolated else "0")
    if isolated:
        command = ["unshare", "-n", "--", *command]
    log_path = run_dir / _JOB_LOG
    with open(log_path, "wb") as log:
        # a new session: the job and every server it starts share a process group we can kill at once
        job = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               env=_child_env(), start_new_session=True)
    group = job.pid
    try:
        while not _exited(job.pid):
            if time.monotonic() > deadline:
                _dump_stacks(job.pid)
                raise TfGrpcTimeout(
                    f"tf_grpc: the run did not finish within timeout_s={timeout_s:g} s; killed it"
                    f"{_tails(run_dir)}{_main_stack(run_dir / _STACKS_FILE)}", group)
            time.sleep(_POLL_S)
    finally:
        # the job has exited but is not reaped yet, so its pid still names the group: nothing else can take it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
        job.wait()
    result_path = run_dir / _RESULT_FILE
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if "error" in result:
            raise TfGrpcError(f"tf_grpc: {result['error']}{_tails(run_dir, result.get('logs'))}", group)
        result["record"]["process_group"] = group
        return result["record"]
    raise TfGrpcError(f"tf_grpc: the job process died (exit code {job.returncode}) without a result"
                      f"{_tails(run_dir)}", group)


def _exited(pid: int) -> bool:
    """Whether ``pid`` (our child) has exited, without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _dump_stacks(pid: int) -> None:
    """Ask the job to write its Python stacks to its log (faulthandler), so a timeout says where it hung."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
        end = time.monotonic() + _STACK_DUMP_S
        while time.monotonic() < end and not _exited(pid):
            time.sleep(_POLL_S)


def _main_stack(path: Path, frames: int = 15) -> str:
    """The innermost frames of the job's main thread from its faulthandler dump (most recent call first)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    sections: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            sections.append([line])
        elif sections and line.strip():
            sections[-1].append(line)
    if not sections:
        return ""
    # faulthandler lists the newest thread first, so the main thread last; it cuts stacks at 100 frames
    main = next((s for s in sections if any("_child_main" in line for line in s)), sections[-1])
    shown = main[1:frames + 1]
    more = len(main) - 1 - len(shown)
    return ("\n--- where the chief's main thread was (most recent call first) ---\n" + "\n".join(shown)
            + (f"\n  ... {more} outer frames" if more > 0 else ""))


def _tail(path: Path, chars: int = _STDERR_TAIL_CHARS) -> str:
    """The last ``chars`` of a log, without TensorFlow's start-up lines (logged before TF_CPP_MIN_LOG_LEVEL applies)."""
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if not any(noise in line for noise in _START_UP_NOISE)]
    return "\n".join(lines)[-chars:].strip()


def _tails(run_dir: Path, names: Sequence[str] | None = None) -> str:
    """The stderr tails of the named logs (default: the job's), each under a header."""
    parts = []
    for name in names or [_JOB_LOG]:
        text = _tail(run_dir / name)
        who = "the chief (job process)" if name == _JOB_LOG else name.removesuffix(".log")
        parts.append(f"\n--- stderr tail of {who} ---\n{text or '(empty)'}")
    return "".join(parts)


# -- inside the run: the job (chief) and the servers -----------------------------------------


def _child_main(argv: list[str]) -> None:
    """Entry point of the run's processes: ``job RUN_DIR PARENT_PID ISOLATED`` or ``server ...``."""
    if argv[0] == "job":
        _job_main(Path(argv[1]), int(argv[2]), argv[3] == "1")
    elif argv[0] == "server":
        _server_main(json.loads(argv[1]), argv[2], int(argv[3]), int(argv[4]))
    else:
        raise SystemExit(f"bench.tf_grpc: unknown role {argv[0]!r} (known: job, server)")


def _die_with_parent(parent_pid: int) -> None:
    """Get SIGKILL when the parent dies; exit now if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _server_main(cluster: dict[str, list[str]], job_name: str, task_index: int, parent_pid: int) -> None:
    """One worker or PS task: a ``tf.distribute.Server`` that serves until it is killed."""
    _die_with_parent(parent_pid)
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    import tensorflow as tf

    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job_name, task_index=task_index,
                                  protocol="grpc", start=True)
    server.join()


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 (all held until all are chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def _peak_rss_mb(rusage: resource.struct_rusage) -> float:
    return rusage.ru_maxrss / 1024.0  # kilobytes on Linux


class _Job:
    """The job process: starts the servers, watches them, runs the chief, writes the result once."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.servers: dict[str, subprocess.Popen] = {}
        self.rss_mb: dict[str, float] = {}
        self.finishing = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="tf_grpc-watch", daemon=True)
        self.lock = threading.Lock()
        self.written = False

    def write(self, result: dict[str, Any]) -> None:
        """Write the result file atomically, once (the first writer wins: a dead server or the chief)."""
        with self.lock:
            if self.written:
                return
            self.written = True
            tmp = self.run_dir / (_RESULT_FILE + ".tmp")
            tmp.write_text(json.dumps(result))
            tmp.rename(self.run_dir / _RESULT_FILE)

    def fail(self, message: str, logs: Sequence[str] = ()) -> None:
        """Record an error with the logs whose tails explain it, and end the job (the caller kills the rest)."""
        self.write({"error": message, "logs": [_JOB_LOG, *logs]})
        sys.stderr.flush()
        os._exit(1)

    def start_servers(self, cluster: dict[str, list[str]]) -> None:
        env = dict(os.environ)
        for job_name in ("ps", "worker"):
            for index in range(len(cluster[job_name])):
                name = f"{job_name}-{index}"
                with open(self.run_dir / f"{name}.log", "wb") as log:
                    self.servers[name] = subprocess.Popen(
                        _python_command("server", json.dumps(cluster), job_name, str(index), str(os.getpid())),
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.watcher.start()

    def _watch(self) -> None:
        """A server that exits before the chief is done fails the run (TF would wait for it forever)."""
        while not self.finishing.is_set():
            for name, proc in self.servers.items():
                if proc.poll() is not None and not self.finishing.is_set():
                    self.fail(f"{name} (tf.distribute.Server) exited with code {proc.returncode} "
                              "before training finished", [f"{name}.log"])
            time.sleep(_POLL_S)

    def wait_listening(self, ports: dict[str, int]) -> None:
        """Wait until every server accepts connections (the watcher ends the job if one dies first)."""
        waiting = dict(ports)
        while waiting:
            for name, port in list(waiting.items()):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        del waiting[name]
            if waiting:
                time.sleep(_POLL_S)

    def dead_servers(self) -> dict[str, int]:
        """The servers that have exited, by name, with their exit codes."""
        return {name: proc.returncode for name, proc in self.servers.items() if proc.poll() is not None}

    def stop_servers(self) -> None:
        """Kill the servers and keep their peak RSS (``wait4`` of each)."""
        self.finishing.set()
        self.watcher.join()  # it must not reap a server before wait4 below does
        for proc in self.servers.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for name, proc in self.servers.items():
            with contextlib.suppress(ChildProcessError):
                _, status, rusage = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
                self.rss_mb[name] = _peak_rss_mb(rusage)


def _shorten(text: str, chars: int = 1500) -> str:
    """TensorFlow's error messages can run to pages: keep their start (the log tail has the rest)."""
    return text if len(text) <= chars else text[:chars].rstrip() + " [...]"


def _bring_up_loopback() -> None:
    done = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"'ip link set lo up' in the private network namespace failed: {done.stderr.strip()}")


def _job_main(run_dir: Path, parent_pid: int, isolated: bool) -> None:
    _die_with_parent(parent_pid)
    # kept open for the life of the process: a timeout makes the caller send SIGUSR1 for the stacks
    stacks = open(run_dir / _STACKS_FILE, "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    job = _Job(run_dir)
    where = "the chief (job process)"
    try:
        if isolated:
            _bring_up_loopback()
        where = "the chief (job process) while loading the callables"
        spec = pickle.loads((run_dir / _SPEC_FILE).read_bytes())
        servers = spec["servers"]
        ports = _free_ports(2 * servers + 1)
        cluster = {
            "chief": [f"127.0.0.1:{ports[0]}"],
            "ps": [f"127.0.0.1:{p}" for p in ports[1:1 + servers]],
            "worker": [f"127.0.0.1:{p}" for p in ports[1 + servers:]],
        }
        started = time.perf_counter()
        where = "the chief (job process) while starting the servers"
        job.start_servers(cluster)
        where = "the chief (job process)"
        record = _chief(job, spec, cluster, started)
        job.stop_servers()
        record["worker_peak_rss_mb"] = max(v for k, v in job.rss_mb.items() if k.startswith("worker"))
        record["ps_peak_rss_mb"] = max(v for k, v in job.rss_mb.items() if k.startswith("ps"))
        record["chief_peak_rss_mb"] = _peak_rss_mb(resource.getrusage(resource.RUSAGE_SELF))
        record["peak_rss_mb_per_process"] = dict(sorted(job.rss_mb.items()))
        job.write({"record": record})
    except BaseException as exc:
        traceback.print_exc()
        message = f"{where} failed: {type(exc).__name__}: {_shorten(str(exc))}"
        dead = job.dead_servers()
        if dead:  # the likely cause: say it first, with their logs
            exits = ", ".join(f"{name} (tf.distribute.Server) exited with code {code}" for name, code in dead.items())
            message = f"{exits} before training finished; then {message}"
        job.fail(message, [f"{name}.log" for name in dead])
    sys.stdout.flush()
    sys.stderr.flush()
    # TF's coordinator threads can keep a normal interpreter exit waiting on the servers just killed
    os._exit(0)


def _chief(job: _Job, spec: dict[str, Any], cluster: dict[str, list[str]], started: float) -> dict[str, Any]:
    """Build the model under ParameterServerStrategy and time the steps; returns the record."""
    import keras
    import numpy as np
    import tensorflow as tf

    servers, batch_size = spec["servers"], spec["batch_size"]
    job.wait_listening({name: int(address.rsplit(":", 1)[1])
                        for kind in ("ps", "worker") for name, address in
                        ((f"{kind}-{i}", a) for i, a in enumerate(cluster[kind]))})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=None)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    x, y = spec["make_batch"](batch_size, 0)
    x, y = np.asarray(x), np.asarray(y)
    with strategy.scope():
        model = spec["build_model"]()
        if not isinstance(model, keras.Model):
            raise TypeError(f"build_model() returned {type(model).__name__}, expected an uncompiled keras.Model")
        if not model.built:
            model(x[:1])  # creates the variables now, on the PS tasks, not inside the step function
        loss_object = spec["loss_fn"]()
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
    setup_s = time.perf_counter() - started
    times: list[float] = []
    first = last = None
    for step in range(spec["warmup"] + spec["steps"]):
        begun = time.perf_counter()
        losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(servers)]
        coordinator.join()
        if step >= spec["warmup"]:
            times.append(time.perf_counter() - begun)
        first = first or losses
        last = losses
    step_time = float(np.median(times))
    return {
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


def _mean_loss(remote_values: list[Any] | None) -> float:
    if not remote_values:
        return _NAN
    values = [float(v.fetch()[0]) for v in remote_values]
    return sum(values) / len(values) if all(math.isfinite(v) for v in values) else _NAN
