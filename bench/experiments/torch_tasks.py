"""The convergence tasks' models in PyTorch (``bench converge --framework torch``), beside the Keras ones of
``bench.experiments.tasks``.

Each task's data, shards, held-out set and evaluation are the task's own (``tasks.Task``); only the model, its
loss and the layout of a batch are PyTorch's:

- :func:`torch_builder` gives a ``torch.nn.Module`` returning logits, layer for layer the Keras model of the task
  (the same parameter counts), initialised as Keras initialises it (Glorot-uniform kernels, orthogonal recurrent
  kernels, zero biases), so that the task's default learning rate, steps and target hold for it too. Keras'
  one-hot-times-dense embedding is a plain ``nn.Embedding`` (its gradient dense, as the Keras one's).
- :func:`torch_loss` is ``loss(y, logits)`` (``y`` first, as Keras'): mean cross-entropy, over non-padding
  tokens for ``seq2seq``.
- :class:`TorchTaskWorkload` is what ``bench converge --framework torch`` hands the runtime
  (``tasks.task_workload(name, data, "torch")``).
- :func:`torch_batch` lays a task's batch out for PyTorch: images channels-first ``(N, C, H, W)`` float32,
  token ids and labels int64.

PyTorch is only imported inside functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from bench.experiments.tasks import PAD, Task, TaskWorkload


def torch_batch(x: np.ndarray, y: np.ndarray | None = None) -> Any:
    """``x`` (and ``y``) as a PyTorch model takes them: images ``(N, H, W, C)`` to ``(N, C, H, W)`` float32,
    integers (token ids, labels) to int64; ``(x, y)`` when ``y`` is given, else ``x``."""
    x = np.asarray(x)
    if x.ndim == 4:
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32)
    elif np.issubdtype(x.dtype, np.integer):
        x = np.ascontiguousarray(x, dtype=np.int64)
    else:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if y is None:
        return x
    return x, np.ascontiguousarray(y, dtype=np.int64)


# -- losses -------------------------------------------------------------------------------------------------------


def classification_loss(y: Any, logits: Any) -> Any:
    """Mean cross-entropy of ``logits`` against labels ``y`` (over the batch, and over tokens for sequences)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1).long())


def masked_token_loss(y: Any, logits: Any) -> Any:
    """Mean token cross-entropy over the positions where ``y != PAD`` (a scalar), as ``tasks.masked_token_loss``."""
    import torch.nn.functional as F

    labels = y.reshape(-1).long()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, reduction="none")
    mask = (labels != PAD).to(ce.dtype)
    return (ce * mask).sum() / mask.sum().clamp(min=1.0)


def torch_loss(task: Task) -> Callable[[Any, Any], Any]:
    """The task's training loss in PyTorch, ``loss(y, logits) -> scalar``."""
    return masked_token_loss if task.masked else classification_loss


# -- models -------------------------------------------------------------------------------------------------------


def _keras_init(model: Any) -> Any:
    """Initialise ``model`` as Keras does its layers: Glorot-uniform kernels and embeddings, orthogonal recurrent
    kernels (all gates' at once, as Keras' one recurrent kernel), zero biases."""
    import torch
    from torch import nn

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.xavier_uniform_(module.weight)
            elif isinstance(module, nn.GRU):
                for name, parameter in module.named_parameters():
                    if name.startswith("weight_ih"):
                        nn.init.xavier_uniform_(parameter)
                    elif name.startswith("weight_hh"):
                        nn.init.orthogonal_(parameter.T)
                    else:
                        nn.init.zeros_(parameter)
    return model


def _cnn(in_channels: int, widths: tuple[int, ...], pool_every: bool, side: int, hidden: int, classes: int) -> Any:
    """Convolutions of ``widths`` (3x3, same padding, ReLU), max-pooling 2 after each (``pool_every``) or after
    the last, then a ReLU dense layer of ``hidden`` and the logits: ``digits``' and ``cifar10``'s CNNs."""
    from torch import nn

    layers: list[Any] = []
    channels = in_channels
    for width in widths:
        layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
        if pool_every:
            layers.append(nn.MaxPool2d(2))
            side //= 2
        channels = width
    if not pool_every:
        layers.append(nn.MaxPool2d(2))
        side //= 2
    layers += [nn.Flatten(), nn.Linear(channels * side * side, hidden), nn.ReLU(), nn.Linear(hidden, classes)]
    return _keras_init(nn.Sequential(*layers))


