"""The real-data tasks of bench converge: datasets, shards, held-out sets, models, losses, metrics and errors."""

from __future__ import annotations

import math
import os
import pickle

import numpy as np
import pytest

from bench.experiments import tasks
from bench.experiments.tasks import TASKS, Task, TaskDataError, get_task

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
pytest.importorskip("sklearn")


def _functions(task: Task, seed: int = 0):
    """The model of ``task`` built as the runtime builds it, with a gradient step and a predict function."""
    keras.utils.set_random_seed(seed)
    model = task.build()
    loss = task.loss_fn()
    non_trainable = [v.value for v in model.non_trainable_variables]

    @tf.function(reduce_retracing=True)
    def step(weights, x, y):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            predictions, _ = model.stateless_call(weights, non_trainable, x, training=True)
            value = loss(y, predictions)
        return value, tape.gradient(value, weights)

    @tf.function(reduce_retracing=True)
    def forward(weights, x):
        return model.stateless_call(weights, non_trainable, x, training=False)[0]

    weights = [v.value.numpy() for v in model.trainable_variables]
    return model, step, forward, weights


def _sgd(task: Task, steps: int, lr: float, batch_size: int = 32, servers: int = 1):
    """Plain synchronous SGD as the runtime does it; the held-out scores before and after, and the gradients."""
    _, step, forward, weights = _functions(task)
    before = task.evaluate(lambda x: forward(weights, x).numpy())
    grads = None
    for s in range(steps):
        per_server = [step(weights, *task.train_batch(s, k, servers, batch_size))[1] for k in range(servers)]
        grads = per_server[0]
        weights = [w - lr * np.mean([np.asarray(g[i]) for g in per_server], axis=0) for i, w in enumerate(weights)]
    return before, task.evaluate(lambda x: forward(weights, x).numpy()), grads


# -- get_task ---------------------------------------------------------------------------------------------------


def test_get_task_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown task 'mnist'") as info:
        get_task("mnist")
    assert not isinstance(info.value, TaskDataError)
    for name in TASKS:
        assert name in str(info.value)


@pytest.mark.parametrize("name", ["cifar10", "seq2seq"])
def test_get_task_needs_data(name):
    with pytest.raises(TaskDataError, match=f"{name}: needs --data") as info:
        get_task(name)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["digits", "text"])
def test_get_task_takes_no_data(name, tmp_path):
    with pytest.raises(TaskDataError, match=f"{name}: takes no --data"):
        get_task(name, str(tmp_path))


def test_get_task_normalises_names_and_defaults_to_digits():
    assert get_task().name == "digits"
    assert get_task(" Digits ").name == "digits"
    assert tasks.DEFAULT_TASK in TASKS and set(tasks.NEEDS_DATA) <= set(TASKS)


# -- digits -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return get_task("digits")


def test_digits_attributes_and_shapes(digits):
    assert (digits.metric, digits.default_target) == ("accuracy", "accuracy=0.97")
    assert digits.default_learning_rate > 0 and digits.default_steps > 0 and digits.default_eval_every > 0
    x, y = digits.train_batch(3, 1, 2, 32)
    assert x.shape == (32, 8, 8, 1) and x.dtype == np.float32 and x.flags.c_contiguous
    assert y.shape == (32,) and y.dtype == np.int32
    assert x.min() >= 0.0 and x.max() <= 1.0 and x.max() > 0.9
    hx, hy = digits.heldout()
    assert 355 <= len(hy) <= 365 and hx.shape == (len(hy), 8, 8, 1) and hy.shape == (len(hy),)
    assert digits.train_size == 1797 - len(hy)
    assert np.bincount(hy).min() >= 30  # stratified: ~36 per class


def test_digits_shards_are_disjoint_and_deterministic(digits):
    servers, batch = 4, 32
    for step in (0, 5):
        shards = [digits.train_indices(step, k, servers, batch) for k in range(servers)]
        joined = np.concatenate(shards)
        assert len(np.unique(joined)) == servers * batch
        x0, y0 = digits.train_batch(step, 2, servers, batch)
        x1, y1 = digits.train_batch(step, 2, servers, batch)
        assert np.array_equal(x0, x1) and np.array_equal(y0, y1)
        assert np.array_equal(y0, digits.y_train[shards[2]])
    # one epoch of steps visits each training example exactly once
    per_step = servers * batch
    steps = digits.train_size // per_step
    seen = np.concatenate([digits.train_indices(s, k, servers, batch) for s in range(steps) for k in range(servers)])
    assert len(np.unique(seen)) == len(seen) == steps * per_step
    # the next epoch is shuffled differently
    n = digits.train_size
    first = digits.train_indices(0, 0, 1, n)
    second = digits.train_indices(1, 0, 1, n)
    assert sorted(first) == sorted(second) == list(range(n)) and not np.array_equal(first, second)
    # a batch straddling the epoch boundary wraps around
    assert len(digits.train_indices(0, 0, 1, n + 5)) == n + 5
    assert np.array_equal(digits.make_batch(32, 7)[1], digits.train_batch(7, 0, 1, 32)[1])
    with pytest.raises(ValueError):
        digits.train_indices(0, 2, 2, 32)


