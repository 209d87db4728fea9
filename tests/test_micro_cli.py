"""bench micro's reference lines in a run: ucx_perftest put_bw and put_lat first, then the transports, each
record with its throughput as a fraction of put_bw at its size (of_reference). Small sizes only."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from bench.results import load_run
from tests.conftest import system_missing

#: ucx_perftest runs in a private network namespace
needs_namespace = pytest.mark.system("netns")


def bench(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@needs_namespace
def test_micro_records_the_latency_line_and_of_reference(tmp_path):
    out = tmp_path / "run"
    # 2MB: past the latency line's 1MB; all of it well under 256 MB
    result = bench("micro", "--sizes", "1KB,2MB", "--iters", "20", "--warmup", "2", "--transports", "local",
                   "--no-peers",
                   "--fabric-transport", "shm", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    run = load_run(out)
    records = run.records
    assert sorted(zip(records["transport"], records["size_bytes"], strict=True)) == [
        ("harness", 1024), ("local", 1024), ("local", 2 << 20), ("memcpy", 1024), ("memcpy", 2 << 20),
        ("ucx_perftest", 1024), ("ucx_perftest", 2 << 20), ("ucx_perftest_lat", 1024)]
    # the references are measured first, so every line's record carries of_reference as it is written
    header = (out / "records.csv").read_text().splitlines()[0].split(",")
    assert "of_reference" in header
    assert list(records["transport"][:3]) == ["ucx_perftest", "ucx_perftest", "ucx_perftest_lat"]
    by = records.set_index(["transport", "size_bytes"])
    for (transport, size), row in by.iterrows():
        reference = by.loc[("ucx_perftest", size), "throughput_MBps"]
        assert row["of_reference"] == pytest.approx(row["throughput_MBps"] / reference, rel=1e-9), transport
    assert by.loc[("ucx_perftest", 1024), "of_reference"] == 1.0
    # put_bw: time per put is size / bandwidth and there is no median; put_lat: a median, half a round trip
    bw = by.loc[("ucx_perftest", 1024)]
    assert math.isnan(bw["p50_us"]) and bw["mean_us"] == pytest.approx(1024 / 2**20 / bw["throughput_MBps"] * 1e6,
                                                                        rel=0.02)
    assert by.loc[("ucx_perftest_lat", 1024), "p50_us"] > 0
    assert run.meta["fabric"]["ucx_perftest_lat"] == "ucx:shm"
    # the summary: a p50 column per line that has one (put_bw has none), a row per size
    lines = result.stdout.splitlines()
    heading = lines.index("p50 µs per transfer:")
    assert lines[heading + 1].split() == ["size", "ucx_perftest_lat", "memcpy", "harness", "local"]
    assert lines[heading + 2].split()[0] == "1KB" and lines[heading + 3].split()[1] == "-"  # put_lat stops at 1MB
    assert (out / "micro_time.svg").is_file()
    assert "latency floor" in (out / "micro_time.svg").read_text()


@pytest.fixture(scope="module")
def end_to_end(tmp_path_factory):
    """One small ``bench micro`` run as a user starts it (every reference line, no peers): its output and directory."""
    out = tmp_path_factory.mktemp("micro") / "run"
    result = bench("micro", "--sizes", "1KB,64KB", "--iters", "4", "--warmup", "1",
                   "--transports", "grpc_tcp,local", "--no-peers", "--out", str(out))
    return result, out


#: the reference lines that run in a private network namespace (ucx_perftest listens on every interface)
PERFTEST = ["ucx_perftest", "ucx_perftest_lat"]


def test_micro_end_to_end_writes_records_meta_and_figures(end_to_end):
    """Wherever the README's install ran: the ucx_perftest lines where network namespaces can be made, else left
    out with the reason in meta.json (the test before expected them everywhere, and failed in a container)."""
    result, out = end_to_end
    assert result.returncode == 0, result.stderr
    run = load_run(out)
    assert run.meta["status"] == "complete"
    assert run.meta["settings"]["transports"] == ["grpc_tcp", "local"]
    assert run.meta["settings"]["fabric"] == "ucx"
    records = run.records.set_index(["transport", "size_bytes"])
    # two transports, then the reference lines: memcpy and the harness alone (below 64KB), and where a private
    # network namespace can be made, ucx_perftest's put bandwidth and put latency (the library's limits)
    perftest = PERFTEST if system_missing("netns") is None else []
    assert sorted(set(run.records["transport"])) == sorted(["grpc_tcp", "harness", "local", "memcpy", *perftest]), \
        result.stderr  # a line left out says why
    assert len(records) == 7 + 2 * len(perftest)
    for line in set(PERFTEST) - set(perftest):  # left out: said in one line, and why in meta.json
        assert "namespace" in run.meta["left_out"][line], run.meta["left_out"]
        assert f"left out: {line}" in result.stderr or f", {line}" in result.stderr
    assert (records["iters"] == 4).all()
    timed = records.dropna(subset=["p99_us"])  # perftest reports no p99
    assert len(timed) == 7 and (timed["p99_us"] >= timed["p50_us"]).all()
    # grpc_tcp copies each payload three times (see its module); local never copies
    for size in (1024, 65536):
        assert records.loc[("grpc_tcp", size), "copied_bytes_per_transfer"] == 3 * size
        assert records.loc[("grpc_tcp", size), "serialisations_per_transfer"] == 1
        assert records.loc[("local", size), "copied_bytes_per_transfer"] == 0
    # host memory on both sides (no --memory): nothing crossed a bus, every line says where its tensors were
    assert run.meta["settings"]["memory"] == ["host", "host"]
    assert (records["sender_memory"] == "host").all() and (records["receiver_memory"] == "host").all()
    moved = records.loc[["grpc_tcp", "local"]]
    assert (moved["device_to_host_bytes_per_transfer"] == 0).all()
    assert (moved["host_to_device_bytes_per_transfer"] == 0).all()
    for figure in ("micro_time.png", "micro_time.svg", "micro_throughput.png", "micro_throughput.svg"):
        assert (out / figure).is_file()


@needs_namespace
def test_micro_end_to_end_has_the_ucx_perftest_lines_where_namespaces_can_be_made(end_to_end):
    result, out = end_to_end
    assert result.returncode == 0, result.stderr
    records = load_run(out).records
    assert sorted(zip(records["transport"], records["size_bytes"], strict=True))[-4:] == [
        ("ucx_perftest", 1024), ("ucx_perftest", 65536), ("ucx_perftest_lat", 1024), ("ucx_perftest_lat", 65536)]
    assert "ucx_perftest" not in load_run(out).meta.get("left_out", {})


def test_micro_without_references_leaves_of_reference_empty(tmp_path):
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "1KB", "--iters", "3", "--warmup", "1", "--transports", "local",
                   "--no-references", "--no-peers", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = load_run(out).records
    assert list(records["transport"]) == ["local"]
    assert "of_reference" in (out / "records.csv").read_text().splitlines()[0].split(",")
    assert records["of_reference"].isna().all()
    assert "p50 µs per transfer:" in result.stdout



def test_rounds_interleave_the_transports_per_size_and_keep_every_transfer(tmp_path):
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "1KB,4KB", "--iters", "4", "--warmup", "1", "--transports", "zerocopy,grpc_tcp",
                   "--rounds", "2", "--no-references", "--no-peers", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    run = load_run(out)
    # per size: every transport once, then again
    assert list(zip(run.records["size_bytes"], run.records["round"], run.records["transport"], strict=True)) == [
        (1024, 1, "zerocopy"), (1024, 1, "grpc_tcp"), (1024, 2, "zerocopy"), (1024, 2, "grpc_tcp"),
        (4096, 1, "zerocopy"), (4096, 1, "grpc_tcp"), (4096, 2, "zerocopy"), (4096, 2, "grpc_tcp")]
    assert run.meta["settings"]["rounds"] == 2
    # every timed transfer of every round is in samples.csv, and its median is the record's
    assert len(run.samples) == 8 * 4
    for record in run.records.itertuples():
        times = run.samples[(run.samples["transport"] == record.transport)
                            & (run.samples["size_bytes"] == record.size_bytes)
                            & (run.samples["round"] == record.round)]["time_us"]
        assert list(run.samples.loc[times.index, "iteration"]) == [0, 1, 2, 3]
        assert times.median() == pytest.approx(record.p50_us)
    points = run.points()
    assert len(points) == 4 and (points["rounds"] == 2).all() and (points["spread"] == "rounds").all()
    # the summary sets grpc_tcp beside zerocopy with the range across the rounds
    lines = result.stdout.splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("time per transfer relative to zerocopy"))
    assert "range across rounds" in lines[heading]
    ratio_line = next(line for line in lines[heading:] if line.strip().startswith("1KB"))
    assert "x (" in ratio_line and ratio_line.rstrip().endswith(")")


def test_an_extra_copy_is_made_and_counted_over_the_transports_named_only(tmp_path):
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "64KB", "--iters", "3", "--warmup", "1", "--transports", "zerocopy,rdma_cp",
                   "--extra-copy", "zerocopy", "--no-references", "--no-peers", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = load_run(out).records.set_index("transport")
    assert records.loc["zerocopy", "extra_copies"] == 1 and records.loc["rdma_cp", "extra_copies"] == 0
    # zerocopy copies nothing of its own: what it copies now is the one copy asked for
    assert records.loc["zerocopy", "copied_bytes_per_transfer"] == 65536
    assert records.loc["rdma_cp", "copied_bytes_per_transfer"] == 65536  # its own staging copy, nothing more


def test_an_extra_copy_over_a_transport_not_measured_is_refused(tmp_path):
    result = bench("micro", "--sizes", "1KB", "--transports", "zerocopy", "--extra-copy", "grpc_tcp",
                   "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bench micro: error: --extra-copy grpc_tcp: not among the transports measured (zerocopy)"]
    assert not (tmp_path / "run").exists()


def test_a_run_compared_with_itself_has_not_changed(tmp_path):
    out = tmp_path / "run"
    assert bench("micro", "--sizes", "1KB,4KB", "--iters", "5", "--transports", "zerocopy,grpc_tcp",
                 "--no-references", "--no-peers", "--no-plot", "--out", str(out)).returncode == 0
    result = bench("compare", str(out), str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    # measured once: no change is called (that takes --rounds 3), and none could be: the ratios are 1
    assert result.stdout.rstrip().endswith("no change called: too few rounds (--rounds 3 in both runs calls one)")
    assert "\n+" not in result.stdout and "\n-" not in result.stdout  # no point marked slower or faster


def test_bench_help_lists_every_command_with_its_line():
    from bench.cli import command_module
    from bench.commands import COMMANDS

    result = bench("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split()).replace("- ", "-")  # argparse wraps lines after a hyphen
    for name in COMMANDS:
        assert f"{name} {' '.join(command_module(name).HELP.split())}" in text, name


@needs_namespace
def test_references_are_lines_of_every_round(tmp_path):
    """One harness for every line: with --rounds the references are measured per size and round like the
    transports, before them, and each round's transport records are set against that round's reference."""
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "1KB,2MB", "--iters", "5", "--warmup", "1", "--transports", "local",
                   "--no-peers",
                   "--fabric-transport", "shm", "--rounds", "2", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = load_run(out).records
    assert list(zip(records["size_bytes"], records["round"], records["transport"], strict=True)) == [
        (1024, 1, "ucx_perftest"), (1024, 1, "ucx_perftest_lat"), (1024, 1, "memcpy"), (1024, 1, "harness"),
        (1024, 1, "local"),
        (1024, 2, "ucx_perftest"), (1024, 2, "ucx_perftest_lat"), (1024, 2, "memcpy"), (1024, 2, "harness"),
        (1024, 2, "local"),
        (2 << 20, 1, "ucx_perftest"), (2 << 20, 1, "memcpy"), (2 << 20, 1, "local"),
        (2 << 20, 2, "ucx_perftest"), (2 << 20, 2, "memcpy"), (2 << 20, 2, "local")]
    for row in records.itertuples():
        reference = records[(records["transport"] == "ucx_perftest") & (records["size_bytes"] == row.size_bytes)
                             & (records["round"] == row.round)]["throughput_MBps"].iloc[0]
        assert row.of_reference == pytest.approx(row.throughput_MBps / reference, rel=1e-9)


@needs_namespace
def test_references_run_under_netns_on_an_emulated_host(tmp_path):
    """Under --launcher netns the reference lines run too (they were left out before): ucx_perftest's pair on
    an emulated host, over the launcher's fabric transport (tcp), memcpy in a rank."""
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "4KB", "--iters", "5", "--warmup", "1", "--transports", "local", "--no-peers",
                   "--launcher", "netns", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    run = load_run(out)
    assert list(run.records["transport"]) == ["ucx_perftest", "ucx_perftest_lat", "memcpy", "harness", "local"]
    assert run.meta["fabric"]["ucx_perftest"] == "ucx:tcp"
    assert "warning" not in result.stderr


