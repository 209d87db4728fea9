"""Tiny PyTorch models for the framework conformance tests, importable by the spawned training processes (the
same shapes as ``tests.tiny_models``' Keras ones)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class _Classifier:
    """What every tiny model shares: PyTorch, and the cross entropy of integer labels on logits (``y`` first)."""

    framework = "torch"

    def loss_fn(self):
        import torch

        return lambda y, logits: torch.nn.functional.cross_entropy(logits, y)


@dataclass(frozen=True)
class TinyTorchMLP(_Classifier):
    """8 inputs, a hidden layer of 16, 3 classes."""

    name: str = "tiny_torch_mlp"

    def build(self):
        import torch

        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def make_batch(self, batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        return rng.standard_normal((batch_size, 8)).astype(np.float32), rng.integers(0, 3, batch_size)


TINY = TinyTorchMLP()


class _EmbeddingNet:
    """Tokens -> embedding of 4 (a sparse gradient) -> mean -> 5 -> BatchNorm -> 3 (made when torch is there)."""

    @staticmethod
    def make():
        import torch

        class EmbeddingNet(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embedding = torch.nn.Embedding(50, 4, sparse=True)
                self.hidden = torch.nn.Linear(4, 5)
                self.norm = torch.nn.BatchNorm1d(5)
                self.logits = torch.nn.Linear(5, 3)

            def forward(self, tokens):
                return self.logits(self.norm(self.hidden(self.embedding(tokens).mean(dim=1))))

        return EmbeddingNet()


@dataclass(frozen=True)
class TinyTorchEmbedding(_Classifier):
    """6 tokens of a vocabulary of 50 (few distinct: rows repeat), a sparse gradient and BatchNorm's state."""

    name: str = "tiny_torch_embedding"

    def build(self):
        return _EmbeddingNet.make()

    def make_batch(self, batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        return rng.integers(0, 12, (batch_size, 6)), rng.integers(0, 3, batch_size)


TINY_EMBEDDING = TinyTorchEmbedding()
