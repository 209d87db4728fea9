"""The reference lines of ``bench micro``: UCX's own ucx_perftest and a single-process memcpy."""

from __future__ import annotations

import math
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from bench import reference
from bench.reference import (
    LATENCY_MAX_SIZE,
    ReferenceUnavailable,
    memcpy_records,
    parse_perftest_output,
    perftest_record,
    ucx_perftest_records,
)
from bench.results import REQUIRED_COLUMNS

SIZES = [4096, 65536]
RECORD_KEYS = {*REQUIRED_COLUMNS["micro"], "fabric", "dtype", "warmup", "min_us", "max_us"}

# A client's output from ucx 1.22 with two progress rows: "average" is per interval, "overall" the whole run.
CLIENT_OUTPUT = """\
+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |       overhead (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
[thread 0]            109913      5.488     9.118     9.118     6854.40    6854.40      109670      109670
[thread 0]            201005      5.528    11.022     9.981     5670.52    6261.93       90728      100191
Final:                300000      5.528    11.284    10.195     5539.03    6130.27       88624       98084
"""


# Captured here (ucx 1.22, libucx-cu12 wheel) from the client of
#   ucx_perftest 127.0.0.1 -p 13337 -t TEST -s SIZE -n ITERS -w 10
# with UCX_TLS=shm or tcp, server and client in a network namespace of their own (as bench/reference.py runs them).
SHM_PUT_BW_1KB = """\
+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |       overhead (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
Final:                  1000      0.060     0.086     0.086    11346.26   11346.26    11618571    11618571
"""
TCP_PUT_BW_1KB = """\
+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |       overhead (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
Final:                  1000      7.584     8.945     8.945      109.17     109.17      111794      111794
"""
SHM_PUT_LAT_1KB = """\
+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |        latency (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
Final:                  1000      0.110     0.131     0.131     7454.05    7454.05     7632946     7632946
"""
TCP_PUT_LAT_1KB = """\
+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |        latency (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
Final:                  1000     10.670    11.707    11.707       83.42      83.42       85419       85419
"""
# 1 MiB over tcp, slow enough for a progress row: the Final row's "average" is its last interval only
TCP_PUT_LAT_1MB = """\
+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |        latency (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
[thread 0]               208   3533.286  2404.572  2404.572      415.87     415.87         416         416
Final:                  1000    196.939   615.158   987.356     1625.60    1012.81        1626        1013
"""


def _iters(size: int) -> int:
    return 50


def _no_perftest_left() -> bool:
    ps = subprocess.run(["ps", "-eo", "ppid=,comm="], capture_output=True, text=True, check=True).stdout
    return not any(line.split()[0] == str(os.getpid()) and "ucx_perftest" in line for line in ps.splitlines())


def test_memcpy_records_have_the_micro_columns_for_every_size():
    records = memcpy_records(SIZES, _iters)
    assert [r["size_bytes"] for r in records] == SIZES
    for record in records:
        assert set(record) >= RECORD_KEYS
        assert record["transport"] == "memcpy"
        assert record["fabric"] == "none"
        assert record["iters"] == 50
        assert record["copied_bytes_per_transfer"] == record["size_bytes"]
        assert record["receiver_cpu_s"] == 0
        assert record["sender_cpu_s"] >= 0
        assert 0 < record["min_us"] <= record["p50_us"] <= record["p99_us"] <= record["max_us"]
        assert record["throughput_MBps"] == pytest.approx(record["size_bytes"] / 2**20 / (record["mean_us"] / 1e6))


def test_memcpy_records_reject_a_bad_iteration_count():
    with pytest.raises(ValueError, match="iters_for"):
        memcpy_records([4096], lambda size: 0)


@pytest.mark.parametrize("fabric_transport", ["shm", "tcp"])
def test_ucx_perftest_records_over_a_fabric_transport(fabric_transport):
    records = ucx_perftest_records(SIZES, fabric_transport, _iters, timeout_s=30)
    assert [r["size_bytes"] for r in records] == SIZES
    for record in records:
        assert set(record) >= RECORD_KEYS
        assert record["transport"] == "ucx_perftest"
        assert record["fabric"] == f"ucx:{fabric_transport}"
        assert record["iters"] == 50
        assert record["copied_bytes_per_transfer"] == 0
        assert record["throughput_MBps"] > 0
        # pipelined puts have a time per put (size / bandwidth) but no per-put median, p99, min or max
        assert record["mean_us"] > 0
        for column in ("p50_us", "p99_us", "min_us", "max_us"):
            assert math.isnan(record[column]), column
        # ucx_perftest's MB/s and per-put time agree with MB = 2**20 bytes
        implied = record["size_bytes"] / 2**20 / (record["mean_us"] / 1e6)
        assert record["throughput_MBps"] == pytest.approx(implied, rel=0.02)
        assert math.isnan(record["sender_cpu_s"])
    assert _no_perftest_left()


