"""The seam between the runtime and a deep-learning framework: what the parameter server, the worker loop and the
analyzer's plan ask of TensorFlow or PyTorch, and nothing more.

A :class:`Framework` builds a workload's model, says its variables in a stable order (trainable, then state),
gives their starting values, analyses one step into the runtime's :class:`~bench.runtime.analyzer.Plan`, and makes
the step a worker runs (:class:`Step`). Everything crosses the seam as arrays over the framework's own memory
(DLPack, no copy): NumPy's in host memory, CuPy's in a GPU's (a run with ``--memory cuda``, PyTorch's only);
received values go in, gradients and new state come out; a sparse gradient comes out as its rows and their
indices (:class:`SparseGradient`, host memory). The runtime (``bench.runtime``: its worker, PS and Local
line), ``StepSends``, the plan and the transports import no framework; the two implementations do:
``bench.runtime.tensorflow_bridge`` (the paper's, the default) and ``bench.runtime.torch_bridge``.

A workload names its framework by a ``framework`` attribute (``"tensorflow"`` when it has none); importing this
module imports no framework.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from bench.runtime.analyzer import Plan, Variable
from transports.memory import HOST, Memory

#: the frameworks a model can be trained in, the paper's first
FRAMEWORKS = ("tensorflow", "torch")
DEFAULT_FRAMEWORK = "tensorflow"

#: ``on_gradients(positions, arrays)``: a bucket of dense gradients (of the trainable variables at ``positions``)
#: handed over as soon as the backward pass has computed it, on the framework's threads
OnGradients = Callable[[list[int], list[np.ndarray]], None]


@dataclass(frozen=True)
class SparseGradient:
    """A sparse gradient (an embedding table's): ``values[i]`` is added to row ``indices[i]``; rows may repeat."""

    values: np.ndarray
    indices: np.ndarray


@dataclass
class StepResult:
    """One forward and backward pass: the loss, each trainable variable's gradient (an array, or a
    :class:`SparseGradient`) and each state variable's new value, all NumPy views of the framework's memory."""

    loss: float
    gradients: list[np.ndarray | SparseGradient]
    new_state: list[np.ndarray]


class Step(ABC):
    """The step every worker runs on the values it received (every variable's, in the plan's order)."""

    @abstractmethod
    def __call__(self, values: list[np.ndarray], x: np.ndarray, y: np.ndarray, copies: Any) -> StepResult:
        """Forward and backward on batch ``x, y`` with ``values`` (used in place where the framework can take them:
        what it cannot take without a copy is copied and counted in ``copies``, a ``RuntimeCopies``)."""


class Framework(ABC):
    """One framework behind the seam (see the module)."""

    #: its name on the command line and in the records
    name: ClassVar[str]
    #: the distributions whose versions a run records (the first is the framework's own)
    distributions: ClassVar[tuple[str, ...]]

    def packages(self) -> dict[str, str]:
        """The installed versions of :attr:`distributions` (what is not installed is left out)."""
        found = {}
        for distribution in self.distributions:
            try:
                found[distribution] = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                continue
        return found

    def version(self) -> str | None:
        """The framework's own version, None when it is not installed."""
        return self.packages().get(self.distributions[0])

    def use_cores(self, cores: int) -> None:  # noqa: B027 (TensorFlow keeps its own pools as they are)
        """This process shares the machine with others of its run: compute on about ``cores`` cores, not on every
        core (a framework whose threads spin while they wait would take the cores its peers' ranks need)."""

    def memory_problem(self, memory: Memory) -> str | None:
        """Why this framework's models cannot train with their tensors in ``memory`` here, in one line naming the
        fix; None when they can. Host memory always can; device memory where the framework says so."""
        if not memory.is_device:
            return None
        return (f"--memory {memory}: the runtime trains {self.name} models in host memory only; train a PyTorch "
                "model (--framework torch) in device memory, or leave --memory out")

    @abstractmethod
    def build(self, workload: Any, seed: int, memory: Memory = HOST) -> Any:
        """The workload's model, built afresh with the framework seeded by ``seed`` (the same model every time),
        computing in ``memory`` (its variables' initial values the same wherever it computes)."""

    @abstractmethod
    def initial_values(self, model: Any) -> list[np.ndarray]:
        """Every variable's value as built (trainable, then state: the plan's order), as arrays of its own."""

    @abstractmethod
    def analyze(self, name: str, model: Any, workload: Any, x: np.ndarray, y: np.ndarray, servers: int,
                batch_size: int) -> Plan:
        """The plan of ``model`` trained on batches like ``x``, ``y`` over ``servers`` servers."""

    @abstractmethod
    def step(self, model: Any, workload: Any, plan_variables: list[Variable],
             on_gradients: OnGradients | None = None) -> Step:
        """The step a worker runs; with ``on_gradients`` it hands each bucket of dense gradients over (of about
        ``GRADIENT_BUCKET_BYTES``, last weights first) while the rest of the backward pass runs."""

    @abstractmethod
    def predictor(self, model: Any, workload: Any, trainable: int) -> Callable[[list[np.ndarray]],
                                                                               Callable[[np.ndarray], np.ndarray]]:
        """``predictor(weights)(x) -> logits``: inference with the trainable ``weights`` (copied: the transport may
        write the next step's into the arrays meanwhile) and the model's own state."""


_IMPLEMENTATIONS = {
    "tensorflow": "bench.runtime.tensorflow_bridge:TensorFlow",
    "torch": "bench.runtime.torch_bridge:Torch",
}
_made: dict[str, Framework] = {}


def framework_named(name: str) -> Framework:
    """The framework called ``name`` (one of :data:`FRAMEWORKS`)."""
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown framework {name!r}: choose one of {', '.join(FRAMEWORKS)}")
    if name not in _made:
        module, _, attribute = _IMPLEMENTATIONS[name].partition(":")
        _made[name] = getattr(importlib.import_module(module), attribute)()
    return _made[name]


def framework_name_of(workload: Any) -> str:
    """The name of the framework ``workload`` is written in (``tensorflow`` unless it says otherwise)."""
    return getattr(workload, "framework", None) or DEFAULT_FRAMEWORK


def framework_of(workload: Any) -> Framework:
    """The framework ``workload`` is written in."""
    return framework_named(framework_name_of(workload))
