"""PyTorch's own training lines of ``bench model``: what a PyTorch user runs instead of our parameter server.

- ``torch_rpc`` (:class:`TorchRpcTraining`): parameter-server training over ``torch.distributed.rpc`` (TensorPipe),
  as pytorch/examples' batch parameter server does it, in the runtime's layout (``bench.runtime.analyzer.Layout``):
  ``servers`` workers (ranks ``0..N-1``) and ``servers`` parameter servers (ranks ``N..2N-1``), worker and PS ``i``
  on host (server) ``i``; every variable (the trainable parameters in ``named_parameters()`` order, then the
  buffers) lives on PS ``index % servers``. A worker fetches its PSs' values by RPC once, then every step computes
  the forward and backward pass on its batch and sends each PS the gradients (and new buffer values) of its
  variables by ``rpc_async``; the PS answers once every worker's have come (``@rpc.functions.async_execution``: no
  thread waits), having applied ``torch.optim.SGD`` with the run's learning rate to the workers' mean gradient (a
  buffer takes the workers' mean, an integer one worker 0's), with its new values, which the worker's parameters
  then are (``param.data``: no copy). Synchronous, as our runtime's default. TensorPipe carries the messages over
  ``uv`` (TCP), or ``ibv`` where an RDMA port is up (``RPC_TRANSPORTS``), the tensors as it chooses (``cma`` between
  ranks of one machine); not over its default between the processes of one network namespace, ``shm``, whose
  reactor thread polls its rings without sleeping (``sched_yield`` in a loop) in every process as long as RPC is up.
  Each rank runs in a session of its own, and Linux shares the cores between sessions (autogroups), so a yielding
  spinner keeps its share: the parameter server's took one of the 2 cores from its worker, whose inception_v3
  forward and backward pass went from 0.29 s before ``init_rpc`` to 6.5 s after (0.28 s without ``shm``).
  TensorPipe's ``ibv`` reactor polls the same way: where RDMA is up, that core is TensorPipe's price for it.
- ``torch_ddp`` (:class:`TorchDdpTraining`): ``DistributedDataParallel``, ``servers`` ranks (no parameter servers),
  ``torch.optim.SGD``; DDP all-reduces the gradients in buckets while the backward pass runs (gloo on the host; with
  device memory NCCL where every rank of a host has a GPU of its own, else gloo, which stages through the host).

Both train the same model (``config.workload``, built and seeded as the runtime builds it: ``build_model``), on the
same synthetic batches (``worker_batch``: worker ``i``'s batch at each step), for ``warmup`` untimed and ``steps``
timed steps. Each worker times its steps: ``compute_s`` is the forward and backward pass and ``comm_s`` the rest
(RPC: sending the gradients until every new value is in, the PSs' apply included; DDP cannot split them, its
all-reduce runs inside the backward pass: NaN). ``apply_s`` is a PS's SGD (RPC). Each worker reports
``("step", server, step)`` to the launcher as its steps begin, so the run's timeout bounds silence.

Listeners: every rank of either line listens (rank 0 a ``TCPStore`` for the rendezvous, which binds every interface;
TensorPipe's and gloo's listeners on the interface ``TP_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` names: the one of
the rank's address) and none takes a token. So they run as ``tf_grpc`` does
(``bench.launch.private.hosts_for_open_listeners``): under no launcher or a local one in one private emulated host (a
network namespace with no link to the host's interfaces), under ``netns`` each server on its own; where no namespace
can be made, and under ``mpi`` or ``slurm`` (whose ranks run where they were started), refused unless ``--bind`` names
an address of the network (then on the host's network, and the record says so: ``isolated_network`` false).

Device memory (``config.memory`` ``cuda``): the model, its gradients and what the PSs hold are on the GPU; RPC moves
them with TensorPipe's device maps (its CUDA channels: cuda_ipc on one node, else staged through the host as
TensorPipe does), DDP over NCCL. Refused, in one line, where torch has no GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from bench.experiments.training import TrainingLine, cores_per_rank
from bench.launch import Launcher, LaunchError, RankContext, RankFailed, RankSpec
from bench.launch.addresses import interface_of
from bench.launch.private import hosts_for_open_listeners
from bench.results import ModelRecord
from bench.results.lines import TORCH_DDP, TORCH_RPC
from bench.runtime.config import TrainConfig, build_model, framework, worker_batch

_NAN = float("nan")
#: seconds of silence allowed beyond ``timeout_s`` until the run's first report: every process imports PyTorch
STARTUP_S = 120.0
#: TensorPipe's transports for torch_rpc's messages, in TensorPipe's order of preference: every one but ``shm``, whose
#: reactor thread polls its rings without sleeping in every process (a core per rank, idle or not; see the module)
RPC_TRANSPORTS = ("ibv", "uv")
#: what listens, in the isolation note and errors
_LISTENERS = "PyTorch's TCPStore (every interface, no token), TensorPipe's and gloo's listeners"


class TorchTrainingError(RuntimeError):
    """A torch_rpc or torch_ddp run failed; the message names the failing rank (and ends with its log tail)."""


class TorchTrainingTimeout(TorchTrainingError, TimeoutError):
    """No process of the run said anything for ``timeout_s``."""


# -- the lines --------------------------------------------------------------------------------------------------


class TorchRpcTraining(TrainingLine):
    """PyTorch's own parameter-server training over ``torch.distributed.rpc`` (TensorPipe), the runtime's layout."""

    def train(self, config: TrainConfig, launcher: Launcher, on_step: Callable[[int, int], None] | None = None
              ) -> tuple[ModelRecord, dict[str, list] | None]:
        record, samples = run_torch_training(TORCH_RPC, config, launcher, on_step)
        return record_row(record), samples


class TorchDdpTraining(TrainingLine):
    """PyTorch's data-parallel training: ``DistributedDataParallel``, gradients all-reduced (gloo; NCCL on GPUs)."""

    def train(self, config: TrainConfig, launcher: Launcher, on_step: Callable[[int, int], None] | None = None
              ) -> tuple[ModelRecord, dict[str, list] | None]:
        record, samples = run_torch_training(TORCH_DDP, config, launcher, on_step)
        return record_row(record), samples


