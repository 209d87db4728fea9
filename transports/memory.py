"""Where a tensor lives: host memory or the memory of CUDA device N, and what this machine has of the latter.

A :class:`Memory` names the memory of one side of a transfer (``host``, ``cuda:0``); ``TensorSpec`` carries one per
side and ``Placement.allocate`` gives memory of that kind. Device arrays are CuPy arrays (the ``cuda12`` and
``cuda13`` extras): NumPy's interface on the GPU, DLPack and ``__cuda_array_interface__`` both ways, raw device
pointers and IPC handles, in a wheel of a hundred megabytes with no framework behind it. Tensors of other frameworks
come in through DLPack without a copy (``transports/tensors.py``).

What the machine has is asked of the NVIDIA driver itself (``libcuda.so.1`` through ctypes), so that ``bench info``
and the refusal of ``--memory cuda`` need no GPU library: ``driver().gpus`` lists the devices, :func:`cuda_problem` says
in one line why device memory cannot be used here (None when it can).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

#: the extra that brings CuPy for each CUDA major the driver supports
EXTRAS = {12: "cuda12", 13: "cuda13"}


@dataclass(frozen=True, order=True)
class Memory:
    """The memory of one side of a transfer: ``host``, or ``cuda`` device ``device`` (as that process numbers it)."""

    kind: str = "host"
    device: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("host", "cuda"):
            raise ValueError(f"memory kind must be 'host' or 'cuda', not {self.kind!r}")
        if type(self.device) is not int or self.device < 0 or (self.kind == "host" and self.device):
            raise ValueError(f"{self.kind} memory cannot be on device {self.device!r}")

    @property
    def is_device(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return "host" if self.kind == "host" else f"cuda:{self.device}"

    @classmethod
    def parse(cls, text: Any) -> Memory:
        """``host``, ``cuda`` (device 0) or ``cuda:N``; a Memory is returned as it is. ValueError names the fix."""
        if isinstance(text, Memory):
            return text
        match = re.fullmatch(r"\s*(host|cuda)(?::(\d{1,3}))?\s*", text) if isinstance(text, str) else None
        if match is None or (match.group(1) == "host" and match.group(2) is not None):
            raise ValueError(f"memory {text!r} is not one of host, cuda, cuda:N (N a device number)")
        return cls(match.group(1), int(match.group(2) or 0))


HOST = Memory()


def parse_sides(text: str) -> tuple[Memory, Memory]:
    """``--memory``: ``KIND`` for both sides or ``SENDER,RECEIVER`` (as nixlbench's initiator and target segment
    types), each ``host``, ``cuda`` or ``cuda:N``."""
    parts = text.split(",")
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"memory {text!r} is one kind (host, cuda, cuda:N) or two, sender's and receiver's, "
                         "joined by a comma (e.g. cuda:0,host)")
    sides = [Memory.parse(part) for part in parts]
    return (sides[0], sides[-1])


def memory_of(array: Any) -> Memory:
    """Where ``array`` lives: host for NumPy's arrays, its device for CuPy's."""
    if type(array) is np.ndarray:
        return HOST
    device = getattr(array, "device", None)
    index = getattr(device, "id", None)
    if type(index) is int and hasattr(array, "__cuda_array_interface__"):
        return Memory("cuda", index)
    return HOST


# -- the driver ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gpu:
    """One CUDA device as the driver reports it."""

    index: int
    name: str
    memory_bytes: int
    pci_bus: str


@dataclass(frozen=True)
class Driver:
    """The NVIDIA driver here: its CUDA version (e.g. 13.0) and devices, or why there is none usable."""

    cuda_version: tuple[int, int] | None
    gpus: tuple[Gpu, ...]
    problem: str | None  # None: the driver loaded and initialised
    #: the devices the driver claims, when more than it was asked about (:data:`MAX_GPUS`); else None
    claimed: int | None = None

    @property
    def cuda_major(self) -> int | None:
        return None if self.cuda_version is None else self.cuda_version[0]

    def capped_note(self) -> str | None:
        """``the driver claims N devices: the first 64 are listed`` when it claimed more than the probe asks about."""
        if self.claimed is None:
            return None
        return f"the driver claims {self.claimed} devices: the first {len(self.gpus)} are listed"


_CUDA_ERRORS = {100: "CUDA_ERROR_NO_DEVICE: it finds no GPU", 999: "CUDA_ERROR_UNKNOWN",
                3: "CUDA_ERROR_NOT_INITIALIZED", 35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
                304: "CUDA_ERROR_OPERATING_SYSTEM"}
#: the driver's functions the probe calls, every one looked up before the first call: a library without one (a
#: partial or fake ``libcuda.so.1``) is no usable driver
_DRIVER_FUNCTIONS = ("cuDriverGetVersion", "cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetName",
                     "cuDeviceTotalMem_v2", "cuDeviceGetPCIBusId")
#: the most devices the probe asks the driver about (a machine has 8 or 16): a driver claiming 2**31 - 1 would
#: otherwise be asked about each, for hours and gigabytes
MAX_GPUS = 64


def driver_text(raw: bytes) -> str:
    """Text the driver wrote (a device's name, its PCI bus id), printable ASCII only: any other byte (a terminal
    escape, a line break) shown as ``\\xNN``, never passed to a terminal."""
    return "".join(chr(byte) if 0x20 <= byte < 0x7F else f"\\x{byte:02x}" for byte in raw)


def _library_path() -> str:
    """The file ``libcuda.so.1`` was loaded from (this process's mappings say), else that name."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libcuda.so"):
                return fields[5].strip()
    return "libcuda.so.1"


@functools.cache
def driver() -> Driver:
    """Ask ``libcuda.so.1`` for its version and devices (once per process; no GPU library needed).

    Whatever the library is, the answer is a Driver: one lacking a function the probe calls is "unusable" naming
    it, one claiming more than :data:`MAX_GPUS` devices is asked about the first of them only, and the names it
    gives are shown as printable ASCII (:func:`driver_text`)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return Driver(None, (), "there is no NVIDIA driver here (libcuda.so.1 is not installed)")
    missing = [name for name in _DRIVER_FUNCTIONS if not hasattr(cuda, name)]
    if missing:
        library = driver_text(os.fsencode(_library_path()))
        return Driver(None, (), f"the NVIDIA driver is unusable: {library} has no {', '.join(missing)} "
                      "(a partial or fake libcuda.so.1: reinstall the driver, or take that file off LD_LIBRARY_PATH)")
    version = ctypes.c_int(0)
    cuda_version = None
    if cuda.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
        cuda_version = (version.value // 1000, version.value % 1000 // 10)
    status = cuda.cuInit(0)
    if status != 0:
        return Driver(cuda_version, (), f"the NVIDIA driver did not start ({_CUDA_ERRORS.get(status, status)})")
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value <= 0:
        return Driver(cuda_version, (), "the NVIDIA driver finds no GPU here")
    found = []
    for index in range(min(count.value, MAX_GPUS)):
        handle = ctypes.c_int(0)
        if cuda.cuDeviceGet(ctypes.byref(handle), index) != 0:
            continue
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, len(name) - 1, handle)
        total = ctypes.c_size_t(0)
        cuda.cuDeviceTotalMem_v2(ctypes.byref(total), handle)
        bus = ctypes.create_string_buffer(64)
        cuda.cuDeviceGetPCIBusId(bus, len(bus) - 1, handle)
        found.append(Gpu(index, driver_text(name.value), total.value, driver_text(bus.value)))
    return Driver(cuda_version, tuple(found), None, count.value if count.value > MAX_GPUS else None)


def extra_hint(found: Driver | None = None) -> str:
    """The install that brings CuPy for the CUDA major of ``found`` (this machine's driver when not given)."""
    extra = EXTRAS.get((found or driver()).cuda_major or 0)
    if extra is None:
        return "pip install -e '.[cuda12]' or '.[cuda13]', the one of the driver's CUDA major"
    return f"pip install -e '.[{extra}]'"


@functools.cache
def array_module() -> Any:
    """CuPy, for device arrays; ImportError names the extra to install."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(f"device memory needs CuPy: {extra_hint()} ({exc})") from None
    return cupy


def cuda_problem(memory: Memory = Memory("cuda")) -> str | None:
    """Why ``memory`` (device memory) cannot be used by this process, in one line; None when it can (a device of
    that number, and CuPy to hold it). Host memory has no problem."""
    if not memory.is_device:
        return None
    found = driver()
    if found.problem is not None:
        return f"device memory ({memory}) needs an NVIDIA GPU, and {found.problem}"
    if memory.device >= len(found.gpus):
        return f"no CUDA device {memory.device} here (the driver shows {len(found.gpus)})"
    try:
        array_module()
    except ImportError as exc:
        return str(exc)
    return None
