"""PyTorch's own training lines (``torch_rpc``: its RPC parameter server; ``torch_ddp``: DistributedDataParallel):
the weights of PyTorch's own one-process SGD after a few synchronous steps over 2 servers, their records, and
listeners out of the host network's reach."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest

from bench.experiments.torch_training import (
    TORCH_DDP,
    TORCH_RPC,
    TorchDdpTraining,
    TorchRpcTraining,
    TorchTrainingError,
    run_torch_training,
)
from bench.launch.hosts import EmulatedHosts, NetnsUnavailable
from bench.launch.local import LocalLauncher
from bench.launch.mpi import MpiLauncher
from bench.launch.netns import NetnsLauncher
from bench.launch.private import PrivateHosts
from bench.results import REQUIRED_COLUMNS
from bench.runtime.config import TrainConfig
from tests import tiny_models, tiny_torch_models
from tests.processes import children_of, gone
from tests.test_framework_conformance import torch_own_training
from tests.test_tf_grpc import _network_address

pytestmark = pytest.mark.timeout(300)
LINES = (TORCH_RPC, TORCH_DDP)


#: the lines run where their listeners are private: a network namespace here (root, ip), or --launcher netns
needs_netns = pytest.mark.system("netns")


def _torch() -> None:
    pytest.importorskip("torch", reason="torch is not installed here")


def _config(workload=tiny_torch_models.TINY, name="tests.tiny_torch_models:TINY", servers=2, steps=3) -> TrainConfig:
    return TrainConfig(model=name, workload=workload, transport="", transport_options={}, batch_size=4,
                       servers=servers, steps=steps, warmup=1, learning_rate=0.1, timeout_s=120)


@needs_netns
@pytest.mark.parametrize("line", LINES)
def test_two_servers_end_with_torchs_own_one_process_weights(line):
    _torch()
    config = _config()
    steps: list[tuple[int, int]] = []
    record, samples = run_torch_training(line, config, on_step=lambda server, step: steps.append((server, step)),
                                         keep_weights=True)
    own = torch_own_training(config)
    assert sorted(record["final_weights"]) == list(range(len(own))) == [0, 1, 2, 3]
    for index, weight in enumerate(own):
        np.testing.assert_allclose(record["final_weights"][index], weight, rtol=1e-5, atol=1e-6)
    # every worker said each of its 1 + 3 steps as it began; the samples are the 3 timed ones of each
    assert sorted(steps) == [(server, step) for server in range(2) for step in range(4)]
    assert samples["worker"] == [0, 0, 0, 1, 1, 1] and all(s > 0 for s in samples["step_time_s"])
    assert record["isolated_network"] is True and "private emulated host" in record["isolation_note"]
    addresses = record["cluster"]
    assert len(addresses) == (4 if line == TORCH_RPC else 2)
    assert len({a.rsplit(":", 1)[0] for a in addresses}) == 1 and not any(a.startswith("127.") for a in addresses)


@needs_netns
@pytest.mark.parametrize(("line", "cls"), [(TORCH_RPC, TorchRpcTraining), (TORCH_DDP, TorchDdpTraining)])
def test_the_line_gives_a_torch_model_record(line, cls):
    _torch()
    record, samples = cls().train(_config(servers=1, steps=2), LocalLauncher())
    row = record.row()
    assert set(row) >= set(REQUIRED_COLUMNS["model"])
    assert (record.transport, record.framework, record.servers, record.steps) == (line, "torch", 1, 2)
    assert record.framework_version and record.framework_version.split("+")[0].count(".") == 2
    assert record.step_time_s > 0 and record.throughput_batches_per_s == pytest.approx(1 / record.step_time_s)
    assert record.worker_peak_rss_mb > 10 and record.isolated_network is True
    assert record.model_mb == pytest.approx((8 * 16 + 16 + 16 * 3 + 3) * 4 / 2**20)
    if line == TORCH_RPC:  # the forward and backward pass, and the rest of the step: sends, the PS's apply, receives
        assert record.compute_s > 0 and record.comm_s > 0 and record.apply_s > 0 and record.ps_peak_rss_mb > 10
        assert record.fabric == "tensorpipe"
    else:  # DDP all-reduces inside the backward pass: no split, no parameter server
        assert math.isnan(record.compute_s) and math.isnan(record.comm_s) and record.ps_peak_rss_mb is None
        assert record.fabric == "gloo"
    assert len(samples["step_time_s"]) == 2


def _network_of(pid: int) -> dict:
    """The network namespace of process ``pid``, its interfaces and the TCP ports listening in it (as /proc shows
    them to this process, which may be outside it)."""
    interfaces = {line.split(":")[0].strip() for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]}
    listening = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # TCP_LISTEN
                listening.add(int(local.rsplit(":", 1)[1], 16))
    return {"namespace": os.readlink(f"/proc/{pid}/ns/net"), "interfaces": interfaces, "listening": listening}


class _Watching(NetnsLauncher):
    """``--launcher netns`` that reads the network of rank 0's process as soon as it says its store listens."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, dict]] = []

    def run(self, ranks, timeout_s, on_report=None, label="run", startup_s=0.0):
        def watch(rank, payload):
            if payload[0] == "rendezvous":
                self.seen.append((payload[1], _network_of(payload[2])))
            if on_report is not None:
                on_report(rank, payload)

        return super().run(ranks, timeout_s, watch, label, startup_s)


