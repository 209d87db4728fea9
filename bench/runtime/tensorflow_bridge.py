"""TensorFlow behind the framework seam (``bench.runtime.framework``): the paper's framework, and the default.

A worker's step is one ``tf.function`` (:func:`step_function`): weights and state enter as tensors over the
received arrays' memory (``keras.Model.stateless_call`` takes tensors instead of variables, DLPack makes them
without a copy where TensorFlow can adopt the memory: writable, 64-byte aligned), and gradients leave from
TensorFlow's own buffers through DLPack. Dense gradients are handed over a bucket at a time from inside the graph
(``tf.numpy_function``), as TensorFlow's dataflow runs a gradient's Send op while the backward pass goes on.
TensorFlow's BFC allocator is selected on the CPU: it carves tensors out of a few large regions it keeps, so the
regions that hold what a worker sends can be registered once (``bench.runtime.sites``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.runtime.analyzer import Output, Plan, Variable, gradient_buckets, plan_from
from bench.runtime.framework import Framework, OnGradients, SparseGradient, Step, StepResult
from transports.memory import HOST, Memory

#: TensorFlow adopts memory through DLPack only at this alignment
ALIGNMENT = 64
#: operations that hand on their input's buffer: the allocation site is further up
_FORWARDING_OPS = {"Identity", "IdentityN", "StopGradient", "Reshape", "EnsureShape", "Snapshot"}


def _environment() -> None:
    """Set before TensorFlow is first imported: quiet start-up, and the BFC allocator on the CPU (see the module).
    Every transport and the local line run with it."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")