@pytest.mark.parametrize("fabric_transport", ["shm", "tcp"])
def test_ucx_perftest_latency_records_stop_at_1mb(fabric_transport):
    records = ucx_perftest_records([*SIZES, 2 * LATENCY_MAX_SIZE], fabric_transport, _iters, timeout_s=30,
                                   test="ucp_put_lat")
    assert [r["size_bytes"] for r in records] == SIZES  # 2 MiB is past the latency line
    for record in records:
        assert set(record) >= RECORD_KEYS
        assert record["transport"] == "ucx_perftest_lat"
        assert record["fabric"] == f"ucx:{fabric_transport}"
        assert record["iters"] == 50 and record["copied_bytes_per_transfer"] == 0
        # p50: perftest's typical latency, half a round trip; the mean is the whole run's
        assert record["p50_us"] > 0 and record["mean_us"] > 0
        assert math.isnan(record["p99_us"]) and math.isnan(record["min_us"]) and math.isnan(record["max_us"])
        implied = record["size_bytes"] / 2**20 / (record["mean_us"] / 1e6)
        assert record["throughput_MBps"] == pytest.approx(implied, rel=0.02)
    assert _no_perftest_left()


def test_an_unknown_perftest_test_is_refused():
    with pytest.raises(ValueError, match="unknown perftest test 'ucp_get'"):
        ucx_perftest_records([4096], "shm", _iters, test="ucp_get")


