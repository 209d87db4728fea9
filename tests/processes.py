"""What the tests count about processes: their children, whether they ended, the sockets of this one.

Only the processes a test started (found by parent) and this process's own descriptors are
counted, never system-wide totals another process can change.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
from pathlib import Path

import pytest


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, ppid, ..."""
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def children_of(parent: int) -> dict[int, list[str]]:
    """The processes whose parent is ``parent``: pid -> argv."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat_fields(entry.name)[1]) == parent:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
    return found


def rank_processes(parent: int) -> dict[int, int]:
    """The rank processes (``python -m bench.launch.rank HUB RANK ...``) started by ``parent``: pid -> rank."""
    return {pid: int(argv[argv.index("bench.launch.rank") + 2])
            for pid, argv in children_of(parent).items() if "bench.launch.rank" in argv}


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie has ended)."""
    try:
        return _stat_fields(pid)[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):  # reaped before, or between open and read
        return True


def open_files() -> dict[str, str]:
    """This process's file descriptors: fd -> what it refers to."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return found


def open_sockets() -> set[str]:
    """The sockets (``socket:[INODE]``) this process holds."""
    return {target for target in open_files().values() if target.startswith("socket:")}


def held_resources() -> tuple[int, int, int]:
    """What this process holds: mappings of shared files (/dev/shm, memfd), of SysV segments, and fds.

    Only this process's own resources count (its /proc/self/maps and fds): system-wide totals of
    /dev/shm or /proc/sysvipc change whenever another process on the machine makes some.
    """
    shm_maps, sysv_maps = set(), set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) > 5 else ""
            if path.startswith("/SYSV"):
                sysv_maps.add((fields[4], path))  # one per attached segment, however many areas
            elif path.startswith(("/dev/shm/", "/memfd:")):
                shm_maps.add((fields[4], path))
    return len(shm_maps), len(sysv_maps), len(os.listdir("/proc/self/fd"))


def open_fds() -> dict[int, str]:
    """This process's open file descriptors and what each is (a path, ``socket:[inode]``, ``anon_inode:...``)."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return fds


@contextlib.contextmanager
def no_cyclic_collector():
    """Whatever stays alive in here is referenced, not merely waiting for the cyclic collector (run once first)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def unprivileged() -> list[str]:
    """A command prefix under which file permissions hold: none for a user; for root, setpriv without the
    capabilities that override them (skipped where that cannot be had)."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]
    if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("root here, and setpriv cannot drop the capabilities that override file permissions")
    return prefix
