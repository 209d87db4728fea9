"""The paper's six models and ``embedding`` in PyTorch (``bench.experiments.torch_models``): Table 2's sizes, the
Keras layouts' tensors, a step on one sample, a sparse embedding gradient, seeded builds, the Keras batches laid
out channels-first, and ``bench models --framework torch``."""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")

from bench.experiments import models, torch_models  # noqa: E402
from bench.experiments.models import MB, MODELS, describe_model, get_model  # noqa: E402

NAMES = ("alexnet", "inception_v3", "vgg16", "lstm", "gru", "fcn5")
#: inputs small enough for a step in a second on a busy CI machine (the layouts' sizes do not depend on them, but
#: AlexNet's and VGG16's first dense layers do: their size tests build at 224x224)
SMALL_INPUTS = {"alexnet": (3, 67, 67), "vgg16": (3, 32, 32), "inception_v3": (3, 107, 107), "lstm": (4, 1024),
                "gru": (4, 1024)}


def _small(name: str):
    defn = get_model(name, framework="torch")
    return replace(defn, input_shape=SMALL_INPUTS[name]) if name in SMALL_INPUTS else defn


def _on_meta(defn):
    """``defn``'s model with its tensors' shapes and no memory (for sizes)."""
    with torch.device("meta"):
        return defn.build()


def _built(defn, seed: int = 0):
    torch.manual_seed(seed)
    return defn.build()


def test_the_torch_registry_is_the_paper_six_and_embedding_in_pytorch():
    known = [*torch_models.TORCH_MODELS, *torch_models.TORCH_EXTRA_MODELS]
    assert known == [*NAMES, "embedding"]
    for name in known:
        defn = get_model(name, framework="torch")
        keras_defn = get_model(name)
        assert defn.framework == "torch" and keras_defn.framework == "tensorflow"
        assert defn.num_classes == keras_defn.num_classes and defn.paper == keras_defn.paper
    assert get_model("VGG16", framework="torch") is torch_models.TORCH_MODELS["vgg16"]
    assert get_model("vgg16") is MODELS["vgg16"]
    assert get_model("inception_v3", framework="torch").input_shape == (3, 299, 299)  # channels-first
    assert models.resolve_model("fcn5", framework="torch") is torch_models.TORCH_MODELS["fcn5"]
    assert models.resolve_model("fcn5") is MODELS["fcn5"]
    with pytest.raises(ValueError, match=r"^unknown framework 'jax': choose one of tensorflow, torch$"):
        get_model("fcn5", framework="jax")
    with pytest.raises(ValueError, match=r"unknown model 'resnet50' \(known: alexnet, .*, fcn5, embedding\)"):
        get_model("resnet50", framework="torch")


@pytest.mark.parametrize("name", NAMES)
def test_sizes_beside_table2(name):
    defn = get_model(name, framework="torch")
    info = describe_model(_on_meta(defn))
    if name in ("alexnet", "vgg16", "fcn5"):
        assert info["variables"] == defn.paper_variables
        assert info["model_mb"] == pytest.approx(defn.paper_model_mb, abs=0.005)
    elif name == "inception_v3":  # Keras' layout: no auxiliary classifier (6 tensors, 2,564,490 parameters)
        assert info["variables"] == defn.paper_variables - 6 == 190
        assert info["model_mb"] + 2_564_490 * 4 / MB == pytest.approx(defn.paper_model_mb, abs=0.005)
        assert info["non_trainable_variables"] == 94 * 2 == 188  # each batch norm's mean and variance, as Keras'
    elif name == "lstm":  # PyTorch's second bias (bias_hh) of 4 x 1024
        assert info["variables"] == 6
        assert info["model_mb"] - 4 * 1024 * 4 / MB == pytest.approx(defn.paper_model_mb, abs=0.005)
    else:  # gru: two biases of 3 x 1024, as Keras' reset_after=True
        assert info["variables"] == 6
        assert info["model_mb"] - 3 * 1024 * 4 / MB == pytest.approx(defn.paper_model_mb, abs=0.005)


def test_vgg16_alexnet_fcn5_and_inception_have_the_keras_models_tensors():
    keras = pytest.importorskip("keras")
    for name in ("vgg16", "alexnet", "fcn5", "inception_v3"):
        keras_defn, torch_defn = get_model(name), get_model(name, framework="torch")
        if name == "inception_v3":  # sizes do not depend on the input after global pooling: build it small
            keras_defn, torch_defn = replace(keras_defn, input_shape=(75, 75, 3)), replace(torch_defn,
                                                                                         input_shape=(3, 75, 75))
        keras.backend.clear_session()
        keras_model = keras_defn.build()
        keras_sizes = sorted(int(np.prod(v.shape)) for v in keras_model.trainable_variables)
        keras_bytes = sum(int(np.prod(v.shape)) * 4 for v in keras_model.trainable_variables)
        del keras_model
        torch_model = _on_meta(torch_defn)
        assert sorted(p.numel() for p in torch_model.parameters()) == keras_sizes, name
        assert sum(p.numel() * p.element_size() for p in torch_model.parameters()) == keras_bytes, name
    keras.backend.clear_session()


def test_describe_model_names_a_torch_models_largest_tensors():
    info = describe_model(_on_meta(get_model("vgg16", framework="torch")))
    assert info["parameters"] == 134_301_514
    assert info["largest"][0] == {"name": "fc1.weight", "shape": (4096, 25088), "mb": 392.0}
    assert info["non_trainable_variables"] == 0 and info["non_trainable_mb"] == 0


