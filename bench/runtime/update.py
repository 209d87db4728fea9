"""The update math a parameter server applies (and the Local line, so that both apply exactly the same updates).

Each update is what :func:`bench.runtime.analyzer.update_keys` names: a gradient (SGD), a sparse gradient's distinct
rows and their indices, or a state's new value (the workers' mean). Host memory with NumPy, device memory with CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.runtime.analyzer import Variable
from transports.memory import array_module

_SLICE = 1 << 20  # elements per slice of an SGD update


def _module_of(array: Any) -> Any:
    """The array module of ``array``: NumPy for host memory, CuPy for a device's."""
    return np if type(array) is np.ndarray else array_module()


def apply_update(variable: Variable, value: np.ndarray, updates: list[list[np.ndarray]],
                 learning_rate: float) -> None:
    """Apply every worker's update of ``variable`` (in the workers' order) to its ``value``, in place.

    Each update is what :func:`update_keys` names: a gradient (SGD, :func:`apply_sgd`), a sparse
    gradient's distinct rows and their indices (:func:`apply_sparse_sgd`), or a state's new value
    (the workers' mean, :func:`apply_state`).
    """
    if not variable.trainable:
        apply_state(variable, value, [u[0] for u in updates])
    elif variable.sparse:
        apply_sparse_sgd(variable, value, [(u[0], u[1]) for u in updates], learning_rate)
    else:
        apply_sgd(variable, value, [u[0] for u in updates], learning_rate)


def _wrong(variable: Variable, what: str, got: np.ndarray, expected: str) -> ValueError:
    return ValueError(f"{what} for '{variable.path}' (variable {variable.index}) has {got.dtype} {got.shape}, "
                      f"expected {expected}")


def apply_sgd(variable: Variable, weight: np.ndarray, gradients: list[np.ndarray], learning_rate: float) -> None:
    """``weight -= learning_rate * mean(gradients)``, after checking every gradient's shape."""
    for gradient in gradients:
        if gradient.shape != weight.shape or gradient.dtype != weight.dtype:
            raise _wrong(variable, "gradient", gradient, f"{weight.dtype} {weight.shape}")
    # in slices: a whole-tensor temporary of hundreds of MB would be fresh memory every step
    scale = learning_rate / len(gradients)
    flat = weight.reshape(-1)
    xp = _module_of(weight)
    for start in range(0, flat.size, _SLICE):
        stop = start + _SLICE
        update = xp.multiply(gradients[0].reshape(-1)[start:stop], scale)
        for gradient in gradients[1:]:
            update += scale * gradient.reshape(-1)[start:stop]
        flat[start:stop] -= update


def apply_sparse_sgd(variable: Variable, weight: np.ndarray, gradients: list[tuple[np.ndarray, np.ndarray]],
                     learning_rate: float) -> None:
    """SGD with sparse gradients: ``weight[indices] -= learning_rate / workers * values``, worker by worker,
    after checking each gradient's rows (their width and dtype, one index per row, every index a row)."""
    rows = weight.shape[0]
    for values, indices in gradients:
        if values.ndim != weight.ndim or values.shape[1:] != weight.shape[1:] or values.dtype != weight.dtype:
            raise _wrong(variable, "sparse gradient", values, f"{weight.dtype} rows of {weight.shape[1:]}")
        if indices.shape != values.shape[:1] or indices.dtype.kind not in "iu":
            raise _wrong(variable, "row indices", indices, f"{len(values)} integers")
        if indices.size and not (indices.min() >= 0 and indices.max() < rows):
            raise ValueError(f"row indices for '{variable.path}' (variable {variable.index}) reach outside its "
                             f"{rows} rows")
    scale = learning_rate / len(gradients)
    for values, indices in gradients:
        np.subtract.at(weight, indices, scale * values)


def apply_state(variable: Variable, state: np.ndarray, values: list[np.ndarray]) -> None:
    """A state's new value: the mean of the workers' (a floating-point state), or the first worker's."""
    for value in values:
        if value.shape != state.shape or value.dtype != state.dtype:
            raise _wrong(variable, "state", value, f"{state.dtype} {state.shape}")
    if state.dtype.kind != "f" or len(values) == 1:
        state[...] = values[0]
        return
    total = values[0].copy()
    for value in values[1:]:
        total += value
    _module_of(state).divide(total, len(values), out=state)