def record_row(record: dict[str, Any]) -> ModelRecord:
    """The ``model`` record of a run's result: the columns ``records.csv`` takes (the rest stays in the result)."""
    return ModelRecord.from_row({k: v for k, v in record.items() if k in ModelRecord.columns()})


def device_of(config: TrainConfig) -> str:
    """``cuda`` when the run asks for device memory (``config.memory``), else ``cpu``."""
    return "cuda" if config.memory_kind.is_device else "cpu"


def run_torch_training(line: str, config: TrainConfig, launcher: Launcher | None = None,
                       on_step: Callable[[int, int], None] | None = None, keep_weights: bool = False
                       ) -> tuple[dict[str, Any], dict[str, list]]:
    """Train ``config`` over ``line`` (``torch_rpc`` or ``torch_ddp``): the record (``model`` columns and
    diagnostics) and the samples (each worker's timed steps). ``on_step(server, step)`` follows the workers;
    ``keep_weights`` puts the final trainable weights (index -> array) in ``record["final_weights"]``.

    Raises ``ValueError`` for a run the line cannot do (replayed compute, a TensorFlow model, no torch, no GPU for
    ``--memory cuda``) and :class:`TorchTrainingError` naming the failing rank."""
    if line not in (TORCH_RPC, TORCH_DDP):
        raise ValueError(f"unknown PyTorch line {line!r}: {TORCH_RPC} or {TORCH_DDP}")
    if config.replayed:
        raise ValueError(f"{line} runs PyTorch's own training: it cannot replay compute (use --compute real)")
    if config.framework != "torch":
        raise ValueError(f"{line} trains PyTorch models, not {config.framework}'s: use --framework torch "
                         "(tf_grpc is TensorFlow's own line)")
    if importlib.util.find_spec("torch") is None:
        raise ValueError(f"{line} needs PyTorch, which is not installed here: pip install 'tensor-transport-bench"
                         "[torch]'")
    device = device_of(config)
    if problem := framework(config).memory_problem(config.memory_kind):
        raise ValueError(f"{line}: {problem}")
    try:
        chosen, own, isolated, note = hosts_for_open_listeners(launcher, _LISTENERS, f"--transport without {line}")
    except LaunchError as exc:
        raise TorchTrainingError(f"{line}: {exc}") from None
    private = own and isolated  # our one private emulated host holds every rank
    servers = config.servers
    job = functools.partial(_rpc_rank if line == TORCH_RPC else _ddp_rank, config, device, keep_weights)
    ranks = [RankSpec(job, f"worker {s}", host=0 if private else s) for s in range(servers)]
    if line == TORCH_RPC:
        ranks += [RankSpec(job, f"ps {s}", host=0 if private else s) for s in range(servers)]

    def on_report(rank: int, payload: Any) -> None:
        if payload[0] == "step" and on_step is not None:
            on_step(payload[1], payload[2])

    try:
        results = chosen.run(ranks, config.timeout_s, on_report,
                             label=f"{config.model}-{line}-b{config.batch_size}-s{servers}", startup_s=STARTUP_S)
    except RankFailed as exc:
        raise (TorchTrainingTimeout if exc.kind == "silent" else TorchTrainingError)(f"{line}: {exc}") from None
    finally:
        if own:
            chosen.close()
    workers = [r for r in results if r.name.startswith("worker")]
    parameter_servers = [r for r in results if r.name.startswith("ps")]
    timed = [r.result for r in workers]
    step_time = float(np.mean([np.mean(w["steps"]) for w in timed]))
    record: dict[str, Any] = {
        "transport": line, "model": config.model, "batch_size": config.batch_size, "servers": servers,
        "steps": config.steps, "warmup": config.warmup, "compute": "real",
        "step_time_s": step_time, "throughput_batches_per_s": 1.0 / step_time,
        "compute_s": float(np.mean([np.mean(w["compute"]) for w in timed])) if line == TORCH_RPC else _NAN,
        "comm_s": float(np.mean([np.mean(w["comm"]) for w in timed])) if line == TORCH_RPC else _NAN,
        "apply_s": float(np.mean([np.mean(r.result["apply"]) for r in parameter_servers]))
        if parameter_servers else None,
        "worker_peak_rss_mb": max(r.peak_rss_mb for r in workers),
        "ps_peak_rss_mb": max((r.peak_rss_mb for r in parameter_servers), default=None),
        "peak_rss_mb_per_process": {r.name: r.peak_rss_mb for r in results},
        "model_mb": timed[0]["model_mb"], "fabric": timed[0]["fabric"],
        "framework": "torch", "framework_version": timed[0]["torch"],
        "isolated_network": isolated, "isolation_note": note, "memory": str(config.memory_kind),
        "first_loss": timed[0]["losses"][0], "last_loss": timed[0]["losses"][-1],
        "cluster": list(results[0].result["cluster"]),
    }
    if keep_weights:
        holders = parameter_servers if line == TORCH_RPC else workers[:1]
        record["final_weights"] = {index: weight for r in holders for index, weight in r.result["weights"].items()}
    rows = sorted((r.rank, seconds) for r in workers for seconds in r.result["steps"])
    return record, {"worker": [rank for rank, _ in rows], "step_time_s": [seconds for _, seconds in rows]}


