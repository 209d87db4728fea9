"""The paper's six benchmark models: they build, have the paper's sizes, take synthetic batches, and train a step."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from bench.experiments import models
from bench.experiments.models import MB, MODELS, describe_model, get_model, row_line, table_header

keras = pytest.importorskip("keras")

NAMES = ("alexnet", "inception_v3", "vgg16", "lstm", "gru", "fcn5")


@pytest.fixture(scope="module")
def built():
    """Each model built once (seeded), shared by the tests of this file."""
    cache = {}

    def build(name):
        if name not in cache:
            keras.utils.set_random_seed(0)
            cache[name] = MODELS[name].build()
        return cache[name]

    yield build
    cache.clear()
    keras.backend.clear_session()


def test_registry_names_and_paper_figures():
    assert tuple(MODELS) == NAMES
    for name, defn in MODELS.items():
        assert defn.name == name
        assert defn.paper_model_mb is not None and defn.paper_model_mb > 0
        assert defn.paper_compute_ms_per_sample is not None and defn.paper_compute_ms_per_sample > 0
    assert MODELS["vgg16"].paper_model_mb == pytest.approx(512.32)


@pytest.mark.parametrize("name", NAMES)
def test_builds_with_input_shape_and_outputs(built, name):
    defn = MODELS[name]
    model = built(name)
    assert isinstance(model, keras.Model)
    assert tuple(model.input_shape) == (None, *defn.input_shape)
    assert tuple(model.output_shape) == (None, defn.num_classes)


@pytest.mark.parametrize("name", NAMES)
def test_size_matches_the_paper(built, name):
    defn = MODELS[name]
    info = describe_model(built(name))
    if name == "inception_v3":  # the paper also counts the auxiliary classifier: 6 tensors, 2,564,490 parameters
        assert info["variables"] == defn.paper_variables - 6
        assert info["model_mb"] + 2_564_490 * 4 / MB == pytest.approx(defn.paper_model_mb, abs=0.005)
    elif name == "gru":  # Keras' reset_after=True GRU has a second recurrent bias of 3 x 1024
        assert info["model_mb"] - 3 * 1024 * 4 / MB == pytest.approx(defn.paper_model_mb, abs=0.005)
    else:
        assert info["model_mb"] == pytest.approx(defn.paper_model_mb, abs=0.005)


def test_vgg16_size_and_variables(built):
    info = describe_model(built("vgg16"))
    assert info["variables"] == 32
    assert info["model_mb"] == pytest.approx(528, rel=0.05)
    assert info["largest"][0]["name"].endswith("fc1/kernel")
    assert info["largest"][0]["shape"] == (25088, 4096)
    assert info["largest"][0]["mb"] == pytest.approx(392.0)
    assert [t["mb"] for t in info["largest"]] == sorted((t["mb"] for t in info["largest"]), reverse=True)


def test_vgg16_with_imagenet_head_is_138m_parameters():
    keras.utils.set_random_seed(0)
    model = get_model("vgg16", num_classes=1000).build()
    info = describe_model(model)
    assert info["parameters"] == 138_357_544
    assert info["variables"] == 32
    assert info["model_mb"] == pytest.approx(528, rel=0.005)
    assert model.output_shape == (None, 1000)
    del model


def test_fcn5_layers(built):
    model = built("fcn5")
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    assert [(layer.kernel.shape[0], layer.units) for layer in dense] == [
        (784, 4096), (4096, 4096), (4096, 4096), (4096, 4096), (4096, 10)
    ]
    assert describe_model(model)["variables"] == 10


def test_rnn_configuration(built):
    for name, layer_type in (("lstm", keras.layers.LSTM), ("gru", keras.layers.GRU)):
        model = built(name)
        recurrent = [layer for layer in model.layers if isinstance(layer, layer_type)]
        assert len(recurrent) == 1 and recurrent[0].units == 1024
        assert MODELS[name].input_shape == (80, 1024)


@pytest.mark.parametrize("name", NAMES)
def test_make_batch_shapes_dtypes_and_determinism(name):
    defn = MODELS[name]
    x, y = defn.make_batch(2, seed=7)
    assert x.shape == (2, *defn.input_shape) and x.dtype == np.float32
    assert y.shape == (2,) and y.dtype == np.int32
    assert ((y >= 0) & (y < defn.num_classes)).all()
    x2, y2 = defn.make_batch(2, seed=7)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert not np.array_equal(x, defn.make_batch(2, seed=8)[0])


def test_make_batch_rejects_empty_batch():
    with pytest.raises(ValueError, match="at least 1"):
        MODELS["fcn5"].make_batch(0, seed=0)


def test_build_is_deterministic_given_the_seed():
    defn = MODELS["gru"]
    weights = []
    for _ in range(2):
        keras.utils.set_random_seed(3)
        weights.append([np.asarray(v.value) for v in defn.build().trainable_variables])
    for a, b in zip(*weights, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["fcn5", "lstm"])
def test_one_forward_backward_step(built, name):
    defn = MODELS[name]
    model = built(name)
    step = models.train_step_function(model, defn.loss_fn())
    x, y = defn.make_batch(1, seed=0)
    loss, grads = step(x, y)
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert len(grads) == len(model.trainable_variables)
    for grad, variable in zip(grads, model.trainable_variables, strict=True):
        assert tuple(grad.shape) == tuple(variable.shape)
    assert any(float(np.abs(np.asarray(g)).max()) > 0 for g in grads)


def test_measure_compute_returns_seconds_per_sample(built):
    seconds = models.measure_compute(MODELS["fcn5"], batch_size=2, steps=1, model=built("fcn5"))
    assert seconds > 0


def test_unknown_model_name():
    known = r"\(known: alexnet, inception_v3, vgg16, lstm, gru, fcn5, embedding\)"
    with pytest.raises(ValueError, match=r"unknown model 'resnet50' " + known):
        get_model("resnet50")
    assert get_model("Inception-v3") is MODELS["inception_v3"]


def test_the_models_table_as_bench_models_prints_it_aligns_and_shows_unknowns():
    rows = [
        {"model": "vgg16", "variables": 32, "paper_variables": 32, "model_mb": 512.3196, "paper_model_mb": 512.32,
         "compute_ms_per_sample": 1234.5678, "paper_compute_ms_per_sample": 30.92},
        {"model": "inception_v3", "variables": 190, "paper_variables": None, "model_mb": 83.1, "paper_model_mb": None,
         "compute_ms_per_sample": 5.0, "paper_compute_ms_per_sample": None},
    ]
    lines = [*table_header(), *(row_line(row) for row in rows)]  # as bench models prints it, row by row
    assert len(lines) == 4
    assert len({len(line) for line in lines}) == 1
    assert "512.32" in lines[2] and "1234.57" in lines[2]
    assert lines[3].startswith("inception_v3") and lines[3].rstrip().endswith("-")


def test_bench_models_rejects_unknown_names(capsys, tmp_path):
    from bench.commands import models as command

    assert command.run(argparse.Namespace(models=["nope"], batch_size=1, steps=1, out=tmp_path / "run")) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_bench_models_prints_a_row_per_model_and_writes_them_as_a_run(capsys, tmp_path):
    from bench.commands import models as command
    from bench.results import load_run

    assert command.run(argparse.Namespace(models=["fcn5"], batch_size=1, steps=1, out=tmp_path / "run")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("fcn5") and "204.47" in out[-2]
    assert out[-1] == f"results: {tmp_path / 'run'}"
    run = load_run(tmp_path / "run")
    assert run.experiment == "models" and run.meta["status"] == "complete"
    row = run.records.iloc[0]
    assert row["model"] == "fcn5" and row["paper_model_mb"] == 204.47 and row["variables"] == 10
    assert row["model_mb"] == pytest.approx(204.47, abs=0.01) and row["compute_ms_per_sample"] > 0


def test_the_embedding_model_looks_up_token_rows_with_a_sparse_gradient():
    import tensorflow as tf

    defn = get_model("embedding")
    assert "embedding" not in MODELS  # beyond the paper's Table 2
    x, y = defn.make_batch(4, seed=1)
    assert x.dtype == np.int32 and x.shape == (4, models.EMBED_TOKENS) and x.min() >= 0 and x.max() < models.EMBED_ROWS
    assert len(np.unique(x)) < x.size  # Zipf: tokens repeat, so the distinct rows are fewer than the lookups
    model = defn.build()
    with tf.GradientTape() as tape:
        loss = defn.loss_fn()(y, model(x, training=True))
    table_gradient = tape.gradient(loss, model.trainable_variables)[0]
    assert isinstance(table_gradient, tf.IndexedSlices)
    assert table_gradient.values.shape == (4 * models.EMBED_TOKENS, models.EMBED_DIM)
