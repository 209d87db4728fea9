"""Versions of the software underneath, the transports, the fabric backends (with what UCX offers here), the RDMA
devices (ports, states, GIDs) and which fabric reaches them, the GPUs (driver, CUDA runtime, UCX's CUDA transports,
cuda_ipc between two processes, GPUDirect RDMA's prerequisites), and the launchers, and for each whether it can run on
this machine and, if not, why."""

from __future__ import annotations

import argparse

import transports
from bench.results import package_versions
from transports.common import Availability

HELP = "versions, transports, fabrics, RDMA devices, GPUs and launchers: whether each can run here"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench info', 'versions, and whether each transport, fabric, launcher and peer line can run here'),
)


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
        print(f"  {name:10} {status.line()}")
    print("\nfabric:")
    for line in _fabric_info():
        print(f"  {line}")
    print("\nRDMA devices:")
    for line in _rdma_info():
        print(f"  {line}")
    print("\nGPUs (bench micro --memory cuda):")
    for line in _gpu_info():
        print(f"  {line}")
    print("\nlaunchers (--launcher):")
    for name, status in _launcher_info().items():
        print(f"  {name:6} {status.line()}")
    print("\npeer lines of bench micro (--peers):")
    from bench.experiments.peers import peer_lines

    for line in peer_lines():
        print(f"  {line.name:8} {line.availability().line()}")
    return 0


def _gpu_info() -> list[str]:
    """The GPUs, the driver's and CuPy's CUDA, UCX's CUDA transports, whether cuda_ipc works between two processes
    here, and GPUDirect RDMA's prerequisites (``bench.experiments.gpus``)."""
    from bench.experiments.doctor import ucx_library
    from bench.experiments.gpus import describe, gpu_facts
    from transports import fabric
    from transports.fabric.rdma_devices import active_ports, read_devices, sysfs_root

    ports = [port.name for port in active_ports(read_devices(sysfs_root()))]
    library = ucx_library(fabric.backend("ucx")) if fabric.availability("ucx").ok else None
    transports_listed = library.transports if library is not None and library.error is None else {}
    has_verbs = library is not None and library.error is None and "--without-verbs" not in library.without
    return describe(gpu_facts(ports, transports_listed, has_verbs))


def _launcher_info() -> dict[str, Availability]:
    """Whether each launcher can run here, without starting anything (MPI is not initialised)."""
    from bench.launch import REGISTRY

    return {name: REGISTRY.load(name).availability() for name in REGISTRY}


def _fabric_info() -> list[str]:
    """Each fabric backend: whether it can run here and why not, its --fabric-transport choices, and for
    one that runs what it offers (UCX: the version and the transports and devices of ``ucx_info -d``)."""
    from bench.experiments.doctor import ucx_library
    from transports import fabric

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
        library = ucx_library(backend)
        if library.error is not None:
            lines.append(f"       ucx_info could not run: {library.error}")
            continue
        if library.version:
            lines.append(f"       ucx {library.version} ({library.origin})")
        lines += [f"       ucx transport {carrier:8} devices: {', '.join(devices)}"
                  + (f" (never used by the fabric: {backend.never_used[carrier]})"
                     if carrier in backend.never_used else "")
                  for carrier, devices in library.transports.items()]
    return lines


def _rdma_info() -> list[str]:
    """The RDMA devices sysfs shows, their ports and GIDs, and per fabric backend which of its links reach the
    active ports (or why there is no device at all)."""
    from bench.experiments.doctor import describe_devices
    from transports import fabric
    from transports.fabric.rdma_devices import active_ports, missing_reason, read_devices, sysfs_root

    root = sysfs_root()
    if (missing := missing_reason(root)) is not None:
        return [f"none: {missing}"]
    devices = read_devices(root)
    lines = describe_devices(devices)
    ports = [port.name for port in active_ports(devices)]
    if not ports:
        return [*lines, "no port is ACTIVE: no fabric can use them ('bench doctor' says why and the fix)"]
    for name in fabric.names():
        status = fabric.availability(name)
        if not status.ok:
            lines.append(f"--fabric {name:6} cannot use them: {status.reason}")
            continue
        reach = fabric.backend(name).rdma_reach(ports)
        lines.append(f"--fabric {name:6} " + (f"reaches them over {', '.join(reach)}" if reach else
                                              f"reaches none of {', '.join(ports)} ('bench doctor --fabric {name}' "
                                              "says why and the fix)"))
    return lines
