"""The six benchmark models of Xue et al., *Fast Distributed Deep Learning over RDMA* (EuroSys '19), Table 2.

AlexNet, Inception-v3, VGGNet-16 (CNN), LSTM, GRU (RNN) and FCN-5 (fully connected), in Keras 3 on
TensorFlow, with synthetic data generated on the fly (the paper's section 5.2 does the same, to keep data
loading out of the measurement). No weights are ever downloaded.

Layouts are chosen so that the sum of the trainable variable tensors (what a worker pulls from and pushes
to the parameter servers every mini-batch) matches the paper's "model size" column. Working back from
those sizes (MB = 2**20 bytes of float32) shows the paper's CNN and FCN models had **10 output classes**
(synthetic CIFAR/MNIST-like labels), not ImageNet's 1000:

=============  ===========================================  ==========  =========  =================
model          layout                                       ours (MB)   paper MB   variable tensors
=============  ===========================================  ==========  =========  =================
alexnet        tf_cnn_benchmarks AlexNet at 224x224 (conv   176.42      176.42     16 (paper 16)
               64-192-384-384-256, 5x5x256 -> 4096 -> 4096
               -> 10)
inception_v3   keras.applications.InceptionV3, 10 classes   83.12       92.90      190 (paper 196)
vgg16          keras.applications.VGG16, 10 classes         512.32      512.32     32 (paper 32)
lstm           (80, 1024) inputs, LSTM(1024), dense 1000    35.93       35.93      5 (paper 14)
gru            (80, 1024) inputs, GRU(1024), dense 1000     27.93       27.92      5 (paper 11)
fcn5           784 -> 4096 -> 4096 -> 4096 -> 4096 -> 10    204.47      204.47     10 (paper 10)
=============  ===========================================  ==========  =========  =================

Inception-v3: the paper's 196 tensors / 92.90 MB are exactly Keras' InceptionV3 (190 tensors: 94 conv
kernels, 94 batch-norm betas, dense kernel and bias) plus the auxiliary classifier of the Inception-v3
paper (6 tensors, 2,564,490 parameters, 9.78 MB). That head is a second output, and the runtime trains
single-output models, so it is left out here. The RNNs' variable counts differ (TensorFlow 1's cells
split their variables differently); their sizes match, up to Keras' second GRU bias (see ``_gru``).

For an ImageNet-sized head use ``get_model(name, num_classes=1000)`` (VGG16 is then 138,357,544 parameters,
527.79 MB).

Every model returns **logits**; ``loss_fn()`` is sparse categorical cross-entropy with
``from_logits=True``. TensorFlow is only imported inside functions, so importing this module is cheap.

The same models in PyTorch: ``get_model(name, framework="torch")``, defined in
``bench.experiments.torch_models`` (its docstring has their sizes beside these).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.ground.paper import TABLE2, PaperModel
from bench.launch.wire import wire_value

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if TYPE_CHECKING:
    import keras

    from bench.results import ModelsRecord

MB = 2**20
#: the paper's RNNs: hidden vector size and number of time steps (Table 2's note)
RNN_HIDDEN = 1024
RNN_STEPS = 80
#: per-step input features of the RNNs; 1024 is what makes Table 2's sizes come out (35.93 / 27.92 MB)
RNN_FEATURES = 1024
#: output classes of the RNNs (a 1024 -> 1000 dense layer), again from Table 2's sizes
RNN_CLASSES = 1000
#: output classes of the CNNs and FCN-5 in the paper (from Table 2's sizes, see the module docstring)
PAPER_CLASSES = 10
FCN_HIDDEN = 4096
#: FCN-5's input features (28x28, MNIST-like): the value that gives Table 2's 204.47 MB
FCN_INPUTS = 784


def _keras():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    return keras


def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


# -- builders: (input_shape, num_classes) -> uncompiled keras.Model producing logits ------------------


@wire_value  # a model's builder travels to the ranks in its ModelDef
def _alexnet(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """AlexNet as in tf_cnn_benchmarks (one tower, no LRN), at 224x224: 5 conv + 3 dense, 16 tensors."""
    keras = _keras()
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input(input_shape),
            layers.Conv2D(64, 11, strides=4, padding="valid", activation="relu", name="conv1"),
            layers.MaxPooling2D(3, strides=2, name="pool1"),
            layers.Conv2D(192, 5, padding="same", activation="relu", name="conv2"),
            layers.MaxPooling2D(3, strides=2, name="pool2"),
            layers.Conv2D(384, 3, padding="same", activation="relu", name="conv3"),
            layers.Conv2D(384, 3, padding="same", activation="relu", name="conv4"),
            layers.Conv2D(256, 3, padding="same", activation="relu", name="conv5"),
            layers.MaxPooling2D(3, strides=2, name="pool5"),
            layers.Flatten(name="flatten"),
            layers.Dense(4096, activation="relu", name="fc6"),
            layers.Dropout(0.5, name="drop6"),
            layers.Dense(4096, activation="relu", name="fc7"),
            layers.Dropout(0.5, name="drop7"),
            layers.Dense(num_classes, name="logits"),
        ],
        name="alexnet",
    )


@wire_value
def _inception_v3(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Keras' InceptionV3, random weights, logits (no auxiliary classifier)."""
    keras = _keras()
    return keras.applications.InceptionV3(
        weights=None, input_shape=input_shape, classes=num_classes, classifier_activation=None
    )


