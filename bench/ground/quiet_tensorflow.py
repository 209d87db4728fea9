"""TensorFlow's start-up lines kept off stderr in the suite's own processes: ``install()`` once, at their entry.

Importing TensorFlow 2.21 on a CPU machine writes lines to file descriptor 2 whatever ``TF_CPP_MIN_LOG_LEVEL``
says ("All log messages before absl::InitializeLog() is called ...", "oneDNN custom operations are on", "Could
not find cuda drivers", "This TensorFlow binary is optimized ...", and at the first device query "failed call to
cuInit"): they interleave with the tables and progress bars of ``bench``. ``install()`` puts a finder in front of
the import system that, at the first ``import tensorflow`` of the process (also through ``import keras``),
sends file descriptor 2 to a temporary file while TensorFlow loads and finds its devices, then writes back what
was not start-up noise. Only ``bench``'s entry points (``bench.cli``, the ranks' ``bench.launch.rank``) install
it; a program that imports the package sees TensorFlow as it is.

The same finder keeps the start short: Keras (which TensorFlow loads, and which loads TensorFlow) loads its
scikit-learn wrappers whenever scikit-learn can be imported, and scikit-learn loads SciPy's statistics with it.
That is about a second of CPU in every training rank, a quarter of TensorFlow's start, for wrappers ``bench``
never uses. While TensorFlow or Keras loads, scikit-learn is held back (unless the process has imported it
already); afterwards it imports as ever (the ``digits`` task's data comes from it). Keras' scikit-learn wrappers
then say scikit-learn is missing.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType

#: what TensorFlow writes at start-up, whatever its log level, and no error of a run
START_UP_NOISE = (
    "All log messages before absl::InitializeLog() is called",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "failed call to cuInit",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "To enable the following instructions:",
    "TF-TRT Warning",
    "Unable to register cu",
)


def is_start_up_noise(line: str) -> bool:
    return any(noise in line for noise in START_UP_NOISE)


@contextlib.contextmanager
def start_up_noise_held_back() -> Iterator[None]:
    """File descriptor 2 goes to a temporary file meanwhile; afterwards what was not start-up noise is written."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not is_start_up_noise(line)]
            if kept:
                os.write(2, "".join(kept).encode())


#: the packages whose first import the finder takes: either may be imported first, and each loads the other
LOADED_QUIETLY = ("tensorflow", "keras")
#: what Keras loads at TensorFlow's import when it can, for wrappers bench never uses (see the module docstring)
HELD_BACK = "sklearn"


@contextlib.contextmanager
def keras_wrappers_held_back() -> Iterator[None]:
    """Meanwhile ``import sklearn`` fails as if it were not installed, unless it is imported already."""
    if HELD_BACK in sys.modules:
        yield
        return
    sys.modules[HELD_BACK] = None  # the import system's mark of a module that cannot be imported
    try:
        yield
    finally:
        if HELD_BACK in sys.modules and sys.modules[HELD_BACK] is None:
            del sys.modules[HELD_BACK]


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module is the real loader's, as ever
        with start_up_noise_held_back(), keras_wrappers_held_back():
            self.loader.exec_module(module)
            if module.__name__ == "tensorflow":
                module.config.list_physical_devices()  # the device query, where "failed call to cuInit" is written


class _QuietFinder(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` and ``keras`` as the other finders do (a look without import,
    ``importlib.util.find_spec``, included), with a loader that holds back their start-up lines and
    scikit-learn."""

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name not in LOADED_QUIETLY or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)  # through the finders after this one (it declines meanwhile)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _QuietLoader(spec.loader)
        return spec


def install() -> None:
    """Hold back TensorFlow's start-up lines in this process (idempotent; nothing if it is imported already)."""
    if "tensorflow" in sys.modules or any(isinstance(finder, _QuietFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _QuietFinder())
