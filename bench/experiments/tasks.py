"""Training tasks on real data for ``bench converge`` (loss against wall-clock time per transport, Figure 10).

A :class:`Task` is a dataset with its model: ``build()`` a Keras 3 model returning **logits**, ``loss_fn()``
(mean cross-entropy; mean over tokens for the sequence tasks, over non-padding tokens for ``seq2seq``),
``train_batch(step, server, servers, batch_size)`` giving each data-parallel worker its own shard of the
training set, ``heldout()`` the evaluation set (disjoint from training) and ``evaluate(predict)`` the held-out
loss and metric (``accuracy``, higher is better, or ``perplexity``, lower is better).

=========  ===================================================================  ==========  ===============
task       data                                                                 metric      --data
=========  ===================================================================  ==========  ===============
digits     scikit-learn's 8x8 digits (1797 images, shipped with the package)    accuracy    none
text       characters of CPython's own standard library sources (~1.4 MB)       perplexity  none
cifar10    CIFAR-10, Python version (data_batch_1..5, test_batch)               accuracy    DIR
seq2seq    aligned parallel text PREFIX.src / PREFIX.tgt, characters            perplexity  PREFIX
=========  ===================================================================  ==========  ===============

Nothing is ever downloaded. Every model is small (one step at batch 32 well under 0.1 s on a 2-core CPU) and
is trained by the runtime with plain synchronous SGD (``w -= lr * mean(gradients)``): each task carries the
``default_learning_rate``, ``default_steps``, ``default_eval_every`` and ``default_target`` that work with it.

Bad input (a missing or malformed path, ``--data`` missing or superfluous) raises :class:`TaskDataError`, a
``ValueError`` whose one-line message names the path, the problem and the fix. TensorFlow and Keras are only
imported inside functions; loaded datasets are cached per ``(name, data)`` in the process.

Why one module of 600 lines: the four tasks (digits, text, CIFAR-10, seq2seq) are each a loader and a
model of 50 to 100 lines, read side by side as one table of what convergence trains on; a fifth task is the
time to give each its module.
"""

from __future__ import annotations

import functools
import math
import os
import pickle
import sysconfig
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import keras

#: the tasks, with a one-line description each (for --help)
TASKS: dict[str, str] = {
    "digits": "scikit-learn's 8x8 handwritten digits, small CNN, accuracy (default; no --data)",
    "text": "character-level GRU language model over CPython's standard library sources, perplexity (no --data)",
    "cifar10": "CIFAR-10 (--data DIR with data_batch_1..5 and test_batch, Python version), small CNN, accuracy",
    "seq2seq": "character GRU encoder-decoder on --data PREFIX (PREFIX.src, PREFIX.tgt aligned lines), perplexity",
}
DEFAULT_TASK = "digits"
#: tasks that need --data, and what it is
NEEDS_DATA = {"cifar10": "DIR", "seq2seq": "PREFIX"}

#: the fixed seed of the train/held-out split and of the per-epoch shuffles
DATA_SEED = 20190325
EVAL_BATCH = 256


class TaskDataError(ValueError):
    """Bad task data (missing or malformed path, --data missing or superfluous); the message is one line."""


def _keras():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    return keras


# -- losses (module level, so they pickle) ----------------------------------------------------------------------


def classification_loss() -> Any:
    """Sparse categorical cross-entropy on logits, mean over the batch (and over tokens for sequences)."""
    return _keras().losses.SparseCategoricalCrossentropy(from_logits=True)


#: the padding token id of seq2seq (ignored by its loss and its metric)
PAD = 0


def masked_token_loss(y: Any, logits: Any) -> Any:
    """Mean token cross-entropy over the positions where ``y != PAD`` (a scalar)."""
    keras = _keras()
    ops = keras.ops
    ce = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    mask = ops.cast(ops.not_equal(y, PAD), ce.dtype)
    return ops.sum(ce * mask) / ops.maximum(ops.sum(mask), 1.0)


