"""The reference lines of ``bench micro``: UCX's own ucx_perftest, perftest's ib_write_bw and ib_write_lat, and a
single-process memcpy."""

from __future__ import annotations

import math
import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.experiments.micro import MicroError, plan_points, run_line
from bench.experiments.references import (
    LATENCY_MAX_SIZE,
    REGISTRY,
    ReferenceLine,
    ReferenceUnavailable,
    reference_lines,
)
from bench.experiments.references import running as reference
from bench.experiments.references.ib_write import (
    parse_ib_write_bw_output,
    parse_ib_write_lat_output,
    verbs_label,
    verbs_record,
    verbs_records,
)
from bench.experiments.references.memcpy import Memcpy, memcpy_records
from bench.experiments.references.ucx_perftest import (
    UcxPerftest,
    UcxPerftestLatency,
    parse_perftest_output,
    perftest_record,
    ucx_perftest_records,
)
from bench.launch.local import LocalLauncher
from bench.results import REQUIRED_COLUMNS
from bench.results import lines as catalogue
from transports import fabric
from transports.fabric.base import Tool
from transports.fabric.ucx.device import UCX_HOME_VARIABLE  # a test may import the backend; bench/ may not

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
# with UCX_TLS=shm or tcp, server and client in a network namespace of their own (as
# bench/experiments/references/ runs them).
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


#: the perftest lines run on private hosts of the launch layer: a network namespace, which needs root and iproute2
needs_namespaces = pytest.mark.system("netns")


def _measure(line, sizes, iters: int = 50, warmup: int | None = None) -> list:
    """``line``'s records at ``sizes``, as bench micro measures it: its rank on the hosts it asks the local
    launcher for, through the harness."""
    points = line.points(plan_points(sizes, iters, warmup))
    records = []
    hosts = line.hosts(LocalLauncher())
    try:
        run_line(line, points, hosts.launcher, line.timeout_s, on_record=lambda point, record: records.append(record))
    finally:
        if hosts.own:
            hosts.launcher.close()
    return records


def _no_perftest_left() -> bool:
    ps = subprocess.run(["ps", "-eo", "ppid=,comm="], capture_output=True, text=True, check=True).stdout
    return not any(line.split()[0] == str(os.getpid()) and "ucx_perftest" in line for line in ps.splitlines())


def test_memcpy_records_have_the_micro_columns_for_every_size():
    records = memcpy_records(SIZES, _iters)
    records = [r.row() for r in records]
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


@needs_namespaces
@pytest.mark.parametrize("fabric_transport", ["shm", "tcp"])
def test_ucx_perftest_records_over_a_fabric_transport(fabric_transport):
    records = _measure(UcxPerftest(fabric_transport=fabric_transport, timeout_s=30), SIZES)
    records = [r.row() for r in records]
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


@needs_namespaces
@pytest.mark.parametrize("fabric_transport", ["shm", "tcp"])
def test_ucx_perftest_latency_records_stop_at_1mb(fabric_transport):
    records = _measure(UcxPerftestLatency(fabric_transport=fabric_transport, timeout_s=30),
                       [*SIZES, 2 * LATENCY_MAX_SIZE])
    records = [r.row() for r in records]
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


def _client_done(tmp_path: Path) -> str:
    """A fake perftest client's end: it says it is done (its server then ends, as a real one does)."""
    return f": > {tmp_path / 'client-done'}; exit 0"


def _server_ends_after_client(tmp_path: Path) -> str:
    """A fake perftest server: it ends once its client is done, as a real one does (within 30 s at the latest)."""
    return (f"i=0; while [ ! -e {tmp_path / 'client-done'} ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i + 1)); "
            "done; exit 0")