def _fake_perftest(tmp_path, monkeypatch, output: str) -> Path:
    """A ucx_perftest that logs its arguments to ``calls`` and, as a client, prints ``output``."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "ucx_perftest"
    fake.parent.mkdir()
    (tmp_path / "output").write_text(output)
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                    f'case "$*" in *-t*) cat {tmp_path / "output"}; exit 0;; esac\nexec sleep 30\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(reference.UCX_HOME_VARIABLE, str(tmp_path))
    monkeypatch.setattr(reference, "_wait_listening", lambda server, port, timeout_s: True)
    return calls


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="a private network namespace needs root")
def test_latency_test_runs_ucp_put_lat_pinned_up_to_1mb_only(monkeypatch, tmp_path):
    calls = _fake_perftest(tmp_path, monkeypatch, SHM_PUT_LAT_1KB)
    monkeypatch.setattr(reference, "_cpu_pair", lambda: (0, 1))
    records = ucx_perftest_records([1024, 2 << 20], "shm", lambda size: 1000, test="ucp_put_lat")
    assert [(r["transport"], r["size_bytes"], r["p50_us"]) for r in records] == [("ucx_perftest_lat", 1024, 0.110)]
    lines = calls.read_text().splitlines()
    servers = [line.split() for line in lines if "-t" not in line.split()]
    clients = [line.split() for line in lines if "-t" in line.split()]
    assert len(clients) == 1 and len(servers) == 1
    client = clients[0]
    assert client[client.index("-t") + 1] == "ucp_put_lat" and client[client.index("-s") + 1] == "1024"
    # server and client each on a CPU of its own: a ping-pong on one core waits a time slice per turn
    assert client[client.index("-c") + 1] == "1" and servers[0][servers[0].index("-c") + 1] == "0"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="a private network namespace needs root")
def test_a_table_of_the_wrong_test_is_refused(monkeypatch, tmp_path):
    calls = _fake_perftest(tmp_path, monkeypatch, SHM_PUT_LAT_1KB)
    with pytest.raises(ReferenceUnavailable, match="printed a latency table, expected bandwidth"):
        ucx_perftest_records([1024], "shm", lambda size: 1000)
    assert " -c " not in calls.read_text()  # the bandwidth test is not pinned


def test_ucx_perftest_records_go_into_the_same_csv_as_the_transports(tmp_path):
    from bench.results import RunWriter, load_run

    writer = RunWriter(tmp_path / "run", "micro", {})
    for record in memcpy_records([4096], _iters) + ucx_perftest_records([4096], "shm", _iters, timeout_s=30):
        writer.add(record)
    writer.finish()
    assert sorted(load_run(tmp_path / "run").records["transport"]) == ["memcpy", "ucx_perftest"]


def test_perftest_environment_maps_fabric_transports_to_ucx_tls(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert reference.perftest_environment("shm")["UCX_TLS"] == "shm"
    assert reference.perftest_environment("tcp")["UCX_TLS"] == "tcp"
    auto = reference.perftest_environment("auto")
    assert "UCX_TLS" not in auto
    assert reference.fabric_label(auto) == "ucx:auto"
    # the wheel's binary finds its libraries only through LD_LIBRARY_PATH
    assert auto["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(reference.perftest_binary().parent.parent / "lib")
    with pytest.raises(ValueError, match="unknown fabric transport"):
        reference.perftest_environment("verbs")


def test_missing_binary_says_where_it_looked_and_how_to_fix_it(monkeypatch, tmp_path):
    monkeypatch.setattr(reference, "perftest_binary", lambda: tmp_path / "bin" / "ucx_perftest")
    with pytest.raises(ReferenceUnavailable) as caught:
        ucx_perftest_records([4096], "shm", _iters)
    message = str(caught.value)
    assert str(tmp_path / "bin" / "ucx_perftest") in message
    assert "libucx-cu12" in message
    assert "pip install" in message


def test_failing_binary_gives_its_exit_code_and_output(monkeypatch, tmp_path):
    fake = tmp_path / "bin" / "ucx_perftest"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'UCX  ERROR something broke' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(reference.UCX_HOME_VARIABLE, str(tmp_path))
    assert reference.perftest_binary() == fake
    with pytest.raises(ReferenceUnavailable, match=r"exit code 3(.|\n)*something broke"):
        ucx_perftest_records([4096], "tcp", _iters, timeout_s=10)


def test_hung_perftest_is_killed_at_the_timeout(monkeypatch, tmp_path):
    fake = tmp_path / "bin" / "ucx_perftest"
    fake.parent.mkdir()
    # the server exits at once, the client (any call with a -t) never does
    fake.write_text('#!/bin/sh\ncase "$*" in *-t*) exec sleep 73;; esac\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(reference.UCX_HOME_VARIABLE, str(tmp_path))
    monkeypatch.setattr(reference, "_wait_listening", lambda server, port, timeout_s: True)
    with pytest.raises(ReferenceUnavailable, match="did not finish within 1 s"):
        ucx_perftest_records([4096], "tcp", _iters, timeout_s=1)
    ps = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True, check=True).stdout
    assert str(fake) not in ps and "sleep 73" not in ps


def test_parse_takes_the_whole_run_columns_of_the_final_row():
    result = parse_perftest_output(CLIENT_OUTPUT, size=65536)
    assert result.kind == "bandwidth"
    assert result.iters == 300000
    assert result.overall_us == 10.195
    assert result.bandwidth_MBps == 6130.27
    assert result.message_rate == 98084
    assert result.percentile_us == 5.528 and result.percentile == 50.0


def test_parse_rejects_a_bandwidth_that_is_not_in_mebibytes():
    in_megabytes = CLIENT_OUTPUT.replace("6130.27", f"{65536 / 10.195e-6 / 1e6:.2f}")
    with pytest.raises(ReferenceUnavailable, match="2\\^20"):
        parse_perftest_output(in_megabytes, size=65536)


def test_parse_rejects_output_without_results():
    with pytest.raises(ReferenceUnavailable, match="no results table"):
        parse_perftest_output("[1] UCX  ERROR client failed. connect() failed: Connection refused\n")


def test_perftest_binary_is_the_wheels(monkeypatch):
    monkeypatch.delenv(reference.UCX_HOME_VARIABLE, raising=False)
    import libucx

    assert reference.perftest_binary() == Path(libucx.__file__).parent / "bin" / "ucx_perftest"


def test_parse_takes_sub_microsecond_put_times_from_the_message_rate():
    fast = CLIENT_OUTPUT.replace(
        "Final:                300000      5.528    11.284    10.195     5539.03    6130.27       88624       98084",
        "Final:                300000      0.020     0.022     0.022    44043.00   44043.00    45100000    45100000",
    )
    result = parse_perftest_output(fast, size=1024)
    assert result.overall_us == 0.022
    assert result.time_us == pytest.approx(1e6 / 45100000)


@pytest.mark.parametrize(("text", "size", "kind", "iters", "percentile_us", "time_us", "bandwidth"), [
    (SHM_PUT_BW_1KB, 1024, "bandwidth", 1000, 0.060, 1e6 / 11618571, 11346.26),
    (TCP_PUT_BW_1KB, 1024, "bandwidth", 1000, 7.584, 8.945, 109.17),
    (SHM_PUT_LAT_1KB, 1024, "latency", 1000, 0.110, 1e6 / 7632946, 7454.05),
    (TCP_PUT_LAT_1KB, 1024, "latency", 1000, 10.670, 11.707, 83.42),
    (TCP_PUT_LAT_1MB, 1 << 20, "latency", 1000, 196.939, 987.356, 1012.81),
], ids=["shm-put_bw-1KB", "tcp-put_bw-1KB", "shm-put_lat-1KB", "tcp-put_lat-1KB", "tcp-put_lat-1MB"])
def test_parse_captured_perftest_outputs(text, size, kind, iters, percentile_us, time_us, bandwidth):
    result = parse_perftest_output(text, size=size)
    assert result.kind == kind
    assert result.iters == iters
    assert result.percentile_us == percentile_us
    assert result.time_us == pytest.approx(time_us)
    assert result.bandwidth_MBps == bandwidth


def test_the_1kb_put_bw_point_is_a_rate_not_a_transfer_time():
    # 1 KiB over shm is a short put, a store into the peer's mapped segment, posted back to back: 0.086 us a put.
    record = perftest_record(parse_perftest_output(SHM_PUT_BW_1KB, size=1024), 1024, 10, 1000, "ucx:shm")
    assert record["transport"] == "ucx_perftest"
    assert record["throughput_MBps"] == 11346.26
    # its time is size / bandwidth, the whole run's time per put ...
    assert record["mean_us"] == pytest.approx(1024 / 2**20 / 11346.26 * 1e6, rel=1e-3)
    # ... and it claims no per-transfer median or tail (these used to repeat the mean: 0.03 us "per transfer")
    for column in ("p50_us", "p99_us", "min_us", "max_us"):
        assert math.isnan(record[column]), column


def test_the_latency_record_takes_p50_from_the_typical_latency():
    record = perftest_record(parse_perftest_output(TCP_PUT_LAT_1MB, size=1 << 20), 1 << 20, 10, 1000, "ucx:tcp")
    assert record["transport"] == "ucx_perftest_lat"
    assert record["p50_us"] == 196.939  # the 50.0%ile column: the median round trip, halved
    assert record["mean_us"] == 987.356  # the Final row's overall latency, not its last interval's 615.158
    assert record["throughput_MBps"] == 1012.81
    assert math.isnan(record["p99_us"])
    assert math.isnan(record["sender_cpu_s"]) and record["copied_bytes_per_transfer"] == 0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="a private network namespace needs root")
def test_perftest_runs_in_a_network_namespace_with_loopback_only(monkeypatch, tmp_path):
    # ucx_perftest's server listens on every interface: where it runs, loopback must be the only one
    seen = tmp_path / "seen"
    fake = tmp_path / "bin" / "ucx_perftest"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nreadlink /proc/self/ns/net >> {seen}\n"
                    f"cut -d: -f1 /proc/net/dev | tail -n +3 >> {seen}\n"
                    'case "$*" in *-t*) exit 3;; esac\nexec sleep 30\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(reference.UCX_HOME_VARIABLE, str(tmp_path))
    monkeypatch.setattr(reference, "_wait_listening", lambda server, port, timeout_s: True)
    with pytest.raises(ReferenceUnavailable, match="exit code 3"):
        ucx_perftest_records([4096], "tcp", _iters, timeout_s=20)
    lines = [line.strip() for line in seen.read_text().splitlines() if line.strip()]
    namespaces = {line for line in lines if line.startswith("net:")}
    interfaces = {line for line in lines if not line.startswith("net:")}
    # server and client in one namespace, not ours
    assert len(namespaces) == 1 and os.readlink("/proc/self/ns/net") not in namespaces
    assert interfaces == {"lo"}
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"tt-perftest-{os.getpid()}-" not in left
