"""What this machine offers device memory (``bench info``'s GPU section, ``bench doctor``'s GPU checks): the GPUs and
the driver's CUDA version (asked of the driver itself), the CUDA runtime of CuPy, UCX's CUDA transports, whether
``cuda_ipc`` works between two processes here (tried: one process exports a device buffer, another maps it and
reads it), and GPUDirect RDMA's prerequisites (an active RDMA port, ``nvidia_peermem`` or dma-buf, a UCX with
verbs), each found or missing with the fix.

Nothing here needs a GPU: without one every line says so, and ``bench micro --memory cuda`` is refused with the
same reason (``transports.memory.cuda_problem``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from transports import fabric
from transports.memory import Driver, Memory, array_module, driver, extra_hint
from transports.tensors import allocation

#: what the second process of the cuda_ipc probe runs: map the exported buffer, read its first word back
_IPC_READER = """
import sys, numpy, cupy
handle = bytes.fromhex(sys.argv[1])
pointer = cupy.cuda.runtime.ipcOpenMemHandle(handle)
word = numpy.empty(1, numpy.uint32)
cupy.cuda.runtime.memcpy(word.ctypes.data, pointer, 4, cupy.cuda.runtime.memcpyDeviceToHost)
cupy.cuda.runtime.ipcCloseMemHandle(pointer)
print(int(word[0]))
"""
#: the word the probe writes into the exported buffer
_IPC_WORD = 0x5EED1E55
#: the kernel that brought dma-buf for peer memory (GPUDirect RDMA without nvidia_peermem)
DMABUF_KERNEL = (5, 12)


@dataclass(frozen=True)
class Prerequisite:
    """One of GPUDirect RDMA's prerequisites: its name, whether it is met, what was found, and the fix."""

    name: str
    met: bool
    finding: str
    fix: str = ""


@dataclass(frozen=True)
class GpuFacts:
    """What ``bench info`` lists and ``bench doctor`` judges."""

    driver: Driver
    #: CuPy's version and its CUDA runtime's, or why CuPy cannot be used
    cupy: str | None
    runtime: str | None
    cupy_problem: str | None
    #: UCX's CUDA transports: the module file, and the transports its ucx_info lists with a GPU present
    ucx_cuda_module: Path | None
    ucx_cuda_transports: tuple[str, ...]
    #: "works", or why not / why not tried
    cuda_ipc: str
    gpudirect: tuple[Prerequisite, ...]


def _cupy() -> tuple[str | None, str | None, str | None]:
    try:
        cupy = array_module()
    except ImportError as exc:
        return None, None, str(exc)
    try:
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        return cupy.__version__, f"{runtime // 1000}.{runtime % 1000 // 10}", None
    except Exception as exc:  # a runtime that does not load: the line says so
        return cupy.__version__, None, f"CuPy {cupy.__version__} cannot reach the CUDA runtime: {exc}"


def ucx_cuda_module() -> Path | None:
    """UCX's CUDA transports (``libuct_cuda.so``: cuda_copy, cuda_ipc) in the UCX the fabric loads, if built: found
    beside the ``ucx_info`` of that UCX (the wheel's, or the system's with TENSOR_BENCH_UCX_HOME)."""
    try:
        home = fabric.backend("ucx").tool("ucx_info").path.parent.parent
    except Exception:  # no UCX, or no ucx_info beside it: nothing to say of its CUDA transports
        return None
    for directory in (home / "lib" / "ucx", home / "lib" / "x86_64-linux-gnu" / "ucx"):
        found = sorted(directory.glob("libuct_cuda.so*"))
        if found:
            return found[0]
    return None


