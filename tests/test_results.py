"""The results store: meta.json and records.csv written, read back and checked."""

from __future__ import annotations

import json

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