# -- in the ranks' processes ------------------------------------------------------------------------------------


def _rendezvous(ctx: RankContext) -> str:
    """Where rank 0's TCPStore listens (``tcp://host:port``: its address in the run; rank 0 reports
    ``("rendezvous", address, pid)`` once it does, see :func:`_listening`); this rank's listeners are put on the
    interface of its own address."""
    host = ctx.cluster.addresses[ctx.rank].rsplit(":", 1)[0]
    interface = interface_of(host)
    if interface is not None:
        os.environ["TP_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"] = interface
    return f"tcp://{ctx.cluster.addresses[0]}"


def _host_ranks(addresses: list[str] | tuple[str, ...], rank: int) -> list[int]:
    """The ranks on ``rank``'s host (the same address), ``rank`` among them."""
    host = addresses[rank].rsplit(":", 1)[0]
    return [i for i, address in enumerate(addresses) if address.rsplit(":", 1)[0] == host]


def _listening(ctx: RankContext) -> None:
    """Rank 0, its store up: says where it listens, and its process (whose network the isolation test reads)."""
    if ctx.rank == 0:
        ctx.report(("rendezvous", ctx.cluster.addresses[0], os.getpid()))


def _rank_device(device: str, addresses: list[str] | tuple[str, ...], rank: int) -> Any:
    """Rank ``rank``'s device: the CPU, or the GPU of its place among its host's ranks (they share one when fewer)."""
    import torch

    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", _host_ranks(addresses, rank).index(rank) % torch.cuda.device_count())


