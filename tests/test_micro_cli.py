"""bench micro's reference lines in a run: ucx_perftest put_bw and put_lat first, then the transports, each
record with its throughput as a fraction of put_bw at its size (of_reference). Small sizes only."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest

from bench.results import load_run

needs_namespace = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                     reason="ucx_perftest runs in a private network namespace, which needs root")


def bench(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@needs_namespace
def test_micro_records_the_latency_line_and_of_reference(tmp_path):
    out = tmp_path / "run"
    # 2MB: past the latency line's 1MB; all of it well under 256 MB
    result = bench("micro", "--sizes", "1KB,2MB", "--iters", "20", "--warmup", "2", "--transports", "local",
                   "--fabric-transport", "shm", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    run = load_run(out)
    records = run.records
    assert sorted(zip(records["transport"], records["size_bytes"], strict=True)) == [
        ("local", 1024), ("local", 2 << 20), ("memcpy", 1024), ("memcpy", 2 << 20),
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
    assert "of ref" in result.stdout and "ucx_perftest_lat" in result.stdout
    assert (out / "micro_time.svg").is_file()
    assert "latency floor" in (out / "micro_time.svg").read_text()


def test_micro_without_references_leaves_of_reference_empty(tmp_path):
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "1KB", "--iters", "3", "--warmup", "1", "--transports", "local",
                   "--no-references", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = load_run(out).records
    assert list(records["transport"]) == ["local"]
    assert "of_reference" in (out / "records.csv").read_text().splitlines()[0].split(",")
    assert records["of_reference"].isna().all()
    assert "of ref" in result.stdout

