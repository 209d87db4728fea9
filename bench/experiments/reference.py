"""Reference lines that ``bench micro`` draws beside the transports.

- ``ucx_perftest``: UCX's own put-bandwidth test (``ucx_perftest -t ucp_put_bw``), run as a
  server and a client process over the same UCX transports (``UCX_TLS``) as our fabric. It
  posts one-sided puts back to back with many in flight and flushes at the end, so it is what
  the UCX underneath can move at best, with no rendezvous, flag or consumer in the way. Its
  columns:

  - ``throughput_MBps``: the whole run's bandwidth (bytes put / elapsed time, MB = 2**20 bytes);
    the denominator of every record's ``of_reference``.
  - ``mean_us``: the whole run's time per put, ``size / bandwidth``. The puts are pipelined, so
    this is a *rate*, not a latency: no one waits for any single put to land. At small sizes
    over shared memory a put is a ``short`` put, a store of the payload into the peer's segment
    mapped in the sender (a cache-hot memcpy of 1 KiB), so 1 KiB takes 0.03 to 0.09 µs and the
    "bandwidth" is 10 to 30 GB/s. That number is true for what the test does, and not
    comparable with the time of a send/receive (or of a ``memcpy`` line that pays a Python
    call per copy).
  - ``p50_us``, ``p99_us``, ``min_us``, ``max_us``: empty. The test measures no per-put time (its
    "50.0%ile" is the interval between consecutive posts, see :func:`parse_perftest_output`);
    until this module said so these columns repeated the mean, which drew the 1 KiB put rate
    (0.03 µs) as if it were a transfer time.

- ``ucx_perftest_lat``: UCX's put-latency test (``ucx_perftest -t ucp_put_lat``) at the sizes up
  to 1 MiB (:data:`LATENCY_MAX_SIZE`), same transports. Client and server take turns: one puts
  the payload, the other polls its memory until the payload's last bytes arrive, then puts it
  back. perftest reports half a round trip: the time from a put being posted to the peer seeing
  all of it, the floor a send/receive latency can approach. Its columns:

  - ``p50_us``: perftest's typical latency, the median of the last (up to 2048) round trips, halved;
  - ``mean_us``: the whole run's average round trip, halved;
  - ``throughput_MBps``: ``size / mean_us`` (what perftest prints as bandwidth): one transfer at a
    time, like the transports' throughput;
  - ``p99_us``, ``min_us``, ``max_us``: empty, perftest reports no other percentile.

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

- ``memcpy``: one ``np.copyto`` of the tensor in one process, the cost of a single copy.

:func:`reference_lines` gives the lines of a run (:data:`REGISTRY`): the two perftest lines of its fabric,
then memcpy; each is a ``MicroLine`` of the harness (``bench.experiments.micro``) measured in one rank of the
launch layer, the perftest lines on private hosts (:func:`bench.launch.private.private_hosts`). The programs
come from the fabric backends (``fabric.backend(name).tool``): the libucx-cu12 wheel's ``ucx_perftest``,
perftest's tools on PATH. For all four perftest lines the CPU columns are empty (both processes busy-poll for their
whole life, not only the timed loop) and no payload is copied in user space. All return records
with the columns of ``bench.experiments.micro.make_record``, in the same order, so they can go into the
same ``records.csv``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, ClassVar

import numpy as np

from bench.experiments.micro import Measured, MicroLine, Point
from bench.launch import Launcher, RankContext, RankSpec
from bench.launch.private import PrivateHosts, hosts_for_open_listeners
from bench.results import MicroRecord, latency_summary
from bench.results import lines as catalogue
from transports import fabric
from transports.common import Availability, Registry
from transports.fabric.base import FabricError, Tool

PERFTEST_TEST = "ucp_put_bw"
PERFTEST_LATENCY_TEST = "ucp_put_lat"
#: the latency line of ucx_perftest (its bandwidth line is the catalogue's bandwidth reference of the ucx fabric)
PERFTEST_LATENCY_LINE = "ucx_perftest_lat"
#: the record names of the two perftest lines, by test
PERFTEST_LINES = {PERFTEST_TEST: catalogue.bandwidth_reference("ucx"), PERFTEST_LATENCY_TEST: PERFTEST_LATENCY_LINE}
#: the latency reference runs up to this size (bytes): beyond it a send/receive is a bandwidth question
LATENCY_MAX_SIZE = 1 << 20
#: seconds the perftest server may take to start listening
_LISTEN_TIMEOUT_S = 10.0
#: seconds the server may take to exit once its client is done
_SERVER_EXIT_TIMEOUT_S = 10.0
#: the perftest's out-of-band port, inside its own network namespace (where nothing else listens)
_PERFTEST_PORT = 13337
_NAN = float("nan")


class ReferenceUnavailable(RuntimeError):
    """A reference line cannot be measured here; the message names the problem and the fix."""


@dataclass(frozen=True)
class PerftestResult:
    """The whole-run numbers of one ucx_perftest client (its ``Final:`` row).

    ``kind`` is ``"bandwidth"`` for a table headed "overhead (usec)" (``ucp_put_bw``: the time
    columns are time per put of a pipelined stream) and ``"latency"`` for one headed "latency
    (usec)" (``ucp_put_lat``: the time columns are half round trips).
    """

    kind: str
    iters: int
    overall_us: float  # "overhead|latency (usec) / overall": per put, or half a round trip, over the whole run
    bandwidth_MBps: float  # "bandwidth (MB/s) / overall", MB = 2**20 bytes
    message_rate: float  # "message rate (msg/s) / overall"
    percentile_us: float  # the "50.0%ile" column; see parse_perftest_output for what it is per kind
    percentile: float = 50.0  # the rank of that column (perftest's -R)

    @property
    def time_us(self) -> float:
        """Whole-run time per put (bandwidth) or per half round trip (latency), from whichever column has
        more digits.

        The time has 3 decimals (0.022 us for 1 KiB over shm: 2% steps), the message rate
        is a whole number (6 msg/s at 1 GiB): so the rate below 1 us, the time above. In both
        tests the message rate is 1e6 / that time (perftest halves a latency test's rate too).
        """
        if self.overall_us < 1 and self.message_rate > 0:
            return 1e6 / self.message_rate
        return self.overall_us


# ---------------------------------------------------------------------------------------------
# ucx_perftest


def fabric_label(env: dict[str, str]) -> str:
    """``ucx:<UCX_TLS>``, or ``ucx:auto`` when UCX chooses."""
    return f"ucx:{env.get('UCX_TLS') or 'auto'}"


def ucx_perftest_records(sizes: list[int], fabric_transport: str, iters_for: Callable[[int], int],
                         timeout_s: float = 120, *, warmup_for: Callable[[int], int] | None = None,
                         test: str = PERFTEST_TEST, port: int = _PERFTEST_PORT) -> list[MicroRecord]:
    """Run ``ucx_perftest -t <test>`` once per size, server and client in this process's network namespace
    (the line's rank runs it in a private one: :class:`UcxPerftest`); one record per size.

    ``test`` is ``ucp_put_bw`` (the ``ucx_perftest`` line) or ``ucp_put_lat`` (the
    ``ucx_perftest_lat`` line, measured only at the sizes up to :data:`LATENCY_MAX_SIZE`; the
    others are skipped). The module docstring says what each column of each line means.
    ``fabric_transport`` is ``auto``, ``shm`` or ``tcp`` (UCX_TLS unset / ``shm`` / ``tcp``).
    ``iters_for(size)`` gives the timed puts (bandwidth) or round trips (latency) per size,
    ``warmup_for(size)`` the untimed ones (default: a tenth of the timed ones, 1 to 10).
    ``timeout_s`` bounds each size's run; on timeout both processes are killed. The server listens on
    ``port``. Raises ReferenceUnavailable if ucx_perftest cannot run.
    """
    if test not in PERFTEST_LINES:
        raise ValueError(f"unknown perftest test '{test}' (known: {', '.join(PERFTEST_LINES)})")
    if test == PERFTEST_LATENCY_TEST:
        sizes = [size for size in sizes if size <= LATENCY_MAX_SIZE]
    if not sizes:
        return []
    tool = _tool("ucx", "ucx_perftest", fabric_transport)
    binary, env = tool.path, tool.environment
    records = []
    for size in sizes:
        iters = _count(iters_for(size), "iters_for", size)
        warmup = _count(warmup_for(size), "warmup_for", size) if warmup_for else max(1, min(10, iters // 10))
        result = run_perftest(binary, env, size, iters, warmup, timeout_s, port, test=test,
                              cpus=_cpu_pair() if test == PERFTEST_LATENCY_TEST else None)
        records.append(perftest_record(result, size, warmup, iters, fabric_label(env)))
    return records


def perftest_record(result: PerftestResult, size: int, warmup: int, iters: int, fabric: str) -> MicroRecord:
    """The ``micro`` record of one perftest result: ``ucx_perftest`` for a bandwidth test,
    ``ucx_perftest_lat`` for a latency test (the module docstring says what each column means)."""
    time_us = result.time_us
    if result.kind == "latency":
        name, p50_us = PERFTEST_LINES[PERFTEST_LATENCY_TEST], result.percentile_us
    else:
        # A pipelined stream has a time per put (size / bandwidth) but no per-put distribution.
        name, p50_us = PERFTEST_LINES[PERFTEST_TEST], _NAN
    return _record(
        name, size, warmup, iters,
        p50_us=p50_us, p99_us=_NAN, mean_us=time_us, min_us=_NAN, max_us=_NAN,
        throughput_MBps=result.bandwidth_MBps,
        # Both sides busy-poll for the whole process life, not only the timed loop: not comparable.
        sender_cpu_s=_NAN, receiver_cpu_s=_NAN,
        copied_bytes=0, fabric=fabric,
    )


def run_perftest(binary: Path, env: dict[str, str], size: int, iters: int, warmup: int,
                 timeout_s: float, port: int = _PERFTEST_PORT, *, test: str = PERFTEST_TEST,
                 cpus: tuple[int, int] | None = None) -> PerftestResult:
    """One ucx_perftest server (on ``port``) and client pair running ``test`` in this network namespace;
    ``cpus``: the CPU the server and the one the client are pinned to (``ucx_perftest -c``)."""
    server_pin, client_pin = (["-c", str(cpus[0])], ["-c", str(cpus[1])]) if cpus else ([], [])
    with tempfile.TemporaryFile("w+") as server_out, tempfile.TemporaryFile("w+") as client_out:
        server = client = None
        try:
            server = _spawn([str(binary), "-p", str(port), *server_pin], env, server_out)
            deadline = time.monotonic() + timeout_s
            if not _wait_listening(server, port, min(_LISTEN_TIMEOUT_S, timeout_s)):
                if server.poll() is None:
                    raise ReferenceUnavailable(
                        f"ucx_perftest server did not listen on port {port} within "
                        f"{min(_LISTEN_TIMEOUT_S, timeout_s):.0f} s{_tail(server_out)}"
                    )
                raise _failed("server", server.returncode, server_out, binary, env, port=port)
            command = [str(binary), "127.0.0.1", "-p", str(port), "-t", test,
                       "-s", str(size), "-n", str(iters), "-w", str(warmup), *client_pin]
            client = _spawn(command, env, client_out)
            try:
                client.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ReferenceUnavailable(
                    f"ucx_perftest at {size} bytes did not finish within {timeout_s:.0f} s "
                    f"({iters} {'round trips' if test == PERFTEST_LATENCY_TEST else 'puts'}, {test}); "
                    "raise --timeout or use fewer iterations"
                ) from None
            if client.returncode != 0:
                raise _failed("client", client.returncode, client_out, binary, env, server_out, test=test, port=port)
            with contextlib.suppress(subprocess.TimeoutExpired):  # the numbers are in; finally kills it
                server.wait(timeout=_SERVER_EXIT_TIMEOUT_S)
            result = parse_perftest_output(_read(client_out), size)
            expected = "latency" if test == PERFTEST_LATENCY_TEST else "bandwidth"
            if result.kind != expected:
                raise ReferenceUnavailable(f"ucx_perftest -t {test} printed a {result.kind} table, expected "
                                           f"{expected}{_tail(client_out)}")
            return result
        finally:
            for proc in (client, server):
                _reap(proc)


def parse_perftest_output(text: str, size: int | None = None) -> PerftestResult:
    """The whole-run numbers of a ucx_perftest client's table output (not ``-v``/``-f``).

    A bandwidth test (``ucp_put_bw``) prints (ucx 1.18 to 1.22)::

        |              |              |       overhead (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
        |    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
        Final:                  1000      0.060     0.086     0.086    11346.26   11346.26    11618571    11618571

    and a latency test (``ucp_put_lat``) the same table headed "latency (usec)"::

        Final:                  1000      0.110     0.131     0.131     7454.05    7454.05     7632946     7632946

    In every row "average" covers the last report interval (about a second) and "overall"
    the run so far, so the ``Final:`` row's "overall" columns are the whole run. The time
    columns are time per put in a bandwidth test, half a round trip in a latency test; the
    message rate is 1e6 / that time and the bandwidth size / that time in MB/s with MB = 2**20
    bytes, which is checked here when ``size`` (bytes per put) is given. The "50.0%ile" is the
    median of the last (up to 2048) intervals between iterations: in a latency test the typical
    round trip, halved (perftest's "typical latency"); in a bandwidth test the interval between
    consecutive put posts, with many puts in flight mostly the cost of posting one (0.07 us at
    64 MiB), not a transfer time.
    """
    if "bandwidth (MB/s)" not in text or ("overhead (usec)" not in text and "latency (usec)" not in text):
        raise ReferenceUnavailable(f"ucx_perftest printed no results table{_tail_text(text)}")
    kind = "latency" if "latency (usec)" in text else "bandwidth"
    rank = re.search(r"\|\s*([\d.]+)%ile\s*\|", text)
    rows = [line for line in text.splitlines() if line.startswith("Final:")]
    if not rows:  # no Final row: fall back to the last progress row of the table
        rows = [line for line in text.splitlines() if re.match(r"^(\[thread \d+\])?\s*\d+\s+[\d.]+\s", line)]
    if not rows:
        raise ReferenceUnavailable(f"ucx_perftest printed no result row{_tail_text(text)}")
    fields = re.sub(r"^(Final:|\[thread \d+\])", "", rows[-1]).split()
    if len(fields) != 8:
        raise ReferenceUnavailable(f"ucx_perftest result row has {len(fields)} fields, expected 8: {rows[-1]!r}")
    iters, percentile_us, _, overall_us, _, overall_bw, _, overall_rate = (float(f) for f in fields)
    result = PerftestResult(kind, int(iters), overall_us, overall_bw, overall_rate, percentile_us,
                            float(rank.group(1)) if rank else 50.0)
    if size is not None and result.time_us > 0 and overall_bw > 0:
        implied_mb = size / (result.time_us * 1e-6) / overall_bw
        if not 0.98 < implied_mb / 2**20 < 1.02:  # 2**20 and 10**6 differ by 4.9%
            raise ReferenceUnavailable(
                f"ucx_perftest's MB/s is not 2^20 bytes/s here ({implied_mb:.0f} bytes); "
                f"update bench/experiments/reference.py"
            )
    return result


def _cpu_pair() -> tuple[int, int] | None:
    """Two CPUs this process may run on, for the latency test's server and client; None with fewer.

    Unpinned, the scheduler may start both busy-polling processes on one core, and each turn of the
    ping-pong then waits for a time slice: seen here, 1 KiB put_lat over shm with a median of
    0.12 us and a mean of 20 to 1300 us (the mean settled at 0.12 to 0.24 us once pinned).
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return (allowed[0], allowed[1]) if len(allowed) >= 2 else None


_UCX_REINSTALL = "reinstall the libucx-cu12 wheel ('pip install --force-reinstall libucx-cu12')"


def _spawn(command: list[str], env: dict[str, str], out: IO[str], fix: str = _UCX_REINSTALL) -> subprocess.Popen:
    try:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    except OSError as exc:
        raise ReferenceUnavailable(f"cannot start {command[0]}: {exc}; {fix}") from None


def _reap(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state): nothing more to do
        proc.wait(timeout=10)


def _wait_listening(server: subprocess.Popen, port: int, timeout_s: float) -> bool:
    """Whether the server listens on ``port`` before it exits or ``timeout_s`` passes.

    The server's "Waiting for connection..." sits in its stdio buffer while stdout is not a
    terminal, and probing with a connect would take its one connection: so read the kernel's
    socket table.
    """
    deadline = time.monotonic() + timeout_s
    while server.poll() is None:
        listening = _listening(port, server.pid)
        if listening is None:  # no /proc/net/tcp: give it a moment and hope
            time.sleep(0.5)
            return server.poll() is None
        if listening:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return False


def _listening(port: int, pid: int) -> bool | None:
    """Whether a TCP socket listens on ``port`` in the network namespace of process ``pid``;
    None if the kernel table cannot be read."""
    seen = False
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT, state 0A is LISTEN
            if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False if seen else None


def _failed(role: str, code: int | None, out: IO[str], binary: Path, env: dict[str, str],
            other: IO[str] | None = None, *, test: str = PERFTEST_TEST,
            port: int = _PERFTEST_PORT) -> ReferenceUnavailable:
    text = _read(out) + (_read(other) if other is not None else "")
    if "error while loading shared libraries" in text:
        hint = (f"its libraries are not found; set LD_LIBRARY_PATH to the UCX lib directory "
                f"({binary.parent.parent / 'lib'})")
    else:
        tls = f"UCX_TLS={env['UCX_TLS']} " if env.get("UCX_TLS") else ""
        setup = f"{tls}LD_LIBRARY_PATH={binary.parent.parent / 'lib'}"
        hint = (f"run '{setup} {binary} -p {port}' and '{setup} {binary} 127.0.0.1 -p {port} -t {test}' "
                "by hand to see why, or try another --fabric-transport")
    return ReferenceUnavailable(f"ucx_perftest {role} failed (exit code {code}): {hint}{_tail_text(text)}")


def _read(out: IO[str]) -> str:
    out.flush()
    out.seek(0)
    return out.read()


def _tail(out: IO[str]) -> str:
    return _tail_text(_read(out))


def _tail_text(text: str, lines: int = 6) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return ("; it printed:\n  " + "\n  ".join(kept)) if kept else ""


def _tool(fabric_name: str, name: str, fabric_transport: str) -> Tool:
    """Reference program ``name`` of fabric backend ``fabric_name``; its FabricError (what is missing and how
    to install it) becomes ReferenceUnavailable. ValueError for an unknown fabric transport."""
    try:
        backend = fabric.backend(fabric_name)
    except ImportError as exc:
        raise ReferenceUnavailable(f"{name}: cannot load the {fabric_name} fabric backend ({exc})") from None
    try:
        return backend.tool(name, fabric_transport)
    except FabricError as exc:
        raise ReferenceUnavailable(str(exc)) from None


# ---------------------------------------------------------------------------------------------
# perftest's verbs tools: ib_write_bw, ib_write_lat

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
        return self.size / (self.average_MBps * 2**20) * 1e6 if self.average_MBps > 0 else _NAN


@dataclass(frozen=True)
class VerbsLatencyResult:
    """One row of ib_write_lat's table (see :func:`parse_ib_write_lat_output`): times of half a round trip,
    in microseconds; NaN for the columns a perftest before 4.x does not print."""

    size: int
    iters: int
    min_us: float
    max_us: float
    typical_us: float  # "t_typical": the median
    average_us: float = _NAN
    stdev_us: float = _NAN
    p99_us: float = _NAN
    p999_us: float = _NAN
    device: str | None = None


def _perftest_table(text: str, tool: str, size: int | None) -> tuple[str, list[str]]:
    """The header line of a perftest result table and the fields of its row for ``size`` (the last row when
    ``size`` is None); ReferenceUnavailable when there is none."""
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if "#bytes" in line and "#iterations" in line]
    if not heads:
        raise ReferenceUnavailable(f"{tool} printed no results table{_tail_text(text)}")
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
        raise ReferenceUnavailable(f"{tool} printed no result row{which}{_tail_text(text)}")
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
                                   f"Gb/sec: {header.strip()!r}; update bench/experiments/reference.py")
    result = VerbsBandwidthResult(int(row_size), int(iters), peak if peak > 0 else _NAN, average, rate,
                                  _perftest_device(text))
    if size is not None and average >= 1 and rate >= 0.01:
        implied_mb = size * rate * 1e6 / average
        if not 0.98 < implied_mb / 2**20 < 1.02:
            raise ReferenceUnavailable(
                f"{VERBS_BANDWIDTH_TOOL}'s MB/sec is not 2^20 bytes/s here ({implied_mb:.0f} bytes); "
                "update bench/experiments/reference.py"
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
    rest = values[5:9] if full else [_NAN] * 4
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
        return _record(
            VERBS_BANDWIDTH_TOOL, result.size, 0, result.iters,
            p50_us=_NAN, p99_us=_NAN, mean_us=result.time_us, min_us=_NAN, max_us=_NAN,
            throughput_MBps=result.average_MBps,
            sender_cpu_s=_NAN, receiver_cpu_s=_NAN, copied_bytes=0, fabric=fabric_label_,
        )
    mean_us = result.average_us
    return _record(
        VERBS_LATENCY_TOOL, result.size, 0, result.iters,
        p50_us=result.typical_us, p99_us=result.p99_us, mean_us=mean_us, min_us=result.min_us, max_us=result.max_us,
        throughput_MBps=result.size / 2**20 / (mean_us / 1e6) if mean_us > 0 else _NAN,
        sender_cpu_s=_NAN, receiver_cpu_s=_NAN, copied_bytes=0, fabric=fabric_label_,
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
    tool = _tool("verbs", tool_name, fabric_transport)
    records = []
    for size in sizes:
        iters = max(_VERBS_MIN_ITERS, _count(iters_for(size), "iters_for", size))
        text = run_verbs_tool(tool, size, iters, timeout_s, port, cpus=_cpu_pair() if latency else None)
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
            server = _spawn(server_command, tool.environment, server_out, fix)
            deadline = time.monotonic() + timeout_s
            listen_s = min(_LISTEN_TIMEOUT_S, timeout_s)
            if not _wait_listening(server, port, listen_s):
                if server.poll() is None:
                    raise ReferenceUnavailable(f"{tool.name} server did not listen on port {port} within "
                                               f"{listen_s:.0f} s{_tail(server_out)}")
                raise _verbs_failed(tool, "server", server.returncode, _read(server_out), common)
            client = _spawn(client_command, tool.environment, client_out, fix)
            try:
                client.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ReferenceUnavailable(
                    f"{tool.name} at {size} bytes did not finish within {timeout_s:.0f} s ({iters} iterations); "
                    "raise --timeout or use fewer iterations"
                ) from None
            if client.returncode != 0:
                raise _verbs_failed(tool, "client", client.returncode, _read(client_out) + _read(server_out), common)
            with contextlib.suppress(subprocess.TimeoutExpired):  # the numbers are in; finally kills it
                server.wait(timeout=_SERVER_EXIT_TIMEOUT_S)
            return _read(client_out)
        finally:
            for proc in (client, server):
                _reap(proc)


def _verbs_failed(tool: Tool, role: str, code: int | None, text: str, common: list[str]) -> ReferenceUnavailable:
    if "Did not detect devices" in text or "Unable to find the Infiniband/RoCE device" in text:
        hint = ("it finds no RDMA device inside its private network namespace; check 'ibv_devices', and that "
                "'rdma system show netns' says shared (else 'rdma system set netns shared')")
    else:
        command = " ".join(common)
        hint = f"run '{command}' and '{command} 127.0.0.1' by hand to see why"
    return ReferenceUnavailable(f"{tool.name} {role} failed (exit code {code}): {hint}{_tail_text(text)}")


# ---------------------------------------------------------------------------------------------
# memcpy


def memcpy_records(sizes: list[int], iters_for: Callable[[int], int]) -> list[MicroRecord]:
    """Time ``np.copyto`` between two pre-touched uint8 arrays in this process; one record per size.

    One untimed copy per size, then ``iters_for(size)`` timed ones, each timed on its own.
    ``sender_cpu_s`` is this process's CPU time over the timed copies.
    """
    records = []
    for size in sizes:
        iters = _count(iters_for(size), "iters_for", size)
        src = np.ones(size, dtype=np.uint8)  # written, so every page is resident
        dst = np.zeros(size, dtype=np.uint8)
        dst.fill(1)  # np.zeros may hand back untouched calloc pages
        np.copyto(dst, src)
        samples = np.empty(iters, dtype=np.int64)
        cpu0 = time.process_time()
        for i in range(iters):
            t0 = time.perf_counter_ns()
            np.copyto(dst, src)
            samples[i] = time.perf_counter_ns() - t0
        cpu_s = time.process_time() - cpu0
        del src, dst
        summary = latency_summary(samples / 1e3)
        mean_us = summary["mean_us"]
        records.append(_record(
            "memcpy", size, 1, iters, **summary,
            throughput_MBps=size / 2**20 / (mean_us / 1e6) if mean_us > 0 else math.inf,
            sender_cpu_s=cpu_s, receiver_cpu_s=0.0, copied_bytes=size, fabric="none",
        ))
    return records


# ---------------------------------------------------------------------------------------------
# the lines: each a MicroLine of bench micro, measured in one rank of the launch layer


@dataclass
class ReferenceLine(MicroLine):
    """A reference line of ``bench micro``: one rank that measures every point itself and reports a record each.

    ``fabric_transport``: the UCX transports of the run (what its launcher makes of ``--fabric-transport``);
    ``timeout_s`` bounds one size.
    """

    fabric_transport: str = "auto"
    timeout_s: float = 120.0
    #: the fabric backend whose runs it belongs in (None: every run)
    fabric: ClassVar[str | None] = None

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        return [RankSpec(functools.partial(_reference_job, self, points), self.name)]

    @abstractmethod
    def measure(self, point: Point, port: int) -> MicroRecord:
        """The record of ``point``, measured here; ``port`` is this rank's own to listen on."""


def _reference_job(line: ReferenceLine, points: list[Point], ctx: RankContext) -> None:
    port = int(ctx.cluster.addresses[ctx.rank].rsplit(":", 1)[1])
    for point in points:
        ctx.report(Measured(point.size_bytes, line.measure(point, port)))


@dataclass
class PerftestLine(ReferenceLine):
    """A perftest tool's line: server and client in the line's rank, on private hosts of the launch layer.

    Its tools listen on every interface (no bind option), so the rank runs where the network cannot reach
    it: in one private emulated host under the local launcher, on the emulated host under netns
    (:func:`bench.launch.private.private_hosts`), with the launch layer's reaper and stale sweep.
    """

    #: the perftest's tool, of the fabric backend
    tool: ClassVar[str]
    #: a latency test: the sizes up to LATENCY_MAX_SIZE, server and client pinned to a CPU each
    latency: ClassVar[bool] = False

    def points(self, points: list[Point]) -> list[Point]:
        return [p for p in points if p.size_bytes <= LATENCY_MAX_SIZE] if self.latency else points

    def availability(self) -> Availability:
        if self.fabric is not None and not (status := fabric.availability(self.fabric)).ok:
            return Availability(False, f"{self.name}: the {self.fabric} fabric is not available here: "
                                       f"{status.reason} (its lines need it; measure where it is, or pass "
                                       "--no-references)")
        try:
            _tool(self.fabric, self.tool, self.fabric_transport)
        except ReferenceUnavailable as exc:
            return Availability(False, str(exc))
        return Availability(True)

    def hosts(self, launcher: Launcher) -> PrivateHosts:
        return hosts_for_open_listeners(launcher, self.tool, "--no-references")


@dataclass
class UcxPerftest(PerftestLine):
    """UCX's put bandwidth, ``ucx_perftest -t ucp_put_bw``: the run's bandwidth reference."""

    name: str = "ucx_perftest"
    fabric: ClassVar[str | None] = "ucx"
    tool: ClassVar[str] = "ucx_perftest"
    test: ClassVar[str] = PERFTEST_TEST
    bandwidth_reference: ClassVar[bool] = True

    def measure(self, point: Point, port: int) -> MicroRecord:
        [record] = ucx_perftest_records([point.size_bytes], self.fabric_transport, lambda size: point.iters,
                                        self.timeout_s, warmup_for=lambda size: max(1, point.warmup),
                                        test=self.test, port=port)
        return record


@dataclass
class UcxPerftestLatency(UcxPerftest):
    """UCX's put latency, ``ucx_perftest -t ucp_put_lat``, up to 1 MiB."""

    name: str = "ucx_perftest_lat"
    test: ClassVar[str] = PERFTEST_LATENCY_TEST
    latency: ClassVar[bool] = True
    bandwidth_reference: ClassVar[bool] = False


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


@dataclass
class Memcpy(ReferenceLine):
    """One ``np.copyto`` of the tensor in one process: the cost of a single copy."""

    name: str = "memcpy"

    def measure(self, point: Point, port: int) -> MicroRecord:
        [record] = memcpy_records([point.size_bytes], lambda size: point.iters)
        return record


#: the reference lines, in the order they are measured (before the transports: of_reference needs the
#: bandwidth reference of each size first); each entry's class says which fabric's runs it belongs in
REGISTRY = Registry("reference line", {line.name: (line.implementation, line.about)
                                        for line in catalogue.of_kind("reference")})


def reference_lines(fabric_name: str, fabric_transport: str = "auto",
                    timeout_s: float = 120.0) -> list[ReferenceLine]:
    """The reference lines of a ``bench micro`` run over fabric backend ``fabric_name`` (those of its fabric and
    those of every run), in order; ValueError for a fabric without lines of its own."""
    classes = [REGISTRY.load(name) for name in REGISTRY]
    if not any(cls.fabric == fabric_name for cls in classes):
        known = sorted({cls.fabric for cls in classes if cls.fabric})
        raise ValueError(f"no reference lines for fabric '{fabric_name}' (known: {', '.join(known)})")
    return [cls(fabric_transport=fabric_transport, timeout_s=timeout_s) for cls in classes
            if cls.fabric in (None, fabric_name)]


# ---------------------------------------------------------------------------------------------


def _count(value: int, what: str, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{what}({size}) gave {value!r}; it must be a positive integer")
    return int(value)


def _record(name: str, size: int, warmup: int, iters: int, *, p50_us: float, p99_us: float, mean_us: float,
            min_us: float, max_us: float, throughput_MBps: float, sender_cpu_s: float, receiver_cpu_s: float,
            copied_bytes: int, fabric: str) -> MicroRecord:
    """A ``micro`` record of a reference line; what a line does not measure is NaN."""
    return MicroRecord(
        transport=name, size_bytes=size, dtype="uint8", warmup=warmup, iters=iters, p50_us=p50_us, p99_us=p99_us,
        mean_us=mean_us, min_us=min_us, max_us=max_us, throughput_MBps=throughput_MBps, sender_cpu_s=sender_cpu_s,
        receiver_cpu_s=receiver_cpu_s, sender_cpu_us_per_transfer=sender_cpu_s / iters * 1e6,
        receiver_cpu_us_per_transfer=receiver_cpu_s / iters * 1e6, copied_bytes_per_transfer=copied_bytes,
        fabric=fabric)
