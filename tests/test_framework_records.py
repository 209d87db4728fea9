"""Records name the framework that trained the model: old runs read as TensorFlow, and the readers (points, the
report, figures, ``bench compare``) never take a PyTorch point for a TensorFlow one (issue 61)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from bench.readers.compare import CompareError, compare
from bench.results import SAMPLES_FILE, ModelRecord, RunWriter, load_run, package_versions

V1_FIXTURES = Path(__file__).parent / "data" / "v1"
VERSIONS = {"tensorflow": "2.21.0", "torch": "2.13.0+cpu"}


def model_run(path: Path, steps: dict[tuple[str, str], float], samples: bool = False) -> Path:
    """A model run of fcn5 at batch 4 on 2 servers: ``(transport, framework) -> step time``."""
    writer = RunWriter(path, "model", {})
    rng = np.random.default_rng(0)
    for (transport, framework), step in steps.items():
        record = ModelRecord(transport=transport, framework=framework, framework_version=VERSIONS.get(framework),
                             model="fcn5", batch_size=4, servers=2, steps=10, step_time_s=step,
                             throughput_batches_per_s=1 / step, compute_s=step / 2, comm_s=step / 2)
        writer.add(record)
        if samples:
            times = step * (1 + 0.01 * rng.random(20))
            writer.add_samples(record, {"worker": [0] * len(times), "step_time_s": times})
    writer.finish()
    return path


def as_version_3(path: Path) -> Path:
    """The run as a bench of schema 3 wrote it: no framework columns in its records or samples."""
    meta = json.loads((path / "meta.json").read_text())
    meta["schema_version"] = 3
    (path / "meta.json").write_text(json.dumps(meta))
    for name in ("records.csv", SAMPLES_FILE):
        if not (path / name).exists():
            continue
        with open(path / name) as file:
            rows = list(csv.DictReader(file))
        columns = [c for c in rows[0] if c not in ("framework", "framework_version")]
        with open(path / name, "w", newline="") as file:
            out = csv.DictWriter(file, fieldnames=columns, extrasaction="ignore")
            out.writeheader()
            out.writerows(rows)
    return path


# -- records --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("experiment", ["model", "scale", "converge"])
def test_a_version_1_run_reads_as_tensorflow(experiment):
    run = load_run(V1_FIXTURES / experiment)
    assert set(run.records["framework"]) == {"tensorflow"}
    assert run.frameworks == ["tensorflow"]
    assert set(run.points()["framework"]) == {"tensorflow"}


def test_a_version_3_run_and_its_samples_read_as_tensorflow_and_keep_their_intervals(tmp_path):
    path = as_version_3(model_run(tmp_path / "run", {("zerocopy", "tensorflow"): 0.5, ("grpc_tcp", "tensorflow"): 1.0},
                                  samples=True))
    assert "framework" not in (path / "records.csv").read_text().splitlines()[0]
    run = load_run(path)
    assert list(run.records["framework"]) == ["tensorflow", "tensorflow"]
    assert set(run.samples["framework"]) == {"tensorflow"}
    points = run.points()
    assert list(points["spread"]) == ["samples", "samples"]  # the samples still match their points


def test_a_record_written_without_a_framework_reads_as_tensorflow(tmp_path):
    run = load_run(model_run(tmp_path / "run", {("zerocopy", None): 0.5}))
    assert list(run.records["framework"]) == ["tensorflow"]


def test_points_of_two_frameworks_stay_apart(tmp_path):
    run = load_run(model_run(tmp_path / "run", {("zerocopy", "tensorflow"): 0.5, ("zerocopy", "torch"): 0.25},
                             samples=True))
    points = run.points()
    assert len(points) == 2
    assert dict(zip(points["framework"], points["step_time_s"], strict=True)) == {"tensorflow": 0.5, "torch": 0.25}
    assert dict(zip(points["framework"], points["framework_version"], strict=True)) == VERSIONS
    torch, = (part for part in run.by_framework() if part.framework == "torch")
    assert list(torch.records["step_time_s"]) == [0.25] and set(torch.samples["framework"]) == {"torch"}


def test_meta_json_records_the_version_of_torch_without_importing_it():
    versions = package_versions()
    try:
        expected = metadata.version("torch")
    except metadata.PackageNotFoundError:
        expected = "not installed"
    assert versions["torch"] == expected
    try:
        torchvision = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        torchvision = None
    # left out where it is not there (it often cannot be installed beside torch)
    assert versions.get("torchvision") == torchvision


# -- the readers ----------------------------------------------------------------------------------------------


def test_a_figure_of_a_run_of_both_frameworks_is_drawn_once_for_each(tmp_path):
    from bench.readers.plot import draw, figures

    run = load_run(model_run(tmp_path / "run", {("zerocopy", "tensorflow"): 0.5, ("grpc_tcp", "tensorflow"): 1.0,
                                                ("zerocopy", "torch"): 0.25}))
    drawn = dict(figures(run))
    try:
        assert {"model_throughput", "model_throughput_torch"} <= set(drawn)
        assert drawn["model_throughput_torch"].get_suptitle().startswith("PyTorch: Training throughput")
        assert drawn["model_throughput"].get_suptitle().startswith("TensorFlow: Training throughput")
        # each figure's bars are its framework's lines only: two TensorFlow bars, one PyTorch bar
        bars = {stem: [len(ax.patches) for ax in fig.axes if ax.get_visible()] for stem, fig in drawn.items()
                if stem.startswith("model_throughput")}
        assert bars == {"model_throughput": [2], "model_throughput_torch": [1]}
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")
    figure = draw(run, "model_step_time_torch")
    assert figure is not None and figure.get_suptitle().startswith("PyTorch: ")


def test_a_run_of_one_framework_keeps_its_figures_names_and_pytorchs_says_so(tmp_path):
    from bench.readers.plot import figures

    tf = load_run(model_run(tmp_path / "tf", {("zerocopy", "tensorflow"): 0.5}))
    torch = load_run(model_run(tmp_path / "torch", {("zerocopy", "torch"): 0.5}))
    tf_titles = {stem: fig.get_suptitle() for stem, fig in figures(tf)}
    torch_titles = {stem: fig.get_suptitle() for stem, fig in figures(torch)}
    assert set(tf_titles) == set(torch_titles)  # the same files
    assert not any("TensorFlow" in title for title in tf_titles.values())
    assert all(title.startswith("PyTorch: ") for title in torch_titles.values())


def test_the_report_keeps_two_frameworks_apart_and_lists_their_versions(tmp_path):
    from bench.readers.report.build import build_report

    path = model_run(tmp_path / "run", {("zerocopy", "tensorflow"): 0.5, ("grpc_tcp", "tensorflow"): 1.0,
                                        ("zerocopy", "torch"): 0.25, ("grpc_tcp", "torch"): 1.0})
    report = build_report([path], tmp_path / "figures", figures=False)
    titles = [section.title for section in report.sections]
    assert "Figure 9: training throughput (TensorFlow)" in titles
    assert "Figure 9: training throughput (PyTorch)" in titles
    ratios = {section.title: table.rows for section in report.sections for table in section.tables
              if table.name == "figure9-ratios"}
    # zerocopy over grpc_tcp: 2x in TensorFlow, 4x in PyTorch, each against its own framework's line
    assert ratios["Figure 9: training throughput (TensorFlow)"][0][4].startswith("2.00x")
    assert ratios["Figure 9: training throughput (PyTorch)"][0][4].startswith("4.00x")
    software = next(row for table in report.overview if table.name == "setup" for row in table.rows
                    if row[0] == "software")
    assert software[2].startswith("TensorFlow 2.21.0; PyTorch 2.13.0+cpu, Python ")


def test_compare_matches_points_by_framework(tmp_path):
    tf = model_run(tmp_path / "tf", {("zerocopy", "tensorflow"): 0.5})
    torch = model_run(tmp_path / "torch", {("zerocopy", "torch"): 0.5})
    with pytest.raises(CompareError) as error:
        compare(tf, torch)
    message = str(error.value)
    assert "\n" not in message
    assert "TensorFlow (tensorflow)" in message and "PyTorch (torch)" in message
    assert "compare runs of the same --framework" in message
    # two runs of one framework compare as ever, PyTorch's named
    same = compare(torch, torch)
    assert same.key == ["transport", "model", "batch_size", "servers"] and same.exit_status() == 0
    assert same.format().splitlines()[0].startswith("model runs of PyTorch compared on step_time_s")
    # runs of both: each point against its own framework's, summed up per line and framework
    both = model_run(tmp_path / "both", {("zerocopy", "tensorflow"): 0.5, ("zerocopy", "torch"): 0.5})
    slower = model_run(tmp_path / "slower", {("zerocopy", "tensorflow"): 0.5, ("zerocopy", "torch"): 1.0})
    comparison = compare(both, slower)
    assert {row.point: row.state for row in comparison.rows} == {
        ("zerocopy", "tensorflow", "fcn5", 4, 2): "same", ("zerocopy", "torch", "fcn5", 4, 2): "slower"}
    assert [s.name for s in comparison.summaries()] == ["zerocopy (tensorflow)", "zerocopy (torch)"]
    assert comparison.format().splitlines()[-1].startswith("slower beyond 10%: zerocopy (torch)")


# -- the commands ---------------------------------------------------------------------------------------------

#: runs bench's entry point with PyTorch hidden, as on an install without the 'torch' extra
WITHOUT_TORCH = ("import sys; sys.modules['torch'] = None; from bench.cli import main; "
                 "sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("argv", [
    ["model", "fcn5", "--transport", "zerocopy"],
    ["scale", "fcn5", "--transport", "grpc_tcp"],
    ["converge", "--transport", "grpc_tcp"],
    ["analyze", "fcn5"],
])
def test_framework_torch_without_torch_names_the_extra_before_it_starts(tmp_path, argv):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *argv, "--framework", "torch", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"bench {argv[0]}: error: 'bench {argv[0]}' needs the 'torch' extra "
                               "(torch not installed here)"), lines[0]
    assert "pip install 'tensor-transport-bench[torch]'" in lines[0]
    assert not out.exists()


def test_an_unknown_framework_is_a_usage_error(capsys):
    from bench.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["model", "fcn5", "--framework", "jax"])
    assert exited.value.code == 2
    assert "argument --framework: invalid choice: 'jax' (choose from 'tensorflow', 'torch')" in capsys.readouterr().err


def test_framework_torch_needs_the_torch_extra_not_tensorflow():
    import argparse

    from bench.commands import analyze, model
    from bench.commands.common import extras_of

    assert extras_of(model, argparse.Namespace(framework="tensorflow")) == ("models",)
    assert extras_of(model, argparse.Namespace(framework="torch")) == ("torch",)
    assert extras_of(analyze, argparse.Namespace()) == ("models",)
    parser = argparse.ArgumentParser()
    model.add_arguments(parser)
    assert parser.parse_args(["fcn5"]).framework == "tensorflow"
    assert parser.parse_args(["fcn5", "--framework", "torch"]).framework == "torch"
