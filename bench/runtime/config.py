"""A training run's config, its step times, and what every role of the runtime shares (``bench.runtime``).

:class:`TrainConfig` says what is trained and how; :class:`StepTimes` is what each rank's loop measures;
:class:`RuntimeCopies` counts the bytes the runtime copies to hand a tensor to the framework. The model is built,
batched and analysed here for every role alike (:func:`build_model`, :func:`worker_batch`, :func:`plan_of`), and
the starting weights are the same for the parameter servers and the Local line (:func:`initial_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.runtime.analyzer import Plan, Variable
from bench.runtime.framework import Framework, framework_name_of, framework_of
from bench.runtime.workload import Workload, batch
from transports.common import aligned_empty, in_device_memory
from transports.ledger import Ledger
from transports.memory import HOST, Memory
from transports.tensors import to_host

ALIGNMENT = 64


@dataclass
class TrainConfig:
    """What to train and how."""

    #: how records name the model (``vgg16``, ``digits``, ``tests.tiny_models:TINY``)
    model: str
    #: what is trained (a model definition, a task): handed in by the experiment, see :mod:`bench.runtime.workload`
    workload: Workload
    transport: str
    transport_options: dict[str, Any]
    batch_size: int
    servers: int = 1
    steps: int = 20
    warmup: int = 2
    learning_rate: float = 0.01
    seed: int = 0
    timeout_s: float = 600.0
    #: how records name the transport (``grpc_rdma:direct``); defaults to ``transport``
    label: str = ""
    #: asynchronous SGD: each PS applies every worker's gradients as they come, workers never wait for each other
    asynchronous: bool = False
    #: ``real`` runs the model; ``replay`` and ``paper`` wait ``compute_s`` per step instead (see the module)
    compute: str = "real"
    compute_s: float = 0.0
    #: the analyzer's plan (from :func:`bench.experiments.training.profile`); None: each process analyses the model
    #: it builds
    plan: Plan | None = None
    #: keep nothing that grows with the steps (no per-step times, no copy of the final weights): a long soak
    constant_memory: bool = False
    #: ``watch(transport, ctx)`` wraps each rank's transport (the soak's content check): a transport whose
    #: ``finish()`` gives what goes to the rank's ``extra["watch"]`` at the end; must travel on the run's channels
    watch: Callable[[Any, Any], Any] | None = None
    #: evaluate on the held-out set every this many steps and at the last (worker 0; 0: never)
    evaluate_every: int = 0
    #: stop once worker 0 has trained this many seconds (``steps`` is then the most it runs); None: run ``steps``
    time_s: float | None = None
    #: where the weights, gradients and received tensors live (``host``, ``cuda``, ``cuda:N``): with device memory
    #: the model computes on that GPU and the parameter servers apply SGD there (CuPy); see the module
    memory: str = "host"

    @property
    def replayed(self) -> bool:
        return self.compute != "real"

    @property
    def framework(self) -> str:
        """The framework the workload is written in (``tensorflow``, ``torch``)."""
        return framework_name_of(self.workload)

    @property
    def memory_kind(self) -> Memory:
        """:attr:`memory` as a :class:`~transports.memory.Memory`."""
        return Memory.parse(self.memory)

    def memory_problem(self) -> str | None:
        """Why this run cannot keep its tensors in :attr:`memory`, in one line naming the fix; None when it can."""
        memory = self.memory_kind
        if not memory.is_device:
            return None
        if self.plan is not None and any(v.sparse for v in self.plan.trainable):
            return (f"--memory {memory}: {self.model} has a sparse gradient, whose rows the runtime gathers in "
                    "host memory only; train it with --memory host")
        return framework(self).memory_problem(memory)


@dataclass
class StepTimes:
    """Seconds per step spent in each phase, summed over the timed steps."""

    total: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    apply: float = 0.0
    copied_bytes: int = 0
    #: each timed step's seconds (workers and the local line; ``total`` is their sum)
    steps: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class RuntimeCopies:
    """Counts the payload bytes the runtime itself copies to hand tensors to or from the framework."""

    def __init__(self) -> None:
        self.bytes = 0

    def adoptable(self, array: np.ndarray, alignment: int = ALIGNMENT) -> np.ndarray:
        """``array``, or an aligned copy when the framework could not adopt its memory (read-only, not contiguous,
        or not at ``alignment``: TensorFlow's 64 bytes). A device array is adopted as it is (DLPack)."""
        if in_device_memory(array):
            return array
        if not array.flags.writeable or not array.flags.c_contiguous or array.ctypes.data % alignment:
            array = aligned_copy(array)
            self.bytes += array.nbytes
        return array


def host_copy(array: Any) -> np.ndarray:
    """A copy of ``array`` in host memory (off its device, for a device array)."""
    return array.copy() if type(array) is np.ndarray else to_host(array, Ledger())


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A writable, C-contiguous, 64-byte aligned copy of ``array``."""
    out = aligned_empty(array.shape, array.dtype, ALIGNMENT)
    out[...] = array
    return out


def worker_batch(config: TrainConfig, server: int, step: int):
    """Worker ``server``'s batch at ``step`` (see :func:`bench.runtime.workload.batch`)."""
    return batch(config.workload, config.batch_size, config.servers, config.seed, server, step)


def framework(config: TrainConfig) -> Framework:
    """The framework ``config``'s workload is written in."""
    return framework_of(config.workload)


def build_model(config: TrainConfig, memory: Memory = HOST):
    """The workload's model, built afresh (seeded; variable paths as in the plan), computing in ``memory``."""
    return framework(config).build(config.workload, config.seed, memory)


def plan_of(config: TrainConfig) -> Plan:
    """The analyzer's plan for ``config``: the model built, its step traced for the run's batches."""
    model = build_model(config)
    x, y = worker_batch(config, 0, 0)
    return framework(config).analyze(config.model, model, config.workload, np.asarray(x), np.asarray(y),
                                     config.servers, config.batch_size)


def initial_weights(config: TrainConfig, variables: list[Variable]) -> dict[int, np.ndarray]:
    """The starting values of ``variables``: the model's (seeded), or seeded random ones when compute is replayed."""
    if config.replayed:
        return {v.index: (np.random.default_rng(config.seed + v.index).standard_normal(v.shape) * 0.05).astype(v.dtype)
                for v in variables}
    every = framework(config).initial_values(build_model(config))
    return {v.index: every[v.index] for v in variables}
