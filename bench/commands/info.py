"""Versions of the software underneath, the transports, the fabric backends (with what UCX offers here) and the
launchers, and for each whether it can run on this machine and, if not, why."""

from __future__ import annotations

import argparse
import os
import sys

import transports
from bench.results import package_versions

HELP = "versions, transports, fabrics and launchers: whether each can run here"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    print("bench: tensor transport benchmarks")
    print("\nversions:")
    for name, version in package_versions().items():
        print(f"  {name:24} {version}")
    print("\ntransports:")
    for name in transports.names():
        status = transports.availability(name)
        print(f"  {name:10} {'available' if status.ok else 'not available: ' + status.reason}")
    print("\nfabric:")
    for line in _fabric_info():
        print(f"  {line}")
    print("\nlaunchers (--launcher):")
    for name, status in _launcher_info().items():
        print(f"  {name:6} {status}")
    return 0


def _launcher_info() -> dict[str, str]:
    """Whether each launcher can run here, without starting anything (MPI is not initialised)."""
    import importlib.util
    import shutil

    from bench.launch import LAUNCHERS
    from bench.launch.hosts import NetnsUnavailable, check_support

    status = dict.fromkeys(LAUNCHERS, "available")
    try:
        check_support()
    except NetnsUnavailable as exc:
        status["netns"] = f"not available: {exc}"
    if importlib.util.find_spec("mpi4py") is None:
        status["mpi"] = "not available: mpi4py is not installed (pip install -e '.[mpi]')"
    else:
        mpirun = shutil.which("mpirun", path=os.pathsep.join([os.path.dirname(sys.executable),
                                                              os.environ.get("PATH", "")]))
        status["mpi"] = f"available (mpirun: {mpirun or 'not on PATH; srun or a system mpirun will do'})"
    return status


def _fabric_info() -> list[str]:
    """Each fabric backend: whether it can run here and why not, its --fabric-transport choices, and for
    one that runs what it offers (UCX: the transports and devices of ``ucx_info -d``)."""
    import re
    import subprocess

    from transports import fabric
    from transports.fabric.base import FabricError

    lines = []
    for name in fabric.names():
        status = fabric.availability(name)
        if not status.ok:
            lines.append(f"{name:6} not available: {status.reason}")
            continue
        backend = fabric.backend(name)
        lines.append(f"{name:6} available (--fabric {name}; --fabric-transport {'|'.join(backend.fabric_transports)})")
        if "ucx_info" not in backend.reference_tools:
            continue
        try:
            tool = backend.tool("ucx_info")
            info = subprocess.run([str(tool.path), "-v"], capture_output=True, text=True, timeout=30,
                                  env=tool.environment)
            version = re.search(r"version:?\s*([\w.]+)", info.stdout)
            lines.append(f"       ucx {version.group(1)}" if version else "")
            info = subprocess.run([str(tool.path), "-d"], capture_output=True, text=True, timeout=30,
                                  env=tool.environment)
        except (OSError, subprocess.SubprocessError, FabricError) as exc:
            lines.append(f"       ucx_info could not run: {exc}")
            continue
        offered: dict[str, list[str]] = {}
        transport = None
        for line in info.stdout.splitlines():
            words = line.strip("# ").split(":", 1)
            if len(words) == 2 and words[0].strip() == "Transport":
                transport = words[1].strip()
            elif len(words) == 2 and words[0].strip() == "Device" and transport:
                offered.setdefault(transport, []).append(words[1].strip())
        lines += [f"       ucx transport {carrier:8} devices: {', '.join(devices)}"
                  for carrier, devices in offered.items()]
    return [line for line in lines if line]