def test_contend_measures_every_point_again_beside_busy_processes_and_leaves_none(tmp_path):
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "1KB,4KB", "--iters", "5", "--warmup", "1", "--transports", "zerocopy",
                   "--no-references", "--peers", "socket", "--contend", "2", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    run = load_run(out)
    assert run.meta["settings"]["contend"] == 2
    by = run.records.set_index(["transport", "size_bytes"])
    assert sorted(by.index) == [("socket", 1024), ("socket", 4096), ("zerocopy", 1024), ("zerocopy", 4096)]
    assert (by["contend"] == 2).all() and (by["contended_p50_us"] > 0).all()
    assert (by["contended_p99_us"] >= by["contended_p50_us"]).all()
    for (transport, size), row in by.iterrows():
        assert row["contended_of_quiet"] == pytest.approx(row["contended_p50_us"] / row["p50_us"])
        if transport == "zerocopy":
            best = by.loc[("socket", size), "contended_p50_us"]
            assert row["contended_of_peer"] == pytest.approx(row["contended_p50_us"] / best)
    # the contended pass writes no samples: each point's quiet transfers only
    assert len(run.samples) == 4 * 5
    assert "2 busy" in result.stdout


def test_busy_processes_spin_while_held_and_end_with_their_parent():
    from bench.ground.contention import busy_processes

    with busy_processes(2) as busy:
        assert len(busy) == 2 and all(process.poll() is None for process in busy)
    assert all(process.returncode is not None for process in busy)
    # a parent that dies without cleaning up (SIGKILL) leaves no spinner behind
    child = subprocess.run([sys.executable, "-c", "import os\nfrom bench.ground.contention import busy_processes\n"
                            "with busy_processes(1) as busy:\n    print(busy[0].pid, flush=True)\n    os._exit(0)"],
                           capture_output=True, text=True, timeout=60, env={**os.environ,
                                                                          "PYTHONPATH": os.pathsep.join(sys.path)})
    pid = int(child.stdout.split()[0])

    def running() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running()