def test_digits_heldout_is_disjoint_from_training(digits):
    from sklearn.datasets import load_digits

    train, held = digits.info["train_indices"], digits.info["heldout_indices"]
    assert len(np.intersect1d(train, held)) == 0 and len(train) + len(held) == 1797
    images = load_digits().images.astype(np.float32) / 16.0
    assert np.array_equal(digits.heldout()[0][..., 0], images[held])
    assert np.array_equal(digits.x_train[..., 0], images[train])


def test_digits_sgd_lowers_the_loss(digits):
    before, after, grads = _sgd(digits, 60, digits.default_learning_rate)
    assert set(before) == {"heldout_loss", "accuracy"}
    assert before["accuracy"] < 0.3
    assert after["heldout_loss"] < 0.5 * before["heldout_loss"]
    assert after["accuracy"] > before["accuracy"] + 0.2
    assert all(isinstance(g, tf.Tensor) for g in grads)


def test_evaluate_matches_score_and_the_keras_loss(digits):
    _, _, forward, weights = _functions(digits)
    x, y = digits.heldout()
    logits = forward(weights, x).numpy()
    whole = digits.score(y, logits)
    for batch in (256, 7):
        in_batches = digits.evaluate(lambda b: forward(weights, b).numpy(), batch_size=batch)
        assert in_batches["heldout_loss"] == pytest.approx(whole["heldout_loss"], rel=1e-5)
        assert in_batches["accuracy"] == whole["accuracy"]
    assert whole["heldout_loss"] == pytest.approx(float(digits.loss_fn()(y, logits)), rel=1e-4)
    assert whole["accuracy"] == pytest.approx(float(np.mean(logits.argmax(1) == y)))


def test_build_is_deterministic_under_the_seed(digits):
    a = [w.copy() for w in _functions(digits, seed=3)[3]]
    b = _functions(digits, seed=3)[3]
    c = _functions(digits, seed=4)[3]
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
    assert not all(np.array_equal(u, v) for u, v in zip(a, c, strict=True))


# -- text -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text():
    return get_task("text")


def test_text_corpus_loads_and_heldout_is_the_tail(text):
    corpus, files = tasks.text_corpus()
    assert len(corpus) >= tasks.TEXT_MIN_CHARS and files
    assert all(os.path.isfile(f) for f in files)
    vocabulary = text.info["vocabulary"]
    split, seq = text.info["split"], text.info["seq_len"]
    assert split == int(len(corpus) * 0.9)

    x, y = text.heldout()
    assert x.dtype == np.int32 and x.shape[1] == seq and len(x) * seq <= tasks.TEXT_HELDOUT_TOKENS
    expected = corpus[split:split + seq + 1]
    known = [c if c in vocabulary[1:] else "<unk>" for c in expected]
    assert [vocabulary[i] for i in x[0]] == known[:-1]
    assert [vocabulary[i] for i in y[0]] == known[1:]
    # training windows come from the head only
    tx, ty = text.train_batch(0, 0, 1, 4)
    assert tx.shape == ty.shape == (4, seq) and np.array_equal(tx[:, 1:], ty[:, :-1])
    assert len(text.x_train) * seq <= split
    head = [c if c in vocabulary[1:] else "<unk>" for c in corpus[:seq]]
    assert [vocabulary[i] for i in text.x_train[0]] == head


def test_text_untrained_perplexity_is_about_the_vocabulary(text):
    vocab = len(text.info["vocabulary"])
    assert 60 <= vocab <= 130
    _, step, forward, weights = _functions(text)
    # a slice of the held-out set is enough to see it
    x, y = text.heldout()
    score = text.score(y[:64], forward(weights, x[:64]).numpy())
    assert set(score) == {"heldout_loss", "perplexity"}
    assert 0.7 * vocab < score["perplexity"] < 1.3 * vocab
    assert score["perplexity"] == pytest.approx(math.exp(score["heldout_loss"]))
    # the gradients are dense tensors (an Embedding layer's would be IndexedSlices)
    _, grads = step(weights, *text.train_batch(0, 0, 1, 8))
    assert all(isinstance(g, tf.Tensor) for g in grads) and len(grads) == len(weights)


