"""The bench command: bad input gives one clear line and exit 2; a small micro run end to end."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from bench.results import load_run


def bench(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["micro", "--sizes", "1XB"], "invalid size '1XB'"),
        (["micro", "--sizes", "2MB-1MB"], "start 2MB is larger than the end 1MB"),
        (["micro", "--transports", "nope"], "unknown transport 'nope' (known: grpc_tcp"),
        (["micro", "--iters", "0"], "at least 1"),
        (["micro", "--timeout", "-3"], "positive number of seconds"),
        (["report", "results", "--out", ""], "--out: expected a path, got an empty one"),
        (["analyze", "fcn5", "--json", " "], "--json: expected a path, got an empty one"),
        (["model", "fcn5", "--batch-size", "1,,2"], "got '1,,2' (an empty item)"),
        (["scale", "fcn5", "--servers", ",1"], "got ',1' (an empty item)"),
        (["plot"], "RESULTS_DIR"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_exit_2_no_traceback(args, fragment):
    result = bench(*args)
    assert result.returncode == 2
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def _command_parsers():
    from bench.cli import build_parser

    [commands] = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return commands.choices


def test_help_says_each_default_once():
    for name, parser in _command_parsers().items():
        for action in parser._actions:
            if not action.option_strings or action.help in (None, argparse.SUPPRESS):
                continue
            said = parser.formatter_class(parser.prog)._get_help_string(action) % vars(action)
            assert len(re.findall(r"\(default[: ]", said)) <= 1, f"bench {name} {action.option_strings[0]}: {said}"


def test_every_command_ends_its_help_with_examples_that_parse():
    for name, parser in _command_parsers().items():
        module = importlib.import_module(f"bench.commands.{name}")
        assert module.EXAMPLES, name
        help_text = parser.format_help()
        assert "examples:" in help_text
        for line, what in module.EXAMPLES:
            assert line in help_text and what in help_text
            argv = shlex.split(line)
            assert name in argv, line
            parser.parse_args(argv[argv.index(name) + 1:])  # a bad example exits 2 here


def test_plot_of_a_directory_that_is_not_a_run(tmp_path):
    result = bench("plot", str(tmp_path))
    assert result.returncode == 2 and "not a results directory" in result.stderr


def test_info_lists_every_transport_and_versions():
    result = bench("info")
    assert result.returncode == 0
    for word in ("grpc_tcp", "zerocopy", "local", "grpcio", "numpy", "ucx 1.", "ucx transport tcp",
                 "launchers (--launcher):", "netns", "mpi", "fabric:", "ucx    available", "verbs",
                 "peer lines of bench micro (--peers):", "socket   available"):
        assert word in result.stdout
    # "can it run here" is one type everywhere: launchers answer as transports and fabrics do
    from bench.launch import REGISTRY
    from transports.common import Availability

    for name in REGISTRY:
        status = REGISTRY.load(name).availability()
        assert isinstance(status, Availability) and f"  {name:6} {status.line()}" in result.stdout
    # UCX's tcp and sysv are listed as UCX has them, each saying that the fabric never uses it
    for carrier in ("tcp", "sysv"):
        line = next(line for line in result.stdout.splitlines() if f"ucx transport {carrier} " in line)
        assert "never used by the fabric" in line, line


def test_info_says_why_the_verbs_fabric_cannot_run_here():
    from transports import fabric

    status = fabric.availability("verbs")
    if status.ok:
        pytest.skip("this machine has an RDMA device")
    assert f"verbs  not available: {status.reason}" in bench("info").stdout


def test_a_fabric_that_cannot_run_here_is_a_usage_error_naming_why(tmp_path):
    from transports import fabric

    status = fabric.availability("verbs")
    if status.ok:
        pytest.skip("this machine has an RDMA device")
    result = bench("micro", "--sizes", "1KB", "--transports", "zerocopy", "--fabric", "verbs", "--out",
                   str(tmp_path / "run"))
    assert result.returncode == 2 and f"--fabric verbs: not available here: {status.reason}" in result.stderr
    assert not (tmp_path / "run").exists()
    result = bench("micro", "--sizes", "1KB", "--fabric", "ucx", "--fabric-transport", "rc")
    assert result.returncode == 2 and "invalid choice: 'rc'" in result.stderr


def test_micro_refuses_to_overwrite_a_run(tmp_path):
    (tmp_path / "run").mkdir()
    result = bench("micro", "--sizes", "1KB", "--transports", "local", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "already exists" in result.stderr


def test_analyze_refuses_an_existing_out_before_it_builds_the_model(tmp_path):
    (tmp_path / "run").mkdir()
    plan = tmp_path / "plan.json"
    result = bench("analyze", "fcn5", "--json", str(plan), "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "already exists; choose another --out" in result.stderr
    # nothing was done: no plan printed, none written, the directory as it was
    assert result.stdout == "" and not plan.exists() and not any((tmp_path / "run").iterdir())


def test_model_end_to_end_with_a_tiny_model(tmp_path):
    pytest.importorskip("tensorflow")
    out = tmp_path / "run"
    result = bench("model", "tests.tiny_models:TINY", "--transport", "zerocopy,local", "--batch-size", "1,2",
                   "--steps", "2", "--warmup", "1", "--fabric-transport", "shm", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    run = load_run(out)
    assert sorted(zip(run.records["transport"], run.records["batch_size"], strict=True)) == [
        ("local", 1), ("local", 2), ("zerocopy", 1), ("zerocopy", 2)]
    assert (run.records["throughput_batches_per_s"] > 0).all()
    assert (out / "model_throughput.png").is_file() and (out / "model_step_time.png").is_file()
    # the summary: what was timed, and local's step time over zerocopy's, one row per batch size
    lines = result.stdout.splitlines()
    assert "timed: 2 steps of every worker after 1 warm-up steps, per run" in lines
    heading = next(i for i, line in enumerate(lines) if line.startswith("step time relative to zerocopy"))
    assert lines[heading + 1].split() == ["run", "local"]
    for row, batch in zip(lines[heading + 2:heading + 4], (1, 2), strict=True):
        assert f" b{batch} x1 " in row and re.search(r" \d+\.\d+x( \([0-9.]+-[0-9.]+\))?$", row), row


def test_analyze_prints_the_plan_and_writes_it_as_json(tmp_path):
    pytest.importorskip("tensorflow")
    from bench.experiments.training import model_config
    from bench.runtime.analyzer import Plan
    from bench.runtime.config import plan_of

    result = bench("analyze", "tests.tiny_models:TINY_EMBEDDING", "--servers", "2", "--batch-size", "4", "--json",
                   str(tmp_path / "plan.json"), "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-2000:]
    run = load_run(tmp_path / "run")  # the plan as a run: a record per tensor and direction
    assert run.experiment == "analysis" and len(run.records) == 38
    assert set(run.records["placement"]) == {"static", "dynamic"}
    lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["g0.values", "gradient", "dynamic"] for line in lines)
    assert any(line.split()[:3] == ["s7", "state", "static"] for line in lines)
    assert "38 cross-process tensors over 2 server(s): 34 static" in result.stdout
    written = Plan.from_json(json.loads((tmp_path / "plan.json").read_text()))
    expected = plan_of(model_config("tests.tiny_models:TINY_EMBEDDING", transport="zerocopy",
                                    transport_options={}, batch_size=4, servers=2))
    assert written == expected and written.transfers == expected.transfers


def test_micro_leaves_out_zerocopy_without_the_analysis_unless_asked():
    import transports
    from bench.options import default_choices, labels

    labels = labels(default_choices())
    assert "zerocopy" in labels and "zerocopy:no_analysis" not in labels
    # grpc_rdma's two modes are two lines where it can run, and neither is where it cannot
    here = transports.availability("grpc_rdma").ok
    assert ("grpc_rdma" in labels, "grpc_rdma:direct" in labels) == (here, here)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["analyze", "resnet"], "unknown model 'resnet' (known: alexnet"),
        (["analyze", "vgg16", "--servers", "0"], "at least 1"),
        (["model", "vgg16", "--transport", "zerocopy:no_plan"], "transport 'zerocopy' has no mode 'no_plan'"),
        (["model", "resnet"], "unknown model 'resnet' (known: alexnet"),
        (["model", "vgg16", "--transport", "zercopy"], "unknown transport 'zercopy'"),
        (["model", "vgg16", "--batch-size", "0"], "at least 1"),
    ],
)
def test_bad_model_input_is_one_line_exit_2(args, fragment):
    result = bench(*args)
    assert result.returncode == 2 and fragment in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_scale_end_to_end_labels_replayed_records_and_draws_figure_11(tmp_path):
    pytest.importorskip("tensorflow")
    out = tmp_path / "run"
    result = bench("scale", "tests.tiny_models:TINY", "--transport", "zerocopy", "--servers", "1,2", "--steps", "2",
                   "--warmup", "1", "--fabric-transport", "shm", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    run = load_run(out)
    records = run.records.set_index(["transport", "servers"])
    assert sorted(records.index) == [("local", 1), ("zerocopy", 1), ("zerocopy", 2)]
    assert (run.records["compute"] == "replay").all() and (run.records["launcher"] == "local").all()
    assert records.loc[("zerocopy", 1), "scaling_efficiency"] == 1.0
    assert records.loc[("zerocopy", 2), "total_batches_per_s"] == pytest.approx(
        2 * records.loc[("zerocopy", 2), "throughput_batches_per_s"])
    assert run.meta["compute_s"]["tests.tiny_models:TINY-b1"] > 0
    # the plan analysed once (at 1 server) is laid out for 2: both workers talk to both PSs, a control message
    # pair each a step (a 1-server plan reused as it was ran one worker and one PS on two servers' ranks)
    assert records.loc[("zerocopy", 2), "control_messages_per_step"] == 4 * records.loc[
        ("zerocopy", 1), "control_messages_per_step"] > 0
    assert (out / "scale_throughput.png").is_file() and (out / "scale_efficiency.svg").is_file()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["scale", "vgg16", "--servers", "0"], "at least 1"),
        (["scale", "vgg16", "--compute", "guess"], "invalid choice: 'guess'"),
        (["scale", "vgg16", "--link-rate", "10gbit"], "--link-rate shapes the links between emulated hosts"),
        (["micro", "--launcher", "smoke-signals"], "invalid choice: 'smoke-signals'"),
        (["micro", "--launcher", "mpi", "--bind", "nowhere0"], "--bind nowhere0: no such address or network interface"),
    ],
)
def test_bad_scale_and_launcher_input_is_one_line_exit_2(args, fragment):
    result = bench(*args)
    assert result.returncode == 2 and fragment in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_run_of_the_baseline_alone_prints_no_table_relative_to_it(capsys):
    """bench model of zerocopy alone printed a heading and a row of nothing 'relative to zerocopy'."""
    from bench.readers.summary import print_relative

    alone = [("fcn5 b1 x1", {"zerocopy": {"step_time_s": 0.2}})]
    print_relative("step time relative to zerocopy", "run", alone, [], "zerocopy", "step_time_s")
    assert capsys.readouterr().out == ""
