"""The paper's six benchmark models and the ``embedding`` model in PyTorch (``get_model(name, framework="torch")``,
``bench models --framework torch``), beside the Keras ones of ``bench.experiments.models``.

Our own ``torch.nn`` definitions (torchvision cannot be installed beside every torch a user has; nothing is
downloaded), layer for layer the Keras layouts, with the same synthetic data: a batch is the Keras model's batch
laid out for PyTorch (images channels-first ``(N, C, H, W)`` float32, token ids and labels int64). Every model
returns **logits**; the loss is :func:`cross_entropy` (``loss(y, logits)``, ``y`` first as Keras'). Weights are
PyTorch's default initialisation, deterministic after ``torch.manual_seed``.

Trainable sizes beside Table 2 (MB = 2**20 bytes of float32; tensors: ``named_parameters()``):

=============  ==========  =========  ============  =====================================================
model          ours (MB)   paper MB   tensors       against Keras' layout
=============  ==========  =========  ============  =====================================================
alexnet        176.42      176.42     16 (16)       the same tensors, transposed (PyTorch's own layout)
inception_v3   83.12       92.90      190 (196)     the same: batch norm without a scale, as Keras'
                                                    ``scale=False`` (a bias only, no weight)
vgg16          512.32      512.32     32 (32)       the same tensors
lstm           35.94       35.93      6 (14)        a second bias of 4 x 1024 (``bias_hh``): +0.0156 MB
gru            27.93       27.92      6 (11)        as Keras' ``reset_after=True`` GRU (two biases of
                                                    3 x 1024): +0.0117 MB on the paper
fcn5           204.47      204.47     10 (10)       the same tensors
=============  ==========  =========  ============  =====================================================

Inception-v3 leaves out the auxiliary classifier as the Keras model does (see ``bench.experiments.models``).
PyTorch's RNN cells keep an input and a recurrent bias per gate set where Keras' LSTM keeps one; Keras' GRU has
two as well. State (not trainable, not counted above): each batch norm's ``running_mean`` and ``running_var``, as
Keras' moving mean and variance: 188 buffers in Inception-v3, 2 in ``embedding``, as Keras' non-trainable
variables. PyTorch's batch count (``num_batches_tracked``, an int64 scalar) is left out (``None``): with a momentum
set, batch norm never reads it, and each would be one more tiny tensor through the parameter server every step (94
in Inception-v3, about 13 ms of a step's communication on this machine's 2 cores).

Batch norm as Keras': momentum 0.99 of the old statistics (PyTorch's ``momentum=0.01``), epsilon 1e-3. A batch
of one sample trains through the ``embedding`` model's batch norm as through Keras' (its output is the bias;
PyTorch's own refuses a single value per channel).

PyTorch is only imported inside functions, so importing this module is cheap.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from bench.experiments.models import (
    EMBED_DIM,
    EMBED_ROWS,
    EMBED_TOKENS,
    FCN_HIDDEN,
    FCN_INPUTS,
    PAPER_CLASSES,
    RNN_CLASSES,
    RNN_FEATURES,
    RNN_HIDDEN,
    RNN_STEPS,
    ModelDef,
    _token_batch,
)
from bench.launch.wire import wire_value

#: Keras' BatchNormalization defaults in PyTorch's terms (PyTorch's momentum weighs the new batch)
BN_MOMENTUM = 0.01
BN_EPSILON = 1e-3


def cross_entropy(y: Any, logits: Any) -> Any:
    """The loss of every model: mean cross-entropy of ``logits`` against integer labels ``y`` (``y`` first)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits, y)


