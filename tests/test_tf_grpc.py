"""The tf_grpc reference run: TensorFlow's ParameterServerStrategy over its gRPC runtime, ranks of a launcher run."""

from __future__ import annotations

import ipaddress
import math
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from bench.experiments.tf_grpc import TfGrpcError, TfGrpcTimeout, record_row, run_tf_grpc
from bench.launch import LaunchError, LauncherUnavailable, RankSpec
from bench.launch.addresses import interface_address
from bench.launch.hosts import NetnsUnavailable
from bench.launch.local import LocalLauncher
from bench.launch.mpi import MpiLauncher
from bench.launch.netns import NetnsLauncher
from bench.results import REQUIRED_COLUMNS
from tests.tf_grpc_models import build_failing, build_hanging
from tests.tiny_models import TINY

pytestmark = pytest.mark.timeout(300)

#: seconds of silence a run may keep here; start-up imports TensorFlow in every process of a busy machine
RUN_TIMEOUT_S = 150.0


def _netns_available() -> tuple[bool, str]:
    try:
        NetnsLauncher()
    except LauncherUnavailable as exc:
        return False, str(exc)
    return True, ""


NETNS, WHY_NOT_NETNS = _netns_available()
needs_netns = pytest.mark.system("netns")


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children_of_this_process() -> set[str]:
    """Live children of the test process (other tests may have left long-lived ones, e.g. a resource tracker)."""
    children = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            children += (task / "children").read_text().split()
        except OSError:
            continue
    return {child for child in children if _alive(int(child))}


