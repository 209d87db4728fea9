"""Busy processes beside a measurement: ``bench micro --contend N`` measures every point again with them.

Each is a Python interpreter spinning in a loop (what another job on a shared machine does to a latency),
started before the measurement and killed after it, whatever happened in between; they never outlive the
command (each also ends when its parent does: it checks every few milliseconds whether it was orphaned).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

#: the loop each busy process runs: spin, and end once the process that started it is gone
_SPIN = """
import os, sys, time
parent = int(sys.argv[1])  # passed, not read: the parent may be gone before this line runs
while True:
    deadline = time.monotonic() + 0.005
    while time.monotonic() < deadline:
        pass
    if os.getppid() != parent:
        break
"""


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` processes, each spinning on a core for as long as the ``with`` block lasts."""
    started: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            started.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid())], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield started
    finally:
        for process in started:
            process.kill()
        for process in started:
            process.wait()
