"""The "local" line: one process, no communication, the same updates on the same batches as the servers'."""

from __future__ import annotations

import time

import numpy as np

from bench.runtime.config import (
    ALIGNMENT,
    RuntimeCopies,
    StepTimes,
    TrainConfig,
    aligned_copy,
    build_model,
    framework,
    host_copy,
    initial_weights,
    plan_of,
    worker_batch,
)
from bench.runtime.update import apply_update
from bench.runtime.worker import SparseRows, Updates, replayed_compute
from transports import TensorSpec
from transports.common import aligned_empty
from transports.ledger import Ledger
from transports.placement import Placement
from transports.tensors import empty, to_device


def train_locally(config: TrainConfig) -> tuple[StepTimes, dict[int, np.ndarray]]:
    """The "local" line: one process, no communication, the same updates on the same batches."""
    plan = config.plan if config.plan is not None else plan_of(config)
    variables = list(plan.variables)
    memory = config.memory_kind
    values = [to_device(aligned_copy(w), memory, Ledger()) for w in initial_weights(config, variables).values()]
    local = _LocalMemory()
    if config.replayed:
        replayed = replayed_compute(config, local, plan, plan.layout.worker(0))

        def compute(server: int, step: int) -> Updates:
            return replayed(step, values, RuntimeCopies(), None)[1]
    else:
        step_fn = framework(config).step(build_model(config, memory), config.workload, variables)
        copies = RuntimeCopies()
        rows = [SparseRows(local, plan, plan.layout.worker(server)) for server in range(config.servers)]

        def compute(server: int, step: int) -> Updates:
            x, y = worker_batch(config, server, step)
            result = step_fn(values, x, y, copies)
            return rows[server].updates(plan, result.gradients, result.new_state)

    times = StepTimes()
    for step in range(config.warmup + config.steps):
        if step == config.warmup:
            times = StepTimes()
        started = time.perf_counter()
        per_server = [compute(server, step) for server in range(config.servers)]
        computed = time.perf_counter()
        for position, (variable, value) in enumerate(zip(variables, values, strict=True)):
            apply_update(variable, value, [[array for _, array in updates[position]] for updates in per_server],
                         config.learning_rate)
        done = time.perf_counter()
        times.total += done - started
        times.steps.append(done - started)
        times.compute += computed - started
        times.apply += done - computed
    return times, {index: host_copy(value) if memory.is_device else value for index, value in enumerate(values)}


class _AlignedPlacement(Placement):
    """Aligned process memory, where local training builds what a transport's placement would give."""

    def allocate(self, spec: TensorSpec) -> np.ndarray:
        if spec.src_memory.is_device:
            return empty(spec.shape, spec.dtype, spec.src_memory)
        return aligned_empty(spec.shape, spec.dtype, ALIGNMENT)


class _LocalMemory:
    """What local training allocates from where a transport would (its ``placement``)."""

    def __init__(self) -> None:
        self.placement = _AlignedPlacement()
