"""What running a reference tool takes, written once for every tool: the sizes a latency test stops at, starting
and reaping its processes, waiting for a server to listen, its output's tail in an error, the tool's program from
its fabric backend, and a ``micro`` record of what it measured (NaN for what it does not measure).

The tools' modules call these through the module (``running.spawn``), so that a test can stand in for one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import IO

import numpy as np

from bench.results import MicroRecord
from transports import fabric
from transports.fabric.base import FabricError, Tool
from transports.memory import HOST, Memory

#: the latency reference runs up to this size (bytes): beyond it a send/receive is a bandwidth question
LATENCY_MAX_SIZE = 1 << 20
#: seconds the server may take to exit once its client is done
SERVER_EXIT_TIMEOUT_S = 10.0
NAN = float("nan")


class ReferenceUnavailable(RuntimeError):
    """A reference line cannot be measured here; the message names the problem and the fix."""


def cpu_pair() -> tuple[int, int] | None:
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


UCX_REINSTALL = "reinstall the libucx-cu12 wheel ('pip install --force-reinstall libucx-cu12')"


def spawn(command: list[str], env: dict[str, str], out: IO[str], fix: str = UCX_REINSTALL) -> subprocess.Popen:
    try:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    except OSError as exc:
        raise ReferenceUnavailable(f"cannot start {command[0]}: {exc}; {fix}") from None


def reap(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state): nothing more to do
        proc.wait(timeout=10)


def wait_listening(server: subprocess.Popen, port: int, timeout_s: float) -> bool:
    """Whether the server listens on ``port`` before it exits or ``timeout_s`` passes.

    The server's "Waiting for connection..." sits in its stdio buffer while stdout is not a
    terminal, and probing with a connect would take its one connection: so read the kernel's
    socket table.
    """
    deadline = time.monotonic() + timeout_s
    while server.poll() is None:
        state = listening(port, server.pid)
        if state is None:  # no /proc/net/tcp: give it a moment and hope
            time.sleep(0.5)
            return server.poll() is None
        if state:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return False


def listening(port: int, pid: int) -> bool | None:
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


def read(out: IO[str]) -> str:
    out.flush()
    out.seek(0)
    return out.read()


def tail(out: IO[str]) -> str:
    return tail_text(read(out))


def tail_text(text: str, lines: int = 6) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return ("; it printed:\n  " + "\n  ".join(kept)) if kept else ""


def tool(fabric_name: str, name: str, fabric_transport: str) -> Tool:
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


def count(value: int, what: str, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{what}({size}) gave {value!r}; it must be a positive integer")
    return int(value)


def record(name: str, size: int, warmup: int, iters: int, *, p50_us: float, p99_us: float, mean_us: float,
            min_us: float, max_us: float, throughput_MBps: float, sender_cpu_s: float, receiver_cpu_s: float,
            copied_bytes: int, fabric: str, memory: tuple[Memory, Memory] = (HOST, HOST), source: str = "reused",
            source_writes: int | None = None, source_write_lead_min_us: float | None = None) -> MicroRecord:
    """A ``micro`` record of a reference line (over ``memory``: the sender's, the receiver's); what a line does not
    measure is NaN. ``source`` and its columns (``bench.experiments.micro.sources.source_columns``) are a line's
    whose loop is ours; a tool with a loop of its own (``ucx_perftest``, perftest's) reuses its buffer."""
    return MicroRecord(
        transport=name, size_bytes=size, dtype="uint8", warmup=warmup, iters=iters, p50_us=p50_us, p99_us=p99_us,
        mean_us=mean_us, min_us=min_us, max_us=max_us, throughput_MBps=throughput_MBps, sender_cpu_s=sender_cpu_s,
        receiver_cpu_s=receiver_cpu_s, sender_cpu_us_per_transfer=sender_cpu_s / iters * 1e6,
        receiver_cpu_us_per_transfer=receiver_cpu_s / iters * 1e6, copied_bytes_per_transfer=copied_bytes,
        fabric=fabric, sender_memory=str(memory[0]), receiver_memory=str(memory[1]), source=source,
        source_writes=source_writes, source_write_lead_min_us=source_write_lead_min_us)
