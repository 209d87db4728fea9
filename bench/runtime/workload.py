"""What the runtime trains, handed in by the experiment: a model on synthetic batches, or a task on its real data.

The runtime imports no model or task of its own: ``bench model`` hands it a model definition
(``bench.experiments.models``), ``bench converge`` a task (``bench.experiments.tasks``), a test a tiny model of its
own. Anything with these methods will do; it travels to every rank on the run's channels (``bench.launch.wire``), so it
must be data there (a dataclass of the project's or of a module named in ``TENSOR_BENCH_WIRE_MODULES``, or a class
marked ``@wire_value``) and small (a task loads its data where it is used, not in the message).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Workload(Protocol):
    """A model: how to build it, its loss, and a seeded synthetic batch."""

    def build(self) -> Any:
        """A fresh, uncompiled ``keras.Model`` (deterministic after ``keras.utils.set_random_seed``)."""

    def loss_fn(self) -> Any:
        """The training loss, ``loss(y, logits) -> scalar``."""

    def make_batch(self, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """A mini-batch ``(x, y)`` determined by ``seed``."""


@runtime_checkable
class RealData(Workload, Protocol):
    """A task: a workload with a training set the workers share out and a held-out set to evaluate on.

    Training on it, a worker's step is traced before the run's clock starts (a convergence run's time to
    accuracy leaves TensorFlow's tracing out)."""

    def train_batch(self, step: int, server: int, servers: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Worker ``server``'s batch at ``step``, disjoint from the other workers'."""

    def evaluate(self, predict: Any) -> dict[str, float]:
        """The held-out loss and metric of ``predict(x) -> logits``."""


def batch(workload: Workload, batch_size: int, servers: int, seed: int, server: int, step: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``server``'s batch at ``step``: a task's share of its training set, or a seeded synthetic batch."""
    if isinstance(workload, RealData):
        return workload.train_batch(step, server, servers, batch_size)
    return workload.make_batch(batch_size, seed=seed + 1000 * server + step)