def torch_batch(defn: ModelDef, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The Keras model's synthetic batch for the same ``seed``, laid out for PyTorch: images channels-first
    float32, token ids and labels int64 (the same samples in both frameworks)."""
    from bench.experiments.torch_tasks import torch_batch as laid_out

    shape = defn.input_shape
    keras_shape = (*shape[1:], shape[0]) if len(shape) == 3 else shape
    x, y = replace(defn, framework="tensorflow", input_shape=keras_shape).make_batch(batch_size, seed)
    return laid_out(x, y)


def variable_sizes(model: Any) -> tuple[list[tuple[str, tuple[int, ...], int]], list[int]]:
    """``model``'s trainable parameters as ``(path, shape, bytes)`` in ``named_parameters()`` order, and its
    buffers' sizes in bytes (the state: batch norm's statistics)."""
    trainable = [(path, tuple(parameter.shape), parameter.numel() * parameter.element_size())
                 for path, parameter in model.named_parameters() if parameter.requires_grad]
    return trainable, [buffer.numel() * buffer.element_size() for _, buffer in model.named_buffers()]


def measure_torch_compute(defn: ModelDef, batch_size: int, steps: int, *, model: Any | None = None,
                          seed: int = 0) -> float:
    """Seconds per sample of one forward + backward pass of a PyTorch model (training mode, gradients computed
    and not applied): one untimed warm-up step, then ``steps`` timed ones on a synthetic batch."""
    import torch

    if model is None:
        torch.manual_seed(seed)
        model = defn.build()
    model.train()
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    x, y = (torch.from_numpy(array) for array in defn.make_batch(batch_size, seed))
    loss = defn.loss_fn()

    def step() -> float:
        for parameter in parameters:
            parameter.grad = None
        value = loss(y, model(x))
        value.backward()
        return float(value.detach())  # backward() has returned: every gradient is computed

    step()  # warm up
    started = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - started
    for parameter in parameters:
        parameter.grad = None
    return elapsed / (steps * batch_size)


# -- layers Keras has and torch.nn has not -----------------------------------------------------------------------


@functools.cache
def _layers() -> SimpleNamespace:
    """The ``torch.nn`` modules the builders share (defined once torch is imported)."""
    import torch
    from torch import nn

    class BiasOnlyBatchNorm2d(nn.BatchNorm2d):
        """Keras' ``BatchNormalization(scale=False)``: normalise, then add a bias (``beta``); no weight."""

        def __init__(self, channels: int) -> None:
            super().__init__(channels, eps=BN_EPSILON, momentum=BN_MOMENTUM, affine=False)
            self.bias = nn.Parameter(torch.zeros(channels))  # batch_norm takes a bias without a weight
            self.num_batches_tracked = None  # (unread with a momentum set: see the module)

    class BatchNorm1d(nn.BatchNorm1d):
        """Keras' ``BatchNormalization()`` over features, which trains on a batch of one sample too: its
        variance is then 0, the output the bias, and the moving variance decays (PyTorch's own refuses it)."""

        def __init__(self, features: int) -> None:
            super().__init__(features, eps=BN_EPSILON, momentum=BN_MOMENTUM)
            self.num_batches_tracked = None  # (unread with a momentum set: see the module)

        def forward(self, x: Any) -> Any:
            if not (self.training and x.shape[0] == 1):
                return super().forward(x)
            out = torch.batch_norm(x, self.weight, self.bias, None, None, True, 0.0, self.eps, False)
            with torch.no_grad():
                self.running_mean.lerp_(x.detach()[0], self.momentum)
                self.running_var.mul_(1.0 - self.momentum)
            return out

    class Concat(nn.Module):
        """Branches run on the same input, their outputs concatenated along the channels (an Inception block)."""

        def __init__(self, **branches: Any) -> None:
            super().__init__()
            for name, branch in branches.items():
                self.add_module(name, branch)

        def forward(self, x: Any) -> Any:
            return torch.cat([branch(x) for branch in self.children()], dim=1)

    class Recurrent(nn.Module):
        """One recurrent layer over the steps (batch first), its last output through a dense layer."""

        def __init__(self, kind: str, features: int, hidden: int, classes: int) -> None:
            super().__init__()
            self.kind = kind
            self.add_module(kind, getattr(nn, kind.upper())(features, hidden, batch_first=True))
            self.logits = nn.Linear(hidden, classes)

        def forward(self, x: Any) -> Any:
            outputs, _ = getattr(self, self.kind)(x)
            return self.logits(outputs[:, -1])

    class EmbeddingClassifier(nn.Module):
        """Tokens -> embedding (a sparse gradient) -> mean -> 256 (ReLU) -> batch norm -> classes."""

        def __init__(self, classes: int) -> None:
            super().__init__()
            self.embedding = nn.Embedding(EMBED_ROWS, EMBED_DIM, sparse=True)
            self.hidden = nn.Linear(EMBED_DIM, 256)
            self.norm = BatchNorm1d(256)
            self.logits = nn.Linear(256, classes)

        def forward(self, tokens: Any) -> Any:
            return self.logits(self.norm(torch.relu(self.hidden(self.embedding(tokens).mean(dim=1)))))

    return SimpleNamespace(BiasOnlyBatchNorm2d=BiasOnlyBatchNorm2d, BatchNorm1d=BatchNorm1d, Concat=Concat,
                           Recurrent=Recurrent, EmbeddingClassifier=EmbeddingClassifier)


