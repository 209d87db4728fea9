"""Tensors of any framework in and out of a transport without a copy, and the counted copies between memories.

In: :func:`adopt` takes what a caller sends (a NumPy array, or a tensor of TensorFlow, PyTorch, JAX or CuPy) and
gives the array a transport moves, over the same memory: host memory as a NumPy array, device memory as a CuPy
array. It asks ``__dlpack__`` first (every framework speaks it; TensorFlow's eager tensors, PyTorch's, JAX's), then
``__cuda_array_interface__`` (Numba, older CuPy), then the array interface and the buffer protocol.

Out: a receive returns a NumPy array (host memory) or a CuPy array (device memory), as the plan says;
:func:`as_framework` hands it to a framework through DLPack, over the same memory.

bfloat16: NumPy has no such dtype and its DLPack refuses one; ml_dtypes' ``bfloat16`` (what TensorFlow and JAX hand
over as NumPy) is one, and a bfloat16 tensor goes in and out through DLPack over the same memory all the same: its
capsule is relabelled (DLPack's bfloat16 code for ``uint16`` of the same bits, or back) before NumPy or the
framework takes it, and NumPy's array is viewed as ``bfloat16`` (:func:`_relabelled`). Host memory only (CuPy
has no bfloat16).

Between memories: :func:`to_host` and :func:`to_device` copy a tensor across the PCIe bus and count it in the
ledger (``device_to_host_bytes``, ``host_to_device_bytes``), apart from host copies (``copied_bytes``).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from typing import Any

import numpy as np

from transports.common import data_pointer, in_device_memory
from transports.memory import Memory, array_module

__all__ = ["FRAMEWORKS", "adopt", "allocation", "as_framework", "bfloat16", "contiguous", "data_pointer", "empty",
           "ready", "to_device", "to_host"]

#: DLPack's device types (dlpack.h): host memory, CUDA device memory, pinned host memory, managed memory
DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13
#: the frameworks :func:`as_framework` hands a received array to
FRAMEWORKS = ("numpy", "cupy", "torch", "tensorflow", "jax")
#: JAX takes host memory over as it is only at this alignment (XLA's); elsewhere it copies, silently
JAX_ALIGNMENT = 64
#: DLPack's type codes (dlpack.h) of unsigned integers and of bfloat16
DL_UINT, DL_BFLOAT = 1, 4
#: where a DLTensor's dtype lies in it (after its data pointer, its device and ndim): code (uint8), bits (uint8),
#: lanes (uint16); the unversioned capsule ("dltensor") points at its DLManagedTensor, whose DLTensor comes first
_DLTENSOR_DTYPE_AT = 20
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def bfloat16() -> np.dtype | None:
    """ml_dtypes' bfloat16 as a NumPy dtype; None where ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


class _Capsule:
    """An unversioned DLPack capsule handed to a consumer that asks an object for it (``from_dlpack``): once."""

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self._capsule, self._device = capsule, device

    def __dlpack__(self, **_options: Any) -> Any:
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise BufferError("this DLPack capsule was taken already")
        return capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def _relabelled(producer: Any, code: int, to: int) -> _Capsule | None:
    """``producer``'s DLPack capsule (unversioned, not yet consumed) with its 16-bit dtype code ``code`` made ``to``
    in place (the bits stay: bfloat16 and uint16 are both 2 bytes), as an object ``from_dlpack`` takes; None when
    its dtype is not one 16-bit lane of ``code``."""
    capsule = producer.__dlpack__()
    at = _capsule_pointer(capsule, b"dltensor") + _DLTENSOR_DTYPE_AT
    dtype = (ctypes.c_uint8 * 4).from_address(at)
    if (dtype[0], dtype[1], dtype[2], dtype[3]) != (code, 16, 1, 0):
        return None
    dtype[0] = to
    return _Capsule(capsule, tuple(producer.__dlpack_device__()))