@pytest.mark.parametrize("name", [*NAMES, "embedding"])
def test_a_step_on_one_sample_gives_finite_gradients_for_every_parameter(name):
    defn = _small(name)
    model = _built(defn)
    model.train()
    x, y = defn.make_batch(1, seed=0)
    logits = model(torch.from_numpy(x))
    assert tuple(logits.shape) == (1, defn.num_classes)
    loss = defn.loss_fn()(torch.from_numpy(y), logits)
    loss.backward()
    assert np.isfinite(float(loss.detach()))
    for path, parameter in model.named_parameters():
        gradient = parameter.grad
        assert gradient is not None, path
        assert gradient.is_sparse == (name == "embedding" and path == "embedding.weight"), path
        values = gradient.coalesce().values() if gradient.is_sparse else gradient
        assert bool(torch.isfinite(values).all()), path
    assert any(float(p.grad.abs().max()) > 0 for p in model.parameters() if not p.grad.is_sparse)


def test_the_embedding_gradient_is_the_rows_the_batch_looked_up():
    defn = get_model("embedding", framework="torch")
    model = _built(defn)
    x, y = defn.make_batch(3, seed=1)
    defn.loss_fn()(torch.from_numpy(y), model(torch.from_numpy(x))).backward()
    gradient = model.embedding.weight.grad
    assert gradient.is_sparse and tuple(gradient.shape) == (models.EMBED_ROWS, models.EMBED_DIM)
    assert tuple(gradient._values().shape) == (3 * models.EMBED_TOKENS, models.EMBED_DIM)
    np.testing.assert_array_equal(np.sort(gradient._indices()[0].numpy()), np.sort(x.ravel()))


def test_the_embedding_models_batch_norm_trains_on_one_sample_as_keras():
    model = _built(get_model("embedding", framework="torch"))
    norm = model.norm
    with torch.no_grad():
        norm.running_var.fill_(2.0)
    sample = torch.randn(1, 256)
    out = norm(sample)
    torch.testing.assert_close(out, norm.bias.detach().expand(1, 256))  # a sample's variance is 0: the bias
    torch.testing.assert_close(norm.running_mean, 0.01 * sample[0])
    torch.testing.assert_close(norm.running_var, torch.full((256,), 2.0 * 0.99))
    assert norm.num_batches_tracked is None  # unread with a momentum: not state the parameter server carries
    out.sum().backward()
    assert norm.weight.grad is not None and norm.bias.grad is not None


def test_inception_batch_norm_is_keras_scale_false():
    model = _on_meta(get_model("inception_v3", framework="torch"))
    first = model.conv1
    assert [path for path, _ in first.named_parameters()] == ["conv.weight", "bn.bias"]
    assert first.conv.bias is None and first.bn.weight is None
    assert (first.bn.eps, first.bn.momentum) == (1e-3, 0.01)
    assert [path for path, _ in first.named_buffers()] == ["bn.running_mean", "bn.running_var"]  # as Keras' state
    assert sum(1 for _ in model.buffers()) == 188  # Keras' non-trainable variables of Inception-v3


@pytest.mark.parametrize("name", ["alexnet", "embedding"])
def test_builds_are_deterministic_under_a_seed(name):
    defn = _small(name)
    first, again, other = _built(defn, 3).state_dict(), _built(defn, 3).state_dict(), _built(defn, 4).state_dict()
    assert list(first) == list(again)
    for key in first:
        torch.testing.assert_close(first[key], again[key], rtol=0, atol=0)
    assert any(not torch.equal(first[key], other[key]) for key in first if first[key].is_floating_point())


@pytest.mark.parametrize("name", ["alexnet", "lstm", "fcn5", "embedding"])
def test_a_torch_batch_is_the_keras_batch_laid_out_for_pytorch(name):
    keras_defn, torch_defn = get_model(name), get_model(name, framework="torch")
    x, y = torch_defn.make_batch(2, seed=5)
    keras_x, keras_y = keras_defn.make_batch(2, seed=5)
    assert x.shape == (2, *torch_defn.input_shape) and x.flags.c_contiguous
    assert y.dtype == np.int64 and x.dtype == (np.int64 if name == "embedding" else np.float32)
    np.testing.assert_array_equal(x, keras_x.transpose(0, 3, 1, 2) if keras_x.ndim == 4 else keras_x)
    np.testing.assert_array_equal(y, keras_y)
    assert keras_y.dtype == np.int32  # the Keras batch is unchanged


def test_a_torch_model_definition_travels_on_the_runs_wire():
    from bench.launch.wire import decode_message, encode_message

    defn = get_model("inception_v3", framework="torch")
    arrived = decode_message(encode_message(defn))
    assert arrived == defn and arrived.builder is defn.builder and arrived.framework == "torch"


def test_bench_models_framework_torch_prints_the_table_and_records_the_framework(capsys, tmp_path):
    from bench.cli import main
    from bench.results import load_run
    from bench.runtime.framework import framework_named

    out = tmp_path / "run"
    assert main(["models", "fcn5", "--framework", "torch", "--steps", "1", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    version = framework_named("torch").version()
    assert lines[0].startswith(f"torch {version}: forward+backward at batch size 1")
    assert lines[-2].startswith("fcn5") and "204.47" in lines[-2]
    run = load_run(out)
    assert run.meta["status"] == "complete" and run.meta["settings"]["framework"] == "torch"
    row = run.records.iloc[0]
    assert row["model"] == "fcn5" and row["framework"] == "torch" and row["framework_version"] == version
    assert row["variables"] == 10 and row["model_mb"] == pytest.approx(204.47, abs=0.005)
    assert row["compute_ms_per_sample"] > 0


def test_bench_models_refuses_an_unknown_model_in_torch(capsys, tmp_path):
    from bench.commands import models as command

    args = argparse.Namespace(models=["nope"], batch_size=1, steps=1, framework="torch", out=tmp_path / "run")
    assert command.run(args) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