def _side(side: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """The output side of a convolution or pooling window over ``side`` pixels."""
    return (side + 2 * padding - kernel) // stride + 1


def _too_small(name: str, input_shape: tuple[int, ...], side: int) -> None:
    if side < 1:
        raise ValueError(f"input {input_shape} is too small for {name}: its last pooling has no pixel left; "
                         "give a larger input_shape")


# -- builders: (input_shape, num_classes) -> torch.nn.Module producing logits; input_shape channels-first -----------


@wire_value  # a model's builder travels to the ranks in its ModelDef
def _alexnet(input_shape: tuple[int, ...], num_classes: int) -> Any:
    """AlexNet as in tf_cnn_benchmarks (one tower, no LRN), as ``models._alexnet``: 5 conv + 3 dense, 16 tensors."""
    from torch import nn

    channels, side, _ = input_shape
    side = _side(_side(_side(_side(side, 11, 4), 3, 2), 3, 2), 3, 2)
    _too_small("alexnet", input_shape, side)
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(channels, 64, 11, stride=4)), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(3, 2)),
        ("conv2", nn.Conv2d(64, 192, 5, padding=2)), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(3, 2)),
        ("conv3", nn.Conv2d(192, 384, 3, padding=1)), ("relu3", nn.ReLU()),
        ("conv4", nn.Conv2d(384, 384, 3, padding=1)), ("relu4", nn.ReLU()),
        ("conv5", nn.Conv2d(384, 256, 3, padding=1)), ("relu5", nn.ReLU()), ("pool5", nn.MaxPool2d(3, 2)),
        ("flatten", nn.Flatten()),
        ("fc6", nn.Linear(256 * side * side, 4096)), ("relu6", nn.ReLU()), ("drop6", nn.Dropout(0.5)),
        ("fc7", nn.Linear(4096, 4096)), ("relu7", nn.ReLU()), ("drop7", nn.Dropout(0.5)),
        ("logits", nn.Linear(4096, num_classes)),
    ]))


@wire_value
def _vgg16(input_shape: tuple[int, ...], num_classes: int) -> Any:
    """VGG16 as Keras' (``keras.applications.VGG16``): 13 conv + 3 dense, 32 tensors."""
    from torch import nn

    channels, side, _ = input_shape
    layers: list[tuple[str, Any]] = []
    for block, (width, convs) in enumerate(((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)), start=1):
        for number in range(1, convs + 1):
            layers += [(f"block{block}_conv{number}", nn.Conv2d(channels, width, 3, padding=1)),
                       (f"block{block}_relu{number}", nn.ReLU())]
            channels = width
        layers.append((f"block{block}_pool", nn.MaxPool2d(2, 2)))
        side //= 2
    _too_small("vgg16", input_shape, side)
    layers += [("flatten", nn.Flatten()), ("fc1", nn.Linear(channels * side * side, 4096)), ("relu1", nn.ReLU()),
               ("fc2", nn.Linear(4096, 4096)), ("relu2", nn.ReLU()), ("predictions", nn.Linear(4096, num_classes))]
    return nn.Sequential(OrderedDict(layers))


