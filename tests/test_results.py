"""The results store: meta.json and records.csv written, read back and checked."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from bench.results import REQUIRED_COLUMNS, SCHEMA_VERSION, ResultsError, RunWriter, load_run


def micro_record(**overrides):
    record = dict.fromkeys(REQUIRED_COLUMNS["micro"], 1.0)
    record.update(transport="grpc_tcp", size_bytes=1024, iters=10)
    record.update(overrides)
    return record


def test_a_run_round_trips(tmp_path):
    writer = RunWriter(tmp_path / "run", "micro", {"sizes": [1024, 2048]})
    writer.add(micro_record(size_bytes=1024, p50_us=12.5))
    writer.add(micro_record(size_bytes=2048, p50_us=20.0))
    writer.finish()
    run = load_run(tmp_path / "run")
    assert run.experiment == "micro"
    assert run.meta["schema_version"] == SCHEMA_VERSION
    assert run.meta["status"] == "complete" and run.meta["end_time"]
    assert run.meta["settings"] == {"sizes": [1024, 2048]}
    for key in ("host", "cpu", "memory_bytes", "packages", "git_commit", "command", "start_time"):
        assert key in run.meta
    assert list(run.records["size_bytes"]) == [1024, 2048]
    assert list(run.records["p50_us"]) == [12.5, 20.0]


def test_records_survive_an_unfinished_run(tmp_path):
    writer = RunWriter(tmp_path / "run", "micro", {})
    writer.add(micro_record())
    run = load_run(tmp_path / "run")
    assert run.meta["status"] == "running" and len(run.records) == 1


def test_a_record_without_required_columns_is_refused(tmp_path):
    writer = RunWriter(tmp_path / "run", "micro", {})
    record = micro_record()
    del record["p99_us"]
    with pytest.raises(ResultsError, match="p99_us"):
        writer.add(record)


def test_an_unknown_schema_version_is_refused(tmp_path):
    writer = RunWriter(tmp_path / "run", "micro", {})
    writer.add(micro_record())
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    meta["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "run" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ResultsError, match="schema_version"):
        load_run(tmp_path / "run")


def test_a_directory_that_is_not_a_run_is_named(tmp_path):
    with pytest.raises(ResultsError, match="not a results directory"):
        load_run(tmp_path)


def test_an_existing_run_directory_is_not_overwritten(tmp_path):
    RunWriter(tmp_path / "run", "micro", {})
    with pytest.raises(FileExistsError):
        RunWriter(tmp_path / "run", "micro", {})


# of_reference: each line's throughput as a fraction of the same run's ucx_perftest (put_bw) at the same size


def test_of_reference_is_a_fraction_of_the_reference_throughput():
    from bench.results import of_reference

    assert of_reference(250.0, 1000.0) == 0.25
    assert of_reference(3000.0, 1000.0) == 3.0  # local or memcpy can beat the fabric
    assert of_reference(250.0, None) is None  # no reference ran
    assert of_reference(250.0, 0.0) is None
    assert of_reference(float("nan"), 1000.0) is None


OLD_MICRO_HEADER = (  # records.csv as bench micro wrote it before of_reference existed
    "transport,size_bytes,dtype,warmup,iters,p50_us,p99_us,mean_us,min_us,max_us,transfer_p50_us,consume_p50_us,"
    "throughput_MBps,sender_cpu_s,receiver_cpu_s,sender_cpu_us_per_transfer,receiver_cpu_us_per_transfer,"
    "copied_bytes_per_transfer,serialisations_per_transfer,deserialisations_per_transfer,"
    "control_messages_per_transfer,registrations,fabric"
)


def _old_run(tmp_path, rows):
    writer = RunWriter(tmp_path / "run", "micro", {})
    writer.finish()
    columns = OLD_MICRO_HEADER.split(",")
    lines = [OLD_MICRO_HEADER]
    for transport, size, mbps in rows:
        values = dict.fromkeys(columns, "1.0")
        values.update(transport=transport, size_bytes=str(size), iters="10", throughput_MBps=str(mbps), dtype="uint8",
                      fabric="ucx:shm")
        lines.append(",".join(values[c] for c in columns))
    (tmp_path / "run" / "records.csv").write_text("\n".join(lines) + "\n")
    return tmp_path / "run"


def test_an_old_micro_run_without_of_reference_loads_with_it_computed(tmp_path):
    path = _old_run(tmp_path, [("zerocopy", 1024, 40.0), ("zerocopy", 65536, 2000.0),
                               ("ucx_perftest", 1024, 10000.0), ("ucx_perftest", 65536, 8000.0),
                               ("memcpy", 262144, 5000.0)])
    records = load_run(path).records.set_index(["transport", "size_bytes"])["of_reference"]
    assert records[("zerocopy", 1024)] == pytest.approx(0.004)
    assert records[("zerocopy", 65536)] == pytest.approx(0.25)
    assert records[("ucx_perftest", 65536)] == 1.0
    assert math.isnan(records[("memcpy", 262144)])  # no reference at that size


def test_an_old_micro_run_without_references_loads_with_an_empty_column(tmp_path):
    records = load_run(_old_run(tmp_path, [("zerocopy", 1024, 40.0)])).records
    assert "of_reference" in records and records["of_reference"].isna().all()


def test_recorded_of_reference_is_read_as_written(tmp_path):
    writer = RunWriter(tmp_path / "run", "micro", {})
    writer.add(micro_record(transport="ucx_perftest", throughput_MBps=1000.0, of_reference=1.0))
    writer.add(micro_record(transport="zerocopy", throughput_MBps=10.0, of_reference=0.01))
    writer.add(micro_record(transport="grpc_tcp", throughput_MBps=10.0))  # no reference ran: stays empty
    writer.finish()
    header = (tmp_path / "run" / "records.csv").read_text().splitlines()[0].split(",")
    assert header.index("of_reference") == header.index("throughput_MBps") + 1
    records = load_run(tmp_path / "run").records
    assert list(records["of_reference"][:2]) == [1.0, 0.01]
    assert math.isnan(records["of_reference"][2])


def test_a_size_with_two_references_has_none():
    import pandas as pd

    from bench.results import reference_throughputs, with_of_reference

    records = pd.DataFrame({"transport": ["ucx_perftest", "ucx_perftest", "zerocopy", "ucx_perftest", "zerocopy"],
                            "size_bytes": [1024, 1024, 1024, 4096, 4096],
                            "throughput_MBps": [100.0, 200.0, 50.0, 400.0, 100.0]})
    assert reference_throughputs(records) == {4096: 400.0}
    filled = with_of_reference(records)
    assert filled["of_reference"].isna().tolist() == [True, True, True, False, False]
    assert filled["of_reference"].iloc[4] == 0.25
    assert "of_reference" not in records  # the caller's frame is left alone


# schema version 2: record types, rounds, samples; version 1 directories still load

from pathlib import Path  # noqa: E402

V1_RUNS = Path(__file__).parent / "data" / "v1"


@pytest.mark.parametrize("experiment", ["micro", "model", "scale", "converge", "soak"])
def test_a_version_1_directory_written_by_the_old_code_loads(experiment):
    from bench.results import COLUMNS

    run = load_run(V1_RUNS / experiment)
    assert run.schema_version == 1 and run.experiment == experiment and len(run.records) > 0
    assert run.samples is None  # version 1 kept no samples
    if "round" in COLUMNS[experiment]:
        assert (run.records["round"] == 1).all()
        points = run.points()
        assert len(points) == len(run.records)  # one round: every record is a point of its own
        assert (points["spread"] == "none").all() and (points["rounds"] == 1).all()


def test_a_version_1_directory_plots(tmp_path):
    from bench.readers.plot import plot_run

    for experiment in ("micro", "model", "scale", "converge"):
        (tmp_path / experiment).mkdir()
        written = plot_run(V1_RUNS / experiment, out_dir=tmp_path / experiment)
        assert written and all(path.parent == tmp_path / experiment for path in written)
    assert not list((V1_RUNS / "micro").glob("*.png"))  # nothing written into the run itself


def test_records_are_typed_and_checked_where_they_are_made():
    from bench.results import MicroRecord, ModelRecord, ResultsError, ScaleRecord

    with pytest.raises(TypeError, match="p50_us"):
        MicroRecord(transport="zerocopy", size_bytes=1024, iters=1)  # a required column missing
    with pytest.raises(TypeError, match="p51_us"):
        MicroRecord(**micro_record(), p51_us=1.0)  # a misspelt column
    with pytest.raises(ResultsError, match="p99_us"):
        MicroRecord.from_row({k: v for k, v in micro_record().items() if k != "p99_us"})
    assert MicroRecord.columns()[:4] == ["transport", "line_kind", "size_bytes", "round"]
    assert "round" not in MicroRecord.required()
    assert ScaleRecord.columns()[: len(ModelRecord.columns())] == ModelRecord.columns()
    assert set(ScaleRecord.required()) - set(ModelRecord.required()) == {"launcher", "compute", "link_rate",
                                                                         "scaling_efficiency"}


def test_a_record_of_another_experiment_is_refused(tmp_path):
    from bench.results import ModelsRecord, ResultsError

    writer = RunWriter(tmp_path / "run", "micro", {})
    record = ModelsRecord(model="fcn5", variables=10, model_mb=204.47, batch_size=1, compute_ms_per_sample=1.0)
    with pytest.raises(ResultsError, match="ModelsRecord cannot go into a micro run"):
        writer.add(record)


def _rounds_run(tmp_path, times_by_round):
    """A micro run of one size whose transports took ``times_by_round[transport][round]`` µs per transfer."""
    import numpy as np

    from bench.results import MicroRecord, latency_summary

    writer = RunWriter(tmp_path / "run", "micro", {})
    for round_ in range(len(next(iter(times_by_round.values())))):
        for transport, times in times_by_round.items():
            samples = np.full(9, float(times[round_]))
            record = MicroRecord(transport=transport, size_bytes=1 << 20, round=round_ + 1, iters=9,
                                 **latency_summary(samples), throughput_MBps=1e6 / times[round_],
                                 sender_cpu_s=0.0, receiver_cpu_s=0.0, copied_bytes_per_transfer=0)
            writer.add(record)
            writer.add_samples(record, {"time_us": samples, "transfer_us": samples / 2})
    writer.finish()
    return load_run(tmp_path / "run")


def test_rounds_fold_into_one_point_with_their_range(tmp_path):
    run = _rounds_run(tmp_path, {"zerocopy": [100, 120, 110], "rdma_cp": [200, 150, 180]})
    assert list(run.records["round"]) == [1, 1, 2, 2, 3, 3]
    assert len(run.samples) == 6 * 9 and set(run.samples["round"]) == {1, 2, 3}
    points = run.points().set_index("transport")
    assert points.loc["zerocopy", "p50_us"] == 110 and points.loc["rdma_cp", "p50_us"] == 180  # medians
    assert (points.loc["zerocopy", "p50_us_low"], points.loc["zerocopy", "p50_us_high"]) == (100, 120)
    assert (points.loc["rdma_cp", "p50_us_low"], points.loc["rdma_cp", "p50_us_high"]) == (150, 200)
    assert (points["rounds"] == 3).all() and (points["spread"] == "rounds").all()


def test_a_ratio_carries_the_range_the_spreads_allow(tmp_path):
    from bench.results import ratio

    points = _rounds_run(tmp_path, {"zerocopy": [100, 120, 110], "rdma_cp": [200, 150, 180]}).points()
    zerocopy, rdma_cp = (points[points["transport"] == t].iloc[0] for t in ("zerocopy", "rdma_cp"))
    slower = ratio(rdma_cp, zerocopy, "p50_us")
    assert slower.value == pytest.approx(180 / 110)
    assert (slower.low, slower.high) == (pytest.approx(150 / 120), pytest.approx(200 / 100))
    assert not slower.overlap and str(slower) == "1.64x (1.25-2.00)"
    assert ratio(zerocopy, zerocopy, "p50_us").overlap


def test_one_round_takes_its_spread_from_the_samples(tmp_path):
    import numpy as np

    from bench.results import MicroRecord, latency_summary, median_interval

    times = np.arange(1.0, 101.0)  # 1..100 µs
    writer = RunWriter(tmp_path / "run", "micro", {})
    record = MicroRecord(transport="zerocopy", size_bytes=1024, iters=100, **latency_summary(times),
                         throughput_MBps=1.0, sender_cpu_s=0.0, receiver_cpu_s=0.0, copied_bytes_per_transfer=0)
    writer.add(record)
    writer.add_samples(record, {"time_us": times, "transfer_us": times})
    writer.finish()
    point = load_run(tmp_path / "run").points().iloc[0]
    assert point["spread"] == "samples"
    assert (point["p50_us_low"], point["p50_us_high"]) == median_interval(times) == (41.0, 60.0)
    assert point["p50_us_low"] < point["p50_us"] < point["p50_us_high"]


def test_a_rank_that_writes_records_never_loads_pandas():
    """pandas is for reading runs: a rank's process (a micro line's, a training rank's) imports what it writes
    records with and not pandas, whose import costs every rank a quarter of a second here, seconds under
    emulation."""
    code = ("import sys; import bench.launch.rank, bench.experiments.micro, bench.experiments.training, bench.results; "
            "print('pandas' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