@needs_netns
@pytest.mark.parametrize("line", LINES)
def test_the_rendezvous_store_listens_out_of_the_host_networks_reach(line, monkeypatch):
    """No token guards PyTorch's TCPStore (it listens on every interface): rank 0 runs in a network namespace of its
    own (a private emulated host: its loopback and its link to the run's bridge, nothing else), where its store
    listens. (A plain connection cannot tell: this machine's default route accepts a connection to any address.)"""
    _torch()
    watching = _Watching()
    monkeypatch.setattr("bench.experiments.torch_training.hosts_for_open_listeners",
                        lambda launcher, what, leave_out: PrivateHosts(watching, True, True, "private"))
    record, _ = run_torch_training(line, _config(servers=1, steps=50), LocalLauncher())
    [(address, network)] = watching.seen
    assert address == record["cluster"][0] and not address.startswith("127.")
    assert network["namespace"] != os.readlink("/proc/self/ns/net")
    assert network["interfaces"] == {"lo", EmulatedHosts.INTERFACE}
    assert int(address.rsplit(":", 1)[1]) in network["listening"]


def _refuse_namespaces(monkeypatch) -> None:
    def refuse() -> None:
        raise NetnsUnavailable("namespaces refused by the test")

    monkeypatch.setattr("bench.launch.netns.check_support", refuse)


@pytest.mark.parametrize("line", LINES)
@pytest.mark.parametrize("given", [None, "local"])
def test_without_namespaces_a_loopback_run_is_refused(line, given, monkeypatch):
    """PyTorch's TCPStore listens on every interface and takes no token: without a private namespace a run meant for
    loopback (the default) is refused before any process starts, saying why and what to do."""
    _torch()
    _refuse_namespaces(monkeypatch)
    with pytest.raises(TorchTrainingError, match=rf"^{line}: no private network namespace here \(.*namespaces "
                                                 r"refused by the test.*TCPStore.*not on 127\.0\.0\.1.*--bind"):
        run_torch_training(line, _config(), LocalLauncher() if given else None)


@pytest.mark.parametrize("line", LINES)
def test_runs_it_cannot_do_are_refused_in_one_line(line, monkeypatch):
    with pytest.raises(ValueError, match=rf"{line} trains PyTorch models, not tensorflow's: use --framework torch"):
        run_torch_training(line, _config(tiny_models.TINY, "tests.tiny_models:TINY"))
    with pytest.raises(ValueError, match="cannot replay compute"):
        run_torch_training(line, dataclasses.replace(_config(), compute="replay"))
    with monkeypatch.context() as patch:
        patch.setattr("importlib.util.find_spec", lambda name, *args: None)
        with pytest.raises(ValueError, match=rf"^{line} needs PyTorch, which is not installed here: pip install"):
            run_torch_training(line, _config())
    _torch()
    config = _config()
    config.memory = "cuda"  # what bench model --memory cuda asks of a line
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=rf"^{line}: --memory cuda:0: the torch here .* sees 0 CUDA device"):
            run_torch_training(line, config)


