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

- ``memcpy``: one ``np.copyto`` of the tensor in one process, the cost of a single copy.

For both perftest lines the CPU columns are empty (both processes busy-poll for their whole
life, not only the timed loop) and no payload is copied in user space. All return records
with the columns of ``bench.micro.make_record``, in the same order, so they can go into the
same ``records.csv``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from transports.fabric.ucx.device import FABRIC_TRANSPORTS, UCX_HOME_VARIABLE

PERFTEST_TEST = "ucp_put_bw"
PERFTEST_LATENCY_TEST = "ucp_put_lat"
#: the record names of the two perftest lines, by test
PERFTEST_LINES = {PERFTEST_TEST: "ucx_perftest", PERFTEST_LATENCY_TEST: "ucx_perftest_lat"}
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


def ucx_home() -> Path:
    """The UCX install the fabric uses: ``$TENSOR_BENCH_UCX_HOME``, else the libucx-cu12 wheel."""
    if os.environ.get(UCX_HOME_VARIABLE):
        return Path(os.environ[UCX_HOME_VARIABLE])
    try:
        import libucx  # the PyPI wheel libucx-cu12
    except ImportError:
        raise ReferenceUnavailable(
            "ucx_perftest: the libucx-cu12 wheel is not installed; install it with 'pip install -e .' "
            f"(or set {UCX_HOME_VARIABLE} to a UCX install that has bin/ucx_perftest)"
        ) from None
    return Path(libucx.__file__).parent


def perftest_binary() -> Path:
    """Path of the ``ucx_perftest`` executable (it may not exist; the runner checks)."""
    return ucx_home() / "bin" / "ucx_perftest"


def perftest_environment(fabric_transport: str) -> dict[str, str]:
    """Environment for ucx_perftest on the UCX transports behind ``fabric_transport``."""
    if fabric_transport not in FABRIC_TRANSPORTS:
        raise ValueError(f"unknown fabric transport '{fabric_transport}' (known: {', '.join(FABRIC_TRANSPORTS)})")
    env = dict(os.environ)
    # The wheel's binaries carry no RPATH to its lib/: without this they fail to load libucp.so.0.
    lib = str(perftest_binary().parent.parent / "lib")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    tls = FABRIC_TRANSPORTS[fabric_transport]
    if tls:
        env["UCX_TLS"] = tls
    # "auto" leaves UCX_TLS alone (unset, or the user's own), as the fabric does.
    return env


def fabric_label(env: dict[str, str]) -> str:
    """``ucx:<UCX_TLS>``, or ``ucx:auto`` when UCX chooses."""
    return f"ucx:{env.get('UCX_TLS') or 'auto'}"