@wire_value
def _vgg16(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Keras' VGG16, random weights, logits: 13 conv + 3 dense, 32 tensors."""
    keras = _keras()
    return keras.applications.VGG16(
        weights=None, input_shape=input_shape, classes=num_classes, classifier_activation=None
    )


@wire_value
def _lstm(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """One LSTM layer of 1024 over 80 steps; the last hidden state goes through a dense layer to the classes."""
    keras = _keras()
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.LSTM(RNN_HIDDEN, name="lstm"),
            keras.layers.Dense(num_classes, name="logits"),
        ],
        name="lstm",
    )


@wire_value
def _gru(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """One GRU layer of 1024 over 80 steps, then a dense layer to the classes.

    Keras' default ``reset_after=True`` keeps a second recurrent bias (3072 parameters more: 27.93 MB
    against the paper's 27.92, whose TensorFlow 1 ``GRUCell`` had one bias per gate, as
    ``reset_after=False`` would). ``reset_after=False`` matches the size exactly but runs 2-3x slower on
    CPU here (slower than the LSTM, where the paper has it faster), so the default is kept.
    """
    keras = _keras()
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.GRU(RNN_HIDDEN, name="gru"),
            keras.layers.Dense(num_classes, name="logits"),
        ],
        name="gru",
    )


@wire_value
def _fcn5(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """FCN-5: five dense layers, an input layer and 3 hidden layers of 4096, then the output layer.

    Table 2's note ("3 hidden layers with dimension of 4096 and two layers of input and output") with its
    10 variable tensors and 204.47 MB means five weight layers: the input layer is itself a 4096-unit dense
    layer (784 -> 4096), followed by three 4096 -> 4096 hidden layers and the 4096 -> classes output.
    """
    keras = _keras()
    layers = [keras.Input(input_shape)]
    layers += [keras.layers.Dense(FCN_HIDDEN, activation="relu", name=f"fc{i}") for i in range(1, 5)]
    layers.append(keras.layers.Dense(num_classes, name="logits"))
    return keras.Sequential(layers, name="fcn5")


#: the dynamic model: an embedding table of EMBED_ROWS x EMBED_DIM looked up by EMBED_TOKENS tokens per sample
EMBED_ROWS = 100_000
EMBED_DIM = 64
EMBED_TOKENS = 128


@wire_value
def _embedding(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """A text classifier with a large embedding table: tokens -> embedding (sparse gradient) -> mean -> 256
    -> BatchNorm -> classes. Its table's gradient is ``IndexedSlices``: the rows the batch looked up."""
    keras = _keras()
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input(input_shape, dtype="int32"),
            layers.Embedding(EMBED_ROWS, EMBED_DIM, name="embedding"),
            layers.GlobalAveragePooling1D(name="mean"),
            layers.Dense(256, activation="relu", name="hidden"),
            layers.BatchNormalization(name="norm"),
            layers.Dense(num_classes, name="logits"),
        ],
        name="embedding",
    )


