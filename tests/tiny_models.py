"""A tiny model for runtime tests, importable by the spawned training processes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TinyMLP:
    """8 inputs, a hidden layer of 16, 3 classes."""

    name: str = "tiny_mlp"

    def build(self):
        import keras

        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])

    def make_batch(self, batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        return rng.standard_normal((batch_size, 8)).astype(np.float32), rng.integers(0, 3, batch_size).astype(np.int32)

    def loss_fn(self):
        import keras

        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


TINY = TinyMLP()
