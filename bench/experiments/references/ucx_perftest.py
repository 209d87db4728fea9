"""UCX's own tests, run by the ``ucx_perftest`` of the fabric's UCX: two reference lines.

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

With ``--memory cuda`` both lines put from and into device memory (``ucx_perftest -m cuda``, each side's kind;
the device chosen with ``CUDA_VISIBLE_DEVICES``, UCX's CUDA transports added to a ``UCX_TLS`` the fabric set):
the references the GPU targets are set against.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, ClassVar

from bench.experiments.micro import Point
from bench.experiments.references import running
from bench.experiments.references.lines import PerftestLine
from bench.experiments.references.running import LATENCY_MAX_SIZE, NAN, ReferenceUnavailable
from bench.results import MicroRecord
from bench.results import lines as catalogue
from transports.memory import HOST, Memory

PERFTEST_TEST = "ucp_put_bw"
PERFTEST_LATENCY_TEST = "ucp_put_lat"
#: the latency line of ucx_perftest (its bandwidth line is the catalogue's bandwidth reference of the ucx fabric)
PERFTEST_LATENCY_LINE = "ucx_perftest_lat"
#: the record names of the two perftest lines, by test
PERFTEST_LINES = {PERFTEST_TEST: catalogue.bandwidth_reference("ucx"), PERFTEST_LATENCY_TEST: PERFTEST_LATENCY_LINE}
#: the perftest's out-of-band port, inside its own network namespace (where nothing else listens)
_PERFTEST_PORT = 13337


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


def fabric_label(env: dict[str, str]) -> str:
    """``ucx:<UCX_TLS>``, or ``ucx:auto`` when UCX chooses."""
    return f"ucx:{env.get('UCX_TLS') or 'auto'}"


def memory_arguments(memory: tuple[Memory, Memory], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """What ``ucx_perftest`` needs to put between ``memory`` (the sender's, the receiver's): its ``-m`` option, and
    its environment with the device chosen and UCX's CUDA transports allowed (host memory: nothing changes).
    ReferenceUnavailable for two different devices (one perftest process holds both sides' buffers)."""
    if not any(side.is_device for side in memory):
        return [], env
    devices = {side.device for side in memory if side.is_device}
    if len(devices) > 1:
        raise ReferenceUnavailable(f"ucx_perftest puts between buffers of one device, not {memory[0]} and "
                                   f"{memory[1]}")
    device = devices.pop()
    # device N is the Nth this process sees: where CUDA_VISIBLE_DEVICES chose those already (an index, a UUID, a MIG
    # instance), the child is shown the same one, not the machine's device N
    visible = [name.strip() for name in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if name.strip()]
    if visible and device >= len(visible):
        raise ReferenceUnavailable(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} shows {len(visible)} "
                                   f"device(s): there is no cuda:{device}")
    env = {**env, "CUDA_VISIBLE_DEVICES": visible[device] if visible else str(device)}
    if env.get("UCX_TLS"):
        env["UCX_TLS"] = f"{env['UCX_TLS']},cuda_copy,cuda_ipc"
    return ["-m", ",".join(side.kind for side in memory)], env