# -- the Task ---------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Task:
    """A dataset with its model, for convergence runs.

    ``x_train``/``y_train`` and ``x_heldout``/``y_heldout`` hold the data (``x_train`` may be stored compactly,
    e.g. uint8 images, and is converted per batch by ``prepare``); examples are indexed along axis 0.
    """

    name: str
    metric: str  # "accuracy" (higher is better) or "perplexity" (lower is better)
    description: str
    default_learning_rate: float
    default_steps: int
    default_eval_every: int
    default_target: str | None  # "accuracy=0.97", "perplexity=9"; None when it depends on the data
    x_train: np.ndarray = field(repr=False)
    y_train: np.ndarray = field(repr=False)
    x_heldout: np.ndarray = field(repr=False)
    y_heldout: np.ndarray = field(repr=False)
    builder: Callable[[], Any] = field(repr=False)
    masked: bool = False  # the loss and the metric ignore label PAD (seq2seq)
    prepare: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False)
    default_batch_size: int = 32
    info: dict[str, Any] = field(default_factory=dict)  # vocabulary sizes, sequence lengths, sources, ...

    # -- model -----------------------------------------------------------------------------------------------

    def build(self) -> keras.Model:
        """A fresh model returning logits (deterministic after ``keras.utils.set_random_seed``)."""
        return self.builder()

    def loss_fn(self) -> Any:
        """The training loss, ``loss(y, logits) -> scalar`` (masked mean token cross-entropy for seq2seq)."""
        return masked_token_loss if self.masked else classification_loss()

    # -- data ------------------------------------------------------------------------------------------------

    @property
    def train_size(self) -> int:
        return len(self.y_train)

    def _x(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.prepare(x) if self.prepare is not None else x)

    @functools.lru_cache(maxsize=4)  # noqa: B019 (a few permutations per task, the task lives for the run)
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([DATA_SEED, epoch]).permutation(self.train_size)

    def train_indices(self, step: int, server: int, servers: int, batch_size: int) -> np.ndarray:
        """Training-set indices of ``train_batch(step, server, servers, batch_size)``.

        The training set is shuffled per epoch (seeded by the epoch); worker ``server`` of ``servers`` takes
        positions ``(step * servers + server) * batch_size ...`` of that stream, so the workers' batches of
        one step are disjoint (as long as ``servers * batch_size`` does not exceed the training set and the
        step does not straddle an epoch boundary) and together they go through each epoch once.
        """
        if batch_size < 1 or servers < 1 or not 0 <= server < servers or step < 0:
            raise ValueError(f"bad batch: step={step} server={server} servers={servers} batch_size={batch_size}")
        start = (step * servers + server) * batch_size
        positions = np.arange(start, start + batch_size, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.train_size)
        out = np.empty(batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self._permutation(int(epoch))[offsets[chosen]]
        return out

    def train_batch(self, step: int, server: int, servers: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Worker ``server``'s (x, y) at ``step``: deterministic, disjoint from the other workers' (train_indices)."""
        indices = self.train_indices(step, server, servers, batch_size)
        return self._x(self.x_train[indices]), np.ascontiguousarray(self.y_train[indices])

    def make_batch(self, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Any training batch (to profile or trace the step): ``train_batch(seed, 0, 1, batch_size)``."""
        return self.train_batch(max(seed, 0), 0, 1, batch_size)

    def heldout(self) -> tuple[np.ndarray, np.ndarray]:
        """The held-out evaluation set (x ready for the model, y), disjoint from the training set."""
        return self._x(self.x_heldout), np.ascontiguousarray(self.y_heldout)

    # -- evaluation ------------------------------------------------------------------------------------------

    def evaluate(self, predict: Callable[[np.ndarray], Any], batch_size: int = EVAL_BATCH) -> dict[str, float]:
        """Held-out loss and metric: ``predict`` maps an x batch to logits, called on batches of ``batch_size``.

        Returns ``{"heldout_loss": ..., "accuracy": ...}`` or ``{"heldout_loss": ..., "perplexity": ...}``
        (perplexity = exp of the mean token cross-entropy). Computed in float64 numpy: deterministic.
        """
        x, y = self.heldout()
        totals = np.zeros(3)
        for start in range(0, len(y), batch_size):
            logits = np.asarray(predict(x[start:start + batch_size]))
            totals += _sums(y[start:start + batch_size], logits, self.masked)
        return self._finish(totals)

    def score(self, y: np.ndarray, logits: np.ndarray) -> dict[str, float]:
        """Loss and metric of ``logits`` against labels ``y`` (one array each, e.g. the whole held-out set)."""
        return self._finish(_sums(np.asarray(y), np.asarray(logits), self.masked))

    def _finish(self, totals: np.ndarray) -> dict[str, float]:
        loss_sum, count, correct = totals
        loss = float(loss_sum / max(count, 1.0))
        if self.metric == "perplexity":
            return {"heldout_loss": loss, "perplexity": float(math.exp(min(loss, 700.0)))}
        return {"heldout_loss": loss, "accuracy": float(correct / max(count, 1.0))}


def _sums(y: np.ndarray, logits: np.ndarray, masked: bool) -> np.ndarray:
    """(sum of cross-entropies, number of labels counted, number predicted right) of one batch."""
    logits = logits.astype(np.float64).reshape(-1, logits.shape[-1])
    labels = y.astype(np.int64).reshape(-1)
    if logits.shape[0] != labels.shape[0]:
        raise ValueError(f"predictions {logits.shape} do not match labels {y.shape}")
    top = logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    ce = log_z - logits[np.arange(len(labels)), labels]
    right = logits.argmax(axis=1) == labels
    if masked:
        keep = labels != PAD
        ce, right = ce[keep], right[keep]
    return np.array([ce.sum(), float(len(ce)), float(right.sum())])


# -- get_task ---------------------------------------------------------------------------------------------------


def get_task(name: str = DEFAULT_TASK, data: str | os.PathLike | None = None) -> Task:
    """The task called ``name`` (case and ``-``/``_`` do not matter) on ``data`` where it takes one.

    Raises ``ValueError`` for an unknown name and :class:`TaskDataError` for missing, superfluous or bad data.
    """
    key = str(name).strip().lower().replace("-", "_")
    if key not in TASKS:
        raise ValueError(f"unknown task '{name}' (known: {', '.join(TASKS)})")
    if key in NEEDS_DATA and data is None:
        raise TaskDataError(f"{key}: needs --data {NEEDS_DATA[key]} ({TASKS[key]})")
    if key not in NEEDS_DATA and data is not None:
        raise TaskDataError(f"{key}: takes no --data (got {data}); its data ships with Python/scikit-learn")
    if data is not None:
        data = os.path.abspath(os.path.expanduser(os.fspath(data)))
    return _load(key, data)


@dataclass(frozen=True)
class TaskWorkload:
    """A task as the training runtime is handed it (``bench.runtime.workload.RealData``): its name and data
    directory, the task loaded where it is used (once per process: :func:`get_task` caches), so what is pickled
    into each rank holds no data. Its model is Keras'; ``torch_tasks.TorchTaskWorkload`` is PyTorch's."""

    framework: ClassVar[str] = "tensorflow"

    name: str
    data: str | None = None

    @property
    def task(self) -> Task:
        return get_task(self.name, self.data)

    def build(self) -> keras.Model:
        return self.task.build()

    def loss_fn(self) -> Any:
        return self.task.loss_fn()

    def make_batch(self, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        return self.task.make_batch(batch_size, seed)

    def train_batch(self, step: int, server: int, servers: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        return self.task.train_batch(step, server, servers, batch_size)

    def evaluate(self, predict: Callable[[np.ndarray], Any]) -> dict[str, float]:
        return self.task.evaluate(predict)


def task_workload(name: str, data: str | None = None, framework: str = "tensorflow") -> TaskWorkload:
    """The workload training task ``name`` on ``data`` in ``framework`` ("tensorflow" or "torch")."""
    if framework == "torch":
        from bench.experiments.torch_tasks import TorchTaskWorkload

        return TorchTaskWorkload(name, data)
    if framework != "tensorflow":
        raise ValueError(f"unknown framework '{framework}' (known: tensorflow, torch)")
    return TaskWorkload(name, data)


@functools.lru_cache(maxsize=8)
def _load(key: str, data: str | None) -> Task:
    return {"digits": _digits, "text": _text, "cifar10": _cifar10, "seq2seq": _seq2seq}[key](data)


# -- digits -----------------------------------------------------------------------------------------------------


def _digits_model() -> keras.Model:
    keras = _keras()
    layers = keras.layers
    inputs = keras.Input((8, 8, 1), name="image")
    h = layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(inputs)
    h = layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(h)
    h = layers.MaxPooling2D(2, name="pool")(h)
    h = layers.Flatten(name="flatten")(h)
    h = layers.Dense(64, activation="relu", name="fc")(h)
    return keras.Model(inputs, layers.Dense(10, name="logits")(h), name="digits_cnn")


def _digits(_data: None) -> Task:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise TaskDataError(f"digits: needs scikit-learn ({e}); pip install scikit-learn") from None
    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[..., None]
    y = digits.target.astype(np.int32)
    train, heldout = _stratified_split(y, 0.2, DATA_SEED)
    return Task(
        name="digits", metric="accuracy",
        description=(f"scikit-learn's 8x8 digits ({len(train)} train / {len(heldout)} held out, stratified), "
                     "CNN conv16-conv32-fc64"),
        default_learning_rate=0.2, default_steps=400, default_eval_every=20, default_target="accuracy=0.97",
        x_train=np.ascontiguousarray(x[train]), y_train=y[train],
        x_heldout=np.ascontiguousarray(x[heldout]), y_heldout=y[heldout],
        builder=_digits_model, info={"train_indices": train, "heldout_indices": heldout},
    )


def _stratified_split(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, held-out) indices: ``fraction`` of each class (rounded) held out, chosen by ``seed``."""
    rng = np.random.default_rng(seed)
    heldout = []
    for label in np.unique(y):
        members = np.flatnonzero(y == label)
        heldout.append(rng.permutation(members)[: round(len(members) * fraction)])
    held = np.sort(np.concatenate(heldout))
    return np.setdiff1d(np.arange(len(y)), held), held


# -- text -------------------------------------------------------------------------------------------------------

#: standard-library sources of the text task, in this order (a missing one is skipped; a directory means its
#: sorted *.py files, for modules that became packages in later versions)
TEXT_SOURCES = (
    "argparse.py", "ast.py", "collections/__init__.py", "dataclasses.py", "difflib.py", "enum.py",
    "functools.py", "inspect.py", "logging/__init__.py", "pathlib.py", "pydoc.py", "shutil.py", "subprocess.py",
    "tarfile.py", "textwrap.py", "threading.py", "unittest/case.py", "zipfile.py", "typing.py",
)
TEXT_MIN_CHARS = 400_000
TEXT_SEQ_LEN = 64
TEXT_MIN_COUNT = 20  # characters seen fewer times in the training text map to UNK
TEXT_HELDOUT_TOKENS = 64_000
UNK = 0


def text_corpus(stdlib: str | None = None) -> tuple[str, list[str]]:
    """The text task's corpus (the sources concatenated) and the files it came from."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for name in TEXT_SOURCES:
        path = root / name
        if path.is_file():
            files.append(path)
        elif path.with_suffix("").is_dir():
            files.extend(sorted(path.with_suffix("").glob("*.py")))
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    corpus = "".join(texts)
    if len(corpus) < TEXT_MIN_CHARS:
        raise TaskDataError(
            f"text: the standard library at {root} has only {len(corpus)} characters of the expected sources "
            f"(need {TEXT_MIN_CHARS}; is it a full CPython install with its .py files?)")
    return corpus, [str(f) for f in files]


def _embedding(ids: Any, vocab: int, width: int, name: str) -> Any:
    """An embedding as one-hot times a dense kernel: the same function as ``keras.layers.Embedding`` but its
    gradient is a dense tensor (Embedding's is ``tf.IndexedSlices``, which the transports do not carry)."""
    keras = _keras()
    one_hot = keras.layers.Lambda(lambda t: keras.ops.one_hot(t, vocab), name=f"{name}_one_hot")(ids)
    return keras.layers.Dense(width, use_bias=False, name=name)(one_hot)


def _text_model(vocab: int, seq_len: int) -> Callable[[], Any]:
    def build() -> keras.Model:
        keras = _keras()
        layers = keras.layers
        inputs = keras.Input((seq_len,), dtype="int32", name="chars")
        h = _embedding(inputs, vocab, 32, "embedding")
        h = layers.GRU(128, return_sequences=True, name="gru")(h)
        return keras.Model(inputs, layers.Dense(vocab, name="logits")(h), name="char_gru")

    return build


def _text(_data: None, stdlib: str | None = None) -> Task:
    corpus, files = text_corpus(stdlib)
    split = int(len(corpus) * 0.9)
    counts = Counter(corpus[:split])
    chars = sorted(c for c, n in counts.items() if n >= TEXT_MIN_COUNT)
    vocab = {c: i + 1 for i, c in enumerate(chars)}  # 0 = UNK
    table = np.full(0x110000, UNK, dtype=np.int32)
    table[[ord(c) for c in chars]] = list(vocab.values())
    ids = table[np.frombuffer(corpus.encode("utf-32-le"), dtype=np.uint32)]
    seq = TEXT_SEQ_LEN
    train_ids, held_ids = ids[:split], ids[split:]
    x_train, y_train = _windows(train_ids, seq)
    x_held, y_held = _windows(held_ids, seq)
    limit = TEXT_HELDOUT_TOKENS // seq
    x_held, y_held = x_held[:limit], y_held[:limit]
    return Task(
        name="text", metric="perplexity",
        description=(f"character GRU-128 over {len(files)} CPython stdlib sources ({len(corpus)} chars, "
                     f"vocabulary {len(vocab) + 1}), sequences of {seq}, the last 10% held out"),
        default_learning_rate=2.0, default_steps=600, default_eval_every=50, default_target="perplexity=10",
        x_train=x_train, y_train=y_train, x_heldout=x_held, y_heldout=y_held,
        builder=_text_model(len(vocab) + 1, seq),
        info={"vocabulary": ["<unk>", *chars], "files": files, "split": split, "seq_len": seq},
    )


def _windows(ids: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping (input, next-character target) windows of ``seq`` tokens."""
    n = (len(ids) - 1) // seq
    starts = np.arange(n, dtype=np.int64)[:, None] * seq + np.arange(seq)
    return np.ascontiguousarray(ids[starts]), np.ascontiguousarray(ids[starts + 1])


# -- cifar10 ----------------------------------------------------------------------------------------------------

CIFAR_HINT = "expected CIFAR-10's Python version: data_batch_1..5 and test_batch"
CIFAR_HELDOUT = 5000  # the first 5000 test images (of 10000): an evaluation in about a second on 2 cores
CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
CIFAR_STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)
#: numpy's names an array pickle may refer to (the only classes the CIFAR unpickler will construct)
_NUMPY_PICKLE = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"), ("_codecs", "encode"),  # bytes in pickles of protocol 2
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, numbers, bytes and numpy arrays only (no arbitrary code from a data file)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NUMPY_PICKLE:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open("rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
    except OSError as e:
        raise TaskDataError(f"cifar10: cannot read {path} ({e.strerror or e})") from None
    except Exception as e:
        raise TaskDataError(
            f"cifar10: {path} is not a CIFAR-10 batch (unpickling failed: {type(e).__name__}: {e}; {CIFAR_HINT})"
        ) from None
    if not isinstance(batch, dict):
        raise TaskDataError(f"cifar10: {path} is not a CIFAR-10 batch (a {type(batch).__name__}, not a dict)")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise TaskDataError(f"cifar10: {path} is not a CIFAR-10 batch (no b'data' and b'labels'; {CIFAR_HINT})")
    data = np.asarray(data)
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError):
        raise TaskDataError(f"cifar10: {path} has labels that are not integers") from None
    if data.ndim != 2 or data.shape[1] != 3072 or data.dtype != np.uint8 or len(data) == 0:
        raise TaskDataError(
            f"cifar10: {path} has data of shape {data.shape} and dtype {data.dtype} "
            f"(expected N x 3072 uint8 images, channel-major 3x32x32)")
    if labels.shape != (len(data),):
        raise TaskDataError(f"cifar10: {path} has {len(data)} images but labels of shape {labels.shape}")
    if labels.min() < 0 or labels.max() > 9:
        raise TaskDataError(f"cifar10: {path} has labels outside 0..9 ({labels.min()}..{labels.max()})")
    return data, labels.astype(np.int32)


def cifar_dir(data: str | os.PathLike) -> Path:
    """The directory holding the CIFAR-10 batches: ``data`` or its ``cifar-10-batches-py`` subdirectory."""
    root = Path(data)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise TaskDataError(f"cifar10: {root} {what} (--data DIR: {CIFAR_HINT}, e.g. cifar-10-batches-py/)")
    if not (root / "data_batch_1").exists() and (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    for needed in ("data_batch_1", "test_batch"):
        if not (root / needed).is_file():
            raise TaskDataError(f"cifar10: {root} has no {needed} ({CIFAR_HINT})")
    return root


def _cifar_prepare(x: np.ndarray) -> np.ndarray:
    """uint8 N x 3072 (channel-major) -> float32 N x 32 x 32 x 3, normalised per channel."""
    images = x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).astype(np.float32) / 255.0
    return (images - CIFAR_MEAN) / CIFAR_STD


def _cifar_model() -> keras.Model:
    keras = _keras()
    layers = keras.layers
    inputs = keras.Input((32, 32, 3), name="image")
    h = inputs
    for i, width in enumerate((32, 64, 64), start=1):
        h = layers.Conv2D(width, 3, padding="same", activation="relu", name=f"conv{i}")(h)
        h = layers.MaxPooling2D(2, name=f"pool{i}")(h)
    h = layers.Flatten(name="flatten")(h)
    h = layers.Dense(128, activation="relu", name="fc")(h)
    return keras.Model(inputs, layers.Dense(10, name="logits")(h), name="cifar_cnn")


def _cifar10(data: str) -> Task:
    root = cifar_dir(data)
    parts = []
    for k in range(1, 6):
        path = root / f"data_batch_{k}"
        if not path.exists():
            break
        parts.append(_cifar_batch(path))
    x_train = np.concatenate([p[0] for p in parts])
    y_train = np.concatenate([p[1] for p in parts])
    x_test, y_test = _cifar_batch(root / "test_batch")
    x_test, y_test = x_test[:CIFAR_HELDOUT], y_test[:CIFAR_HELDOUT]
    return Task(
        name="cifar10", metric="accuracy",
        description=(f"CIFAR-10 from {root} ({len(parts)} training batches, {len(y_train)} images; the first "
                     f"{len(y_test)} images of test_batch held out), CNN conv32-64-64-fc128"),
        default_learning_rate=0.05, default_steps=2000, default_eval_every=100, default_target="accuracy=0.5",
        x_train=x_train, y_train=y_train, x_heldout=x_test, y_heldout=y_test,
        builder=_cifar_model, prepare=_cifar_prepare, info={"dir": str(root), "batches": len(parts)},
    )


# -- seq2seq ----------------------------------------------------------------------------------------------------

#: ids of seq2seq's special tokens: padding, unknown character, start and end of sentence
S2S_SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
S2S_UNK, S2S_BOS, S2S_EOS = 1, 2, 3
S2S_MAX_CHARS = 80  # longer sentences are truncated to this many characters
S2S_HELDOUT_PAIRS = 2000


def _read_lines(path: Path, which: str) -> list[str]:
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise TaskDataError(
            f"seq2seq: {path} {what} (--data PREFIX needs PREFIX.src and PREFIX.tgt, the {which} side, "
            f"one sentence per line)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise TaskDataError(f"seq2seq: {path} is not UTF-8 (line {line}: {e.reason}); convert it to UTF-8") from None
    except OSError as e:
        raise TaskDataError(f"seq2seq: cannot read {path} ({e.strerror or e})") from None
    return text.splitlines()


def _s2s_vocab(sentences: list[str]) -> dict[str, int]:
    chars = sorted(set().union(*map(set, sentences)))
    return {c: i + len(S2S_SPECIALS) for i, c in enumerate(chars)}


def _s2s_encode(sentences: list[str], vocab: dict[str, int], length: int, *, source: bool) -> np.ndarray:
    """Sources: ids left-padded to ``length`` (the encoder's last state follows the sentence).
    Targets: ``<s> + chars + </s>`` right-padded to ``length + 2``."""
    out = np.full((len(sentences), length if source else length + 2), PAD, dtype=np.int32)
    for row, sentence in enumerate(sentences):
        ids = [vocab.get(c, S2S_UNK) for c in sentence[:length]]
        if source:
            if ids:
                out[row, -len(ids):] = ids
        else:
            out[row, : len(ids) + 2] = [S2S_BOS, *ids, S2S_EOS]
    return out


def _s2s_model(src_vocab: int, tgt_vocab: int, src_len: int, tgt_len: int) -> Callable[[], Any]:
    def build() -> keras.Model:
        keras = _keras()
        layers = keras.layers
        inputs = keras.Input((src_len + tgt_len,), dtype="int32", name="source_and_decoder_input")
        source, decoder_in = inputs[:, :src_len], inputs[:, src_len:]
        h = _embedding(source, src_vocab, 32, "src_embedding")
        _, state = layers.GRU(128, return_state=True, name="encoder")(h)
        d = _embedding(decoder_in, tgt_vocab, 32, "tgt_embedding")
        d = layers.GRU(128, return_sequences=True, name="decoder")(d, initial_state=state)
        return keras.Model(inputs, layers.Dense(tgt_vocab, name="logits")(d), name="char_seq2seq")

    return build


def _seq2seq(data: str) -> Task:
    src_path, tgt_path = Path(data + ".src"), Path(data + ".tgt")
    src, tgt = _read_lines(src_path, "source"), _read_lines(tgt_path, "target")
    if len(src) != len(tgt):
        raise TaskDataError(
            f"seq2seq: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)} "
            f"(the files must be aligned line by line)")
    pairs = [(s.strip(), t.strip()) for s, t in zip(src, tgt, strict=True)]
    pairs = [(s, t) for s, t in pairs if s and t]
    if len(pairs) < 2:
        raise TaskDataError(
            f"seq2seq: {src_path} and {tgt_path} have {len(pairs)} pairs of non-empty lines "
            f"(need at least 2: the last 10% are held out)")
    split = min(len(pairs) - 1, math.ceil(len(pairs) * 0.9))
    train, held = pairs[:split], pairs[split:][:S2S_HELDOUT_PAIRS]
    src_vocab, tgt_vocab = _s2s_vocab([s for s, _ in train]), _s2s_vocab([t for _, t in train])
    src_len = min(S2S_MAX_CHARS, max(len(s) for s, _ in train))
    tgt_len = min(S2S_MAX_CHARS, max(len(t) for _, t in train))

    def arrays(part: list[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        source = _s2s_encode([s for s, _ in part], src_vocab, src_len, source=True)
        target = _s2s_encode([t for _, t in part], tgt_vocab, tgt_len, source=False)
        x = np.concatenate([source, target[:, :-1]], axis=1)  # decoder input: <s> + target
        y = target[:, 1:]  # target + </s>, padded
        return np.ascontiguousarray(x), np.ascontiguousarray(y)

    x_train, y_train = arrays(train)
    x_held, y_held = arrays(held)
    n_src, n_tgt = len(src_vocab) + len(S2S_SPECIALS), len(tgt_vocab) + len(S2S_SPECIALS)
    return Task(
        name="seq2seq", metric="perplexity",
        description=(f"character GRU-128 encoder-decoder on {data}.src/.tgt ({len(train)} training pairs, "
                     f"{len(held)} held out; vocabularies {n_src}/{n_tgt}; up to {src_len}/{tgt_len} chars)"),
        default_learning_rate=2.0, default_steps=1000, default_eval_every=50, default_target=None,
        x_train=x_train, y_train=y_train, x_heldout=x_held, y_heldout=y_held,
        builder=_s2s_model(n_src, n_tgt, src_len, tgt_len + 1), masked=True,
        info={"source_vocabulary": [*S2S_SPECIALS, *src_vocab], "target_vocabulary": [*S2S_SPECIALS, *tgt_vocab],
              "src_len": src_len, "tgt_len": tgt_len, "train_pairs": len(train), "heldout_pairs": len(held)},
    )
