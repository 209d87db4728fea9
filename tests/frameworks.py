"""The frameworks whose tensors the tests send: a host tensor of each made from NumPy values, and the address of a
tensor's memory as the framework reports it (to show that nothing was copied). A framework that is not installed
skips the test, saying so."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest


def framework_module(framework: str) -> Any:
    return pytest.importorskip(framework, reason=f"{framework} is not installed here")


def framework_tensor(framework: str, values: np.ndarray) -> Any:
    """A CPU tensor of ``framework`` holding ``values`` (in memory of its own)."""
    module = framework_module(framework)
    if framework == "tensorflow":
        with module.device("CPU:0"):
            return module.constant(values)
    if framework == "torch":  # through DLPack, then a copy of the torch's own (Debian's PyTorch 1.13 has no
        return module.from_dlpack(np.ascontiguousarray(values)).clone()  # NumPy 2 interop)
    import jax

    return jax.device_put(values, jax.devices("cpu")[0])


def framework_pointer(framework: str, tensor: Any) -> int:
    """The address of ``tensor``'s first byte, as its framework says."""
    if framework == "torch":
        return tensor.data_ptr()
    if framework == "jax":
        return tensor.unsafe_buffer_pointer()
    # TensorFlow gives no address of its own: its DLPack export is over the tensor's buffer
    return np.from_dlpack(tensor).ctypes.data