def ucx_perftest_records(sizes: list[int], fabric_transport: str, iters_for: Callable[[int], int],
                         timeout_s: float = 120, *, warmup_for: Callable[[int], int] | None = None,
                         test: str = PERFTEST_TEST) -> list[dict[str, Any]]:
    """Run ``ucx_perftest -t <test>`` once per size over loopback; one record per size.

    ``test`` is ``ucp_put_bw`` (the ``ucx_perftest`` line) or ``ucp_put_lat`` (the
    ``ucx_perftest_lat`` line, measured only at the sizes up to :data:`LATENCY_MAX_SIZE`; the
    others are skipped). The module docstring says what each column of each line means.
    ``fabric_transport`` is ``auto``, ``shm`` or ``tcp`` (UCX_TLS unset / ``shm`` / ``tcp``).
    ``iters_for(size)`` gives the timed puts (bandwidth) or round trips (latency) per size,
    ``warmup_for(size)`` the untimed ones (default: a tenth of the timed ones, 1 to 10).
    ``timeout_s`` bounds each size's run; on timeout both processes are killed. Raises
    ReferenceUnavailable if ucx_perftest cannot run.
    """
    if test not in PERFTEST_LINES:
        raise ValueError(f"unknown perftest test '{test}' (known: {', '.join(PERFTEST_LINES)})")
    if test == PERFTEST_LATENCY_TEST:
        sizes = [size for size in sizes if size <= LATENCY_MAX_SIZE]
    if not sizes:
        return []
    binary = perftest_binary()
    if not binary.is_file():
        raise ReferenceUnavailable(
            f"ucx_perftest not found at {binary}: it ships with the libucx-cu12 wheel; reinstall it with "
            f"'pip install --force-reinstall libucx-cu12' (or point {UCX_HOME_VARIABLE} at a UCX install "
            "that has bin/ucx_perftest)"
        )
    if not os.access(binary, os.X_OK):
        raise ReferenceUnavailable(f"ucx_perftest at {binary} is not executable; fix with 'chmod +x {binary}'")
    env = perftest_environment(fabric_transport)
    records = []
    with private_network() as enter:
        for size in sizes:
            iters = _count(iters_for(size), "iters_for", size)
            warmup = _count(warmup_for(size), "warmup_for", size) if warmup_for else max(1, min(10, iters // 10))
            result = run_perftest(binary, env, size, iters, warmup, timeout_s, enter, test=test,
                                  cpus=_cpu_pair() if test == PERFTEST_LATENCY_TEST else None)
            records.append(perftest_record(result, size, warmup, iters, fabric_label(env)))
    return records


@contextlib.contextmanager
def private_network():
    """A network namespace of its own with only loopback up; yields the command prefix that enters it.

    ucx_perftest's server listens on every interface and has no option to bind one, and its UCX
    opens listeners of its own: in a namespace whose only interface is loopback, nothing of it is
    reachable from the network. Shared memory and cma work across network namespaces. Needs root
    and iproute2; without them the reference line is not run (one line says why).
    """
    ip = shutil.which("ip")
    if os.geteuid() != 0 or ip is None:
        raise ReferenceUnavailable(
            "ucx_perftest listens on every interface (it has no bind option), so it runs only inside a private "
            "network namespace, which needs root and iproute2 ('ip'); run as root or pass --no-references"
        )
    name = f"tt-perftest-{os.getpid()}-{secrets.token_hex(3)}"
    made = subprocess.run([ip, "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        raise ReferenceUnavailable(
            f"cannot make a private network namespace for ucx_perftest ({made.stderr.strip() or made.returncode}); "
            "pass --no-references"
        )
    try:
        subprocess.run([ip, "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True)
        yield [ip, "netns", "exec", name]
    finally:
        subprocess.run([ip, "netns", "delete", name], capture_output=True)


def perftest_record(result: PerftestResult, size: int, warmup: int, iters: int, fabric: str) -> dict[str, Any]:
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
                 timeout_s: float, enter: list[str], *, test: str = PERFTEST_TEST,
                 cpus: tuple[int, int] | None = None) -> PerftestResult:
    """One ucx_perftest server and client pair running ``test``, both through ``enter`` (see
    :func:`private_network`); ``cpus``: the CPU the server and the one the client are pinned to
    (``ucx_perftest -c``)."""
    port = _PERFTEST_PORT
    server_pin, client_pin = (["-c", str(cpus[0])], ["-c", str(cpus[1])]) if cpus else ([], [])
    with tempfile.TemporaryFile("w+") as server_out, tempfile.TemporaryFile("w+") as client_out:
        server = client = None
        try:
            server = _spawn([*enter, str(binary), "-p", str(port), *server_pin], env, server_out)
            deadline = time.monotonic() + timeout_s
            if not _wait_listening(server, port, min(_LISTEN_TIMEOUT_S, timeout_s)):
                if server.poll() is None:
                    raise ReferenceUnavailable(
                        f"ucx_perftest server did not listen on port {port} within "
                        f"{min(_LISTEN_TIMEOUT_S, timeout_s):.0f} s{_tail(server_out)}"
                    )
                raise _failed("server", server.returncode, server_out, binary, env)
            command = [*enter, str(binary), "127.0.0.1", "-p", str(port), "-t", test,
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
                raise _failed("client", client.returncode, client_out, binary, env, server_out, test=test)
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
                f"ucx_perftest's MB/s is not 2^20 bytes/s here ({implied_mb:.0f} bytes); update bench/reference.py"
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


def _spawn(command: list[str], env: dict[str, str], out: IO[str]) -> subprocess.Popen:
    try:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    except OSError as exc:
        raise ReferenceUnavailable(
            f"cannot start {command[0]}: {exc}; reinstall the libucx-cu12 wheel ('pip install --force-reinstall "
            "libucx-cu12')"
        ) from None


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
            other: IO[str] | None = None, *, test: str = PERFTEST_TEST) -> ReferenceUnavailable:
    text = _read(out) + (_read(other) if other is not None else "")
    if "error while loading shared libraries" in text:
        hint = (f"its libraries are not found; set LD_LIBRARY_PATH to the UCX lib directory "
                f"({binary.parent.parent / 'lib'})")
    else:
        tls = f"UCX_TLS={env['UCX_TLS']} " if env.get("UCX_TLS") else ""
        setup = f"{tls}LD_LIBRARY_PATH={binary.parent.parent / 'lib'}"
        hint = (f"run '{setup} {binary} -p 13337' and '{setup} {binary} 127.0.0.1 -p 13337 -t {test}' "
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


# ---------------------------------------------------------------------------------------------
# memcpy


def memcpy_records(sizes: list[int], iters_for: Callable[[int], int]) -> list[dict[str, Any]]:
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
        micros = samples / 1e3
        mean_us = float(micros.mean())
        records.append(_record(
            "memcpy", size, 1, iters,
            p50_us=float(np.percentile(micros, 50)), p99_us=float(np.percentile(micros, 99)), mean_us=mean_us,
            min_us=float(micros.min()), max_us=float(micros.max()),
            throughput_MBps=size / 2**20 / (mean_us / 1e6) if mean_us > 0 else math.inf,
            sender_cpu_s=cpu_s, receiver_cpu_s=0.0, copied_bytes=size, fabric="none",
        ))
    return records


# ---------------------------------------------------------------------------------------------


def _count(value: int, what: str, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{what}({size}) gave {value!r}; it must be a positive integer")
    return int(value)


def _record(name: str, size: int, warmup: int, iters: int, *, p50_us: float, p99_us: float, mean_us: float,
            min_us: float, max_us: float, throughput_MBps: float, sender_cpu_s: float, receiver_cpu_s: float,
            copied_bytes: int, fabric: str) -> dict[str, Any]:
    """A ``micro`` row (``bench.results.COLUMNS``); columns a reference line has no value for are left out."""
    return {
        "transport": name,
        "size_bytes": size,
        "dtype": "uint8",
        "warmup": warmup,
        "iters": iters,
        "p50_us": p50_us,
        "p99_us": p99_us,
        "mean_us": mean_us,
        "min_us": min_us,
        "max_us": max_us,
        "throughput_MBps": throughput_MBps,
        "sender_cpu_s": sender_cpu_s,
        "receiver_cpu_s": receiver_cpu_s,
        "sender_cpu_us_per_transfer": sender_cpu_s / iters * 1e6,
        "receiver_cpu_us_per_transfer": receiver_cpu_s / iters * 1e6,
        "copied_bytes_per_transfer": copied_bytes,
        "fabric": fabric,
    }
