"""PyTorch's own peer lines of ``bench micro`` (``torch_gloo``, ``torch_rpc``) and their plain loops: each moves the
tensor intact at one size, torch_rpc's records name the TensorPipe transport and channel, each skips with one line
where torch is missing, and their tokenless listeners run only on private hosts (or the line is left out)."""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.experiments.micro import MicroError
from bench.experiments.peers import calibration_lines, peer_lines
from bench.experiments.peers.torch_gloo import GlooLine, GlooLink, PlainGlooLine
from bench.experiments.peers.torch_rpc import PlainRpcLine, RpcLine, RpcLink
from bench.launch import LaunchError
from bench.launch.hosts import NetnsUnavailable
from bench.launch.local import LocalLauncher
from bench.results import lines as catalogue
from bench.results import load_run
from tests.peer_faults import corrupting
from tests.test_peers import _run, bench

TORCH_MISSING = GlooLine(name="torch_gloo").availability().reason or None
needs_torch = pytest.mark.skipif(TORCH_MISSING is not None, reason=str(TORCH_MISSING))
LINES = [GlooLine, RpcLine, PlainGlooLine, PlainRpcLine]
TENSORPIPE = r"tensorpipe:(shm|uv|ibv),cma"


def test_the_catalogue_has_pytorchs_lines_and_ddp_is_training_only():
    assert {"torch_gloo", "torch_rpc"} <= set(catalogue.micro_peers())
    assert catalogue.line("torch_ddp").kind == "peer" and catalogue.line("torch_ddp").label == \
        "PyTorch DDP (all-reduce)"
    assert "torch_ddp" not in catalogue.micro_peers()
    assert [line.name for line in peer_lines(["torch_gloo", "torch_rpc"])] == ["torch_gloo", "torch_rpc"]
    assert [line.name for line in calibration_lines(["torch_gloo", "torch_rpc"])] == ["torch_gloo_plain",
                                                                                      "torch_rpc_plain"]


@needs_torch
@pytest.mark.system("netns")
@pytest.mark.parametrize("line_class", [GlooLine, RpcLine])
def test_each_torch_line_moves_the_tensor_intact_and_counts_it(line_class):
    line = line_class(name=line_class.__name__, timeout_s=60)
    [(point, sender, receiver)] = _run(line, [1 << 10])
    moved = point.transfers - point.warmup
    assert sender.stats.tensors_sent == receiver.stats.tensors_received == moved
    assert sender.stats.payload_bytes_sent == receiver.stats.payload_bytes_received == moved * 1024
    if line_class is RpcLine:
        assert sender.fabric["fabric"] == "tensorpipe" and sender.fabric["used"][-1] == "cma"


@needs_torch
@pytest.mark.system("netns")
def test_bench_micro_measures_the_torch_lines_beside_their_plain_loops(tmp_path):
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "1KB", "--iters", "20", "--warmup", "2", "--peers", "torch_gloo,torch_rpc",
                   "--calibrate", "--transports", "local", "--no-references", "--no-plot", "--timeout", "120",
                   "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = load_run(out).records.set_index("transport")
    for name in ("torch_gloo", "torch_rpc", "torch_gloo_plain", "torch_rpc_plain"):
        assert records.loc[name, "size_bytes"] == 1024 and records.loc[name, "iters"] == 20
        assert records.loc[name, "p50_us"] > 0
    assert records.loc["torch_gloo", "line_kind"] == "peer"
    assert records.loc["torch_rpc_plain", "line_kind"] == "reference"
    assert records.loc["torch_gloo", "fabric"] == records.loc["torch_gloo_plain", "fabric"] == "gloo:tcp"
    for name in ("torch_rpc", "torch_rpc_plain"):  # the TensorPipe transport and channel it was given
        assert re.fullmatch(TENSORPIPE, records.loc[name, "fabric"]), records.loc[name, "fabric"]