def _from_dlpack_host(tensor: Any) -> np.ndarray:
    """A host tensor of another framework as a NumPy array over its memory: NumPy's ``from_dlpack``, and a bfloat16
    one (which NumPy refuses) relabelled as uint16 and viewed as ml_dtypes' bfloat16."""
    try:
        return np.from_dlpack(tensor)
    except (BufferError, RuntimeError, TypeError, ValueError) as refused:
        dtype, capsule = bfloat16(), None
        if dtype is not None:
            with contextlib.suppress(BufferError, RuntimeError, TypeError, ValueError):  # (then NumPy's refusal)
                capsule = _relabelled(tensor, DL_BFLOAT, DL_UINT)
        if capsule is None:
            raise refused from None
    return np.from_dlpack(capsule).view(dtype)


def adopt(tensor: Any) -> Any:
    """``tensor`` as the array a transport moves, over the same memory (no copy): NumPy's arrays as they are, a
    host tensor of another framework as a NumPy array, a device tensor as a CuPy array. ValueError when it is not
    an array of any kind this knows."""
    if type(tensor) is np.ndarray:
        return tensor
    cupy = sys.modules.get("cupy")  # (not imported: no CuPy array exists)
    if cupy is not None and type(tensor) is cupy.ndarray:  # as it is: the same object every send (no DLPack)
        return tensor
    device_of = getattr(tensor, "__dlpack_device__", None)
    if device_of is not None and hasattr(tensor, "__dlpack__"):
        kind = int(device_of()[0])
        if kind in (DL_CPU, DL_CUDA_HOST):
            return _from_dlpack_host(tensor)
        if kind in (DL_CUDA, DL_CUDA_MANAGED):
            return array_module().from_dlpack(tensor)
        raise ValueError(f"a {type(tensor).__name__} in DLPack device memory {kind} (neither host nor CUDA) "
                         "cannot be sent; move it to host or CUDA memory first")
    if hasattr(tensor, "__cuda_array_interface__"):
        return array_module().asarray(tensor)
    if isinstance(tensor, np.ndarray):  # a subclass: its memory as a plain array
        return tensor.view(np.ndarray)
    return np.asarray(tensor)


def as_framework(array: Any, framework: str) -> Any:
    """A received ``array`` (NumPy or CuPy) as a tensor of ``framework`` (one of :data:`FRAMEWORKS`) over the same
    memory, through DLPack. A read-only NumPy array (a receive into memory the caller must not write) is handed
    over writable when the memory under it is, since DLPack before 1.0 cannot say read-only; ValueError when it
    cannot be handed over without a copy (read-only memory; for JAX, memory not aligned to 64 bytes)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework {framework!r} is not one of {', '.join(FRAMEWORKS)}")
    if framework == "numpy":
        if type(array) is np.ndarray:
            return array
        raise ValueError(f"a {type(array).__name__} in device memory has no NumPy view; use 'cupy' or to_host()")
    if type(array) is np.ndarray and not array.flags.writeable:
        writable = array.view()
        try:
            writable.flags.writeable = True
        except ValueError:
            raise ValueError(f"a read-only array cannot go to {framework} without a copy (the memory under it is "
                             "read-only); copy it first") from None
        array = writable
    if framework == "cupy":
        return array_module().from_dlpack(array)
    exported: Any = array
    if type(array) is np.ndarray and array.dtype == bfloat16():  # (NumPy's DLPack has no bfloat16: see the top)
        exported = _relabelled(array.view(np.uint16), DL_UINT, DL_BFLOAT)
    if framework == "torch":
        import torch

        return torch.from_dlpack(exported)
    if framework == "tensorflow":
        import tensorflow as tf

        return tf.experimental.dlpack.from_dlpack(exported.__dlpack__())
    if type(array) is np.ndarray and array.ctypes.data % JAX_ALIGNMENT:
        raise ValueError(f"JAX takes host memory without a copy only at {JAX_ALIGNMENT}-byte alignment, and this "
                         f"array starts {array.ctypes.data % JAX_ALIGNMENT} bytes past it; copy it first")
    import jax.dlpack

    return jax.dlpack.from_dlpack(exported)


def to_host(array: Any, ledger: Any, out: np.ndarray | None = None) -> np.ndarray:
    """``array``'s bytes in host memory: itself when it is there already, else copied off its device (into ``out``
    when given), the copy counted as ``device_to_host_bytes``."""
    if type(array) is np.ndarray:
        return array
    cupy = array_module()
    if out is None:
        out = np.empty(array.shape, array.dtype)
    cupy.asnumpy(cupy.ascontiguousarray(array), out=out)
    ledger.add(device_to_host_bytes=array.nbytes)
    return out


def to_device(array: np.ndarray, memory: Memory, ledger: Any, out: Any = None) -> Any:
    """``array`` (host memory) copied to ``memory``'s device (into ``out`` when given), counted as
    ``host_to_device_bytes``; host memory asked: ``array`` itself."""
    if not memory.is_device:
        return array
    cupy = array_module()
    with cupy.cuda.Device(memory.device):
        if out is None:
            out = cupy.empty(array.shape, array.dtype)
        out.set(np.ascontiguousarray(array))
        cupy.cuda.get_current_stream().synchronize()
    ledger.add(host_to_device_bytes=array.nbytes)
    return out


def empty(shape: tuple[int, ...], dtype: np.dtype, memory: Memory) -> Any:
    """Uninitialised memory of ``memory``'s kind: a NumPy array on the host, a CuPy array on a device."""
    if not memory.is_device:
        return np.empty(shape, dtype)
    cupy = array_module()
    with cupy.cuda.Device(memory.device):
        return cupy.empty(shape, dtype)