def _fake_perftest(tmp_path, monkeypatch, output: str) -> Path:
    """A ucx_perftest that logs its arguments to ``calls`` and, as a client, prints ``output``."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "ucx_perftest"
    fake.parent.mkdir()
    (tmp_path / "output").write_text(output)
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                    f'case "$*" in *-t*) cat {tmp_path / "output"}; {_client_done(tmp_path)};; esac\n'
                    f'{_server_ends_after_client(tmp_path)}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(UCX_HOME_VARIABLE, str(tmp_path))
    monkeypatch.setattr(reference, "wait_listening", lambda server, port, timeout_s: True)
    return calls


def test_latency_test_runs_ucp_put_lat_pinned_up_to_1mb_only(monkeypatch, tmp_path):
    calls = _fake_perftest(tmp_path, monkeypatch, SHM_PUT_LAT_1KB)
    monkeypatch.setattr(reference, "cpu_pair", lambda: (0, 1))
    records = ucx_perftest_records([1024, 2 << 20], "shm", lambda size: 1000, test="ucp_put_lat")
    records = [r.row() for r in records]
    assert [(r["transport"], r["size_bytes"], r["p50_us"]) for r in records] == [("ucx_perftest_lat", 1024, 0.110)]
    lines = calls.read_text().splitlines()
    servers = [line.split() for line in lines if "-t" not in line.split()]
    clients = [line.split() for line in lines if "-t" in line.split()]
    assert len(clients) == 1 and len(servers) == 1
    client = clients[0]
    assert client[client.index("-t") + 1] == "ucp_put_lat" and client[client.index("-s") + 1] == "1024"
    # server and client each on a CPU of its own: a ping-pong on one core waits a time slice per turn
    assert client[client.index("-c") + 1] == "1" and servers[0][servers[0].index("-c") + 1] == "0"


def test_a_table_of_the_wrong_test_is_refused(monkeypatch, tmp_path):
    calls = _fake_perftest(tmp_path, monkeypatch, SHM_PUT_LAT_1KB)
    with pytest.raises(ReferenceUnavailable, match="printed a latency table, expected bandwidth"):
        ucx_perftest_records([1024], "shm", lambda size: 1000)
    assert " -c " not in calls.read_text()  # the bandwidth test is not pinned


@needs_namespaces
def test_ucx_perftest_records_go_into_the_same_csv_as_the_transports(tmp_path):
    from bench.results import RunWriter, load_run

    writer = RunWriter(tmp_path / "run", "micro", {})
    for record in memcpy_records([4096], _iters) + _measure(UcxPerftest(fabric_transport="shm", timeout_s=30),
                                                             [4096]):
        writer.add(record)
    writer.finish()
    assert sorted(load_run(tmp_path / "run").records["transport"]) == ["memcpy", "ucx_perftest"]


@pytest.mark.parametrize(("fabric_transport", "tls"), [("shm", "shm"), ("tcp", "tcp"), ("auto", None)])
def test_perftest_runs_with_the_ucx_backends_tool_environment(monkeypatch, tmp_path, fabric_transport, tls):
    # the UCX backend's tool: UCX_TLS of the fabric transport ("auto": left alone), and the install's lib/ first
    # on LD_LIBRARY_PATH (the wheel's binaries have no RPATH)
    seen = tmp_path / "seen"
    fake = tmp_path / "bin" / "ucx_perftest"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "tls=${{UCX_TLS-unset}} lib=$LD_LIBRARY_PATH" >> {seen}\n'
                    f'case "$*" in *-t*) cat {tmp_path / "output"}; {_client_done(tmp_path)};; esac\n'
                    f'{_server_ends_after_client(tmp_path)}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "output").write_text(SHM_PUT_BW_1KB)
    monkeypatch.setenv(UCX_HOME_VARIABLE, str(tmp_path))
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.setattr(reference, "wait_listening", lambda server, port, timeout_s: True)
    records = ucx_perftest_records([1024], fabric_transport, lambda size: 1000)
    records = [r.row() for r in records]
    assert [(r["transport"], r["fabric"]) for r in records] == [("ucx_perftest", f"ucx:{tls or 'auto'}")]
    lines = seen.read_text().splitlines()
    assert len(lines) == 2  # server and client
    for line in lines:
        assert line.split()[0] == f"tls={tls or 'unset'}"
        assert line.split()[1].removeprefix("lib=").split(os.pathsep)[0] == str(tmp_path / "lib")


def test_an_unknown_fabric_transport_is_refused():
    with pytest.raises(ValueError, match="unknown fabric transport"):
        ucx_perftest_records([4096], "verbs", _iters)


def test_missing_binary_says_where_it_looked_and_how_to_fix_it(monkeypatch, tmp_path):
    monkeypatch.setenv(UCX_HOME_VARIABLE, str(tmp_path))  # a UCX install without bin/ucx_perftest
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
    monkeypatch.setenv(UCX_HOME_VARIABLE, str(tmp_path))
    with pytest.raises(ReferenceUnavailable, match=r"exit code 3(.|\n)*something broke"):
        ucx_perftest_records([4096], "tcp", _iters, timeout_s=10)


def test_hung_perftest_is_killed_at_the_timeout(monkeypatch, tmp_path):
    fake = tmp_path / "bin" / "ucx_perftest"
    fake.parent.mkdir()
    # the server exits at once, the client (any call with a -t) never does
    fake.write_text('#!/bin/sh\ncase "$*" in *-t*) exec sleep 73;; esac\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(UCX_HOME_VARIABLE, str(tmp_path))
    monkeypatch.setattr(reference, "wait_listening", lambda server, port, timeout_s: True)
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
    record = record.row()
    assert record["transport"] == "ucx_perftest"
    assert record["throughput_MBps"] == 11346.26
    # its time is size / bandwidth, the whole run's time per put ...
    assert record["mean_us"] == pytest.approx(1024 / 2**20 / 11346.26 * 1e6, rel=1e-3)
    # ... and it claims no per-transfer median or tail (these used to repeat the mean: 0.03 us "per transfer")
    for column in ("p50_us", "p99_us", "min_us", "max_us"):
        assert math.isnan(record[column]), column


def test_the_latency_record_takes_p50_from_the_typical_latency():
    record = perftest_record(parse_perftest_output(TCP_PUT_LAT_1MB, size=1 << 20), 1 << 20, 10, 1000, "ucx:tcp")
    record = record.row()
    assert record["transport"] == "ucx_perftest_lat"
    assert record["p50_us"] == 196.939  # the 50.0%ile column: the median round trip, halved
    assert record["mean_us"] == 987.356  # the Final row's overall latency, not its last interval's 615.158
    assert record["throughput_MBps"] == 1012.81
    assert math.isnan(record["p99_us"])
    assert math.isnan(record["sender_cpu_s"]) and record["copied_bytes_per_transfer"] == 0


@needs_namespaces
def test_perftest_runs_on_a_private_host_of_the_launch_layer(monkeypatch, tmp_path):
    # ucx_perftest's server listens on every interface: where it runs, no interface may reach the host's network.
    # The line's rank runs on one private emulated host (a namespace whose one link goes to a bridge of its own).
    from bench.launch.hosts import EmulatedHosts

    seen = tmp_path / "seen"
    fake = tmp_path / "bin" / "ucx_perftest"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nreadlink /proc/self/ns/net >> {seen}\n"
                    f"cut -d: -f1 /proc/net/dev | tail -n +3 >> {seen}\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(UCX_HOME_VARIABLE, str(tmp_path))  # the rank's environment is ours
    with pytest.raises(MicroError,
                       match=r"ucx_perftest: rank 0 \(ucx_perftest\) failed: .*server failed \(exit code 3\)"):
        _measure(UcxPerftest(fabric_transport="tcp", timeout_s=20), [4096])
    lines = [line.strip() for line in seen.read_text().splitlines() if line.strip()]
    namespaces = {line for line in lines if line.startswith("net:")}
    interfaces = {line for line in lines if not line.startswith("net:")}
    assert len(namespaces) == 1 and os.readlink("/proc/self/ns/net") not in namespaces
    assert "lo" in interfaces and interfaces <= {"lo", EmulatedHosts.INTERFACE}
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"-{os.getpid()}-" not in left  # the private host went with the line


# ---------------------------------------------------------------------------------------------
# perftest's verbs tools. No RDMA device here, so these samples are written (not captured) to perftest 4.5's format:
# the header and row format strings of its perftest_parameters.h (RESULT_FMT, REPORT_FMT, RESULT_FMT_LAT,
# REPORT_FMT_LAT; the same in the 6.06 installed here, per its strings), tabs included, and the client's preamble.

IB_WRITE_BW_64KB = """\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF\t\tDevice         : mlx5_0
 Number of qps   : 1\t\tTransport type : IB
 Connection type : RC\t\tUsing SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : ON
 TX depth        : 128
 CQ Moderation   : 100
 Mtu             : 4096[B]
 Link type       : IB
 Max inline data : 0[B]
 rdma_cm QPs\t : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0x05 QPN 0x0b2a PSN 0x6a1c3e RKey 0x1fffbd VAddr 0x007f3c2e5f0000
 remote address: LID 0x05 QPN 0x0b2b PSN 0x91e4d2 RKey 0x1ffebc VAddr 0x007f8a41c20000
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 65536      5000             11034.70            11031.24\t\t   0.176500
---------------------------------------------------------------------------------------
"""
# 1 KiB: the peak not measured (0.00, as with -N), the time per write from the message rate's six decimals
IB_WRITE_BW_1KB = IB_WRITE_BW_64KB.replace(
    " 65536      5000             11034.70            11031.24\t\t   0.176500",
    " 1024       5000             0.00               3921.45\t\t   4.015565")
# --report_gbits: Gb/sec (10**9 bits) instead of MB/sec (2**20 bytes)
IB_WRITE_BW_64KB_GBITS = IB_WRITE_BW_64KB.replace(
    " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]",
    " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]").replace(
    " 65536      5000             11034.70            11031.24\t\t   0.176500",
    " 65536      5000             92.57               92.53\t\t   0.176487")
# the header and row as perftest builds them (RESULT_FMT_LAT, REPORT_FMT_LAT), trailing spaces included
IB_WRITE_LAT_HEADER = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
                       "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ")
IB_WRITE_LAT_ROW = (" 4096    1000          2.61           10.25        2.70     \t       2.72        \t"
                    "0.14   \t\t3.21    \t\t10.25  ")
IB_WRITE_LAT_4KB = """\
---------------------------------------------------------------------------------------
                    RDMA_Write Latency Test
 Dual-port       : OFF\t\tDevice         : mlx5_1
 Number of qps   : 1\t\tTransport type : IB
 Connection type : RC\t\tUsing SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : ON
 TX depth        : 1
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 3
 Max inline data : 220[B]
 rdma_cm QPs\t : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0248 PSN 0xe6be8a RKey 0x1fffbd VAddr 0x007f360b400000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:00:00:01
 remote address: LID 0000 QPN 0x0249 PSN 0x158390 RKey 0x1ffebc VAddr 0x007fe0a4e10000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:00:00:01