@pytest.mark.system("netns")
@pytest.mark.parametrize("line_class", LINES)
def test_a_torch_line_runs_on_a_private_host_of_its_own(line_class):
    """Its store and listeners have no token: under the local launcher it gets a network namespace of its own."""
    hosts = line_class(name="x").hosts(LocalLauncher())
    try:
        assert hosts.own and hosts.isolated
    finally:
        hosts.launcher.close()


@pytest.mark.parametrize("line_class", LINES)
def test_without_namespaces_a_loopback_run_leaves_a_torch_line_out_saying_why(line_class, monkeypatch):
    def refuse() -> None:
        raise NetnsUnavailable("namespaces refused by the test")

    monkeypatch.setattr("bench.launch.netns.check_support", refuse)
    with pytest.raises(LaunchError, match=r"namespaces refused by the test.*--peers without torch_(gloo|rpc)"):
        line_class(name="x").hosts(LocalLauncher())


def test_a_torch_line_without_torch_is_one_line(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named '{name}'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    for line_class in (GlooLine, RpcLine):
        status = line_class(name="x").availability()
        assert not status.ok and "torch is not installed here" in status.reason and "\n" not in status.reason


@dataclass
class _ExposedStore(GlooLine):
    """The torch_gloo line's link, its receiver reporting where its store listens and holding it open until the test
    has tried to reach it from this machine's own network (``tried`` appears)."""

    tried: str = ""

    def ranks(self, points: list) -> list:
        return self.pair_ranks(_expose, points)


def _expose(line: _ExposedStore, points: list, ctx) -> None:
    with GlooLink(ctx.cluster, ctx.rank, line.timeout_s) as link:
        if ctx.rank == 1:
            host = ctx.cluster.addresses[1].rpartition(":")[0].strip("[]")
            ctx.report(("store", host, link._store.port))
            deadline = time.monotonic() + line.timeout_s
            while not Path(line.tried).exists() and time.monotonic() < deadline:
                time.sleep(0.05)


@needs_torch
@pytest.mark.system("netns")
def test_a_torch_lines_store_is_not_reachable_from_outside_its_private_host(tmp_path):
    """gloo's TCPStore has no token and listens on every interface: the sender reached it inside the line's private
    host (the link came up), and from this machine's own network it cannot be reached."""
    line = _ExposedStore(name="torch_gloo", timeout_s=60, tried=str(tmp_path / "tried"))
    outcomes = []

    def on_report(rank: int, payload) -> None:
        if isinstance(payload, tuple) and payload[:1] == ("store",):
            _, host, port = payload
            try:
                socket.create_connection((host, port), timeout=5).close()
                outcomes.append("reached")
            except OSError as exc:
                outcomes.append(type(exc).__name__)
            (tmp_path / "tried").touch()

    hosts = line.hosts(LocalLauncher())
    try:
        assert hosts.isolated
        hosts.launcher.run(line.ranks([]), 120, on_report, label="exposed_store")
    finally:
        if hosts.own:
            hosts.launcher.close()
    assert len(outcomes) == 1 and outcomes[0] != "reached", outcomes


CorruptingGlooLink = corrupting(GlooLink)
CorruptingRpcLink = corrupting(RpcLink)


@dataclass
class CorruptingGlooLine(GlooLine):
    def link(self, cluster, rank: int) -> GlooLink:
        return CorruptingGlooLink(cluster, rank, self.timeout_s)


@dataclass
class CorruptingRpcLine(RpcLine):
    def link(self, cluster, rank: int) -> RpcLink:
        return CorruptingRpcLink(cluster, rank, self.timeout_s)


@needs_torch
@pytest.mark.system("netns")
@pytest.mark.parametrize("line_class", [CorruptingGlooLine, CorruptingRpcLine])
def test_each_torch_lines_data_check_fails_on_a_corrupted_buffer(line_class):
    line = line_class(name=line_class.__name__, timeout_s=60)
    with pytest.raises(MicroError, match=r"transfer 0 of 64KB arrived wrong: element 8192 of 16384 differs"):
        _run(line, [64 << 10])
