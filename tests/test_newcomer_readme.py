"""The README's sample of ``bench micro``'s output has the columns today's ``bench micro`` prints.

The sample had gone stale (no ``harness`` column, a Local line measured before Local changed): a newcomer comparing
their run with it could not tell a difference of the code from one of the machine. Here a short run of every line
available prints its two tables; the README's must name the same columns in the same order, missing only lines that
cannot run here (a peer library not installed, a line that needs a network namespace).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import transports
from bench import options
from bench.results import lines as catalogue

ROOT = Path(__file__).resolve().parent.parent
P50 = "p50 µs per transfer"
RELATIVE = "time per transfer relative to zerocopy"


def readme_sample() -> list[str]:
    """The lines of the README's code block that shows ``$ bench micro ...`` and its output."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", (ROOT / "README.md").read_text(), re.DOTALL | re.MULTILINE)
    [sample] = [block for block in blocks if block.startswith("$ bench micro")]
    return sample.splitlines()


def tables(lines: list[str]) -> tuple[list[str], list[str]]:
    """The columns of the p50 table (names have no spaces) and of the relative table (columns two spaces apart)."""
    p50 = next(i for i, line in enumerate(lines) if line.startswith(P50))
    relative = next(i for i, line in enumerate(lines) if line.startswith(RELATIVE))
    return lines[p50 + 1].split(), re.split(r"\s{2,}", lines[relative + 1].strip())


def _line_names() -> set[str]:
    """Every line a run may have: the catalogue's, and the transports with their modes."""
    names = {name for kind in catalogue.KINDS for name in catalogue.names(kind)}
    for name in transports.names():
        names |= {name, *(f"{name}:{mode}" for mode in transports.transport_class(name).modes())}
    return names


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> list[str]:
    """What a short ``bench micro`` with every line available here prints."""
    out = tmp_path_factory.mktemp("readme") / "run"
    result = subprocess.run([sys.executable, "-m", "bench.cli", "micro", "--sizes", "1KB", "--iters", "5", "--warmup",
                             "1", "--no-plot", "--out", str(out)], capture_output=True, text=True, timeout=900,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_the_readme_samples_columns_are_what_bench_micro_prints(printed):
    readme_p50, readme_relative = tables(readme_sample())
    here_p50, here_relative = tables(printed)
    lines = _line_names()
    # every column printed here is in the README's sample, in the same order; what the sample has beyond them are
    # lines that cannot run here, never a column bench micro no longer prints
    assert [column for column in readme_p50 if column in here_p50] == here_p50, (readme_p50, here_p50)
    assert set(readme_p50) - set(here_p50) <= lines, set(readme_p50) - set(here_p50)
    assert [column for column in readme_relative if column in here_relative] == here_relative, (readme_relative,
                                                                                               here_relative)
    assert set(readme_relative) - set(here_relative) <= lines | {"zerocopy of put bw"}


def test_the_readme_sample_is_one_run_of_todays_command():
    """Its first line is what bench micro says first, for the README's own command, and its results directory is the
    one named at the end."""
    sample = readme_sample()
    assert sample[0] == "$ bench micro --sizes 1KB-64MB"
    first = re.fullmatch(r"bench micro: 9 sizes \(1KB\.\.64MB\) over (.+), source fresh, launcher local -> "
                         r"(results/micro-\d{8}-\d{6})", sample[1])
    assert first is not None, sample[1]
    assert first.group(1) == ", ".join(options.labels(options.default_choices()))
    assert sample[-2:] == [f"results: {first.group(2)} (every column of every point: records.csv)",
                           f"figure: {first.group(2)}/micro_time.png"]