class TensorFlow(Framework):
    """Keras 3 models on TensorFlow (see the module)."""

    name = "tensorflow"
    distributions = ("tensorflow", "keras")

    def build(self, workload: Any, seed: int, memory: Memory = HOST) -> Any:
        """The Keras model, in host memory (:meth:`memory_problem` refuses a device's before a run starts)."""
        _environment()
        import keras

        # Keras names layers with a per-process counter: a fresh session keeps the variables' paths (the plan's) the
        # same however many models this process built before
        keras.backend.clear_session()
        keras.utils.set_random_seed(seed)
        return workload.build()

    def initial_values(self, model: Any) -> list[np.ndarray]:
        return [np.asarray(v.value) for v in list(model.trainable_variables) + list(model.non_trainable_variables)]

    def analyze(self, name: str, model: Any, workload: Any, x: np.ndarray, y: np.ndarray, servers: int,
                batch_size: int) -> Plan:
        return analyze(name, model, workload.loss_fn(), np.asarray(x), np.asarray(y), servers, batch_size)

    def step(self, model: Any, workload: Any, plan_variables: list[Variable],
             on_gradients: OnGradients | None = None) -> Step:
        return _TensorFlowStep(model, workload.loss_fn(), on_gradients)

    def predictor(self, model: Any, workload: Any, trainable: int) -> Callable[[list[np.ndarray]],
                                                                               Callable[[np.ndarray], np.ndarray]]:
        import tensorflow as tf

        non_trainable = [v.value for v in model.non_trainable_variables]

        @tf.function(reduce_retracing=True)
        def predict(weights, x):
            return model.stateless_call(weights, non_trainable, x, training=False)[0]

        def with_weights(weights: list[np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
            held = [tf.constant(w) for w in weights]  # a copy: the transport may write the next step's weights
            return lambda x: predict(held, x).numpy()

        return with_weights


class _TensorFlowStep(Step):
    def __init__(self, model: Any, loss: Any, on_gradients: OnGradients | None) -> None:
        self._trainable = len(model.trainable_variables)
        self._step = step_function(model, loss, on_gradients)

    def __call__(self, values: list[np.ndarray], x: np.ndarray, y: np.ndarray, copies: Any) -> StepResult:
        tensors = [tensor(copies, value) for value in values]
        loss, gradients, new_state = self._step(tensors[:self._trainable], tensors[self._trainable:], x, y)
        return StepResult(loss, [_array_of(g) for g in gradients], [np.from_dlpack(s) for s in new_state])


def tensor(copies: Any, array: np.ndarray) -> Any:
    """A TensorFlow tensor over ``array``'s memory (DLPack), or over an aligned copy when it must be (counted)."""
    import tensorflow as tf

    return tf.experimental.dlpack.from_dlpack(copies.adoptable(array, ALIGNMENT).__dlpack__())


def _array_of(gradient: Any) -> np.ndarray | SparseGradient:
    """A gradient as NumPy views of TensorFlow's memory (DLPack, no copy): an ``IndexedSlices`` as its rows."""
    import tensorflow as tf

    if isinstance(gradient, tf.IndexedSlices):
        return SparseGradient(np.from_dlpack(gradient.values), np.from_dlpack(gradient.indices))
    return np.from_dlpack(gradient)


def variables_of(model: Any, sparse_rows: dict[int, int] | None = None) -> list[Variable]:
    """Every variable of a Keras model: the trainable ones in the model's order, then the state."""
    sparse_rows = sparse_rows or {}
    trainable = list(model.trainable_variables)
    return [
        Variable(i, v.path, tuple(int(d) for d in v.shape), np.dtype(v.dtype), i < len(trainable),
                 sparse_rows.get(i, 0))
        for i, v in enumerate(trainable + list(model.non_trainable_variables))
    ]


def step_function(model: Any, loss: Any, on_gradients: OnGradients | None = None) -> Any:
    """The step every worker runs: ``(weights, state, x, y) -> (loss, gradients, new state)``.

    Weights and state come in as tensors (``stateless_call``), so values a transport received are used
    where they are; a gradient is a tensor, or ``IndexedSlices`` for an embedding table.

    With ``on_gradients``, the step calls ``on_gradients(positions, arrays)`` with each bucket of dense gradients
    (:func:`bench.runtime.analyzer.gradient_buckets`; of the weights at ``positions``) as soon as TensorFlow has
    computed them, on TensorFlow's threads while the rest of the backward pass runs, as its dataflow runs a
    gradient's Send op: each array is the gradient's own memory (no copy), and holds it until the array is dropped.
    """
    import tensorflow as tf

    @tf.function(reduce_retracing=True)
    def step(weights, state, x, y):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            predictions, new_state = model.stateless_call(weights, state, x, training=True)
            value = loss(y, predictions)
        gradients = tape.gradient(value, weights)
        if on_gradients is not None:
            for positions in gradient_buckets(dense_bytes(gradients)):
                tf.numpy_function(functools.partial(_hand_over, on_gradients, positions),
                                  [gradients[i] for i in positions], Tout=[], stateful=True,
                                  name=f"hand_over_gradients_{positions[0]}")
        return value, gradients, new_state

    return step


def dense_bytes(gradients: list) -> list[int | None]:
    """Each gradient's bytes (a ``tf.Tensor``), or None for a sparse one (``IndexedSlices``): what buckets them."""
    import tensorflow as tf

    return [gradient.shape.num_elements() * gradient.dtype.size if isinstance(gradient, tf.Tensor) else None
            for gradient in gradients]


def _hand_over(on_gradients: OnGradients, positions: list[int], *arrays: np.ndarray) -> list:
    on_gradients(positions, list(arrays))
    return []


def allocation_site(tensor: Any) -> str:
    """The graph operation that allocates ``tensor``'s buffer: up through operations that forward one."""
    op = tensor.op
    seen = 0
    while op.type in _FORWARDING_OPS and op.inputs and seen < 64:
        op, seen = op.inputs[0].op, seen + 1
    return f"{op.type} {op.name}"


def traced_step(model: Any, loss: Any, x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
    """The step function traced for batches shaped like ``x``, ``y``, and its concrete graph."""
    import tensorflow as tf

    step = step_function(model, loss)
    concrete = step.get_concrete_function(
        [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables],
        [tf.TensorSpec(v.shape, v.dtype) for v in model.non_trainable_variables],
        tf.TensorSpec(x.shape, tf.as_dtype(x.dtype)), tf.TensorSpec(y.shape, tf.as_dtype(y.dtype)))
    return step, concrete


def analyze(name: str, model: Any, loss: Any, x: np.ndarray, y: np.ndarray, servers: int, batch_size: int) -> Plan:
    """The plan of ``model`` trained on batches like ``x``, ``y`` over ``servers`` servers, read off the traced
    graph (see ``bench.runtime.analyzer``)."""
    import tensorflow as tf

    _, concrete = traced_step(model, loss, x, y)
    _, gradients, new_state = concrete.structured_outputs
    sparse_rows = {}
    for i, gradient in enumerate(gradients):
        if isinstance(gradient, tf.IndexedSlices):
            rows = gradient.values.shape[0]
            sparse_rows[i] = int(rows) if rows is not None else 0
            if not sparse_rows[i]:
                raise ValueError(f"the sparse gradient of variable {i} has no static bound on its rows; "
                                 "the runtime needs one to place it")
    variables = variables_of(model, sparse_rows)
    trainable = [v for v in variables if v.trainable]
    outputs = dict(zip([v.index for v in trainable], gradients, strict=True))
    outputs.update(zip([v.index for v in variables if not v.trainable], new_state, strict=True))
    return plan_from(name, variables, {index: _output(output) for index, output in outputs.items()}, servers,
                     batch_size)


def _output(output: Any) -> Output:
    """What the graph gives for a variable, as the plan needs it."""
    import tensorflow as tf

    if isinstance(output, tf.IndexedSlices):
        return Output(None, np.dtype(output.values.dtype.as_numpy_dtype), "",
                      np.dtype(output.indices.dtype.as_numpy_dtype))
    shape = tuple(output.shape.as_list()) if output.shape.is_fully_defined() else None
    return Output(shape, np.dtype(output.dtype.as_numpy_dtype), allocation_site(output))