@needs_netns
@pytest.mark.parametrize("line", LINES)
def test_a_sparse_gradient_and_batch_norm_train_as_in_one_process(line):
    """An embedding whose gradient is sparse (its rows travel) and BatchNorm's state, over 2 servers: the trainable
    weights of PyTorch's own one-process SGD."""
    _torch()
    config = _config(tiny_torch_models.TINY_EMBEDDING, "tests.tiny_torch_models:TINY_EMBEDDING")
    record, _ = run_torch_training(line, config, keep_weights=True)
    own = torch_own_training(config)
    assert sorted(record["final_weights"]) == list(range(len(own)))
    for index, weight in enumerate(own):
        np.testing.assert_allclose(record["final_weights"][index], weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("line", LINES)
def test_under_mpi_on_loopback_the_run_is_refused_before_anything_starts(line):
    """mpirun's ranks run where they were started, on the host's network: PyTorch's store would listen on every
    interface of it while the run was asked to stay on loopback."""
    _torch()
    launcher = object.__new__(MpiLauncher)  # its class says what it is; no MPI is initialised here
    launcher.bind = "127.0.0.1"
    with pytest.raises(TorchTrainingError, match=rf"^{line}: .*TCPStore.* listens on every interface .*--launcher mpi "
                                                 rf"runs it on the host's own network: pass --bind ADDRESS to accept "
                                                 rf"that, or --transport without {line}$"):
        run_torch_training(line, _config(), launcher)


def _live_children() -> set[int]:
    return {pid for pid in children_of(os.getpid()) if not gone(pid)}


@dataclasses.dataclass(frozen=True)
class FailingBuild(tiny_torch_models.TinyTorchMLP):
    """The tiny model, whose every build fails (in the ranks' processes)."""

    def build(self):
        raise RuntimeError("no model today")


@needs_netns
@pytest.mark.parametrize("line", LINES)
def test_a_failing_rank_is_named_and_nothing_is_left(line):
    _torch()
    before = _live_children()
    # every rank builds the model: whichever fails first is named first
    with pytest.raises(TorchTrainingError, match=rf"^{line}: rank \d \((worker|ps) \d\) failed: RuntimeError: no "
                                                 r"model today"):
        run_torch_training(line, _config(FailingBuild(), "tests.test_torch_training:FailingBuild"))
    assert _live_children() <= before


@dataclasses.dataclass(frozen=True)
class ThreadsAtTheLoss(tiny_torch_models.TinyTorchMLP):
    """The tiny model, whose loss a worker asks for once its RPC agent is up: it fails, naming the process's threads."""

    def loss_fn(self):
        names = sorted({(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()})
        raise RuntimeError(f"threads: {' '.join(names)} :threads")


@needs_netns
def test_no_tensorpipe_thread_polls_a_core_beside_the_workers_compute():
    """TensorPipe's shm transport runs a reactor thread in every process that polls its rings without sleeping: with
    each rank in a session of its own, the parameter server's took a core from its worker's forward and backward pass
    (inception_v3 2 cores: 0.29 s before init_rpc, 6.5 s after). torch_rpc's agents run without it."""
    _torch()
    with pytest.raises(TorchTrainingError, match=r"rank 0 \(worker 0\) failed: RuntimeError: threads: ") as failed:
        run_torch_training(TORCH_RPC, _config(ThreadsAtTheLoss(), "tests.test_torch_training:ThreadsAtTheLoss",
                                              servers=1))
    threads = str(failed.value).split("threads: ", 1)[1].split(" :threads", 1)[0].split()
    assert any(name.startswith("TP_") for name in threads), threads  # TensorPipe's own threads are there, named
    assert "TP_SHM_reactor" not in threads


@pytest.mark.parametrize("line", LINES)
def test_without_namespaces_a_network_bind_runs_there_and_says_so(line, monkeypatch):
    _torch()
    address = _network_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    _refuse_namespaces(monkeypatch)
    record, _ = run_torch_training(line, _config(servers=1, steps=2), LocalLauncher(bind=address))
    assert record["isolated_network"] is False
    assert "namespaces refused by the test" in record["isolation_note"]
    assert "every interface" in record["isolation_note"] and f"--bind {address}" in record["isolation_note"]
    assert all(a.startswith(f"{address}:") for a in record["cluster"])