def _variables(model: Any) -> tuple[list[Any], int]:
    """The model's variables in the seam's order (trainable parameters, then buffers) and how many are trainable."""
    from bench.runtime.torch_bridge import variables

    trainable, state = variables(model)
    return trainable + state, len(trainable)


def _model_mb(model: Any) -> float:
    """The trainable variables' MB, as the runtime's records count a model's size."""
    variables, trainable = _variables(model)
    return sum(v.numel() * v.element_size() for v in variables[:trainable]) / 2**20


def _batch(config: TrainConfig, server: int, step: int, device: Any) -> tuple[Any, Any]:
    import torch

    x, y = worker_batch(config, server, step)
    return (torch.from_numpy(np.ascontiguousarray(x)).to(device), torch.from_numpy(np.ascontiguousarray(y)).to(device))


def _synchronize(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _worker_result(model: Any, times: dict[str, list[float]], losses: list[float], fabric: str, ctx: RankContext
                   ) -> dict[str, Any]:
    import torch

    return {**times, "losses": losses, "fabric": fabric, "model_mb": _model_mb(model), "torch": str(torch.__version__),
            "cluster": list(ctx.cluster.addresses)}


# -- torch_rpc ---

#: the parameter server of this process (a PS rank's), which the RPC functions below serve
_SERVER: _ParameterServer | None = None


class _ParameterServer:
    """A PS's variables (``index -> tensor``) and the step it is gathering: each worker's updates, summed; once
    every worker's are in, SGD on the mean and the new values to every worker (the futures they wait on)."""

    def __init__(self, values: dict[int, Any], trainable: int, workers: int, learning_rate: float, warmup: int,
                 device: Any) -> None:
        import torch

        self.values, self.trainable, self.workers, self.warmup, self.device = values, trainable, workers, warmup, device
        self.parameters = [values[i] for i in sorted(values) if i < trainable]
        self.optimizer = torch.optim.SGD(self.parameters, lr=learning_rate) if self.parameters else None
        self.lock = threading.Lock()
        self.step = 0
        self.arrived: dict[int, list[Any]] = {}
        self.future = self._new_future()
        self.apply_s: list[float] = []

    def _new_future(self) -> Any:
        import torch

        return torch.futures.Future(devices=[self.device] if self.device.type == "cuda" else None)

    def current(self) -> list[Any]:
        return [self.values[i] for i in sorted(self.values)]

    def update(self, worker: int, step: int, updates: list[Any]) -> Any:
        """Worker ``worker``'s updates of step ``step`` (of this PS's variables, in index order): the future of the
        step's new values."""
        with self.lock:
            if step != self.step or worker in self.arrived:
                raise RuntimeError(f"worker {worker} sent step {step}'s updates while this PS gathers step {self.step}")
            self.arrived[worker] = updates
            future = self.future
            if len(self.arrived) < self.workers:
                return future
            started = time.perf_counter()
            self._apply([self.arrived[w] for w in sorted(self.arrived)])
            _synchronize(self.device)
            if step >= self.warmup:
                self.apply_s.append(time.perf_counter() - started)
            self.arrived, self.step, self.future = {}, step + 1, self._new_future()
        future.set_result(self.current())
        return future

    def _apply(self, per_worker: list[list[Any]]) -> None:
        import torch

        indices = sorted(self.values)
        for position, index in enumerate(indices):
            updates = [updates[position] for updates in per_worker]
            value = self.values[index]
            if index < self.trainable:
                value.grad = _mean(updates)
            elif value.is_floating_point():
                with torch.no_grad():
                    value.copy_(torch.stack(updates).mean(dim=0))
            else:  # a count (BatchNorm's batches): the same on every worker
                with torch.no_grad():
                    value.copy_(updates[0])
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def _mean(gradients: list[Any]) -> Any:
    """The mean of the workers' gradients of one variable, summed into the first (received here: the PS's own
    memory, no temporary of the variable's size); sparse ones (an embedding's rows) added as sparse tensors."""
    total = gradients[0]
    if total.is_sparse:
        for gradient in gradients[1:]:
            total = total + gradient
        return total / len(gradients)
    for gradient in gradients[1:]:
        total.add_(gradient)
    return total.div_(len(gradients)) if len(gradients) > 1 else total


def _ps_values() -> list[Any]:
    """RPC: this PS's variables' values, in index order."""
    return _SERVER.current()


def _ps_update(worker: int, step: int, updates: list[Any]) -> Any:
    """RPC (``async_execution``, made so by :func:`_rpc_functions`): the future of the step's new values."""
    return _SERVER.update(worker, step, updates)


def _rpc_functions() -> None:
    """Make :func:`_ps_update` an ``@rpc.functions.async_execution`` function, in every rank's process (the caller
    says so in its request; this module imports torch only in the ranks)."""
    global _ps_update
    from torch.distributed import rpc

    if not hasattr(_ps_update, "_wrapped_async_rpc_function"):
        _ps_update = rpc.functions.async_execution(_ps_update)  # same name: it travels by reference


def _rpc_options(config: TrainConfig, ctx: RankContext, device: Any) -> Any:
    from torch.distributed import rpc

    options = rpc.TensorPipeRpcBackendOptions(init_method=_rendezvous(ctx), rpc_timeout=config.timeout_s,
                                              _transports=list(RPC_TRANSPORTS))
    if device.type == "cuda":  # tensors go device to device: every peer's values on the GPU its rank uses
        servers = config.servers
        for rank in range(2 * servers):
            if rank != ctx.rank:
                options.set_device_map(_rpc_name(rank, servers),
                                       {device: _rank_device("cuda", ctx.cluster.addresses, rank)})
    return options


def _rpc_name(rank: int, servers: int) -> str:
    return f"worker{rank}" if rank < servers else f"ps{rank - servers}"


def _rpc_rank(config: TrainConfig, device_kind: str, keep_weights: bool, ctx: RankContext) -> dict[str, Any]:
    """A rank of torch_rpc: worker ``rank`` below ``servers``, else PS ``rank - servers``."""
    global _SERVER
    from torch.distributed import rpc

    _rpc_functions()
    servers = config.servers
    framework(config).use_cores(cores_per_rank(ctx, servers))  # as the runtime's ranks do
    device = _rank_device(device_kind, ctx.cluster.addresses, ctx.rank)
    model = build_model(config).to(device)
    variables, trainable = _variables(model)
    options = _rpc_options(config, ctx, device)
    if ctx.rank >= servers:  # a PS: its share of the variables, served until every rank is done
        ps = ctx.rank - servers
        values = {i: v.detach().clone().requires_grad_(i < trainable) for i, v in enumerate(variables)
                  if i % servers == ps}
        _SERVER = _ParameterServer(values, trainable, servers, config.learning_rate, config.warmup, device)
        rpc.init_rpc(_rpc_name(ctx.rank, servers), rank=ctx.rank, world_size=2 * servers, rpc_backend_options=options)
        rpc.shutdown()
        return {"apply": _SERVER.apply_s or [0.0], "cluster": list(ctx.cluster.addresses),
                "weights": {i: v.detach().cpu().numpy() for i, v in values.items() if i < trainable}
                if keep_weights else {}}
    server = ctx.rank
    rpc.init_rpc(_rpc_name(server, servers), rank=server, world_size=2 * servers, rpc_backend_options=options)
    _listening(ctx)
    owned = [[i for i in range(len(variables)) if i % servers == ps] for ps in range(servers)]

    def install(futures: list[Any]) -> None:
        for indices, future in zip(owned, futures, strict=True):
            for index, value in zip(indices, future.wait(), strict=True):
                variables[index].data = value  # the received tensor is the parameter now (no copy)

    install([rpc.rpc_async(f"ps{ps}", _ps_values) for ps in range(servers)])
    loss_fn = config.workload.loss_fn()
    times: dict[str, list[float]] = {"steps": [], "compute": [], "comm": []}
    losses: list[float] = []
    for step in range(config.warmup + config.steps):
        ctx.report(("step", server, step))
        x, y = _batch(config, server, step, device)
        began = time.perf_counter()
        for parameter in variables[:trainable]:
            parameter.grad = None
        loss = loss_fn(y, model(x))
        loss.backward()
        _synchronize(device)
        computed = time.perf_counter()
        updates = [p.grad for p in variables[:trainable]] + [b.detach() for b in variables[trainable:]]
        install([rpc.rpc_async(f"ps{ps}", _ps_update, args=(server, step, [updates[i] for i in indices]))
                 for ps, indices in enumerate(owned)])
        _synchronize(device)
        done = time.perf_counter()
        losses.append(float(loss.detach()))
        if step >= config.warmup:
            times["steps"].append(done - began)
            times["compute"].append(computed - began)
            times["comm"].append(done - computed)
    rpc.shutdown()
    return _worker_result(model, times, losses, "tensorpipe", ctx)


# -- torch_ddp ---


def _ddp_backend(device: Any, ctx: RankContext) -> str:
    """gloo on the host; NCCL on GPUs when this host's ranks each have one (NCCL refuses two ranks on one GPU)."""
    import torch

    if device.type != "cuda":
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= len(_host_ranks(ctx.cluster.addresses, ctx.rank)) else "gloo"


def _ddp_rank(config: TrainConfig, device_kind: str, keep_weights: bool, ctx: RankContext) -> dict[str, Any]:
    """A rank of torch_ddp: worker ``rank``, its model wrapped in ``DistributedDataParallel``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    server = ctx.rank
    framework(config).use_cores(cores_per_rank(ctx, config.servers))
    device = _rank_device(device_kind, ctx.cluster.addresses, ctx.rank)
    backend = _ddp_backend(device, ctx)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=_rendezvous(ctx), rank=server, world_size=config.servers,
                            timeout=timedelta(seconds=config.timeout_s))
    _listening(ctx)
    try:
        model = build_model(config).to(device)
        parallel = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(parallel.parameters(), lr=config.learning_rate)
        loss_fn = config.workload.loss_fn()
        times: dict[str, list[float]] = {"steps": []}
        losses: list[float] = []
        for step in range(config.warmup + config.steps):
            ctx.report(("step", server, step))
            x, y = _batch(config, server, step, device)
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(y, parallel(x))
            loss.backward()  # DDP all-reduces the gradients (their mean) meanwhile, and waits for the last bucket
            optimizer.step()
            _synchronize(device)
            done = time.perf_counter()
            losses.append(float(loss.detach()))
            if step >= config.warmup:
                times["steps"].append(done - began)  # the all-reduce is inside: no split (see the module)
        result = _worker_result(model, times, losses, backend, ctx)
        variables, trainable = _variables(model)
        result["weights"] = ({i: v.detach().cpu().numpy() for i, v in enumerate(variables[:trainable])}
                             if keep_weights and server == 0 else {})
        return result
    finally:
        dist.destroy_process_group()
