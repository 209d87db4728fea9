"""Tiny models for runtime tests, importable by the spawned training processes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class _Classifier:
    """What every tiny model shares: the loss of 3-class integer labels on logits."""

    def loss_fn(self):
        import keras

        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@dataclass(frozen=True)
class TinyMLP(_Classifier):
    """8 inputs, a hidden layer of 16, 3 classes."""

    name: str = "tiny_mlp"

    def build(self):
        import keras

        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])

    def make_batch(self, batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        return rng.standard_normal((batch_size, 8)).astype(np.float32), rng.integers(0, 3, batch_size).astype(np.int32)


TINY = TinyMLP()


@dataclass(frozen=True)
class TinyEmbedding(_Classifier):
    """6 tokens of a vocabulary of 50 -> embedding of 4 (a sparse gradient) -> mean -> 5 -> BatchNorm -> 3."""

    name: str = "tiny_embedding"

    def build(self):
        import keras

        return keras.Sequential([
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(50, 4, name="embedding"),
            keras.layers.GlobalAveragePooling1D(name="mean"),
            keras.layers.Dense(5, name="hidden"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Dense(3, name="logits"),
        ])

    def make_batch(self, batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, 12, (batch_size, 6)).astype(np.int32)  # few distinct: rows repeat
        return tokens, rng.integers(0, 3, batch_size).astype(np.int32)


TINY_EMBEDDING = TinyEmbedding()


@dataclass(frozen=True)
class TinyDeep(_Classifier):
    """40 dense layers of 4 (80 variables): more tensors than a transport has threads."""

    name: str = "tiny_deep"

    def build(self):
        import keras

        return keras.Sequential([keras.Input((4,)), *[keras.layers.Dense(4, activation="tanh") for _ in range(39)],
                                 keras.layers.Dense(3)])

    def make_batch(self, batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        return rng.standard_normal((batch_size, 4)).astype(np.float32), rng.integers(0, 3, batch_size).astype(np.int32)


TINY_DEEP = TinyDeep()