def ucx_perftest_records(sizes: list[int], fabric_transport: str, iters_for: Callable[[int], int],
                         timeout_s: float = 120, *, warmup_for: Callable[[int], int] | None = None,
                         test: str = PERFTEST_TEST, port: int = _PERFTEST_PORT,
                         memory: tuple[Memory, Memory] = (HOST, HOST)) -> list[MicroRecord]:
    """Run ``ucx_perftest -t <test>`` once per size, server and client in this process's network namespace
    (the line's rank runs it in a private one: :class:`UcxPerftest`); one record per size.

    ``test`` is ``ucp_put_bw`` (the ``ucx_perftest`` line) or ``ucp_put_lat`` (the
    ``ucx_perftest_lat`` line, measured only at the sizes up to :data:`LATENCY_MAX_SIZE`; the
    others are skipped). The module docstring says what each column of each line means.
    ``fabric_transport`` is ``auto``, ``shm`` or ``tcp`` (UCX_TLS unset / ``shm`` / ``tcp``).
    ``iters_for(size)`` gives the timed puts (bandwidth) or round trips (latency) per size,
    ``warmup_for(size)`` the untimed ones (default: a tenth of the timed ones, 1 to 10).
    ``timeout_s`` bounds each size's run; on timeout both processes are killed. The server listens on
    ``port``. ``memory``: the sender's and the receiver's (:func:`memory_arguments`). Raises ReferenceUnavailable
    if ucx_perftest cannot run.
    """
    if test not in PERFTEST_LINES:
        raise ValueError(f"unknown perftest test '{test}' (known: {', '.join(PERFTEST_LINES)})")
    if test == PERFTEST_LATENCY_TEST:
        sizes = [size for size in sizes if size <= LATENCY_MAX_SIZE]
    if not sizes:
        return []
    tool = running.tool("ucx", "ucx_perftest", fabric_transport)
    binary = tool.path
    placed, env = memory_arguments(memory, tool.environment)
    records = []
    for size in sizes:
        iters = running.count(iters_for(size), "iters_for", size)
        warmup = running.count(warmup_for(size), "warmup_for", size) if warmup_for else max(1, min(10, iters // 10))
        result = run_perftest(binary, env, size, iters, warmup, timeout_s, port, test=test,
                              cpus=running.cpu_pair() if test == PERFTEST_LATENCY_TEST else None, placed=placed)
        records.append(perftest_record(result, size, warmup, iters, fabric_label(env), memory))
    return records


def perftest_record(result: PerftestResult, size: int, warmup: int, iters: int, fabric: str,
                    memory: tuple[Memory, Memory] = (HOST, HOST)) -> MicroRecord:
    """The ``micro`` record of one perftest result: ``ucx_perftest`` for a bandwidth test,
    ``ucx_perftest_lat`` for a latency test (the module docstring says what each column means)."""
    time_us = result.time_us
    if result.kind == "latency":
        name, p50_us = PERFTEST_LINES[PERFTEST_LATENCY_TEST], result.percentile_us
    else:
        # A pipelined stream has a time per put (size / bandwidth) but no per-put distribution.
        name, p50_us = PERFTEST_LINES[PERFTEST_TEST], NAN
    return running.record(
        name, size, warmup, iters,
        p50_us=p50_us, p99_us=NAN, mean_us=time_us, min_us=NAN, max_us=NAN,
        throughput_MBps=result.bandwidth_MBps,
        # Both sides busy-poll for the whole process life, not only the timed loop: not comparable.
        sender_cpu_s=NAN, receiver_cpu_s=NAN,
        copied_bytes=0, fabric=fabric, memory=memory,
    )


def run_perftest(binary: Path, env: dict[str, str], size: int, iters: int, warmup: int,
                 timeout_s: float, port: int = _PERFTEST_PORT, *, test: str = PERFTEST_TEST,
                 cpus: tuple[int, int] | None = None, placed: list[str] | None = None) -> PerftestResult:
    """One ucx_perftest server (on ``port``) and client pair running ``test`` in this network namespace;
    ``cpus``: the CPU the server and the one the client are pinned to (``ucx_perftest -c``); ``placed``: the
    client's memory option (:func:`memory_arguments`)."""
    server_pin, client_pin = (["-c", str(cpus[0])], ["-c", str(cpus[1])]) if cpus else ([], [])
    with tempfile.TemporaryFile("w+") as server_out, tempfile.TemporaryFile("w+") as client_out:
        server = client = None
        try:
            server = running.spawn([str(binary), "-p", str(port), *server_pin], env, server_out)
            deadline = time.monotonic() + timeout_s
            # a server that lives may start slowly on a busy machine: the size's whole timeout bounds it
            if not running.wait_listening(server, port, timeout_s):
                if server.poll() is None:
                    raise ReferenceUnavailable(
                        f"ucx_perftest server did not listen on port {port} within {timeout_s:.0f} s "
                        f"(raise --timeout){running.tail(server_out)}"
                    )
                raise _failed("server", server.returncode, server_out, binary, env, port=port)
            command = [str(binary), "127.0.0.1", "-p", str(port), "-t", test,
                       "-s", str(size), "-n", str(iters), "-w", str(warmup), *(placed or []), *client_pin]
            client = running.spawn(command, env, client_out)
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
                server.wait(timeout=running.SERVER_EXIT_TIMEOUT_S)
            result = parse_perftest_output(running.read(client_out), size)
            expected = "latency" if test == PERFTEST_LATENCY_TEST else "bandwidth"
            if result.kind != expected:
                raise ReferenceUnavailable(f"ucx_perftest -t {test} printed a {result.kind} table, expected "
                                           f"{expected}{running.tail(client_out)}")
            return result
        finally:
            for proc in (client, server):
                running.reap(proc)


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
        raise ReferenceUnavailable(f"ucx_perftest printed no results table{running.tail_text(text)}")
    kind = "latency" if "latency (usec)" in text else "bandwidth"
    rank = re.search(r"\|\s*([\d.]+)%ile\s*\|", text)
    rows = [line for line in text.splitlines() if line.startswith("Final:")]
    if not rows:  # no Final row: fall back to the last progress row of the table
        rows = [line for line in text.splitlines() if re.match(r"^(\[thread \d+\])?\s*\d+\s+[\d.]+\s", line)]
    if not rows:
        raise ReferenceUnavailable(f"ucx_perftest printed no result row{running.tail_text(text)}")
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
                f"update bench/experiments/references/ucx_perftest.py"
            )
    return result


def _failed(role: str, code: int | None, out: IO[str], binary: Path, env: dict[str, str],
            other: IO[str] | None = None, *, test: str = PERFTEST_TEST,
            port: int = _PERFTEST_PORT) -> ReferenceUnavailable:
    text = running.read(out) + (running.read(other) if other is not None else "")
    if "error while loading shared libraries" in text:
        hint = (f"its libraries are not found; set LD_LIBRARY_PATH to the UCX lib directory "
                f"({binary.parent.parent / 'lib'})")
    else:
        tls = f"UCX_TLS={env['UCX_TLS']} " if env.get("UCX_TLS") else ""
        setup = f"{tls}LD_LIBRARY_PATH={binary.parent.parent / 'lib'}"
        hint = (f"run '{setup} {binary} -p {port}' and '{setup} {binary} 127.0.0.1 -p {port} -t {test}' "
                "by hand to see why, or try another --fabric-transport")
    return ReferenceUnavailable(f"ucx_perftest {role} failed (exit code {code}): {hint}{running.tail_text(text)}")


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
                                        test=self.test, port=port,
                                        memory=(point.sender_memory, point.receiver_memory))
        return record

    def memory_problem(self, memory: tuple[Memory, Memory]) -> str | None:
        return None  # ucx_perftest -m: host, cuda (memory_arguments)


@dataclass
class UcxPerftestLatency(UcxPerftest):
    """UCX's put latency, ``ucx_perftest -t ucp_put_lat``, up to 1 MiB."""

    name: str = "ucx_perftest_lat"
    test: ClassVar[str] = PERFTEST_LATENCY_TEST
    latency: ClassVar[bool] = True
    bandwidth_reference: ClassVar[bool] = False