---------------------------------------------------------------------------------------
""" + IB_WRITE_LAT_HEADER + "\n" + IB_WRITE_LAT_ROW + "\n" + "-" * 87 + "\n"
# a perftest before 4.x: t_min, t_max and t_typical only
IB_WRITE_LAT_4KB_OLD = """\
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]
 4096    1000          2.61           10.25        2.70
"""
# what the tools print here, with no RDMA device
NO_DEVICE = (" Did not detect devices \n If device exists, check if driver is up\n"
             " Unable to find the Infiniband/RoCE device\n")


def test_parse_ib_write_bw_takes_the_average_bandwidth_in_mebibytes():
    result = parse_ib_write_bw_output(IB_WRITE_BW_64KB, size=65536)
    assert (result.size, result.iters, result.device) == (65536, 5000, "mlx5_0")
    assert result.peak_MBps == 11034.70 and result.average_MBps == 11031.24
    assert result.message_rate_Mpps == 0.176500
    # 64 KiB: the time per write from the bandwidth's digits (the rate has only 6 here)
    assert result.time_us == pytest.approx(65536 / (11031.24 * 2**20) * 1e6)


def test_parse_ib_write_bw_small_writes_time_from_the_message_rate_and_no_peak():
    result = parse_ib_write_bw_output(IB_WRITE_BW_1KB, size=1024)
    assert result.size == 1024 and result.average_MBps == 3921.45
    assert math.isnan(result.peak_MBps)  # 0.00: not measured
    assert result.time_us == 1 / 4.015565


def test_parse_ib_write_bw_converts_gbits_to_mebibytes():
    result = parse_ib_write_bw_output(IB_WRITE_BW_64KB_GBITS, size=65536)
    assert result.average_MBps == pytest.approx(92.53e9 / 8 / 2**20)
    assert result.average_MBps == pytest.approx(11031.24, rel=0.001)


def test_parse_ib_write_bw_rejects_a_bandwidth_that_is_not_in_mebibytes():
    in_megabytes = IB_WRITE_BW_64KB.replace("11031.24", f"{65536 * 0.1765:.2f}")  # 10**6 bytes a MB
    with pytest.raises(ReferenceUnavailable, match="2\\^20"):
        parse_ib_write_bw_output(in_megabytes, size=65536)


def test_parse_ib_write_bw_wants_the_row_of_its_size():
    with pytest.raises(ReferenceUnavailable, match="no result row for 4096 bytes"):
        parse_ib_write_bw_output(IB_WRITE_BW_64KB, size=4096)


@pytest.mark.parametrize("parse", [parse_ib_write_bw_output, parse_ib_write_lat_output])
def test_parse_perftest_verbs_output_without_a_table(parse):
    with pytest.raises(ReferenceUnavailable, match=r"printed no results table(.|\n)*Unable to find"):
        parse(NO_DEVICE)


def test_parse_ib_write_lat_takes_every_column():
    result = parse_ib_write_lat_output(IB_WRITE_LAT_4KB, size=4096)
    assert (result.size, result.iters, result.device) == (4096, 1000, "mlx5_1")
    assert (result.min_us, result.max_us, result.typical_us) == (2.61, 10.25, 2.70)
    assert (result.average_us, result.stdev_us, result.p99_us, result.p999_us) == (2.72, 0.14, 3.21, 10.25)


def test_parse_ib_write_lat_of_an_old_perftest_has_no_mean_or_percentiles():
    result = parse_ib_write_lat_output(IB_WRITE_LAT_4KB_OLD, size=4096)
    assert (result.min_us, result.max_us, result.typical_us) == (2.61, 10.25, 2.70)
    assert math.isnan(result.average_us) and math.isnan(result.p99_us)


def test_parse_ib_write_lat_refuses_cycles_and_bandwidth_tables():
    with pytest.raises(ReferenceUnavailable, match="without -C"):
        parse_ib_write_lat_output(IB_WRITE_LAT_4KB.replace("[usec]", "[cycles]"))
    with pytest.raises(ReferenceUnavailable, match="not a latency table"):
        parse_ib_write_lat_output(IB_WRITE_BW_64KB)
    with pytest.raises(ReferenceUnavailable, match="not a bandwidth table"):
        parse_ib_write_bw_output(IB_WRITE_LAT_4KB)


def test_the_ib_write_bw_record_is_a_rate_without_a_distribution():
    record = verbs_record(parse_ib_write_bw_output(IB_WRITE_BW_64KB, size=65536), "verbs:mlx5_0:1")
    record = record.row()
    assert set(record) >= RECORD_KEYS
    assert record["transport"] == "ib_write_bw" and record["fabric"] == "verbs:mlx5_0:1"
    assert (record["size_bytes"], record["iters"], record["warmup"]) == (65536, 5000, 0)
    assert record["throughput_MBps"] == 11031.24
    assert record["mean_us"] == pytest.approx(65536 / 2**20 / 11031.24 * 1e6)
    for column in ("p50_us", "p99_us", "min_us", "max_us", "sender_cpu_s"):
        assert math.isnan(record[column]), column
    assert record["copied_bytes_per_transfer"] == 0


def test_the_ib_write_lat_record_takes_p50_from_the_typical_latency():
    record = verbs_record(parse_ib_write_lat_output(IB_WRITE_LAT_4KB, size=4096), "verbs:mlx5_1:1")
    record = record.row()
    assert set(record) >= RECORD_KEYS
    assert record["transport"] == "ib_write_lat"
    assert (record["p50_us"], record["mean_us"], record["p99_us"]) == (2.70, 2.72, 3.21)
    assert (record["min_us"], record["max_us"]) == (2.61, 10.25)
    assert record["throughput_MBps"] == pytest.approx(4096 / 2**20 / 2.72e-6)
    assert math.isnan(record["receiver_cpu_s"]) and record["copied_bytes_per_transfer"] == 0


def test_verbs_label_prefers_the_tools_arguments():
    given = Tool("ib_write_bw", Path("/usr/bin/ib_write_bw"), {}, ("-d", "mlx5_2", "-i", "2", "-x", "3"))
    assert verbs_label(given, "mlx5_0") == "verbs:mlx5_2:2"
    found = Tool("ib_write_bw", Path("/usr/bin/ib_write_bw"), {})
    assert verbs_label(found, "mlx5_0") == "verbs:mlx5_0:1"  # the device perftest reported, its default port


def test_verbs_lines_say_the_fabric_is_not_available_here():
    status = fabric.availability("verbs")
    assert not status.ok  # no RDMA device on this machine
    for line in reference_lines("verbs", "auto")[:2]:
        status = line.availability()
        assert not status.ok
        message = status.reason
        assert message.startswith(f"{line.name}: the verbs fabric is not available here: ")
        assert status.reason in message and "--no-references" in message
        assert "\n" not in message


def test_verbs_lines_name_the_missing_rdma_device(monkeypatch):
    reason = "no RDMA device found (ibv_get_device_list is empty); check 'ibv_devices'"
    monkeypatch.setattr(fabric, "availability", lambda name: fabric.Availability(False, reason)
                        if name == "verbs" else pytest.fail(f"asked about {name}"))
    with pytest.raises(ReferenceUnavailable, match=r"ib_write_lat: .*no RDMA device found"):
        verbs_records([4096], "ib_write_lat", _iters)
    assert verbs_records([2 * LATENCY_MAX_SIZE], "ib_write_lat", _iters) == []  # nothing to measure: not asked


def test_the_reference_lines_of_the_verbs_fabric():
    lines = reference_lines("verbs", "auto")
    assert [line.name for line in lines] == ["ib_write_bw", "ib_write_lat", "memcpy", "harness"]
    bandwidth = [line.name for line in lines if line.bandwidth_reference]
    assert bandwidth == [catalogue.bandwidth_reference("verbs")] == ["ib_write_bw"]
    [point] = plan_points([4096], 50)
    record = Memcpy().measure(point, port=0)
    assert (record.transport, record.size_bytes, record.iters) == ("memcpy", 4096, 50)


@needs_namespaces
def test_the_reference_lines_of_the_ucx_fabric_run_its_perftest_lines():
    lines = reference_lines("ucx", "shm", timeout_s=30)
    assert [line.name for line in lines] == ["ucx_perftest", "ucx_perftest_lat", "memcpy", "harness"]
    bandwidth = [line.name for line in lines if line.bandwidth_reference]
    assert bandwidth == [catalogue.bandwidth_reference("ucx")] == ["ucx_perftest"]
    for line in lines[:2]:
        records = [r.row() for r in _measure(line, [4096], iters=50, warmup=3)]
        assert [(r["transport"], r["fabric"], r["warmup"], r["iters"]) for r in records] == [
            (line.name, "ucx:shm", 3, 50)]
    assert _no_perftest_left()


def test_reference_lines_refuse_an_unknown_fabric():
    with pytest.raises(ValueError, match="no reference lines for fabric 'gm'"):
        reference_lines("gm", "auto")


def test_the_registry_names_every_reference_line_the_readers_know():
    """Every reference line the catalogue knows is in the references' registry, but the peers' plain loops, which
    run beside their peer line only when asked (``--calibrate``)."""
    from bench.experiments.peers import CALIBRATIONS, calibration_lines

    calibrations = [line.name for line in catalogue.calibrations()]
    assert calibrations == list(CALIBRATIONS) == ["mpi_plain", "mpi_rma_plain", "socket_plain", "nixl_plain",
                                                  "mooncake_plain", "torch_gloo_plain", "torch_rpc_plain"]
    assert tuple(REGISTRY) == tuple(n for n in catalogue.names("reference") if n not in calibrations)
    assert [REGISTRY.load(name)().name for name in REGISTRY] == list(REGISTRY)
    assert [line.name for line in calibration_lines(["mpi"])] == ["mpi_plain"]
    assert [line.name for line in calibration_lines(["socket", "mpi_rma"])] == ["mpi_rma_plain", "socket_plain"]
    assert [line.name for line in calibration_lines(["nixl"])] == ["nixl_plain"]
    assert [line.name for line in calibration_lines(["mooncake"])] == ["mooncake_plain"]
    assert [line.name for line in calibration_lines(["torch_rpc", "torch_gloo"])] == ["torch_gloo_plain",
                                                                                      "torch_rpc_plain"]


def _fake_verbs_tool(tmp_path, monkeypatch, output: str, arguments=("-d", "mlx5_0", "-i", "1", "-x", "3")) -> Path:
    """perftest's tool as the verbs backend would give it, faked: logs its arguments to ``calls`` and, as a
    client (its last argument an address), prints ``output``; the verbs fabric claims to be available."""
    calls = tmp_path / "calls"
    fake = tmp_path / "ib_write_tool"
    (tmp_path / "output").write_text(output)
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                    f'case "$*" in *127.0.0.1) cat {tmp_path / "output"}; {_client_done(tmp_path)};; esac\n'
                    f'{_server_ends_after_client(tmp_path)}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(fabric, "availability", lambda name: fabric.Availability(True))
    monkeypatch.setattr(reference, "tool", lambda backend, name, fabric_transport: Tool(
        name, fake, dict(os.environ), tuple(arguments)))
    monkeypatch.setattr(reference, "wait_listening", lambda server, port, timeout_s: True)
    return calls


def test_ib_write_bw_runs_server_and_client_with_the_backends_arguments(monkeypatch, tmp_path):
    calls = _fake_verbs_tool(tmp_path, monkeypatch, IB_WRITE_BW_64KB)
    records = verbs_records([65536], "ib_write_bw", lambda size: 5000)
    records = [r.row() for r in records]
    assert [(r["transport"], r["size_bytes"], r["throughput_MBps"], r["fabric"]) for r in records] == [
        ("ib_write_bw", 65536, 11031.24, "verbs:mlx5_0:1")]
    lines = [line.split() for line in calls.read_text().splitlines()]  # in either order: neither waits here
    [server] = [line for line in lines if line[-1] != "127.0.0.1"]
    [client] = [line for line in lines if line[-1] == "127.0.0.1"]
    assert server[:6] == ["-d", "mlx5_0", "-i", "1", "-x", "3"]
    assert server[server.index("-s") + 1] == "65536" and server[server.index("-n") + 1] == "5000"
    assert "-F" in server and server[server.index("-p") + 1] == "18515"
    assert client == [*server, "127.0.0.1"]


def test_ib_write_lat_runs_pinned_up_to_1mb_only(monkeypatch, tmp_path):
    calls = _fake_verbs_tool(tmp_path, monkeypatch, IB_WRITE_LAT_4KB, arguments=())
    monkeypatch.setattr(reference, "cpu_pair", lambda: (0, 1))
    ps_seen = tmp_path / "affinity"
    monkeypatch.setattr(reference, "spawn", _logging_spawn(reference.spawn, ps_seen))
    records = verbs_records([4096, 2 << 20], "ib_write_lat", lambda size: 2)
    records = [r.row() for r in records]
    # perftest's minimum of 5 iterations; the device from the tool's own report, perftest's default port
    assert [(r["transport"], r["size_bytes"], r["p50_us"], r["fabric"]) for r in records] == [
        ("ib_write_lat", 4096, 2.70, "verbs:mlx5_1:1")]
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and all(line.split()[line.split().index("-n") + 1] == "5" for line in lines)
    pins = ps_seen.read_text().splitlines()
    assert pins == ["taskset -c 0", "taskset -c 1"]  # server, then client


def _logging_spawn(spawn, log: Path):
    """``reference.spawn`` that logs the ``taskset -c CPU`` of each command (a command without one fails)."""
    def logged(command, env, out, *rest):
        at = next(i for i, part in enumerate(command) if Path(part).name == "taskset")
        with log.open("a") as f:
            f.write(f"taskset {' '.join(command[at + 1:at + 3])}\n")
        return spawn(command, env, out, *rest)
    return logged


def test_ib_write_bw_without_a_device_says_what_to_check(monkeypatch, tmp_path):
    real_wait_listening = reference.wait_listening
    _fake_verbs_tool(tmp_path, monkeypatch, "")
    monkeypatch.setattr(reference, "wait_listening", real_wait_listening)  # the server exits before listening
    fake = tmp_path / "ib_write_tool"
    fake.write_text(f"#!/bin/sh\nprintf '{NO_DEVICE}'\nexit 1\n")
    with pytest.raises(ReferenceUnavailable, match=r"ib_write_bw server failed \(exit code 1\): .*no RDMA device"
                                                   r".*rdma system show netns"):
        verbs_records([4096], "ib_write_bw", _iters, timeout_s=10)



@dataclass
class Constant(ReferenceLine):
    """A line of the test's own: what a new reference needs (a class with ``measure``), nothing else."""

    name: str = "constant"

    def measure(self, point, port: int):
        return reference.record(self.name, point.size_bytes, point.warmup, point.iters, p50_us=float(port),
                                 p99_us=1.0, mean_us=1.0, min_us=1.0, max_us=1.0, throughput_MBps=1.0,
                                 sender_cpu_s=0.0, receiver_cpu_s=0.0, copied_bytes=0, fabric="none")


