"""A command that needs an optional part of the install says so in one line, before it starts anything."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from bench.ground.quiet_tensorflow import START_UP_NOISE

#: runs bench's entry point with TensorFlow hidden, as on an install without the 'models' extra
WITHOUT_TENSORFLOW = ("import sys; sys.modules['tensorflow'] = None; from bench.cli import main; "
                      "sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("argv", [
    ["model", "vgg16", "--transport", "zerocopy"],
    ["models", "fcn5"],
    ["scale", "fcn5", "--transport", "grpc_tcp"],
    ["converge", "--transport", "grpc_tcp"],
    ["soak", "--transports", "grpc_tcp"],
])
def test_a_command_that_needs_tensorflow_names_the_extra_before_it_starts(tmp_path, argv):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", WITHOUT_TENSORFLOW, *argv, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"bench {argv[0]}: error: 'bench {argv[0]}' needs the 'models' extra "
                               "(tensorflow not installed here): pip install -e '.[models]'"), lines[0]
    assert not out.exists()  # no results directory, and no rank was started


def test_tensorflow_says_nothing_at_start_up_in_benchs_processes(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.cli", "models", "fcn5", "--steps", "1",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if any(noise in line for noise in START_UP_NOISE)] == []
    assert done.stdout.splitlines()[-2].startswith("fcn5")


#: a process of bench's (the hook installed) that imports TensorFlow or Keras first, then scikit-learn itself
TENSORFLOW_THEN_SKLEARN = """
import importlib, sys
from bench.ground import quiet_tensorflow
quiet_tensorflow.install()
importlib.import_module(sys.argv[1])
print(sorted(name for name in ("sklearn", "scipy.stats") if name in sys.modules))
from sklearn.datasets import load_digits
print(len(load_digits().target))
"""


@pytest.mark.parametrize("first", ["tensorflow", "keras"])
def test_tensorflow_starts_in_benchs_processes_without_kerass_scikit_learn_wrappers(first):
    pytest.importorskip("tensorflow")
    pytest.importorskip("sklearn")
    done = subprocess.run([sys.executable, "-c", TENSORFLOW_THEN_SKLEARN, first], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    # neither was loaded by TensorFlow's import; scikit-learn still imports afterwards, for the digits task
    assert done.stdout.splitlines() == ["[]", "1797"], done.stdout


def test_the_readme_installs_what_its_first_command_and_the_missions_second_need():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    first = next(line for line in readme.splitlines() if "pip install" in line and "bench micro" in line)
    # the models (bench model) and the MPI peer lines, so that a newcomer's first figure has MPI in it
    [extras] = re.findall(r"""pip install -e ['"]\.\[([a-z,]+)\]['"]""", first)
    assert {"models", "mpi"} <= set(extras.split(",")), first