def _char_gru(vocab: int) -> Any:
    """The text task's model: embedding 32, GRU-128 over the sequence, logits per position."""
    import torch

    class CharGRU(torch.nn.Module):
        """Embedding, GRU-128 and per-token logits (``tasks._text_model``)."""

        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(vocab, 32)
            self.gru = torch.nn.GRU(32, 128, batch_first=True)
            self.logits = torch.nn.Linear(128, vocab)

        def forward(self, ids: Any) -> Any:
            h, _ = self.gru(self.embedding(ids))
            return self.logits(h)

    return _keras_init(CharGRU())


def _char_seq2seq(src_vocab: int, tgt_vocab: int, src_len: int) -> Any:
    """The seq2seq task's model: the first ``src_len`` ids are the source (embedding 32, GRU-128 encoder), the
    rest the decoder's input (embedding 32, GRU-128 from the encoder's last state), logits per target position."""
    import torch

    class CharSeq2Seq(torch.nn.Module):
        """GRU encoder-decoder over characters (``tasks._s2s_model``)."""

        def __init__(self) -> None:
            super().__init__()
            self.src_embedding = torch.nn.Embedding(src_vocab, 32)
            self.encoder = torch.nn.GRU(32, 128, batch_first=True)
            self.tgt_embedding = torch.nn.Embedding(tgt_vocab, 32)
            self.decoder = torch.nn.GRU(32, 128, batch_first=True)
            self.logits = torch.nn.Linear(128, tgt_vocab)

        def forward(self, ids: Any) -> Any:
            _, state = self.encoder(self.src_embedding(ids[:, :src_len]))
            h, _ = self.decoder(self.tgt_embedding(ids[:, src_len:]), state)
            return self.logits(h)

    return _keras_init(CharSeq2Seq())


def torch_builder(task: Task) -> Callable[[], Any]:
    """``build()`` of the task's PyTorch model: a fresh ``torch.nn.Module`` returning logits (deterministic
    after ``torch.manual_seed``)."""
    info = task.info
    builders: dict[str, Callable[[], Any]] = {
        "digits": lambda: _cnn(1, (16, 32), False, 8, 64, 10),
        "cifar10": lambda: _cnn(3, (32, 64, 64), True, 32, 128, 10),
        "text": lambda: _char_gru(len(info.get("vocabulary", ()))),
        "seq2seq": lambda: _char_seq2seq(len(info.get("source_vocabulary", ())),
                                         len(info.get("target_vocabulary", ())), int(info.get("src_len", 0))),
    }
    if task.name not in builders:
        raise ValueError(f"task '{task.name}' has no PyTorch model (known: {', '.join(builders)}); "
                         "train it with --framework tensorflow")
    return builders[task.name]


@dataclass(frozen=True)
class TorchTaskWorkload(TaskWorkload):
    """A task as the runtime trains it in PyTorch (``bench.runtime.workload.RealData``): the task's data and
    evaluation, its PyTorch model and loss, batches laid out by :func:`torch_batch`."""

    framework: ClassVar[str] = "torch"

    def build(self) -> Any:
        return torch_builder(self.task)()

    def loss_fn(self) -> Any:
        return torch_loss(self.task)

    def make_batch(self, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        return torch_batch(*self.task.make_batch(batch_size, seed))

    def train_batch(self, step: int, server: int, servers: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        return torch_batch(*self.task.train_batch(step, server, servers, batch_size))

    def evaluate(self, predict: Callable[[np.ndarray], Any]) -> dict[str, float]:
        """The held-out loss and metric of ``predict(x) -> logits``, ``x`` laid out as PyTorch takes it."""
        return self.task.evaluate(lambda x: predict(torch_batch(x)))
