"""``bench predict``: its records and figures from a recorded micro run, its errors, and the grid's re-laid plans."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest

from bench.ground.paper import TABLE2
from bench.results import load_run
from bench.results.records import PredictRecord

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")

#: a real `bench micro --transports zerocopy,rdma_cp,grpc_rdma,grpc_tcp --sizes 1KB-64MB:x4 --iters 5 --no-peers
#: --no-references` on this project's 2-core machine (logs left out)
MICRO = Path(__file__).parent / "data" / "predict_cli" / "micro"
TRANSPORTS = ["zerocopy", "rdma_cp", "grpc_rdma", "grpc_tcp"]
#: the smallest grid that shows a line: FCN-5 in PyTorch (its analysis takes about a second), the paper's compute
SMALL = ("fcn5", "--framework", "torch", "--compute", "paper", "--from", str(MICRO), "--servers", "1,4",
         "--link-rate", "10gbit")


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def test_predict_writes_a_predicted_record_per_grid_point_its_summary_and_figures(tmp_path):
    out = tmp_path / "run"
    result = bench("predict", *SMALL, "--out", str(out))
    assert result.returncode == 0, result.stderr
    run = load_run(out)
    assert run.experiment == "predict" and run.meta["status"] == "complete"
    records = run.records
    assert list(records.columns[:len(PredictRecord.columns())]) == PredictRecord.columns()
    assert len(records) == len(TRANSPORTS) * 2  # 4 transports x 2 server counts x 1 rate x 1 model
    assert set(records["kind"]) == {"predicted"}
    assert sorted(set(records["transport"])) == sorted(TRANSPORTS)
    assert sorted(set(records["servers"])) == [1, 4]
    assert set(records["link_rate"]) == {"10gbit"} and set(records["link_rate_bps"]) == {1e10}
    with (out / "records.csv").open() as rows:  # as written (readers shorten a long cell for display)
        assert {r["micro_run"] for r in csv.DictReader(rows)} == {str(MICRO)}
    assert set(records["compute"]) == {"paper"}
    # batch 32 (Figure 11's) by default, at the paper's Table 2 time per sample
    assert set(records["batch_size"]) == {32}
    assert records["compute_s"].to_numpy() == pytest.approx(32 * TABLE2["fcn5"].compute_ms_per_sample / 1e3)
    single = records[records["servers"] == 1]
    assert (single["scaling_efficiency"] == 1.0).all()
    assert (single["total_batches_per_s"] == single["throughput_batches_per_s"]).all()
    four = records[records["servers"] == 4]
    assert (four["total_batches_per_s"] == 4 * four["throughput_batches_per_s"]).all()
    assert ((four["nic_bytes_per_step"] > 0) & (single["nic_bytes_per_step"] == 0).all()).all()
    parts = records[["compute_fraction", "host_fraction", "wire_fraction", "wait_fraction"]].sum(axis=1)
    assert parts.round(9).eq(1.0).all()
    assert records["saturated"].str.match(r"^(nic:(egress|ingress):\d+|cpu:\d+)$").all()
    for stem in ("predict_throughput", "predict_efficiency"):
        assert (out / f"{stem}.png").stat().st_size > 0 and (out / f"{stem}.svg").exists()
    # the summary: a row per server count, and per line what a step is made of and what saturates
    assert "fcn5, batch 32, 10gbit links" in result.stdout
    for transport in TRANSPORTS:
        assert f"  {transport}: at 4 servers a step is" in result.stdout


@pytest.mark.parametrize(("args", "fragment"), [
    (("nosuch",), "unknown model 'nosuch'"),
    (("--link-rate", "10furlongs"), "bad link rate '10furlongs'"),
    (("--link-rate", "0gbit"), "bad link rate '0gbit'"),
    (("--servers", "0"), "--servers: expected a number of at least 1, got 0"),
    (("--servers", "1,99999"), "99999 servers is more than"),
    (("--transport", "zerocopy,nope"), "has no points of nope"),
    (("--from", "RUN_DIR"), "is a predict run, not a micro run"),
    (("--from", "MISSING"), "no meta.json"),
    (("embedding",), "the paper gives no compute time for model 'embedding'"),
    (("--cores-per-host", "0"), "--cores-per-host: expected a number of at least 1, got 0"),
    (("--shared-cores", "two"), "--shared-cores: expected a whole number, got 'two'"),
    (("--shared-cores", "2", "--cores-per-host", "4"), "--shared-cores and --cores-per-host exclude each other"),
    (("--oversubscription", "0.5"), "--oversubscription: expected a ratio of at least 1"),
    (("--oversubscription", "4:0"), "--oversubscription: expected a ratio of at least 1"),
    (("--oversubscription", "inf"), "--oversubscription: expected a ratio of at least 1"),
])
def test_predict_refuses_what_it_cannot_take_in_one_line_before_writing_anything(tmp_path, args, fragment):
    other = tmp_path / "predicted"  # a run that is not a micro run, for --from
    other.mkdir()
    (other / "meta.json").write_text('{"schema_version": 4, "experiment": "predict", "status": "complete", '
                                     '"settings": {}}')
    (other / "records.csv").write_text(",".join(PredictRecord.columns()) + "\n")
    args = tuple(str(other) if a == "RUN_DIR" else str(tmp_path / "missing") if a == "MISSING" else a for a in args)
    given = dict(zip(SMALL[1::2], SMALL[2::2], strict=True)) | dict(zip(args[::2], args[1::2], strict=False))
    model = args[0] if len(args) == 1 else SMALL[0]
    options = [x for option, value in given.items() for x in (option, value)]
    out = tmp_path / "out"
    result = bench("predict", model, *options, "--out", str(out))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench predict: error: ") and fragment in lines[0], lines
    assert not out.exists()


def test_predict_without_a_micro_run_measures_one_at_the_sizes_the_model_needs(tmp_path):
    from bench.experiments.predict.costs import sizes_needed
    from bench.experiments.predict.grid import analyse, micro_sizes

    out = tmp_path / "run"
    result = bench("predict", "fcn5", "--framework", "torch", "--compute", "paper", "--transport", "zerocopy",
                   "--servers", "1,2", "--link-rate", "10gbit", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    with (out / "records.csv").open() as rows:  # as written (readers shorten a long cell for display)
        records = list(csv.DictReader(rows))
    assert len(records) == 2 and {r["micro_run"] for r in records} == {str(out / "micro")}
    micro = load_run(out / "micro")
    assert micro.experiment == "micro" and set(micro.records["transport"]) == {"zerocopy"}
    plan = analyse("fcn5", "torch", 32, "paper").plan
    needed = sizes_needed(plan)
    measured = sorted(set(micro.records["size_bytes"]))
    assert measured == micro_sizes([plan])
    assert measured[0] <= max(1024, needed[0]) and measured[-1] >= needed[-1]
    assert all(b == 4 * a for a, b in pairwise(measured))


def test_a_plan_laid_out_again_for_more_servers_is_the_one_analysed_for_them():
    from bench.experiments.predict.grid import analyse
    from bench.experiments.training import model_config, profile

    one = analyse("fcn5", "torch", 2, "paper")
    assert one.plan.servers == 1 and one.compute_s == pytest.approx(2 * TABLE2["fcn5"].compute_ms_per_sample / 1e3)
    config = model_config("fcn5", framework="torch", transport="zerocopy", transport_options={}, batch_size=2,
                          servers=3, compute="paper")
    analysed, _ = profile(config, None, steps=0)
    assert one.plan.for_servers(3) == analysed
    assert analysed.for_servers(1) == one.plan


def test_a_plan_traced_at_batch_size_1_is_taken_for_another_batch_only_where_no_tensor_depends_on_it():
    from dataclasses import replace

    from bench.experiments.predict.grid import analyse, batch_independent
    from bench.experiments.training import model_config, profile

    config = model_config("fcn5", framework="torch", transport="zerocopy", transport_options={}, batch_size=4,
                          servers=1, compute="paper")
    analysed, _ = profile(config, None, steps=0)
    assert batch_independent(analysed)
    assert analyse("fcn5", "torch", 4, "paper").plan == analysed
    # a sparse variable or a dynamic tensor may depend on the batch: such a plan is traced at the batch asked for
    sparse = replace(analysed, variables=(replace(analysed.variables[0], sparse_rows=3), *analysed.variables[1:]))
    dynamic = replace(analysed, transfers=(replace(analysed.transfers[0], shape=None), *analysed.transfers[1:]))
    assert not batch_independent(sparse) and not batch_independent(dynamic)


def test_the_grid_simulated_by_a_pool_of_processes_is_the_grid_simulated_in_one():
    from bench.commands.predict import link_rates
    from bench.experiments.predict.costs import costs_from_run
    from bench.experiments.predict.grid import analyse, predict

    model = analyse("fcn5", "torch", 32, "paper")
    costs = costs_from_run(MICRO, ["zerocopy", "grpc_tcp"])
    told: list[int] = []
    alone = list(predict([model], costs, [1, 4], link_rates("10gbit"), str(MICRO), on_prediction=told.append))
    pooled = list(predict([model], costs, [1, 4], link_rates("10gbit"), str(MICRO), processes=2))
    assert pooled == alone and len(alone) == 4 and sum(told) == 4
    assert [(r.servers, r.transport) for r in alone] == [(1, "zerocopy"), (1, "grpc_tcp"), (4, "zerocopy"),
                                                         (4, "grpc_tcp")]


def _replayed_scale_run(path: Path, compute_s: list[float], model: str = "fcn5", batch: int = 32) -> Path:
    """A ``bench scale`` run of torch ``model`` with replayed compute, one record per compute time given."""
    from bench.results import RunWriter

    writer = RunWriter(path, "scale", {"compute": "replay"})
    for servers, seconds in enumerate(compute_s, start=1):
        writer.add({"transport": "zerocopy", "framework": "torch", "model": model, "batch_size": batch,
                    "servers": servers, "steps": 5, "step_time_s": 1.0, "throughput_batches_per_s": 1.0,
                    "compute_s": seconds, "comm_s": 0.2, "launcher": "netns", "compute": "replay",
                    "link_rate": "1gbit", "total_batches_per_s": float(servers), "scaling_efficiency": 1.0})
    writer.finish()
    return path


def test_predict_takes_each_models_compute_from_a_replayed_run_to_check_against(tmp_path):
    scale = _replayed_scale_run(tmp_path / "scale", [0.3, 0.7, 0.5])
    out = tmp_path / "run"
    result = bench("predict", "fcn5", "--framework", "torch", "--compute", "replay", "--compute-from", str(scale),
                   "--from", str(MICRO), "--servers", "1,2", "--link-rate", "10gbit", "--transport", "zerocopy",
                   "--out", str(out), "--no-plot")
    assert result.returncode == 0, result.stderr
    records = load_run(out).records
    assert set(records["compute"]) == {"replay"}
    assert set(records["compute_s"]) == {0.5}  # the run's median, not a time measured now
    assert load_run(out).meta["settings"]["compute_from"] == str(scale)


@pytest.mark.parametrize("args, words", [
    (("--compute", "paper"), "goes with --compute replay"),
    (("--batch-size", "8"), "has no torch fcn5 at batch size 8"),
])
def test_predict_refuses_a_compute_run_it_cannot_take(tmp_path, args, words):
    scale = _replayed_scale_run(tmp_path / "scale", [0.3])
    out = tmp_path / "run"
    result = bench("predict", "fcn5", "--framework", "torch", "--compute-from", str(scale), "--from", str(MICRO),
                   "--servers", "1", "--link-rate", "10gbit", *args, "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()