@wire_value
def _token_batch(defn: ModelDef, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids drawn from a Zipf law, as words are (a few rows looked up often, most rarely), and labels."""
    rng = np.random.default_rng(seed)
    tokens = (rng.zipf(1.3, size=(batch_size, *defn.input_shape)) - 1) % EMBED_ROWS
    return tokens.astype(np.int32), rng.integers(0, defn.num_classes, size=batch_size).astype(np.int32)


# -- the registry ----------------------------------------------------------------------------------------


def loss_fn() -> Any:
    """The loss of every model: sparse categorical cross-entropy on logits (integer labels)."""
    keras = _keras()
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@dataclass(frozen=True)
class ModelDef:
    """One benchmark model: how to build it, its synthetic data, and the paper's Table 2 figures.

    ``dataclasses.replace(defn, num_classes=1000)`` (or ``get_model(name, num_classes=1000)``) gives a
    variant with another output layer.
    """

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    builder: Callable[[tuple[int, ...], int], Any] = field(repr=False, compare=False)
    #: ``(defn, batch_size, seed) -> (x, y)`` for inputs other than standard-normal floats (token ids)
    batches: Callable[[Any, int, int], tuple[np.ndarray, np.ndarray]] | None = field(default=None, repr=False,
                                                                                   compare=False)
    #: the framework its builder and loss are written in (``bench.runtime.framework.FRAMEWORKS``); PyTorch's
    #: definitions are in ``bench.experiments.torch_models``
    framework: str = "tensorflow"

    @property
    def paper(self) -> PaperModel | None:
        """The model's row of the paper's Table 2 (``bench.ground.paper.TABLE2``), None for a model beyond the
        paper's."""
        return TABLE2.get(self.name)

    @property
    def paper_model_mb(self) -> float | None:
        """Table 2: the model size (MB), the sum of the variable tensors."""
        return self.paper.model_mb if self.paper else None

    @property
    def paper_variables(self) -> int | None:
        """Table 2: the number of variable tensors."""
        return self.paper.variables if self.paper else None

    @property
    def paper_compute_ms_per_sample(self) -> float | None:
        """Table 2: local computation time per sample (ms, one Tesla P100 GPU, single server)."""
        return self.paper.compute_ms_per_sample if self.paper else None

    def build(self) -> Any:
        """A fresh, uncompiled model with random weights: a ``keras.Model`` (deterministic after
        ``keras.utils.set_random_seed``) or, for PyTorch, a ``torch.nn.Module`` (after ``torch.manual_seed``)."""
        return self.builder(self.input_shape, self.num_classes)

    def make_batch(self, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """A synthetic mini-batch: float32 standard-normal inputs ``(batch_size, *input_shape)`` and int32 labels.

        PyTorch's is the same batch laid out for it: images channels-first, token ids and labels int64."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if self.framework == "torch":
            from bench.experiments.torch_models import torch_batch

            return torch_batch(self, batch_size, seed)
        if self.batches is not None:
            return self.batches(self, batch_size, seed)
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((batch_size, *self.input_shape), dtype=np.float32)
        y = rng.integers(0, self.num_classes, size=batch_size).astype(np.int32)
        return x, y

    def loss_fn(self) -> Any:
        """Sparse categorical cross-entropy from logits (the same for every model), ``loss(y, logits)``."""
        if self.framework == "torch":
            from bench.experiments.torch_models import cross_entropy

            return cross_entropy
        return loss_fn()


# The paper's six (Table 2; its numbers are in bench/ground/paper.py)
MODELS: dict[str, ModelDef] = {
    defn.name: defn
    for defn in (
        ModelDef("alexnet", (224, 224, 3), PAPER_CLASSES, _alexnet),
        ModelDef("inception_v3", (299, 299, 3), PAPER_CLASSES, _inception_v3),
        ModelDef("vgg16", (224, 224, 3), PAPER_CLASSES, _vgg16),
        ModelDef("lstm", (RNN_STEPS, RNN_FEATURES), RNN_CLASSES, _lstm),
        ModelDef("gru", (RNN_STEPS, RNN_FEATURES), RNN_CLASSES, _gru),
        ModelDef("fcn5", (FCN_INPUTS,), PAPER_CLASSES, _fcn5),
    )
}


#: models beyond the paper's six: ``embedding``, whose sparse gradient has a shape known only at run time
#: (the number of distinct rows a batch looks up), the analyzer's dynamic case
EXTRA_MODELS: dict[str, ModelDef] = {
    "embedding": ModelDef("embedding", (EMBED_TOKENS,), PAPER_CLASSES, _embedding, _token_batch),
}


def resolve_model(name: str, framework: str = "tensorflow") -> Any:
    """A model definition by name (``vgg16``) in ``framework``, or ``package.module:ATTRIBUTE`` for one defined
    elsewhere (anything with ``build``, ``loss_fn`` and ``make_batch``: ``bench.runtime.workload.Workload``; it
    names its own framework by a ``framework`` attribute, so ``framework`` does not choose it)."""
    if ":" in name:
        import importlib

        module, _, attribute = name.partition(":")
        return getattr(importlib.import_module(module), attribute)
    return get_model(name, framework=framework)


def _known_models(framework: str) -> dict[str, ModelDef]:
    """Every model defined in ``framework``, the paper's six first."""
    if framework == "tensorflow":
        return {**MODELS, **EXTRA_MODELS}
    if framework == "torch":
        from bench.experiments.torch_models import TORCH_EXTRA_MODELS, TORCH_MODELS

        return {**TORCH_MODELS, **TORCH_EXTRA_MODELS}
    from bench.runtime.framework import FRAMEWORKS  # imports no framework

    raise ValueError(f"unknown framework {framework!r}: choose one of {', '.join(FRAMEWORKS)}")


def get_model(name: str, *, num_classes: int | None = None, framework: str = "tensorflow") -> ModelDef:
    """The model definition called ``name`` (``vgg16``; case and ``-`` vs ``_`` do not matter) in ``framework``
    (``tensorflow``: Keras; ``torch``: ``torch.nn``, from ``bench.experiments.torch_models``).

    ``num_classes`` replaces the output layer's size (e.g. 1000 for ImageNet-sized CNN heads).
    Raises ``ValueError`` naming the known models for an unknown name (or the frameworks for an unknown one).
    """
    key = name.strip().lower().replace("-", "_")
    known = _known_models(framework)
    if key not in known:
        raise ValueError(f"unknown model '{name}' (known: {', '.join(known)})")
    defn = known[key]
    if num_classes is not None:
        if num_classes < 1:
            raise ValueError(f"num_classes must be at least 1, got {num_classes}")
        defn = replace(defn, num_classes=num_classes)
    return defn


# -- describing and measuring ----------------------------------------------------------------------------


def _variable_bytes(variable: Any) -> int:
    return int(np.prod(variable.shape, dtype=np.int64)) * np.dtype(str(variable.dtype)).itemsize


def describe_model(model: Any, largest: int = 5) -> dict[str, Any]:
    """Sizes of a model's variable tensors (what parameter-server training transfers every step), a Keras model's
    or a ``torch.nn.Module``'s.

    Returns ``variables`` (number of trainable tensors), ``parameters``, ``model_mb`` (their total size,
    MB = 2**20 bytes), ``largest`` (the ``largest`` biggest tensors as dicts with ``name``, ``shape``,
    ``mb``, biggest first), and ``non_trainable_variables`` / ``non_trainable_mb`` (e.g. batch-norm
    statistics, which the paper's counts leave out; a PyTorch model's buffers).
    """
    if _is_torch(model):
        from bench.experiments.torch_models import variable_sizes

        sizes, state = variable_sizes(model)
    else:
        sizes = [(v.path, tuple(int(d) for d in v.shape), _variable_bytes(v)) for v in model.trainable_variables]
        state = [_variable_bytes(v) for v in model.non_trainable_variables]
    biggest = sorted(sizes, key=lambda item: item[2], reverse=True)[:largest]
    return {
        "variables": len(sizes),
        "parameters": sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in sizes),
        "model_mb": sum(nbytes for _, _, nbytes in sizes) / MB,
        "largest": [{"name": path, "shape": shape, "mb": nbytes / MB} for path, shape, nbytes in biggest],
        "non_trainable_variables": len(state),
        "non_trainable_mb": sum(state) / MB,
    }


def _is_torch(model: Any) -> bool:
    """Whether ``model`` is a ``torch.nn.Module`` (it cannot be one unless torch has been imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def train_step_function(model: keras.Model, loss: Any | None = None) -> Callable[[Any, Any], tuple[Any, list[Any]]]:
    """A ``tf.function`` ``(x, y) -> (loss, gradients)``: one forward and backward pass, no update."""
    tf = _tf()
    loss = loss if loss is not None else loss_fn()
    variables = list(model.trainable_variables)

    @tf.function
    def step(x: Any, y: Any) -> tuple[Any, list[Any]]:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            value = loss(y, logits)
        return value, tape.gradient(value, variables)

    return step


def measure_compute(
    defn: ModelDef, batch_size: int = 1, steps: int = 3, *, model: Any | None = None, seed: int = 0
) -> float:
    """Seconds per sample of one forward + backward pass, measured here.

    Builds the model (unless ``model`` is given), traces a ``tf.function`` with a ``tf.GradientTape``, runs
    one untimed warm-up step, then times ``steps`` steps on a synthetic batch and divides by
    ``steps * batch_size``. Gradients are computed, not applied (the paper's local computation time). A PyTorch
    model's is the same under autograd (``torch_models.measure_torch_compute``).
    """
    if batch_size < 1 or steps < 1:
        raise ValueError(f"batch_size and steps must be at least 1, got {batch_size} and {steps}")
    if defn.framework == "torch":
        from bench.experiments.torch_models import measure_torch_compute

        return measure_torch_compute(defn, batch_size, steps, model=model, seed=seed)
    tf = _tf()
    if model is None:
        _keras().utils.set_random_seed(seed)
        model = defn.build()
    step = train_step_function(model, defn.loss_fn())
    x, y = defn.make_batch(batch_size, seed)
    x, y = tf.constant(x), tf.constant(y)
    value, _ = step(x, y)  # trace and warm up
    float(value)
    started = time.perf_counter()
    for _ in range(steps):
        value, grads = step(x, y)
        float(value)  # the outputs are materialised when the call returns; this makes sure
    elapsed = time.perf_counter() - started
    del grads
    return elapsed / (steps * batch_size)


def models_table(
    names: Iterable[str] | None = None,
    batch_size: int = 1,
    *,
    steps: int = 3,
    on_row: Callable[[ModelsRecord], None] | None = None,
    framework: str = "tensorflow",
) -> list[ModelsRecord]:
    """Build and measure each model (default: all six) in ``framework``; one record per model, in order, beside
    the paper's Table 2. ``on_row`` is called with each record as soon as it is measured (the big models take a
    while).
    """
    from bench.results import ModelsRecord
    from bench.runtime.framework import framework_named

    definitions = [get_model(name, framework=framework) for name in (list(names) if names else list(MODELS))]
    version = framework_named(framework).version()
    rows = []
    for defn in definitions:
        model = _fresh_model(defn, seed=0)
        info = describe_model(model)
        seconds = measure_compute(defn, batch_size=batch_size, steps=steps, model=model)
        del model
        gc.collect()
        row = ModelsRecord(model=defn.name, framework=framework, framework_version=version,
                           variables=info["variables"], paper_variables=defn.paper_variables,
                           parameters=info["parameters"], model_mb=info["model_mb"],
                           paper_model_mb=defn.paper_model_mb, batch_size=batch_size,
                           compute_ms_per_sample=seconds * 1e3,
                           paper_compute_ms_per_sample=defn.paper_compute_ms_per_sample)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    if framework == "tensorflow":
        _keras().backend.clear_session()
    return rows


def _fresh_model(defn: ModelDef, seed: int) -> Any:
    """``defn``'s model built afresh with its framework seeded by ``seed`` (Keras' session cleared first)."""
    if defn.framework == "torch":
        import torch

        torch.manual_seed(seed)
        return defn.build()
    keras = _keras()
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    return defn.build()


# (key, header, format); None prints as "-"
_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("model", "model", "s"),
    ("variables", "variables", "d"),
    ("paper_variables", "paper", "d"),
    ("model_mb", "model MB", ".2f"),
    ("paper_model_mb", "paper MB", ".2f"),
    ("compute_ms_per_sample", "compute ms/sample", ".2f"),
    ("paper_compute_ms_per_sample", "paper ms/sample", ".2f"),
)
_MIN_WIDTHS = {"model": len("inception_v3")}


def _cell(row: dict[str, Any], key: str, spec: str) -> str:
    value = row.get(key)
    return "-" if value is None else format(value, spec)


def _widths(rows: list[dict[str, Any]]) -> list[int]:
    return [
        max([len(header), _MIN_WIDTHS.get(key, 0)] + [len(_cell(row, key, spec)) for row in rows])
        for key, header, spec in _COLUMNS
    ]


def _line(cells: list[str], widths: list[int]) -> str:
    first, *rest = cells
    return "  ".join([first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))])


def table_header(widths: list[int] | None = None) -> list[str]:
    """The table's header lines; without ``widths``, the widths of an empty table (rows then printed as they
    come with :func:`row_line` line up with them)."""
    widths = widths or _widths([])
    return [_line([header for _, header, _ in _COLUMNS], widths), "  ".join("-" * w for w in widths)]


def row_line(row: dict[str, Any], widths: list[int] | None = None) -> str:
    """One model's line of the table (``widths``: those :func:`table_header` was given)."""
    widths = widths or _widths([])
    return _line([_cell(row, key, spec) for key, _, spec in _COLUMNS], widths)

