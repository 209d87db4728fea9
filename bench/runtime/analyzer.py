"""The graph analyzer: which tensors cross processes, with which static shapes (the paper's section 3.4).

For parameter-server training the cross-process tensors are each trainable
variable going from its parameter server to every worker (the weights) and its
gradient going back (same shape). Keras models declare every variable's shape,
so all of them are static and the transports can place them ahead of time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transports import TensorSpec


@dataclass(frozen=True)
class Variable:
    """A trainable variable: its index, path in the model, shape and dtype."""

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """Ranks of a cluster of ``servers`` servers, each running a worker and a parameter server."""

    servers: int

    def worker(self, server: int) -> int:
        return server

    def ps(self, server: int) -> int:
        return self.servers + server

    @property
    def size(self) -> int:
        return 2 * self.servers

    def ps_of(self, variable: Variable) -> int:
        """Variables are placed round-robin over the parameter servers, as in the paper."""
        return self.ps(variable.index % self.servers)


def variables_of(model) -> list[Variable]:
    """The trainable variables of a Keras model, in the model's order."""
    return [
        Variable(i, v.path, tuple(int(d) for d in v.shape), np.dtype(v.dtype))
        for i, v in enumerate(model.trainable_variables)
    ]


def weight_key(variable: Variable) -> str:
    return f"w{variable.index}"


def gradient_key(variable: Variable) -> str:
    return f"g{variable.index}"


def transfer_plan(variables: list[Variable], layout: Layout) -> list[TensorSpec]:
    """Every cross-process tensor: weights from their PS to each worker, gradients back."""
    specs = []
    for variable in variables:
        ps = layout.ps_of(variable)
        for server in range(layout.servers):
            worker = layout.worker(server)
            specs.append(TensorSpec(weight_key(variable), variable.shape, variable.dtype, ps, worker))
            specs.append(TensorSpec(gradient_key(variable), variable.shape, variable.dtype, worker, ps))
    return specs