def test_the_timing_thread_is_bound_to_a_core_of_its_own_and_only_it():
    import threading

    from bench.experiments.micro import bind_timing_thread

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to bind to")
    seen = {}

    def timing(rank):
        seen[rank] = (bind_timing_thread(rank), os.sched_getaffinity(0))

    for rank in (0, 1):
        thread = threading.Thread(target=timing, args=(rank,))
        thread.start()
        thread.join()
    assert seen[0] == (cpus[0], {cpus[0]}) and seen[1] == (cpus[1], {cpus[1]})
    assert sorted(os.sched_getaffinity(0)) == cpus  # this (another) thread keeps every CPU


@pytest.mark.parametrize("poll_s, naps_before_the_signal", [(0.0, 1), (60.0, 0)])
def test_a_ready_signal_is_napped_for_at_once_or_polled_for_first(monkeypatch, poll_s, naps_before_the_signal):
    """A sender whose transport completes sends on threads of its own waits for the next ready signal in naps from
    the first look (a poll in Python would hold the GIL those threads need); any other polls first. The signal
    comes on the first nap, or, polled for, on the third look at the ring."""
    import numpy as np

    from bench.experiments.micro import loops

    ring = np.zeros(3, np.int64)
    naps, looks = [], []

    class Ring:
        def __getitem__(self, index):
            looks.append(index)
            if len(looks) == 3:
                ring[0] = 1  # the receiver's signal, written while the sender polls
            return ring[index]

    def nap(seconds):
        naps.append(seconds)
        ring[0] = 1  # written while the sender naps

    monkeypatch.setattr(loops.time, "sleep", nap)
    loops.wait_above(Ring(), 0, poll_s)
    assert len(naps) == naps_before_the_signal
    assert len(looks) == (2 if naps_before_the_signal else 3)