def allocation(nbytes: int, memory: Memory) -> Any:
    """``nbytes`` (uint8) of ``memory``'s device in an allocation of their own (``cudaMalloc``, not CuPy's pool):
    what a peer's key to them reaches (CUDA IPC opens the whole allocation an address lies in) holds nothing else."""
    cupy = array_module()
    with cupy.cuda.Device(memory.device):
        own = cupy.cuda.memory.Memory(max(nbytes, 1))
        return cupy.ndarray((nbytes,), np.uint8, cupy.cuda.MemoryPointer(own, 0))


def ready(array: Any) -> None:
    """Wait until the work queued on ``array``'s device (its current stream) is done, so that what it wrote there
    can be read by a copy the transport starts elsewhere (UCX's own CUDA streams); host memory: nothing to wait for."""
    if type(array) is np.ndarray:
        return
    cupy = array_module()
    with cupy.cuda.Device(array.device.id):
        cupy.cuda.get_current_stream().synchronize()


def read_by_now(array: Any) -> None:
    """Wait until all work queued on ``array``'s device is done, on every stream of every thread: a receiver hands
    the memory of a received device tensor back to its sender (a credit for its slot, a spare block), whose next
    put overwrites it with no regard for kernels still reading it. The caller's stream alone would not do: a
    receive may run on a thread of the transport's, and a framework may queue on a stream of its own. Host
    memory: nothing to wait for."""
    if type(array) is np.ndarray:
        return
    array_module().cuda.Device(array.device.id).synchronize()


def contiguous(array: Any, ledger: Any) -> Any:
    """``array`` as a C-contiguous array, counting the copy when its layout forces one: a host array's in host memory
    (``copied_bytes``), a device array's on its device (``device_to_device_bytes``, finished before it is returned:
    see :func:`ready`)."""
    if in_device_memory(array):
        if array.flags.c_contiguous:
            return array
        cupy = array_module()
        with cupy.cuda.Device(array.device.id):
            copy = cupy.ascontiguousarray(array)
            cupy.cuda.get_current_stream().synchronize()
        ledger.add(device_to_device_bytes=array.nbytes)
        return copy
    array = np.asarray(array)
    if array.flags.c_contiguous:
        return array
    ledger.add(copied_bytes=array.nbytes)
    return np.ascontiguousarray(array)