# -- cifar10 ----------------------------------------------------------------------------------------------------


def _cifar_batch(path, n, seed, *, data=None, labels=None):
    rng = np.random.default_rng(seed)
    batch = {
        b"batch_label": b"testing batch",
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8) if data is None else data,
        b"labels": [int(v) for v in rng.integers(0, 10, size=n)] if labels is None else labels,
        b"filenames": [b"x.png"] * n,
    }
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)
    return batch


@pytest.fixture
def cifar_dir(tmp_path):
    root = tmp_path / "cifar"
    root.mkdir()
    for k in (1, 2):
        _cifar_batch(root / f"data_batch_{k}", 10, k)
    _cifar_batch(root / "test_batch", 6, 9)
    return root


def test_cifar10_loads_the_python_format(cifar_dir):
    task = get_task("cifar10", str(cifar_dir))
    assert task.metric == "accuracy" and task.train_size == 20
    with open(cifar_dir / "data_batch_2", "rb") as f:
        second = pickle.load(f, encoding="bytes")
    x, y = task.train_batch(0, 0, 1, 20)
    assert x.shape == (20, 32, 32, 3) and x.dtype == np.float32 and y.dtype == np.int32
    indices = task.train_indices(0, 0, 1, 20)
    k = int(np.flatnonzero(indices == 13)[0])  # data_batch_2's fourth image
    raw = second[b"data"][3]
    assert y[k] == second[b"labels"][3]
    # channel-major 3x32x32 -> 32x32x3: red (0, 0), green (0, 1), blue (31, 31)
    expected = (np.array([raw[0], raw[1024 + 1], raw[3072 - 1]]) / 255.0 - tasks.CIFAR_MEAN) / tasks.CIFAR_STD
    assert np.allclose([x[k, 0, 0, 0], x[k, 0, 1, 1], x[k, 31, 31, 2]], expected, atol=1e-5)
    hx, hy = task.heldout()
    with open(cifar_dir / "test_batch", "rb") as f:
        test = pickle.load(f, encoding="bytes")
    assert hx.shape == (6, 32, 32, 3) and list(hy) == test[b"labels"]
    _, step, forward, weights = _functions(task)
    value, grads = step(weights, x[:4], y[:4])
    assert np.isfinite(float(value)) and len(grads) == len(weights)
    assert set(task.evaluate(lambda b: forward(weights, b).numpy())) == {"heldout_loss", "accuracy"}


def test_cifar10_accepts_the_extracted_archive_directory(tmp_path, cifar_dir):
    outer = tmp_path / "outer"
    outer.mkdir()
    cifar_dir.rename(outer / "cifar-10-batches-py")
    assert get_task("cifar10", str(outer)).train_size == 20


def _cifar_error(path) -> str:
    with pytest.raises(TaskDataError) as info:
        get_task("cifar10", str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith("cifar10: ")
    return message


def test_cifar10_errors(tmp_path, cifar_dir):
    assert "does not exist" in _cifar_error(tmp_path / "nowhere")
    assert "is not a directory" in _cifar_error(cifar_dir / "test_batch")
    empty = tmp_path / "empty"
    empty.mkdir()
    message = _cifar_error(empty)
    assert f"{empty} has no data_batch_1" in message and "data_batch_1..5 and test_batch" in message
    (cifar_dir / "test_batch").unlink()
    assert "has no test_batch" in _cifar_error(cifar_dir)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"not a pickle at all", "is not a CIFAR-10 batch (unpickling failed"),
        (pickle.dumps([1, 2, 3]), "not a dict"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8)}), "no b'data' and b'labels'"),
        (pickle.dumps({b"data": np.zeros((2, 32, 32, 3), np.uint8), b"labels": [0, 1]}), "expected N x 3072 uint8"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}), "expected N x 3072 uint8"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1, 2]}), "2 images but labels"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}), "labels outside 0..9"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": os.getcwd}), "refusing to load"),
    ],
)
def test_cifar10_malformed_batches(cifar_dir, content, expected):
    (cifar_dir / "data_batch_2").write_bytes(content)
    message = _cifar_error(cifar_dir)
    assert str(cifar_dir / "data_batch_2") in message and expected in message


# -- seq2seq ----------------------------------------------------------------------------------------------------