def test_a_new_line_is_one_class_measured_in_a_rank_of_the_launcher():
    records = _measure(Constant(), [1024, 4096], iters=7)
    assert [(r.transport, r.size_bytes, r.iters) for r in records] == [("constant", 1024, 7), ("constant", 4096, 7)]
    # measured in a rank, on the port the launcher gave it (not the test process's: it has none)
    assert all(r.p50_us > 1024 for r in records)


def test_the_null_line_times_the_harness_over_a_link_that_moves_nothing():
    """The harness measuring itself: the same loops and checks over a link that moves nothing, at the sizes the
    marker checks (a larger transfer is checked byte for byte, which nothing moved cannot pass)."""
    from bench.experiments.references.null import NullLine

    line = NullLine(timeout_s=30)
    assert [p.size_bytes for p in line.points(plan_points([1024, 60000, 64 << 10, 1 << 20], 5))] == [1024, 60000]
    sides = []
    run_line(line, plan_points([1024, 60000], 20, 2), LocalLauncher(), 30,
             on_sides=lambda point, sender, receiver: sides.append((point, sender, receiver)))
    assert [point.size_bytes for point, _, _ in sides] == [1024, 60000]
    for _, sender, receiver in sides:
        assert sender.transfers == receiver.transfers == 22 and receiver.corrupted == 0
        assert sender.stats.tensors_sent == receiver.stats.tensors_received == 20
        assert sender.stats.copied_bytes == receiver.stats.copied_bytes == 0
        assert sender.fabric == {"fabric": "none", "used": ["shared memory word"]}