def cuda_ipc_probe(found: Driver, cupy_problem: str | None, timeout_s: float = 60.0) -> str:
    """Whether a device buffer exported by this process (``cudaIpcGetMemHandle``) can be mapped and read by a
    second one here: "works", or why not (or why it was not tried)."""
    if found.problem is not None:
        return f"not tried: {found.problem}"
    if cupy_problem is not None:
        return f"not tried: {cupy_problem}"
    cupy = array_module()
    try:
        # an allocation of its own: the reader maps the whole allocation and reads its first word, which in CuPy's
        # pool could be another array's
        buffer = allocation(4096, Memory("cuda")).view(cupy.uint32)
        buffer.fill(_IPC_WORD)
        cupy.cuda.get_current_stream().synchronize()
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(buffer.data.ptr))
        done = subprocess.run([sys.executable, "-c", _IPC_READER, handle.hex()], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"fails: the second process did not map the buffer within {timeout_s:g} s"
    except Exception as exc:  # the export itself failed: the line says how
        return f"fails: cannot export device memory ({type(exc).__name__}: {exc})"
    if done.returncode != 0 or done.stdout.strip() != str(_IPC_WORD):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"fails: the second process could not read the buffer ({last})"
    return "works"


def _kernel_version(release: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", release)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def gpudirect_prerequisites(found: Driver, ports: list[str], ucx_has_verbs: bool,
                            sys_root: Path = Path("/"), kernel: str | None = None) -> tuple[Prerequisite, ...]:
    """GPUDirect RDMA's prerequisites (the NIC reads and writes GPU memory): a GPU, an active RDMA port, a way for
    the NIC to reach GPU memory (the ``nvidia_peermem`` module, or dma-buf: Linux 5.12 or newer with NVIDIA's open
    kernel module), and a UCX with verbs beside its CUDA transports."""
    kernel = kernel if kernel is not None else os.uname().release
    peermem = (sys_root / "sys/module/nvidia_peermem").exists()
    try:
        open_module = "Open Kernel Module" in (sys_root / "proc/driver/nvidia/version").read_text()
    except OSError:
        open_module = False
    dmabuf = _kernel_version(kernel) >= DMABUF_KERNEL and open_module
    reach = ("nvidia_peermem loaded" if peermem else
             f"dma-buf (Linux {kernel}, NVIDIA's open kernel module)" if dmabuf else
             f"neither nvidia_peermem loaded nor dma-buf (Linux {kernel}, "
             f"{'open' if open_module else 'proprietary or no'} NVIDIA kernel module)")
    return (
        Prerequisite("gpu", found.problem is None, "a GPU" if found.problem is None else found.problem,
                     "run on a machine with an NVIDIA GPU"),
        Prerequisite("rdma port", bool(ports), f"active: {', '.join(ports)}" if ports else "no active RDMA port",
                     "an RDMA NIC with an active port ('bench doctor' says why none is)"),
        Prerequisite("peer memory", peermem or dmabuf, reach,
                     "modprobe nvidia_peermem, or NVIDIA's open kernel module on Linux 5.12 or newer (dma-buf)"),
        Prerequisite("ucx verbs", ucx_has_verbs, "UCX with verbs" if ucx_has_verbs else
                     "the UCX in use has no verbs (the PyPI wheel)",
                     "reinstall against a UCX built with verbs and CUDA (TENSOR_BENCH_UCX_HOME)"),
    )


def gpu_facts(ports: list[str], ucx_transports: dict[str, list[str]], ucx_has_verbs: bool,
              try_ipc: bool = True) -> GpuFacts:
    """Everything :class:`GpuFacts` holds, asked of this machine (``ports``: the active RDMA ports;
    ``ucx_transports``: what the fabric's ucx_info lists)."""
    found = driver()
    version, runtime, problem = _cupy()
    cuda = tuple(name for name in ucx_transports if name.startswith(("cuda", "gdr")))
    ipc = cuda_ipc_probe(found, problem) if try_ipc else "not tried"
    return GpuFacts(found, version, runtime, problem, ucx_cuda_module(), cuda, ipc,
                    gpudirect_prerequisites(found, ports, ucx_has_verbs))


def describe(facts: GpuFacts) -> list[str]:
    """``bench info``'s GPU section, a line per fact."""
    found = facts.driver
    lines = []
    if found.cuda_version is not None:
        lines.append(f"driver: CUDA {found.cuda_version[0]}.{found.cuda_version[1]} (libcuda.so.1)")
    if found.problem is not None:
        lines.append(f"none: {found.problem} (bench micro --memory cuda is refused)")
    for gpu in found.gpus:
        lines.append(f"cuda:{gpu.index} {gpu.name}, {gpu.memory_bytes / 2**30:.1f} GiB, PCI {gpu.pci_bus}")
    if (note := found.capped_note()) is not None:
        lines.append(note)
    if facts.cupy_problem is not None:
        lines.append(f"device arrays: {facts.cupy_problem}")
    else:
        lines.append(f"device arrays: CuPy {facts.cupy}, CUDA runtime {facts.runtime}")
    module = facts.ucx_cuda_module
    listed = ", ".join(facts.ucx_cuda_transports)
    lines.append("ucx cuda transports: " + (
        listed + (f" ({module.name})" if module else "") if listed else
        f"built ({module.name}: cuda_copy, cuda_ipc), none listed without a GPU" if module and found.problem else
        f"built ({module.name}), none listed by ucx_info" if module else
        "not built into the UCX in use"))
    lines.append(f"cuda_ipc between two processes: {facts.cuda_ipc}")
    missing = [p for p in facts.gpudirect if not p.met]
    lines.append("gpudirect rdma: " + ("would work: " + "; ".join(p.finding for p in facts.gpudirect)
                                       if not missing else
                                       "would not: " + "; ".join(p.finding for p in missing)
                                       + " ('bench doctor' says the fixes)"))
    if found.problem is None and facts.cupy_problem is not None:
        lines.append(f"to use the GPU: {extra_hint(found)}")
    return lines