PAIRS = [(f"hello {i} world", f"bonjour {i} monde") for i in range(18)] + [("abc xyz", "q"), ("z" * 200, "y" * 150)]


def _write_pairs(tmp_path, pairs=PAIRS, name="corpus"):
    prefix = tmp_path / name
    prefix.with_suffix(".src").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    prefix.with_suffix(".tgt").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return str(prefix)


def test_seq2seq_loads_aligned_files(tmp_path):
    task = get_task("seq2seq", _write_pairs(tmp_path))
    assert task.metric == "perplexity" and task.info["train_pairs"] == 18 and task.info["heldout_pairs"] == 2
    src_len, tgt_len = task.info["src_len"], task.info["tgt_len"]
    source_vocab, target_vocab = task.info["source_vocabulary"], task.info["target_vocabulary"]
    x, y = task.x_train, task.y_train
    assert x.dtype == y.dtype == np.int32 and x.shape == (18, src_len + tgt_len + 1) and y.shape == (18, tgt_len + 1)
    source, decoder_in = x[5, :src_len], x[5, src_len:]
    assert "".join(source_vocab[i] for i in source if i) == "hello 5 world"
    assert source[0] == tasks.PAD and source[-1] != tasks.PAD  # left-padded
    words = [target_vocab[i] for i in y[5] if i]
    assert "".join(words[:-1]) == "bonjour 5 monde" and words[-1] == "</s>"
    assert decoder_in[0] == tasks.S2S_BOS and np.array_equal(decoder_in[1:], y[5, :-1])
    # the held-out pairs are the last ones; the longest are truncated; unseen characters are <unk>
    hx, hy = task.heldout()
    assert len(hy) == 2 and (hy == tasks.S2S_UNK).any()
    assert (hx[1, :src_len] == tasks.S2S_UNK).sum() == min(200, src_len)
    # the masked loss and the metric ignore padding
    _, step, forward, weights = _functions(task)
    logits = forward(weights, hx).numpy()
    score = task.score(hy, logits)
    keep = hy != tasks.PAD
    assert score["heldout_loss"] == pytest.approx(float(task.loss_fn()(hy, logits)), rel=1e-4)
    padded_logits = logits.copy()
    padded_logits[~keep] = 1e3 * np.random.default_rng(0).standard_normal(padded_logits[~keep].shape)
    assert task.score(hy, padded_logits) == pytest.approx(score)
    assert score["perplexity"] == pytest.approx(math.exp(score["heldout_loss"]))
    value, grads = step(weights, *task.train_batch(0, 0, 1, 8))
    assert np.isfinite(float(value)) and all(isinstance(g, tf.Tensor) for g in grads)


def test_seq2seq_sgd_lowers_the_loss(tmp_path):
    task = get_task("seq2seq", _write_pairs(tmp_path, PAIRS[:18] * 5, name="repeated"))
    before, after, _ = _sgd(task, 30, task.default_learning_rate, batch_size=16)
    assert after["perplexity"] < 0.6 * before["perplexity"]


def _seq2seq_error(prefix) -> str:
    with pytest.raises(TaskDataError) as info:
        get_task("seq2seq", str(prefix))
    message = str(info.value)
    assert "\n" not in message and message.startswith("seq2seq: ")
    return message


def test_seq2seq_errors(tmp_path):
    prefix = tmp_path / "p"
    assert f"{prefix}.src does not exist" in _seq2seq_error(prefix)
    prefix.with_suffix(".src").write_text("a\nb\n", encoding="utf-8")
    assert f"{prefix}.tgt does not exist" in _seq2seq_error(prefix)
    prefix.with_suffix(".tgt").write_text("a\n", encoding="utf-8")
    assert f"{prefix}.src has 2 lines but {prefix}.tgt has 1 (the files must be aligned" in _seq2seq_error(prefix)
    prefix.with_suffix(".src").write_text("", encoding="utf-8")
    prefix.with_suffix(".tgt").write_text("", encoding="utf-8")
    assert "0 pairs of non-empty lines" in _seq2seq_error(prefix)
    prefix.with_suffix(".src").write_text("\n\n", encoding="utf-8")
    prefix.with_suffix(".tgt").write_text("x\ny\n", encoding="utf-8")
    assert "0 pairs of non-empty lines" in _seq2seq_error(prefix)
    prefix.with_suffix(".src").write_bytes(b"ok\n\xff\xfe bad\n")
    assert f"{prefix}.src is not UTF-8 (line 2" in _seq2seq_error(prefix)
    (tmp_path / "d.src").mkdir()
    assert "d.src is not a file" in _seq2seq_error(tmp_path / "d")