# -- device memory (--memory cuda) --------------------------------------------------------------------------------


def test_ucx_perftest_puts_on_device_memory_with_its_device_and_cuda_transports():
    from bench.experiments.references.running import ReferenceUnavailable
    from bench.experiments.references.ucx_perftest import memory_arguments
    from transports.memory import HOST, Memory

    env = {"UCX_TLS": "sm,self", "PATH": "/bin"}
    assert memory_arguments((HOST, HOST), env) == ([], env)
    args, placed = memory_arguments((Memory("cuda", 1), Memory("cuda", 1)), env)
    assert args == ["-m", "cuda,cuda"] and placed["CUDA_VISIBLE_DEVICES"] == "1"
    assert placed["UCX_TLS"] == "sm,self,cuda_copy,cuda_ipc" and env["UCX_TLS"] == "sm,self"  # the caller's kept
    args, placed = memory_arguments((Memory("cuda", 0), HOST), {})
    assert args == ["-m", "cuda,host"] and "UCX_TLS" not in placed  # UCX chooses: its CUDA transports among them
    with pytest.raises(ReferenceUnavailable, match="one device"):
        memory_arguments((Memory("cuda", 0), Memory("cuda", 1)), env)
    # where CUDA_VISIBLE_DEVICES chose this process's devices, cuda:N is the Nth of them, for the child too
    chosen = {"CUDA_VISIBLE_DEVICES": "3, GPU-5a1e"}
    assert memory_arguments((Memory("cuda", 1), HOST), chosen)[1]["CUDA_VISIBLE_DEVICES"] == "GPU-5a1e"
    assert memory_arguments((Memory("cuda", 0), HOST), chosen)[1]["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(ReferenceUnavailable, match="shows 2 device"):
        memory_arguments((Memory("cuda", 2), HOST), chosen)


def test_lines_that_move_host_memory_only_say_so_for_device_memory():
    """A cuda run leaves out, with one line, every line that cannot put its tensors in device memory; transports
    (staging when they must), ucx_perftest and NIXL's VRAM line stay."""
    from bench.experiments.micro import TransportLine
    from bench.experiments.peers import calibration_lines, peer_lines
    from bench.experiments.references import reference_lines
    from transports.memory import HOST, Memory

    cuda = (Memory("cuda", 0), Memory("cuda", 0))
    lines = [*reference_lines("ucx", "auto", 60), *peer_lines(None, 60), *calibration_lines(None, 60),
             TransportLine("zerocopy"), TransportLine("grpc_tcp")]
    kept = {line.name for line in lines if line.memory_problem(cuda) is None}
    assert kept == {"ucx_perftest", "ucx_perftest_lat", "nixl", "zerocopy", "grpc_tcp"}
    assert all("host memory only" in line.memory_problem(cuda) for line in lines if line.name not in kept)
    assert all(line.memory_problem((HOST, HOST)) is None for line in lines)
