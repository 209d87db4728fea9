"""perftest's RDMA write tools on the verbs fabric (``--fabric verbs``): two reference lines.

- ``ib_write_bw``: perftest's RDMA write bandwidth test, on the verbs fabric (``--fabric verbs``)
  in place of ``ucx_perftest``, with the device, port and GID index of the RDMA_* settings.
  The client posts RDMA writes back to back (128 in flight) over one RC queue pair and counts
  completions; like ``ucx_perftest`` it is what the NIC can move at best. Its columns:

  - ``throughput_MBps``: "BW average", the whole run's bandwidth (MB = 2**20 bytes, perftest's
    MB/sec); the denominator of every record's ``of_reference`` in a verbs run.
  - ``mean_us``: the whole run's time per write (size / bandwidth, or 1 / "MsgRate"): a rate,
    as for ``ucx_perftest``.
  - ``p50_us``, ``p99_us``, ``min_us``, ``max_us``: empty (no per-write time; "BW peak" is not kept).

- ``ib_write_lat``: perftest's RDMA write latency test at the sizes up to 1 MiB, same device.
  Client and server take turns writing the payload to each other, each polling its memory for
  the peer's write; perftest reports half a round trip. Its columns: ``p50_us`` is "t_typical"
  (the median), ``mean_us`` "t_avg", ``p99_us`` the "99% percentile", ``min_us``/``max_us``
  "t_min"/"t_max", ``throughput_MBps`` ``size / mean_us``.

  Both verbs lines record ``warmup`` 0 (perftest takes no warm-up count) and the fabric
  ``verbs:<device>:<port>``; they run only where the verbs fabric is available (an RDMA device).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from bench.experiments.micro import Point
from bench.experiments.references import running
from bench.experiments.references.lines import PerftestLine
from bench.experiments.references.running import LATENCY_MAX_SIZE, NAN, ReferenceUnavailable
from bench.results import MicroRecord
from transports import fabric
from transports.fabric.base import Tool

VERBS_BANDWIDTH_TOOL = "ib_write_bw"
VERBS_LATENCY_TOOL = "ib_write_lat"
#: the record names of the two verbs lines (each named after its tool)
VERBS_LINES = (VERBS_BANDWIDTH_TOOL, VERBS_LATENCY_TOOL)
#: perftest's out-of-band port (its default), inside the tools' own network namespace
_VERBS_PORT = 18515
#: perftest refuses fewer iterations (``-n``: "at least 5")
_VERBS_MIN_ITERS = 5
#: the device port perftest uses when not told (``-i``)
_VERBS_DEFAULT_IB_PORT = "1"
_PERFTEST_INSTALL = "install perftest ('apt-get install perftest', 'dnf install perftest')"


@dataclass(frozen=True)
class VerbsBandwidthResult:
    """One row of ib_write_bw's client table (see :func:`parse_ib_write_bw_output`); bandwidths in MB/s with
    MB = 2**20 bytes, whichever unit the tool printed."""

    size: int
    iters: int
    peak_MBps: float  # "BW peak": NaN where perftest did not measure it (it prints 0.00)
    average_MBps: float  # "BW average": size * iters / the whole run's time
    message_rate_Mpps: float  # "MsgRate": writes per microsecond over the whole run
    device: str | None = None  # the "Device :" of the header

    @property
    def time_us(self) -> float:
        """The whole run's time per write, from the column with more digits: the bandwidth has 2 decimals
        (MB/s), the message rate 6 (Mpps), so the rate below about 10 KiB a write, the bandwidth above."""
        if self.message_rate_Mpps > 0 and self.average_MBps * 100 < self.message_rate_Mpps * 1e6:
            return 1 / self.message_rate_Mpps
        return self.size / (self.average_MBps * 2**20) * 1e6 if self.average_MBps > 0 else NAN


@dataclass(frozen=True)
class VerbsLatencyResult:
    """One row of ib_write_lat's table (see :func:`parse_ib_write_lat_output`): times of half a round trip,
    in microseconds; NaN for the columns a perftest before 4.x does not print."""

    size: int
    iters: int
    min_us: float
    max_us: float
    typical_us: float  # "t_typical": the median
    average_us: float = NAN
    stdev_us: float = NAN
    p99_us: float = NAN
    p999_us: float = NAN
    device: str | None = None


def _perftest_table(text: str, tool: str, size: int | None) -> tuple[str, list[str]]:
    """The header line of a perftest result table and the fields of its row for ``size`` (the last row when
    ``size`` is None); ReferenceUnavailable when there is none."""
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if "#bytes" in line and "#iterations" in line]
    if not heads:
        raise ReferenceUnavailable(f"{tool} printed no results table{running.tail_text(text)}")
    header = lines[heads[-1]]
    rows = []
    for line in lines[heads[-1] + 1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[0].isdigit() and fields[1].isdigit():
            rows.append(fields)
    if size is not None:
        rows = [fields for fields in rows if int(fields[0]) == size]
    if not rows:
        which = f" for {size} bytes" if size is not None else ""
        raise ReferenceUnavailable(f"{tool} printed no result row{which}{running.tail_text(text)}")
    return header, rows[-1]


def _perftest_device(text: str) -> str | None:
    found = re.search(r"Device\s*:\s*(\S+)", text)
    return found.group(1) if found else None


def _numbers(fields: list[str], count: int, tool: str) -> list[float]:
    try:
        return [float(f) for f in fields[:count]]
    except ValueError:
        raise ReferenceUnavailable(f"{tool} result row is not numeric: {' '.join(fields)!r}") from None


def parse_ib_write_bw_output(text: str, size: int | None = None) -> VerbsBandwidthResult:
    """The result row of an ib_write_bw client's output (perftest 4.5 to 6.x, not ``--out_json``).

    After its settings and the two queue pairs' addresses it prints (tabs and spaces as the tool's)::

         #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
         65536      5000             11034.70            11031.24		   0.176500

    one row per size (``-a`` runs them all; ``size`` picks one). MB/sec is 2**20 bytes a second
    (its ``--help``: "MiB=2^20 byte"); ``--report_gbits`` prints Gb/sec (10**9 bits), converted
    here. "BW average" and "MsgRate" cover the whole run (size * iterations / its time), and
    bandwidth / size = message rate is checked when ``size`` is given. "BW peak" (the best interval
    between completions) is 0.00 when not measured (``-N``, ``-D``, more than 20000 iterations).
    """
    header, fields = _perftest_table(text, VERBS_BANDWIDTH_TOOL, size)
    if "BW average" not in header or "MsgRate" not in header:
        raise ReferenceUnavailable(f"{VERBS_BANDWIDTH_TOOL}'s table is not a bandwidth table: {header.strip()!r}")
    if len(fields) < 5:
        raise ReferenceUnavailable(
            f"{VERBS_BANDWIDTH_TOOL} result row has {len(fields)} fields, expected 5: {' '.join(fields)!r}")
    row_size, iters, peak, average, rate = _numbers(fields, 5, VERBS_BANDWIDTH_TOOL)
    if "[Gb/sec]" in header:
        peak, average = (value * 1e9 / 8 / 2**20 for value in (peak, average))
    elif "[MB/sec]" not in header:
        raise ReferenceUnavailable(f"{VERBS_BANDWIDTH_TOOL} printed bandwidth in a unit other than MB/sec or "
                                   f"Gb/sec: {header.strip()!r}; update bench/experiments/references/ib_write.py")
    result = VerbsBandwidthResult(int(row_size), int(iters), peak if peak > 0 else NAN, average, rate,
                                  _perftest_device(text))
    if size is not None and average >= 1 and rate >= 0.01:
        implied_mb = size * rate * 1e6 / average
        if not 0.98 < implied_mb / 2**20 < 1.02:
            raise ReferenceUnavailable(
                f"{VERBS_BANDWIDTH_TOOL}'s MB/sec is not 2^20 bytes/s here ({implied_mb:.0f} bytes); "
                "update bench/experiments/references/ib_write.py"
            )
    return result


def parse_ib_write_lat_output(text: str, size: int | None = None) -> VerbsLatencyResult:
    """The result row of ib_write_lat's output (either side's; perftest 4.5 to 6.x, without ``-C``/``-H``/``-D``).

    It prints a header line and one row per size (``-a`` runs them all; ``size`` picks one)::

         #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec] ...
         4096    1000          2.61           10.25        2.70     	       2.72        	0.14 ...

    the header going on with ``99% percentile[usec]   99.9% percentile[usec]`` and the row with their
    values, tabs and spaces as above.
    Every time is half a round trip (client and server write to each other in turn; each waits to see the
    peer's write land): ``t_typical`` is the median, ``t_avg`` the mean, the percentiles over all
    iterations. A perftest before 4.x prints only the first five columns (the others are NaN here).
    """
    header, fields = _perftest_table(text, VERBS_LATENCY_TOOL, size)
    if "t_typical" not in header:
        raise ReferenceUnavailable(f"{VERBS_LATENCY_TOOL}'s table is not a latency table: {header.strip()!r}")
    if "[usec]" not in header:
        raise ReferenceUnavailable(f"{VERBS_LATENCY_TOOL} printed times in another unit than usec (run without -C): "
                                   f"{header.strip()!r}")
    full = "t_avg" in header
    expected = 9 if full else 5
    if len(fields) < expected:
        raise ReferenceUnavailable(f"{VERBS_LATENCY_TOOL} result row has {len(fields)} fields, expected "
                                   f"{expected}: {' '.join(fields)!r}")
    values = _numbers(fields, expected, VERBS_LATENCY_TOOL)
    row_size, iters, t_min, t_max, typical = values[:5]
    rest = values[5:9] if full else [NAN] * 4
    return VerbsLatencyResult(int(row_size), int(iters), t_min, t_max, typical, *rest, device=_perftest_device(text))


def verbs_label(tool: Tool, device: str | None = None) -> str:
    """``verbs:<device>:<port>``: from the tool's ``-d``/``-i`` arguments, else the device the tool reported
    (``device``) and perftest's default port 1."""
    arguments = list(tool.arguments)

    def given(flag: str) -> str | None:
        return arguments[arguments.index(flag) + 1] if flag in arguments[:-1] else None

    return f"verbs:{given('-d') or device or '?'}:{given('-i') or _VERBS_DEFAULT_IB_PORT}"


def verbs_record(result: VerbsBandwidthResult | VerbsLatencyResult, fabric_label_: str) -> MicroRecord:
    """The ``micro`` record of one verbs result: ``ib_write_bw`` or ``ib_write_lat`` (the module docstring says
    what each column means)."""
    if isinstance(result, VerbsBandwidthResult):
        return running.record(
            VERBS_BANDWIDTH_TOOL, result.size, 0, result.iters,
            p50_us=NAN, p99_us=NAN, mean_us=result.time_us, min_us=NAN, max_us=NAN,
            throughput_MBps=result.average_MBps,
            sender_cpu_s=NAN, receiver_cpu_s=NAN, copied_bytes=0, fabric=fabric_label_,
        )
    mean_us = result.average_us
    return running.record(
        VERBS_LATENCY_TOOL, result.size, 0, result.iters,
        p50_us=result.typical_us, p99_us=result.p99_us, mean_us=mean_us, min_us=result.min_us, max_us=result.max_us,
        throughput_MBps=result.size / 2**20 / (mean_us / 1e6) if mean_us > 0 else NAN,
        sender_cpu_s=NAN, receiver_cpu_s=NAN, copied_bytes=0, fabric=fabric_label_,
    )


def verbs_records(sizes: list[int], tool_name: str, iters_for: Callable[[int], int], timeout_s: float = 120,
                  fabric_transport: str = "auto", port: int = _VERBS_PORT) -> list[MicroRecord]:
    """Run perftest's ``tool_name`` (``ib_write_bw`` or ``ib_write_lat``) once per size, server and client
    on this host; one record per size.

    The latency line runs only the sizes up to :data:`LATENCY_MAX_SIZE`. The tool, its arguments
    (the device, port and GID index of the RDMA_* settings) and its environment come from the verbs
    backend (``fabric.backend("verbs").tool``); the pair runs in this process's network namespace (the
    line's rank runs it in a private one: :class:`IbWriteBw`), the client reaching the server's out-of-band
    socket on ``port`` over loopback while the writes go through the RDMA device. ``iters_for(size)`` gives
    the iterations (at least 5, perftest's minimum); perftest takes no warm-up count, so the records' ``warmup`` is 0.
    Raises ReferenceUnavailable if the verbs fabric is not available here or the tool cannot run.
    """
    if tool_name not in VERBS_LINES:
        raise ValueError(f"unknown verbs reference tool '{tool_name}' (known: {', '.join(VERBS_LINES)})")
    latency = tool_name == VERBS_LATENCY_TOOL
    if latency:
        sizes = [size for size in sizes if size <= LATENCY_MAX_SIZE]
    if not sizes:
        return []
    status = fabric.availability("verbs")
    if not status.ok:
        raise ReferenceUnavailable(f"{tool_name}: the verbs fabric is not available here: {status.reason} "
                                   "(its lines need one; measure on a host with an RDMA NIC, or pass --no-references)")
    tool = running.tool("verbs", tool_name, fabric_transport)
    records = []
    for size in sizes:
        iters = max(_VERBS_MIN_ITERS, running.count(iters_for(size), "iters_for", size))
        text = run_verbs_tool(tool, size, iters, timeout_s, port, cpus=running.cpu_pair() if latency else None)
        result = parse_ib_write_lat_output(text, size) if latency else parse_ib_write_bw_output(text, size)
        records.append(verbs_record(result, verbs_label(tool, result.device)))
    return records


def run_verbs_tool(tool: Tool, size: int, iters: int, timeout_s: float, port: int = _VERBS_PORT, *,
                   cpus: tuple[int, int] | None = None) -> str:
    """One server (out-of-band socket on ``port``) and client pair of perftest's ``tool`` at ``size`` bytes in
    this network namespace; the client's output. ``cpus``: the CPU the server and the one the client are
    pinned to (with ``taskset``, where there is one)."""
    taskset = shutil.which("taskset") if cpus else None
    server_pin, client_pin = ([taskset, "-c", str(cpus[0])], [taskset, "-c", str(cpus[1])]) \
        if taskset and cpus else ([], [])
    common = [str(tool.path), *tool.arguments, "-p", str(port), "-s", str(size), "-n", str(iters), "-F"]
    server_command = [*server_pin, *common]
    client_command = [*client_pin, *common, "127.0.0.1"]
    fix = _PERFTEST_INSTALL
    with tempfile.TemporaryFile("w+") as server_out, tempfile.TemporaryFile("w+") as client_out:
        server = client = None
        try:
            server = running.spawn(server_command, tool.environment, server_out, fix)
            deadline = time.monotonic() + timeout_s
            # a server that lives may start slowly on a busy machine: the size's whole timeout bounds it
            if not running.wait_listening(server, port, timeout_s):
                if server.poll() is None:
                    raise ReferenceUnavailable(f"{tool.name} server did not listen on port {port} within "
                                               f"{timeout_s:.0f} s (raise --timeout){running.tail(server_out)}")
                raise _verbs_failed(tool, "server", server.returncode, running.read(server_out), common)
            client = running.spawn(client_command, tool.environment, client_out, fix)
            try:
                client.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ReferenceUnavailable(
                    f"{tool.name} at {size} bytes did not finish within {timeout_s:.0f} s ({iters} iterations); "
                    "raise --timeout or use fewer iterations"
                ) from None
            if client.returncode != 0:
                raise _verbs_failed(tool, "client", client.returncode,
                                    running.read(client_out) + running.read(server_out), common)
            with contextlib.suppress(subprocess.TimeoutExpired):  # the numbers are in; finally kills it
                server.wait(timeout=running.SERVER_EXIT_TIMEOUT_S)
            return running.read(client_out)
        finally:
            for proc in (client, server):
                running.reap(proc)


def _verbs_failed(tool: Tool, role: str, code: int | None, text: str, common: list[str]) -> ReferenceUnavailable:
    if "Did not detect devices" in text or "Unable to find the Infiniband/RoCE device" in text:
        hint = ("it finds no RDMA device inside its private network namespace; check 'ibv_devices', and that "
                "'rdma system show netns' says shared (else 'rdma system set netns shared')")
    else:
        command = " ".join(common)
        hint = f"run '{command}' and '{command} 127.0.0.1' by hand to see why"
    return ReferenceUnavailable(f"{tool.name} {role} failed (exit code {code}): {hint}{running.tail_text(text)}")


@dataclass
class IbWriteBw(PerftestLine):
    """perftest's RDMA write bandwidth, ``ib_write_bw``: the bandwidth reference of a verbs run."""

    name: str = VERBS_BANDWIDTH_TOOL
    fabric: ClassVar[str | None] = "verbs"
    tool: ClassVar[str] = VERBS_BANDWIDTH_TOOL
    bandwidth_reference: ClassVar[bool] = True

    def measure(self, point: Point, port: int) -> MicroRecord:
        [record] = verbs_records([point.size_bytes], self.tool, lambda size: point.iters, self.timeout_s,
                                 self.fabric_transport, port=port)
        return record


@dataclass
class IbWriteLat(IbWriteBw):
    """perftest's RDMA write latency, ``ib_write_lat``, up to 1 MiB."""

    name: str = VERBS_LATENCY_TOOL
    tool: ClassVar[str] = VERBS_LATENCY_TOOL
    latency: ClassVar[bool] = True
    bandwidth_reference: ClassVar[bool] = False
