"""The tf_grpc reference run: TensorFlow's ParameterServerStrategy over its gRPC runtime, in separate processes."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import pytest

from bench import tf_grpc
from bench.results import REQUIRED_COLUMNS
from bench.tf_grpc import TfGrpcError, TfGrpcTimeout, network_isolation, record_row, run_tf_grpc

pytestmark = pytest.mark.timeout(240)

#: seconds a run may take here before the test stops waiting; start-up imports TensorFlow in every process
RUN_TIMEOUT_S = 150.0


# The callables a run gets: module level, so the chief process imports them by name.


def build_mlp():
    """A 2-layer MLP: 8 inputs, 16 hidden, 3 classes."""
    import keras

    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def make_batch(batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch_size, 8)).astype(np.float32), rng.integers(0, 3, batch_size).astype(np.int32)


def loss_fn():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build_failing():
    raise RuntimeError("no model today: build_failing was asked to fail")


def build_hanging():
    time.sleep(3600)


def _processes_in_group(group: int) -> list[str]:
    """Command lines of the live processes in process group ``group`` (zombies count as gone)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        # after the command: state, ppid, pgrp
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(f"{stat.parent.name}: {cmdline}")
    return found


def _children_of_this_process() -> set[str]:
    """Live children of the test process (other tests may have left long-lived ones, e.g. a resource tracker)."""
    pid = os.getpid()
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += (task / "children").read_text().split()
        except OSError:
            continue
    alive = set()
    for child in children:
        try:
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(child)
        except OSError:
            continue
    return alive


@pytest.mark.parametrize(
    ("servers", "isolate"),
    [(1, True), (2, True), (1, False)],
    ids=["1-server", "2-servers", "1-server-loopback-fallback"],
)
def test_trains_with_the_variables_on_the_ps_tasks(servers, isolate, monkeypatch):
    if isolate and not network_isolation()[0]:
        pytest.skip(f"no private network namespace here: {network_isolation()[1]}")
    if not isolate:  # as where unshare is not permitted
        monkeypatch.setattr(tf_grpc, "_ISOLATION", (False, "isolation turned off by the test"))
    children_before = _children_of_this_process()
    steps = 4
    record = run_tf_grpc(build_mlp, make_batch, loss_fn, batch_size=8, servers=servers, steps=steps, warmup=1,
                         timeout_s=RUN_TIMEOUT_S)

    assert set(record) >= {*REQUIRED_COLUMNS["model"], "isolated_network", "worker_peak_rss_mb", "ps_peak_rss_mb"}
    assert record["transport"] == "tf_grpc"
    assert (record["batch_size"], record["servers"], record["steps"]) == (8, servers, steps)
    assert record["step_time_s"] > 0
    assert record["min_step_time_s"] <= record["step_time_s"] <= record["max_step_time_s"]
    assert record["throughput_batches_per_s"] == pytest.approx(1 / record["step_time_s"])
    assert math.isnan(record["compute_s"]) and math.isnan(record["comm_s"])
    assert record["isolated_network"] is isolate
    assert record["isolation_note"]
    assert record["worker_peak_rss_mb"] > 0 and record["ps_peak_rss_mb"] > 0
    assert set(record["peak_rss_mb_per_process"]) == {f"{kind}-{i}" for kind in ("ps", "worker")
                                                      for i in range(servers)}
    assert math.isfinite(record["first_loss"]) and math.isfinite(record["last_loss"])
    assert len(record["worker_batches_last_step"]) == servers

    # every variable lived on a PS task, round-robin over all of them
    devices = record["variable_devices"]
    assert len(devices) == 4
    assert all(d.startswith("/job:ps/") for d in devices.values()), devices
    assert {d.split("/task:")[1].split("/")[0] for d in devices.values()} == {str(i) for i in range(servers)}

    assert set(record_row(record)) >= set(REQUIRED_COLUMNS["model"])
    assert _processes_in_group(record["process_group"]) == []
    assert _children_of_this_process() <= children_before


def test_a_failing_build_raises_with_its_message_and_leaves_no_process():
    children_before = _children_of_this_process()
    started = time.monotonic()
    with pytest.raises(TfGrpcError, match="no model today") as raised:
        run_tf_grpc(build_failing, make_batch, loss_fn, batch_size=4, servers=1, steps=2, timeout_s=RUN_TIMEOUT_S)
    assert time.monotonic() - started < RUN_TIMEOUT_S
    assert not isinstance(raised.value, TfGrpcTimeout)
    assert "RuntimeError" in str(raised.value)
    assert _processes_in_group(raised.value.process_group) == []
    assert _children_of_this_process() <= children_before


def test_a_hanging_run_is_killed_at_its_timeout_and_leaves_no_process():
    children_before = _children_of_this_process()
    started = time.monotonic()
    with pytest.raises(TfGrpcTimeout, match="timeout_s=5") as raised:
        run_tf_grpc(build_hanging, make_batch, loss_fn, batch_size=4, servers=1, steps=2, timeout_s=5)
    assert time.monotonic() - started < 60
    assert "where the chief's main thread was" in str(raised.value)
    assert _processes_in_group(raised.value.process_group) == []
    assert _children_of_this_process() <= children_before


def test_callables_that_cannot_be_pickled_are_refused_before_anything_starts():
    children_before = _children_of_this_process()
    with pytest.raises(TfGrpcError, match="picklable"):
        run_tf_grpc(lambda: None, make_batch, loss_fn, batch_size=4, servers=1, steps=2)
    assert _children_of_this_process() <= children_before


def test_without_unshare_the_run_says_it_is_not_isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    isolated, note = tf_grpc._probe_isolation()
    assert not isolated
    assert "no unshare" in note and "every interface" in note


@pytest.mark.parametrize("bad", [{"servers": 0}, {"steps": 0}, {"batch_size": 1.5}, {"warmup": -1}])
def test_bad_arguments_are_refused(bad):
    arguments = {"batch_size": 4, "servers": 1, "steps": 2, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        run_tf_grpc(build_mlp, make_batch, loss_fn, **arguments)