def _our_namespaces() -> list[str]:
    """The network namespaces this test process's emulated hosts have left (named ``tbench-<pid>-...``)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [name for name in listed if name.startswith(f"tbench-{os.getpid()}-")]


@pytest.fixture
def nothing_left_behind():
    """Asserts after the test that no process the test started, nor a namespace of its, is left."""
    before = _children_of_this_process()
    yield
    assert _children_of_this_process() <= before
    assert _our_namespaces() == []


class WatchedNetns(NetnsLauncher):
    """``--launcher netns`` that keeps the pids the ranks report, and kills rank ``victim`` after step 1."""

    def __init__(self, victim: str | None = None) -> None:
        super().__init__()
        self.victim = victim
        self.pids: dict[str, int] = {}

    def run(self, ranks, timeout_s, on_report=None, label="run", startup_s=0.0):
        def watch(rank, payload):
            if payload[0] == "serving":
                self.pids[payload[1]] = payload[2]
            elif payload[0] == "started":
                self.pids["chief"] = payload[1]
            elif payload[:2] == ("step", 1) and self.victim:
                os.kill(self.pids[self.victim], signal.SIGKILL)

        return super().run(ranks, timeout_s, watch, label, startup_s)


def _train(servers: int, steps: int = 4, launcher=None) -> dict:
    return run_tf_grpc(TINY.build, TINY.make_batch, TINY.loss_fn, batch_size=8, servers=servers, steps=steps,
                       warmup=1, timeout_s=RUN_TIMEOUT_S, launcher=launcher)


def _check_record(record: dict, servers: int, steps: int = 4) -> None:
    assert set(record) >= {*REQUIRED_COLUMNS["model"], "isolated_network", "worker_peak_rss_mb", "ps_peak_rss_mb"}
    assert record["transport"] == "tf_grpc"
    assert (record["batch_size"], record["servers"], record["steps"]) == (8, servers, steps)
    assert record["step_time_s"] > 0
    assert record["min_step_time_s"] <= record["step_time_s"] <= record["max_step_time_s"]
    assert record["throughput_batches_per_s"] == pytest.approx(1 / record["step_time_s"])
    assert math.isnan(record["compute_s"]) and math.isnan(record["comm_s"])
    assert record["isolation_note"]
    processes = {"chief"} | {f"{kind} {i}" for kind in ("ps", "worker") for i in range(servers)}
    assert set(record["peak_rss_mb_per_process"]) == processes
    assert all(mb > 10 for mb in record["peak_rss_mb_per_process"].values())
    assert record["worker_peak_rss_mb"] > 10 and record["ps_peak_rss_mb"] > 10 and record["chief_peak_rss_mb"] > 10
    assert math.isfinite(record["first_loss"]) and math.isfinite(record["last_loss"])
    # every closure of the last step ran and took a batch: servers x (warmup + steps) in all, one per worker and step
    # when each took one; the coordinator gives a closure to whichever worker is free (a busy machine: [4, 6])
    batches = record["worker_batches_last_step"]
    assert len(batches) == servers and all(1 <= b <= servers * (1 + steps) for b in batches)
    assert [len(record["cluster"][job]) for job in ("chief", "ps", "worker")] == [1, servers, servers]

    # every variable lived on a PS task, round-robin over all of them
    devices = record["variable_devices"]
    assert len(devices) == 4
    assert all(d.startswith("/job:ps/") for d in devices.values()), devices
    assert {d.split("/task:")[1].split("/")[0] for d in devices.values()} == {str(i) for i in range(servers)}
    assert set(record_row(record).row()) >= set(REQUIRED_COLUMNS["model"])


@needs_netns
# each way to the local launcher (none given: the default; given) and each server count, in pairs: the launcher's
# wrapping into a private host does not depend on how many servers it holds
@pytest.mark.parametrize(("given", "servers"), [(None, 2), ("local", 1)])
def test_under_local_it_trains_in_a_private_emulated_host(servers, given, nothing_left_behind):
    record = _train(servers, launcher=LocalLauncher() if given else None)
    _check_record(record, servers)
    assert record["isolated_network"] is True
    assert "private emulated host" in record["isolation_note"]
    # every rank on the one host, none on the host's loopback
    addresses = [a for job in record["cluster"].values() for a in job]
    assert len({a.rsplit(":", 1)[0] for a in addresses}) == 1
    assert not any(a.startswith("127.") for a in addresses)


def _refuse_namespaces(monkeypatch) -> None:
    def refuse() -> None:
        raise NetnsUnavailable("namespaces refused by the test")

    monkeypatch.setattr("bench.launch.netns.check_support", refuse)


@pytest.mark.parametrize("given", [None, "local"])
def test_without_namespaces_it_refuses_to_listen_on_every_interface(monkeypatch, given, nothing_left_behind):
    """TensorFlow's servers bind 0.0.0.0 whatever the cluster spec says: without a private namespace, a run
    meant for loopback (the default) is refused before any process starts (before, it ran, open to the network)."""
    _refuse_namespaces(monkeypatch)
    with pytest.raises(TfGrpcError, match=r"no private network namespace here \(.*namespaces refused by the test.*"
                                          r"listen on every interface of the host, not on 127\.0\.0\.1.*--bind"):
        _train(1, launcher=LocalLauncher() if given else None)


def _network_address() -> str | None:
    """An IPv4 address of this host that is not loopback, or None."""
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        if address and not ipaddress.ip_address(address).is_loopback:
            return address
    return None


def test_without_namespaces_a_network_bind_runs_there_and_says_so(monkeypatch, nothing_left_behind):
    address = _network_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    _refuse_namespaces(monkeypatch)
    record = _train(1, launcher=LocalLauncher(bind=address))
    _check_record(record, 1)
    assert record["isolated_network"] is False
    assert "namespaces refused by the test" in record["isolation_note"]
    assert "every interface" in record["isolation_note"] and f"--bind {address}" in record["isolation_note"]
    assert all(a.startswith(f"{address}:") for job in record["cluster"].values() for a in job)


@needs_netns
def test_under_netns_each_server_runs_on_its_own_host(nothing_left_behind):
    launcher = WatchedNetns()
    record = _train(2, launcher=launcher)
    _check_record(record, 2)
    assert record["isolated_network"] is True
    host = {job: [a.rsplit(":", 1)[0] for a in addresses] for job, addresses in record["cluster"].items()}
    assert host["ps"] == host["worker"] and len(set(host["ps"])) == 2
    assert host["chief"] == host["ps"][:1]
    assert set(launcher.pids) == set(record["peak_rss_mb_per_process"])
    assert not any(_alive(pid) for pid in launcher.pids.values())


@needs_netns
@pytest.mark.parametrize(("victim", "rank"), [("ps 1", 2), ("worker 0", 3)])
def test_a_server_killed_mid_run_is_named_and_nothing_is_left(victim, rank, nothing_left_behind):
    launcher = WatchedNetns(victim)
    with pytest.raises(TfGrpcError, match=rf"rank {rank} \({victim}\) died \(killed by SIGKILL\)") as raised:
        _train(2, steps=100_000, launcher=launcher)
    assert not isinstance(raised.value, TfGrpcTimeout)
    assert str(raised.value).startswith(f"tf_grpc: rank {rank} ({victim}) died")
    assert len(launcher.pids) == 5 and not any(_alive(pid) for pid in launcher.pids.values())


def test_a_failing_build_raises_naming_the_chief(nothing_left_behind):
    with pytest.raises(TfGrpcError, match=r"rank 0 \(chief\) failed: RuntimeError: no model today") as raised:
        run_tf_grpc(build_failing, TINY.make_batch, TINY.loss_fn, batch_size=4, servers=1, steps=2,
                    timeout_s=RUN_TIMEOUT_S)
    assert not isinstance(raised.value, TfGrpcTimeout)


def test_a_silent_run_ends_at_its_timeout_saying_where_the_chief_hung(nothing_left_behind):
    # every process imports TensorFlow within the start-up allowance (STARTUP_S); the chief reports, connects to
    # the servers and then hangs in build_model, silent for 20 s
    with pytest.raises(TfGrpcTimeout, match=r"rank 0 \(chief\) did not finish: no rank said anything for 20 s") \
            as raised:
        run_tf_grpc(build_hanging, TINY.make_batch, TINY.loss_fn, batch_size=4, servers=1, steps=2, timeout_s=20)
    assert "in build_hanging" in str(raised.value)  # the chief's stacks, dumped into its log before the end


def test_mpi_refuses_the_servers_and_its_error_comes_through(nothing_left_behind):
    # the coordinator's checks of MpiLauncher.run, without initialising MPI in the test process
    launcher = object.__new__(MpiLauncher)
    launcher.process, launcher.world, launcher._broken = 0, 16, ""
    with pytest.raises(LaunchError, match="cannot run under --launcher mpi; use --launcher local or netns") as raised:
        _train(2, launcher=launcher)
    assert not isinstance(raised.value, TfGrpcError)


def test_the_ranks_are_the_chief_then_the_ps_tasks_then_the_workers_on_their_servers():
    seen: list[RankSpec] = []

    class Recording(LocalLauncher):
        """A launcher whose hosts are private (as netns'): tf_grpc runs on it as it is, each server's ranks on
        their host."""

        name = "recording"
        private_hosts = True

        def run(self, ranks, timeout_s, on_report=None, label="run", startup_s=0.0):
            seen.extend(ranks)
            raise LaunchError("recorded")

    with pytest.raises(LaunchError, match="recorded"):
        _train(2, launcher=Recording())
    assert [(s.name, s.host, s.service) for s in seen] == [
        ("chief", 0, False), ("ps 0", 0, True), ("ps 1", 1, True), ("worker 0", 0, True), ("worker 1", 1, True)]


def test_callables_that_cannot_travel_by_name_are_refused_before_anything_starts(nothing_left_behind):
    with pytest.raises(TfGrpcError, match="callables that travel on the run's channels by name"):
        run_tf_grpc(lambda: None, TINY.make_batch, TINY.loss_fn, batch_size=4, servers=1, steps=2)


@pytest.mark.parametrize("bad", [{"servers": 0}, {"steps": 0}, {"batch_size": 1.5}, {"warmup": -1},
                                 {"timeout_s": 0}])
def test_bad_arguments_are_refused(bad):
    arguments = {"batch_size": 4, "servers": 1, "steps": 2, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        run_tf_grpc(TINY.build, TINY.make_batch, TINY.loss_fn, **arguments)


def test_the_silence_watch_writes_every_threads_stack_and_lets_the_chief_live():
    """The chief's watch reads the stacks holding the interpreter's lock (faulthandler's timer read them without it
    and crashed the chief with SIGSEGV amid TensorFlow's threads); it names the other threads and their frames."""
    import io
    import threading
    import time

    from bench.experiments.tf_grpc import SilenceWatch

    stop = threading.Event()

    def waiting_in_a_named_frame() -> None:
        stop.wait()

    other = threading.Thread(target=waiting_in_a_named_frame, name="a-busy-peer")
    other.start()
    out = io.StringIO()
    watch = SilenceWatch(0.1, out)
    try:
        while not watch.fired:
            time.sleep(0.01)
    finally:
        watch.close()
        stop.set()
        other.join()
    text = out.getvalue()
    assert "thread a-busy-peer:" in text and "waiting_in_a_named_frame" in text
    assert "thread silence-watch" not in text  # its own stack says nothing
    assert not watch._thread.is_alive()
