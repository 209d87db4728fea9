"""The framework seam: the parameter-server runtime trains a PyTorch model over every transport to the weights of
PyTorch's own one-process training, and TensorFlow's to local training's (``tests/test_runtime.py``); sparse
gradients, gradients sent while the backward pass runs, and no copy on the zero-copy path, in both frameworks.
Nothing outside the runtime's bridges and the model builders imports a framework."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import transports
from bench.experiments.training import DEVICE_CROSSINGS, model_record, train
from bench.runtime.config import TrainConfig, worker_batch
from bench.runtime.framework import FRAMEWORKS, framework_named, framework_of
from bench.runtime.local import train_locally
from tests import tiny_models, tiny_torch_models
from transports.memory import Memory

ROOT = Path(__file__).resolve().parents[1]
TRANSPORTS = [
    ("grpc_tcp", {}),
    ("zerocopy", {"fabric_transport": "shm"}),
    ("rdma_cp", {"fabric_transport": "shm"}),
    ("grpc_rdma", {"fabric_transport": "shm", "mode": "buffered"}),
    ("grpc_rdma", {"fabric_transport": "shm", "mode": "direct"}),
]
#: a tiny model of each framework, and its name as the spawned ranks import it
TINY = {"tensorflow": (tiny_models.TINY, "tests.tiny_models:TINY"),
        "torch": (tiny_torch_models.TINY, "tests.tiny_torch_models:TINY")}
EMBEDDING = {"tensorflow": (tiny_models.TINY_EMBEDDING, "tests.tiny_models:TINY_EMBEDDING"),
             "torch": (tiny_torch_models.TINY_EMBEDDING, "tests.tiny_torch_models:TINY_EMBEDDING")}


def needs(framework: str) -> None:
    pytest.importorskip(framework, reason=f"{framework} is not installed here")


def config(workload, name, transport="zerocopy", options=None, servers=1, steps=3) -> TrainConfig:
    return TrainConfig(model=name, workload=workload, transport=transport, transport_options=options or {},
                       batch_size=4, servers=servers, steps=steps, warmup=1, learning_rate=0.1, timeout_s=120)


def final_weights(result) -> dict[int, np.ndarray]:
    weights = {}
    for role, times in result["outcome"].values():
        if role == "ps":
            weights.update(times.extra["final_weights"])
    return weights


def torch_own_training(run: TrainConfig) -> list[np.ndarray]:
    """PyTorch's own synchronous SGD in one process: each step the mean of every worker's gradient on its batch,
    applied by ``torch.optim.SGD``; the trainable weights at the end."""
    torch = pytest.importorskip("torch")
    model = framework_named("torch").build(run.workload, run.seed)
    loss_fn = run.workload.loss_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=run.learning_rate)
    for step in range(run.warmup + run.steps):
        optimizer.zero_grad(set_to_none=True)
        for server in range(run.servers):
            x, y = worker_batch(run, server, step)
            (loss_fn(torch.from_numpy(y), model(torch.from_numpy(x))) / run.servers).backward()
        optimizer.step()
    return [parameter.detach().numpy().copy() for parameter in model.parameters()]


def test_framework_names_and_workloads():
    assert FRAMEWORKS == ("tensorflow", "torch")
    assert framework_of(tiny_torch_models.TINY).name == "torch"
    assert framework_of(object()).name == "tensorflow"  # a workload that says nothing: the paper's
    with pytest.raises(ValueError, match="unknown framework 'jax': choose one of tensorflow, torch"):
        framework_named("jax")


@pytest.mark.parametrize(("transport", "options"), TRANSPORTS,
                         ids=[f"{t}-{o.get('mode', '')}".rstrip("-") for t, o in TRANSPORTS])
def test_torch_training_over_a_transport_ends_with_torchs_own_weights(transport, options):
    needs("torch")
    if not transports.availability(transport).ok:
        pytest.skip(transports.availability(transport).reason)
    workload, name = TINY["torch"]
    run = config(workload, name, transport, options)
    distributed = final_weights(train(run))
    own = torch_own_training(run)
    assert sorted(distributed) == list(range(len(own)))
    for index, weight in enumerate(own):
        np.testing.assert_allclose(distributed[index], weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_two_servers_train_a_sparse_gradient_and_state_as_one_process(framework):
    """An embedding (sparse gradient: its distinct rows and their indices) and BatchNorm's state, over two
    servers: the weights of local training; torch's trainable ones also PyTorch's own SGD's."""
    needs(framework)
    workload, name = EMBEDDING[framework]
    run = config(workload, name, "zerocopy", {"fabric_transport": "shm"}, servers=2)
    plan = framework_of(workload).analyze(name, framework_of(workload).build(workload, 0), workload,
                                          *workload.make_batch(4, 0), 2, 4)
    assert [v.path for v in plan.trainable if v.sparse] and plan.state
    assert sum(not t.static for t in plan.transfers) == 4  # g0.values, g0.indices from each of two workers
    _, local = train_locally(run)
    distributed = final_weights(train(run))
    assert sorted(distributed) == sorted(local)
    for index, weight in local.items():
        np.testing.assert_allclose(distributed[index], weight, rtol=1e-5, atol=1e-6)
    if framework == "torch":
        for index, weight in enumerate(torch_own_training(run)):
            np.testing.assert_allclose(distributed[index], weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_zerocopy_sends_gradients_during_the_backward_pass_and_copies_nothing(framework):
    """Every dense gradient of the tiny model goes to the transport from the framework's own memory while the
    backward pass runs; nothing is copied, by the transport or the runtime."""
    needs(framework)
    workload, name = TINY[framework]
    run = config(workload, name, "zerocopy", {"fabric_transport": "shm"})
    result = train(run)
    [worker] = [times for role, times in result["outcome"].values() if role == "worker"]
    assert worker.extra["updates_sent_early"] == 4 * run.steps  # two kernels and two biases, every timed step
    record = model_record(run, result["outcome"]).row()
    assert record["updates_sent_early_per_step"] == 4
    assert record["copied_bytes_per_step"] == 0
    assert record["runtime_copied_bytes_per_step"] == 0
    assert record["memory"] == "host"
    assert [record[f"{crossing}_per_step"] for crossing in DEVICE_CROSSINGS] == [0, 0, 0]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_zerocopy_sends_every_update_from_registered_memory_after_the_first_step(framework):
    """What a worker sends (gradients and new state) lies where the runtime registered its region in the first step:
    every timed send is a registration-cache hit, in PyTorch as in TensorFlow (PyTorch's tensors left in the C
    library's heap missed every step, and the runtime looked for their regions again every step)."""
    needs(framework)
    workload, name = TINY[framework]
    run = config(workload, name, "zerocopy", {"fabric_transport": "shm"})
    result = train(run)
    [worker] = [times for role, times in result["outcome"].values() if role == "worker"]
    assert worker.extra["sites"]["missed"] == {}
    record = model_record(run, result["outcome"]).row()
    assert record["unregistered_sends_per_step"] == 0
    assert record["registration_hit_rate"] == 1.0
    assert record["copied_bytes_per_step"] == 0


#: where device memory moves device to device (UCX's cuda_ipc on one node), and where it is staged through the host
DEVICE_TRANSPORTS = [("zerocopy", {}, False), ("rdma_cp", {}, False), ("grpc_tcp", {}, True)]


def gpu_problem() -> str | None:
    """Why this machine cannot train PyTorch in device memory (the reason a GPU case skips); None when it can."""
    needs("torch")
    return framework_named("torch").memory_problem(Memory.parse("cuda"))


@pytest.mark.parametrize(("transport", "options", "staged"), DEVICE_TRANSPORTS,
                         ids=[t for t, _, _ in DEVICE_TRANSPORTS])
def test_torch_training_in_device_memory_ends_with_torchs_own_weights(transport, options, staged):
    """``--memory cuda``: the model computes on the GPU, the parameter server applies SGD there, and the weights
    are PyTorch's own training's; zerocopy and rdma_cp cross no bus (device to device), grpc_tcp stages both ways,
    counted."""
    if problem := gpu_problem():
        pytest.skip(problem)
    workload, name = TINY["torch"]
    run = dataclasses.replace(config(workload, name, transport, options), memory="cuda")
    result = train(run)
    distributed = final_weights(result)
    for index, weight in enumerate(torch_own_training(run)):  # (on the host: a GPU sums in another order)
        np.testing.assert_allclose(distributed[index], weight, rtol=1e-3, atol=1e-4)
    record = model_record(run, result["outcome"]).row()
    assert record["memory"] == "cuda:0"
    crossed = record["device_to_host_bytes_per_step"] + record["host_to_device_bytes_per_step"]
    assert (crossed > 0) == staged


def test_device_memory_is_refused_in_one_line_where_it_cannot_be_had(capsys):
    """TensorFlow's runtime keeps host memory; a sparse gradient's rows are gathered on the host; PyTorch without a
    GPU: each refused before a rank starts, naming the fix."""
    cuda = Memory.parse("cuda")
    assert "--framework torch" in framework_named("tensorflow").memory_problem(cuda)
    assert framework_named("tensorflow").memory_problem(Memory.parse("host")) is None
    from bench.cli import main

    assert main(["model", "fcn5", "--memory", "cuda", "--steps", "1", "--no-plot"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "host memory only" in error
    needs("torch")
    workload, name = EMBEDDING["torch"]
    plan = framework_of(workload).analyze(name, framework_of(workload).build(workload, 0), workload,
                                          *workload.make_batch(4, 0), 1, 4)
    sparse = dataclasses.replace(config(workload, name), memory="cuda", plan=plan)
    assert "sparse gradient" in sparse.memory_problem()
    assert dataclasses.replace(sparse, memory="host").memory_problem() is None
    if gpu_problem() is None:
        return  # (a GPU here: PyTorch can have device memory)
    assert "CUDA device" in gpu_problem()


def test_torch_weights_are_the_received_memory_and_gradients_leave_from_autograds():
    """A worker's parameters compute over the arrays the transport received (no copy in), and the gradients it
    hands over are views of autograd's own gradient tensors (no copy out)."""
    torch = pytest.importorskip("torch")
    from bench.runtime.config import RuntimeCopies

    workload, _ = TINY["torch"]
    bridge = framework_named("torch")
    model = bridge.build(workload, 0)
    values = bridge.initial_values(model)
    handed: list[tuple[list[int], list[np.ndarray]]] = []
    step = bridge.step(model, workload, [], on_gradients=lambda positions, arrays: handed.append((positions,
                                                                                                  arrays)))
    copies = RuntimeCopies()
    result = step(values, *workload.make_batch(4, 0), copies)
    parameters = list(model.parameters())
    assert [p.data_ptr() for p in parameters] == [v.ctypes.data for v in values]
    assert [g.ctypes.data for g in result.gradients] == [p.grad.data_ptr() for p in parameters]
    assert handed and sorted(i for positions, _ in handed for i in positions) == [0, 1, 2, 3]
    assert [a.ctypes.data for _, arrays in handed for a in arrays] == \
        [parameters[i].grad.data_ptr() for positions, _ in handed for i in positions]
    assert copies.bytes == 0
    del torch


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


#: where a framework may be imported: the runtime's bridges, the model and task builders, the lines that are a
#: framework's own training or transport, the tools that tell what is installed
FRAMEWORK_ROOMS = (
    "bench/runtime/tensorflow_bridge.py", "bench/runtime/torch_bridge.py",
    "bench/experiments/models.py", "bench/experiments/torch_models.py", "bench/experiments/tasks.py",
    "bench/experiments/torch_tasks.py", "bench/experiments/tf_grpc.py", "bench/experiments/torch_training.py",
    "bench/experiments/peers/torch_", "bench/experiments/gpus.py", "bench/experiments/doctor.py",
    "bench/ground/", "transports/tensors.py", "transports/memory",
)


def test_nothing_outside_the_bridges_and_the_model_builders_imports_a_framework():
    offenders = []
    for path in sorted([*ROOT.glob("bench/**/*.py"), *ROOT.glob("transports/**/*.py")]):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(FRAMEWORK_ROOMS):
            continue
        found = _imports(path) & {"tensorflow", "keras", "torch"}
        if found:
            offenders.append(f"{relative}: {', '.join(sorted(found))}")
    assert offenders == []
