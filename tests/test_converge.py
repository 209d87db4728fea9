"""``bench converge``: the same learning over every transport, records, the summary, figures, bad input, no network."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from bench.experiments.converge import Target, losses_agree, parse_target, summary_records
from bench.results import load_run

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str, prefix: tuple[str, ...] = (), timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "bench.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


#: a network namespace with only loopback can be made here (root, unshare, ip): the shared run goes there
NO_NETWORK = os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("ip") is not None


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One short run of the default task (no task named) over two transports, shared by the tests that read it;
    where it can be, in a network namespace with only loopback up (no route anywhere): the embedded default must
    train there, with nothing to download."""
    out = tmp_path_factory.mktemp("converge") / "run"
    # one server: the two servers' gradient averaging is test_runtime's, and the time limit's below
    args = ["converge", "--transport", "grpc_tcp,zerocopy", "--servers", "1", "--steps", "12", "--eval-every", "5",
            "--target", "accuracy=0.1", "--out", str(out)]
    if NO_NETWORK:
        script = f"ip link set lo up && exec {shlex.join([sys.executable, '-m', 'bench.cli', *args])}"
        result = subprocess.run(["unshare", "-n", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                                timeout=900)
    else:
        result = bench(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_every_transport_learns_the_same_thing(run_dir):
    records = load_run(run_dir).records
    steps = records[records["kind"] == "step"]
    by_transport = {label: rows.sort_values("step")["train_loss"].to_numpy()
                    for label, rows in steps.groupby("transport")}
    assert set(by_transport) == {"grpc_tcp", "zerocopy"} and len(by_transport["grpc_tcp"]) == 12
    assert (by_transport["zerocopy"] == pytest.approx(by_transport["grpc_tcp"], rel=1e-6))
    evals = records[records["kind"] == "eval"]
    assert sorted(set(evals["step"])) == [0, 5, 10, 11]  # every 5 steps and the last
    for _, rows in evals.groupby("step"):
        assert rows["metric_value"].nunique() == 1 and rows["heldout_loss"].nunique() == 1
    assert load_run(run_dir).meta["loss_max_relative_difference"] == {"zerocopy": 0.0}


def test_records_carry_time_the_metric_the_fabric_and_a_summary(run_dir):
    run = load_run(run_dir)
    records = run.records
    assert run.meta["settings"]["task"] == "digits" and run.meta["settings"]["metric"] == "accuracy"
    evals = records[records["kind"] == "eval"]
    for _, rows in evals.groupby("transport"):
        assert rows.sort_values("step")["wall_s"].is_monotonic_increasing
    assert set(evals["metric"]) == {"accuracy"}
    assert records[records["transport"] == "zerocopy"]["fabric"].str.startswith("ucx:").all()
    summary = records[records["kind"] == "summary"].set_index("transport")
    assert set(summary.index) == {"grpc_tcp", "zerocopy"} and (summary["target"] == "accuracy=0.1").all()
    assert summary.loc["grpc_tcp", "speedup_vs_grpc_tcp"] == pytest.approx(1.0)
    assert summary["time_to_target_s"].notna().all()


def test_the_figures_are_drawn(run_dir):
    for stem in ("converge_loss_vs_time", "converge_metric_vs_step"):
        assert (run_dir / f"{stem}.png").stat().st_size > 10_000


def test_a_time_limit_stops_every_rank_at_one_step(tmp_path):
    out = tmp_path / "run"
    result = bench("converge", "digits", "--transport", "zerocopy", "--time", "3", "--eval-every", "1000",
                   "--out", str(out), "--no-plot")
    assert result.returncode == 0, result.stdout[-1500:] + result.stderr[-3000:]
    steps = load_run(out).records.query("kind == 'step'")
    assert 3 < len(steps) < 100_000
    assert steps["step"].tolist() == list(range(len(steps)))  # both workers reported every step, none more
    assert steps["wall_s"].max() >= 3.0


@pytest.mark.system("netns")
def test_the_default_task_needs_no_network(run_dir):
    """The shared run was made in a network namespace with only loopback (no route anywhere): the embedded default
    trained to the end there."""
    run = load_run(run_dir)
    assert run.meta["status"] == "complete" and run.meta["settings"]["task"] == "digits"


@pytest.mark.parametrize(("args", "message"), [
    (("nope",), "unknown task 'nope'"),
    (("cifar10",), "cifar10"),
    (("cifar10", "--data", "/nonexistent/cifar"), "/nonexistent/cifar"),
    (("digits", "--transport", "local"), "--transport local: converge trains through the parameter-server runtime"),
    (("digits", "--target", "speed=3"), "is not METRIC=VALUE"),
    # a metric the task never reports: the target could never be reached (kept short should the check be missing)
    (("digits", "--target", "perplexity=8", "--transport", "grpc_tcp", "--servers", "1", "--steps", "1",
      "--no-plot"), "--target perplexity=8: the digits task reports accuracy and heldout_loss, never perplexity"),
    (("digits", "--steps", "5", "--time", "3"), "not allowed with argument"),
])
def test_bad_input_is_one_line_and_makes_no_results(tmp_path, args, message):
    result = bench("converge", *args, "--out", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_targets_parse_and_compare_in_the_metric_s_direction():
    assert parse_target("accuracy=0.97") == Target("accuracy", 0.97)
    assert Target("accuracy", 0.9).reached(0.95) and not Target("accuracy", 0.9).reached(0.85)
    assert Target("perplexity", 10).reached(9.5) and not Target("perplexity", 10).reached(12)
    for bad in ("accuracy", "accuracy=2", "perplexity=-1", "loss=1", "accuracy=x"):
        with pytest.raises(ValueError):
            parse_target(bad)


def test_a_target_must_be_a_metric_the_task_reports():
    from bench.commands.converge import EXAMPLES
    from bench.experiments.converge import target_problem
    from bench.experiments.tasks import get_task

    assert target_problem(parse_target("heldout_loss=0.5"), "text", "perplexity") is None
    assert target_problem(parse_target("perplexity=9"), "text", "perplexity") is None
    problem = target_problem(parse_target("accuracy=0.8"), "text", "perplexity")
    assert problem == ("--target accuracy=0.8: the text task reports perplexity and heldout_loss, never accuracy, so "
                       "the target could not be reached; give --target perplexity=VALUE or heldout_loss=VALUE")
    for line, _ in EXAMPLES:  # the examples of --help ask for targets their tasks can reach
        words = line.split()
        if "--target" in words:
            task = get_task(words[2])
            assert target_problem(parse_target(words[words.index("--target") + 1]), task.name, task.metric) is None


def test_the_summary_times_the_first_evaluation_that_reached_the_target():
    rows = [{"kind": "eval", "transport": label, "task": "cifar10", "step": step, "wall_s": seconds,
             "heldout_loss": 1.0, "metric": "accuracy", "metric_value": value}
            for label, points in {"grpc_tcp": [(0, 0.0, 0.1), (10, 8.0, 0.6), (20, 16.0, 0.7)],
                                  "zerocopy": [(0, 0.0, 0.1), (10, 3.0, 0.6), (20, 6.0, 0.7)],
                                  "rdma_cp": [(0, 0.0, 0.1), (10, 5.0, 0.3)]}.items()
            for step, seconds, value in points]
    summary = pd.DataFrame(summary_records(rows, Target("accuracy", 0.5))).set_index("transport")
    assert summary.loc["zerocopy", "steps_to_target"] == 10 and summary.loc["zerocopy", "time_to_target_s"] == 3.0
    assert summary.loc["zerocopy", "speedup_vs_grpc_tcp"] == pytest.approx(8 / 3)
    assert summary.loc["zerocopy", "paper_speedup_vs_grpc_tcp"] == 2.6  # the paper's Figure 10, CIFAR-10
    assert pd.isna(summary.loc["rdma_cp", "time_to_target_s"])  # never reached


def test_the_summary_keeps_the_framework_of_its_evaluations():
    rows = [{"kind": "eval", "transport": "zerocopy", "task": "digits", "step": step, "wall_s": float(step),
             "heldout_loss": 1.0, "metric": "accuracy", "metric_value": value, "framework": "torch",
             "framework_version": "2.13.0+cpu"} for step, value in ((0, 0.1), (10, 0.98))]
    (summary,) = summary_records(rows, Target("accuracy", 0.97))
    assert (summary.framework, summary.framework_version, summary.steps_to_target) == ("torch", "2.13.0+cpu", 10)


def test_losses_agree_reports_the_largest_relative_difference():
    assert losses_agree({"a": [1.0, 2.0], "b": [1.0, 2.0]}) == {"b": 0.0}
    assert losses_agree({"a": [1.0, 2.0], "b": [1.0, 2.2]})["b"] == pytest.approx(0.1)


def test_the_paper_s_tasks_train_end_to_end_on_files_the_test_writes(tmp_path):
    """CIFAR-10 (its Python format) and Seq2Seq (aligned text files) run through the runtime over a transport,
    with the loss per step identical across two transports; here on tiny files, not the real data sets."""
    from .test_tasks import PAIRS, _cifar_batch, _write_pairs

    cifar = tmp_path / "cifar"
    cifar.mkdir()
    for k in (1, 2):
        _cifar_batch(cifar / f"data_batch_{k}", 40, k)
    _cifar_batch(cifar / "test_batch", 20, 9)
    prefix = _write_pairs(tmp_path, pairs=PAIRS * 4)
    for task, data, target in (("cifar10", str(cifar), "accuracy=0.01"), ("seq2seq", prefix, "perplexity=1000")):
        out = tmp_path / task
        result = bench("converge", task, "--data", data, "--transport", "grpc_tcp,zerocopy", "--servers", "1",
                       "--batch-size", "8", "--steps", "4", "--eval-every", "2", "--target", target, "--out", str(out),
                       "--no-plot")
        assert result.returncode == 0, result.stderr[-3000:]
        run = load_run(out)
        assert run.meta["loss_max_relative_difference"] == {"zerocopy": 0.0}
        summary = run.records.query("kind == 'summary'")
        assert summary["time_to_target_s"].notna().all(), summary