@wire_value
def _inception_v3(input_shape: tuple[int, ...], num_classes: int) -> Any:
    """Inception-v3 as Keras' (``keras.applications.InceptionV3``): 94 convolutions without bias, each with a batch
    norm that has a bias and no scale, then global average pooling and the logits; 190 tensors. No auxiliary
    classifier. The input must be at least 75x75 (107x107 to train on one sample: batch norm needs two values)."""
    from torch import nn

    parts = _layers()

    def conv(cin: int, cout: int, kernel: int | tuple[int, int], stride: int = 1, same: bool = True) -> Any:
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        return nn.Sequential(OrderedDict([
            ("conv", nn.Conv2d(cin, cout, (kh, kw), stride=stride, padding=(kh // 2, kw // 2) if same else 0,
                               bias=False)),
            ("bn", parts.BiasOnlyBatchNorm2d(cout)), ("relu", nn.ReLU()),
        ]))

    def chain(*convs: Any) -> Any:
        return nn.Sequential(*convs)

    def pooled(cin: int, cout: int) -> Any:
        return chain(nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False), conv(cin, cout, 1))

    def block_a(cin: int, pool: int) -> Any:  # mixed0-2: 35x35
        return parts.Concat(branch1x1=conv(cin, 64, 1), branch5x5=chain(conv(cin, 48, 1), conv(48, 64, 5)),
                            branch3x3dbl=chain(conv(cin, 64, 1), conv(64, 96, 3), conv(96, 96, 3)),
                            branch_pool=pooled(cin, pool))

    def block_c(c7: int) -> Any:  # mixed4-7: 17x17, 768 channels
        return parts.Concat(
            branch1x1=conv(768, 192, 1),
            branch7x7=chain(conv(768, c7, 1), conv(c7, c7, (1, 7)), conv(c7, 192, (7, 1))),
            branch7x7dbl=chain(conv(768, c7, 1), conv(c7, c7, (7, 1)), conv(c7, c7, (1, 7)), conv(c7, c7, (7, 1)),
                               conv(c7, 192, (1, 7))),
            branch_pool=pooled(768, 192))

    def block_e(cin: int) -> Any:  # mixed9-10: 8x8
        def split(width: int) -> Any:
            return parts.Concat(a=conv(width, 384, (1, 3)), b=conv(width, 384, (3, 1)))

        return parts.Concat(branch1x1=conv(cin, 320, 1), branch3x3=chain(conv(cin, 384, 1), split(384)),
                            branch3x3dbl=chain(conv(cin, 448, 1), conv(448, 384, 3), split(384)),
                            branch_pool=pooled(cin, 192))

    channels = input_shape[0]
    layers = [
        ("conv1", conv(channels, 32, 3, stride=2, same=False)), ("conv2", conv(32, 32, 3, same=False)),
        ("conv3", conv(32, 64, 3)), ("pool1", nn.MaxPool2d(3, 2)),
        ("conv4", conv(64, 80, 1, same=False)), ("conv5", conv(80, 192, 3, same=False)), ("pool2", nn.MaxPool2d(3, 2)),
        ("mixed0", block_a(192, 32)), ("mixed1", block_a(256, 64)), ("mixed2", block_a(288, 64)),
        ("mixed3", parts.Concat(branch3x3=conv(288, 384, 3, stride=2, same=False),
                                branch3x3dbl=chain(conv(288, 64, 1), conv(64, 96, 3),
                                                   conv(96, 96, 3, stride=2, same=False)),
                                branch_pool=nn.MaxPool2d(3, 2))),
        ("mixed4", block_c(128)), ("mixed5", block_c(160)), ("mixed6", block_c(160)), ("mixed7", block_c(192)),
        ("mixed8", parts.Concat(branch3x3=chain(conv(768, 192, 1), conv(192, 320, 3, stride=2, same=False)),
                                branch7x7x3=chain(conv(768, 192, 1), conv(192, 192, (1, 7)), conv(192, 192, (7, 1)),
                                                  conv(192, 192, 3, stride=2, same=False)),
                                branch_pool=nn.MaxPool2d(3, 2))),
        ("mixed9", block_e(1280)), ("mixed10", block_e(2048)),
        ("avg_pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten()), ("predictions", nn.Linear(2048, num_classes)),
    ]
    return nn.Sequential(OrderedDict(layers))


@wire_value
def _lstm(input_shape: tuple[int, ...], num_classes: int) -> Any:
    """One LSTM layer of 1024 over 80 steps; the last output goes through a dense layer to the classes."""
    return _layers().Recurrent("lstm", input_shape[-1], RNN_HIDDEN, num_classes)


@wire_value
def _gru(input_shape: tuple[int, ...], num_classes: int) -> Any:
    """One GRU layer of 1024 over 80 steps (PyTorch's GRU resets after the recurrent product, as Keras'
    ``reset_after=True``), then a dense layer to the classes."""
    return _layers().Recurrent("gru", input_shape[-1], RNN_HIDDEN, num_classes)


@wire_value
def _fcn5(input_shape: tuple[int, ...], num_classes: int) -> Any:
    """FCN-5 as ``models._fcn5``: 784 -> 4096 -> 4096 -> 4096 -> 4096 -> classes, 10 tensors."""
    from torch import nn

    layers: list[tuple[str, Any]] = []
    features = input_shape[0]
    for number in range(1, 5):
        layers += [(f"fc{number}", nn.Linear(features, FCN_HIDDEN)), (f"relu{number}", nn.ReLU())]
        features = FCN_HIDDEN
    layers.append(("logits", nn.Linear(features, num_classes)))
    return nn.Sequential(OrderedDict(layers))


@wire_value
def _embedding(input_shape: tuple[int, ...], num_classes: int) -> Any:
    """The dynamic model as ``models._embedding``: its table's gradient is sparse (``nn.Embedding(sparse=True)``):
    the rows the batch looked up."""
    return _layers().EmbeddingClassifier(num_classes)


# -- the registry ----------------------------------------------------------------------------------------------


#: the paper's six in PyTorch, in Table 2's order (``get_model(name, framework="torch")``)
TORCH_MODELS: dict[str, ModelDef] = {
    defn.name: defn
    for defn in (
        ModelDef("alexnet", (3, 224, 224), PAPER_CLASSES, _alexnet, framework="torch"),
        ModelDef("inception_v3", (3, 299, 299), PAPER_CLASSES, _inception_v3, framework="torch"),
        ModelDef("vgg16", (3, 224, 224), PAPER_CLASSES, _vgg16, framework="torch"),
        ModelDef("lstm", (RNN_STEPS, RNN_FEATURES), RNN_CLASSES, _lstm, framework="torch"),
        ModelDef("gru", (RNN_STEPS, RNN_FEATURES), RNN_CLASSES, _gru, framework="torch"),
        ModelDef("fcn5", (FCN_INPUTS,), PAPER_CLASSES, _fcn5, framework="torch"),
    )
}

#: beyond the paper's six, as ``models.EXTRA_MODELS``
TORCH_EXTRA_MODELS: dict[str, ModelDef] = {
    "embedding": ModelDef("embedding", (EMBED_TOKENS,), PAPER_CLASSES, _embedding, _token_batch, framework="torch"),
}
