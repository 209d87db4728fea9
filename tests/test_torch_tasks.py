"""The convergence tasks in PyTorch (``bench.experiments.torch_tasks``): the Keras tasks' models layer for layer,
their batches laid out for PyTorch, trained by plain SGD, evaluated through a torch predict."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")
pytest.importorskip("sklearn")

from bench.experiments.tasks import TaskWorkload, task_workload  # noqa: E402
from bench.experiments.torch_tasks import TorchTaskWorkload, torch_batch  # noqa: E402


@pytest.fixture(scope="module")
def data_of(tmp_path_factory):
    """Each task's --data: none for digits and text, a tiny CIFAR-10 directory (random images) and seq2seq corpus."""
    root = tmp_path_factory.mktemp("tasks")
    cifar = root / "cifar"
    cifar.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("data_batch_1", 40), ("data_batch_2", 40), ("test_batch", 12)):
        batch = {b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, size=n)]}
        (cifar / name).write_bytes(pickle.dumps(batch, protocol=2))
    pairs = [(f"hello {i} world", f"bonjour {i} monde") for i in range(18)]
    (root / "corpus.src").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (root / "corpus.tgt").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return {"digits": None, "text": None, "cifar10": str(cifar), "seq2seq": str(root / "corpus")}


TASK_NAMES = ("digits", "text", "cifar10", "seq2seq")


def _built(workload, seed: int = 0):
    torch.manual_seed(seed)
    return workload.build()


def _loss(workload, model, batches) -> float:
    loss = workload.loss_fn()
    with torch.no_grad():
        return float(np.mean([float(loss(torch.from_numpy(y), model(torch.from_numpy(x)))) for x, y in batches]))


def test_task_workload_picks_the_framework():
    assert type(task_workload("digits")) is TaskWorkload and task_workload("digits").framework == "tensorflow"
    torch_digits = task_workload("digits", None, "torch")
    assert isinstance(torch_digits, TorchTaskWorkload) and torch_digits.framework == "torch"
    assert pickle.loads(pickle.dumps(torch_digits)) == torch_digits
    with pytest.raises(ValueError, match="unknown framework 'jax'"):
        task_workload("digits", None, "jax")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_batches_are_laid_out_for_torch(name, data_of):
    workload = task_workload(name, data_of[name], "torch")
    x, y = workload.train_batch(3, 1, 2, 8)
    keras_x, keras_y = workload.task.train_batch(3, 1, 2, 8)
    assert y.dtype == np.int64 and np.array_equal(y, keras_y)
    if keras_x.ndim == 4:  # images: channels first
        assert x.dtype == np.float32 and np.array_equal(x, keras_x.transpose(0, 3, 1, 2))
    else:  # token ids
        assert x.dtype == np.int64 and np.array_equal(x, keras_x)
    assert x.flags.c_contiguous and y.flags.c_contiguous
    made_x, _ = workload.make_batch(8, 5)
    assert np.array_equal(made_x, task_workload(name, data_of[name], "torch").train_batch(5, 0, 1, 8)[0])


@pytest.mark.parametrize("name", TASK_NAMES)
def test_build_is_deterministic_under_the_seed(name, data_of):
    workload = task_workload(name, data_of[name], "torch")
    a, b, c = (_built(workload, seed).state_dict() for seed in (3, 3, 4))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert isinstance(_built(workload), torch.nn.Module)


def test_trainable_sizes_equal_the_keras_models(data_of):
    keras = pytest.importorskip("keras")
    for name in TASK_NAMES:
        workload = task_workload(name, data_of[name], "torch")
        torch_sizes = [p.numel() for p in _built(workload).parameters() if p.requires_grad]
        keras.utils.set_random_seed(0)
        keras_sizes = [int(np.prod(v.shape)) for v in workload.task.build().trainable_variables]
        assert sum(torch_sizes) == sum(keras_sizes), name
        if name in ("digits", "cifar10"):  # the CNNs: variable for variable (a GRU's biases are split otherwise)
            assert torch_sizes == keras_sizes, name


@pytest.mark.parametrize("name", TASK_NAMES)
def test_plain_sgd_lowers_the_training_loss(name, data_of):
    workload = task_workload(name, data_of[name], "torch")
    model = _built(workload)
    loss = workload.loss_fn()
    batches = [workload.train_batch(step, 0, 1, 16) for step in range(2)]
    logits = model(torch.from_numpy(batches[0][0]))
    assert logits.shape[0] == 16 and logits.shape[-1] > 1
    before = _loss(workload, model, batches)
    rate = min(workload.task.default_learning_rate, 0.5)
    for _ in range(4):
        for x, y in batches:
            model.zero_grad()
            loss(torch.from_numpy(y), model(torch.from_numpy(x))).backward()
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter -= rate * parameter.grad
    assert _loss(workload, model, batches) < 0.9 * before


@pytest.mark.parametrize("name", ("digits", "seq2seq"))
def test_evaluate_with_a_torch_predict(name, data_of):
    workload = task_workload(name, data_of[name], "torch")
    model = _built(workload).eval()

    def predict(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(x)).numpy()

    scores = workload.evaluate(predict)
    x, y = torch_batch(*workload.task.heldout())
    metric = "accuracy" if name == "digits" else "perplexity"
    assert set(scores) == {"heldout_loss", metric}
    assert scores == pytest.approx(workload.task.score(y, predict(x)), rel=1e-5)
    with torch.no_grad():
        torch_loss = float(workload.loss_fn()(torch.from_numpy(y), model(torch.from_numpy(x))))
    assert scores["heldout_loss"] == pytest.approx(torch_loss, rel=1e-4)


def test_bench_converge_trains_a_torch_task_as_one_process_sgd_does(tmp_path):
    """``bench converge --framework torch`` through the parameter-server runtime: every transport's loss per step
    is the one-process SGD's from the same seeded start, and the records say torch."""
    from bench.results import load_run
    from tests.test_converge import bench

    out = tmp_path / "run"
    steps, lr = 4, 0.2
    result = bench("converge", "digits", "--framework", "torch", "--transport", "grpc_tcp,zerocopy", "--servers", "1",
                   "--batch-size", "8", "--steps", str(steps), "--eval-every", "2", "--learning-rate", str(lr),
                   "--seed", "0", "--out", str(out), "--no-plot")
    assert result.returncode == 0, result.stderr[-3000:]
    run = load_run(out)
    assert set(run.records["framework"]) == {"torch"}
    assert run.meta["loss_max_relative_difference"] == {"zerocopy": 0.0}

    workload = task_workload("digits", None, "torch")
    model, loss = _built(workload, 0), workload.loss_fn()
    expected = []
    for step in range(steps):
        x, y = workload.train_batch(step, 0, 1, 8)
        model.zero_grad()
        value = loss(torch.from_numpy(y), model(torch.from_numpy(x)))
        value.backward()
        expected.append(float(value.detach()))
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= lr * parameter.grad
    for transport, rows in run.records.query("kind == 'step'").groupby("transport"):
        assert rows.sort_values("step")["train_loss"].tolist() == pytest.approx(expected, rel=1e-5), transport