def test_the_grpc_transports_complete_sends_on_their_own_threads_and_the_fabric_ones_in_the_caller():
    """What ``bench micro``'s sender reads to choose how it waits (``DirectSignals(spin=...)`` in ``role_job``)."""
    import transports

    on_threads = {name for name in ("grpc_tcp", "grpc_rdma", "zerocopy", "rdma_cp", "local")
                  if transports.transport_class(name).completes_on_threads}
    assert on_threads == {"grpc_tcp", "grpc_rdma"}


def test_the_summary_of_a_device_memory_run_counts_each_lines_crossings_of_the_bus():
    import pandas as pd

    from bench.readers.summary import _crossings_line

    points = pd.DataFrame({"transport": ["zerocopy", "grpc_tcp", "ucx_perftest"], "size_bytes": [1024] * 3,
                           "sender_memory": ["cuda:0"] * 3, "receiver_memory": ["host"] * 3,
                           "device_to_host_bytes_per_transfer": [1024.0, 1024.0, float("nan")],
                           "host_to_device_bytes_per_transfer": [0.0, 0.0, float("nan")]})
    line = _crossings_line(points)
    assert line.startswith("tensors in cuda:0 -> host memory") and line.endswith("zerocopy 1, grpc_tcp 1")
    points["sender_memory"] = "host"
    assert _crossings_line(points) == ""
