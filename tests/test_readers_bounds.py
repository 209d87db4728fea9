"""The readers (``bench report``, ``bench compare``, ``bench plot``) look at a CSV before they load it: a file larger
than a real run writes, binary data, or a header of more columns than a record has is one line and exit 2 from
each of them alike, soon and in bounded memory, whatever the file's size on disk. A run's own files, however
shaped, give a value or one line (hypothesis)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.readers.compare import CompareError, compare
from bench.readers.report import ReportError, build_report
from bench.results import ResultsError, load_run
from tests.test_untrusted_results import _samples_run, command, micro_run

ROOT = Path(__file__).parent.parent
READERS = ("report", "compare", "plot")
#: a reader's resident memory in these tests stays below this (the sparse 2 GiB file took 4.3 GB to be refused)
MEMORY_BOUND_KB = 800 * 1024


def argv(name: str, run: Path, good: Path, out: Path) -> list[str]:
    """The reader's command line over ``run`` (compare: ``good`` against it)."""
    return {"report": ["report", str(run), "--out", str(out / "report.md")],
            "compare": ["compare", str(good), str(run)], "plot": ["plot", str(run)]}[name]


def measured(args: list[str], env: dict | None = None) -> tuple[int, str, int]:
    """``bench ARGS`` in a process of its own: exit status, stderr and its peak resident memory (KiB)."""
    code = ("import resource, subprocess, sys\n"
            "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "sys.stderr.write(done.stderr)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
            "sys.exit(done.returncode)\n")
    done = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "bench.cli", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, **(env or {})})
    return done.returncode, done.stderr, int(done.stdout.split()[-1])


def one_line(status: int, err: str, fragment: str) -> None:
    assert status == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert fragment in err, err


def test_a_sparse_2_gib_samples_csv_is_refused_by_every_reader_soon_and_in_bounded_memory(tmp_path):
    good, run = _samples_run(tmp_path / "good"), _samples_run(tmp_path / "run")
    os.truncate(run / "samples.csv", 2 * 2**30)  # 2 GiB of zeros that take no disk
    for name in READERS:
        status, err, peak_kb = measured(argv(name, run, good, tmp_path))
        one_line(status, err, f"{run / 'samples.csv'} is 2,048 MiB, more than the 256 MiB a reader takes from a "
                              "samples.csv")
        assert "set BENCH_CSV_LIMIT_MB=2048 to read it" in err
        assert peak_kb < MEMORY_BOUND_KB, (name, peak_kb)


def test_the_limit_can_be_raised_and_then_binary_data_is_found_a_block_at_a_time(tmp_path):
    good, run = _samples_run(tmp_path / "good"), _samples_run(tmp_path / "run")
    size = (run / "samples.csv").stat().st_size
    os.truncate(run / "samples.csv", 300 * 2**20)
    status, err, peak_kb = measured(argv("compare", run, good, tmp_path), {"BENCH_CSV_LIMIT_MB": "400"})
    one_line(status, err, f"holds binary data, not text (byte 0x00 at offset {size} of {300 * 2**20})")
    assert peak_kb < MEMORY_BOUND_KB


@pytest.mark.parametrize("name", READERS)
def test_binary_samples_are_exit_2_and_the_same_line_from_every_reader(tmp_path, capsys, name):
    good, run = _samples_run(tmp_path / "good"), _samples_run(tmp_path / "run")
    (run / "samples.csv").write_bytes(bytes(range(256)) * 16)
    status, _, err = command(name, capsys, *argv(name, run, good, tmp_path)[1:])
    one_line(status, err, f"{run / 'samples.csv'} is not a CSV of records: it holds binary data, not text "
                          "(byte 0x00 at offset 0 of 4096); the file was not written by bench as it is")


@pytest.mark.parametrize("name", READERS)
def test_a_records_csv_of_a_million_columns_is_refused_by_its_header(tmp_path, capsys, name):
    good, run = micro_run(tmp_path / "good"), micro_run(tmp_path / "run")
    with open(run / "records.csv", "w") as file:  # 10 MB, as the stranger's
        file.write(",".join(f"c{i}" for i in range(10**6)) + "\n" + ",".join("1" * 10**6) + "\n")
    status, _, err = command(name, capsys, *argv(name, run, good, tmp_path)[1:])
    one_line(status, err, f"{run / 'records.csv'}: its first line (the header) is longer than 64 KiB")


def test_a_header_of_more_columns_than_a_record_has_is_refused_before_pandas_parses_it(tmp_path, capsys):
    good, run = micro_run(tmp_path / "good"), micro_run(tmp_path / "run")
    (run / "records.csv").write_text(",".join("x" * 2000) + "\n" + ",".join("1" * 2000) + "\n")
    status, _, err = command("compare", capsys, str(good), str(run))
    one_line(status, err, "its header names 2,000 columns, more than the 1,024 a reader takes")


def test_a_limit_that_is_not_a_size_is_one_line(tmp_path, capsys, monkeypatch):
    run = _samples_run(tmp_path / "run")
    monkeypatch.setenv("BENCH_CSV_LIMIT_MB", "lots")
    status, _, err = command("plot", capsys, str(run))
    one_line(status, err, "BENCH_CSV_LIMIT_MB=lots is not a size in MiB")
    monkeypatch.setenv("BENCH_CSV_LIMIT_MB", "0.000001")  # a byte: even a real run's records are refused
    status, _, err = command("plot", capsys, str(run))
    one_line(status, err, "more than the 1 MiB a reader takes from a records.csv")


def test_a_torn_row_after_a_block_is_still_cut_and_the_rest_read(tmp_path, capsys, monkeypatch):
    from bench.results import reading

    monkeypatch.setattr(reading, "_BLOCK", 64)  # the file looked at in many blocks
    run = _samples_run(tmp_path / "run")
    data = (run / "samples.csv").read_bytes()
    (run / "samples.csv").write_bytes(data + b"zerocopy,1024,1,9,1")
    samples = load_run(run).samples
    assert len(samples) == 8
    assert "its last row is cut short" in capsys.readouterr().err


# -- hypothesis: bytes and shapes of any kind in each of a run's files --------------------------------------------

_HEADER = {"records.csv": "transport,size_bytes,iters,p50_us,p99_us,mean_us,throughput_MBps,sender_cpu_s,"
                          "receiver_cpu_s,copied_bytes_per_transfer",
           "samples.csv": "transport,size_bytes,round,iteration,time_us,transfer_us"}
_META = json.dumps({"schema_version": 3, "experiment": "micro"}).encode()


@st.composite
def contents(draw, name: str) -> tuple[bytes, int]:
    """A file's bytes and the size it is cut or stretched to (0: as it is): bytes of any kind, bench's header
    with rows of anything, headers of any width and length, and files far larger than a run writes (sparse)."""
    kind = draw(st.sampled_from(["bytes", "rows", "wide", "long", "sparse"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300)), 0
    if kind == "wide":
        return ((",".join("c" * draw(st.integers(0, 3)) for _ in range(draw(st.integers(1, 3000)))) + "\n")
                .encode(), 0)
    if kind == "long":
        return b"a" * draw(st.integers(60_000, 200_000)) + draw(st.sampled_from([b"", b"\n1\n"])), 0
    cell = st.one_of(st.sampled_from(["zerocopy", "1024", "1", "nan", "inf", "", '"', "\x00", "\x1b[2J", "\u00e9"]),
                     st.text(max_size=6))
    rows = draw(st.lists(st.lists(cell, max_size=12), max_size=6))
    text = _HEADER[name] + "\n" + "".join(",".join(row) + draw(st.sampled_from(["\n", "\r\n", ""])) for row in rows)
    data = text.encode("utf-8", "surrogatepass")
    return data, (draw(st.sampled_from([300, 2048])) * 2**20 if kind == "sparse" else 0)


#: this process's peak resident memory before the first example (the peak only grows: examples may not raise it much)
_PEAK_BEFORE: list[int] = []


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["records.csv", "samples.csv", "meta.json"]), data=st.data())
def test_every_reader_gives_a_value_or_one_line_in_bounded_memory(name, data):
    if not _PEAK_BEFORE:
        _PEAK_BEFORE.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    content, stretch = data.draw(contents("records.csv" if name == "meta.json" else name))
    with tempfile.TemporaryDirectory() as tmp:
        good = _samples_run(Path(tmp) / "good")
        run = _samples_run(Path(tmp) / "run")
        (run / name).write_bytes(content if name != "meta.json" else content[:200] or _META)
        if stretch:
            os.truncate(run / name, stretch)
        for read in (lambda: load_run(run).samples, lambda: compare(good, run).format(),
                     lambda: build_report([run], Path(tmp) / "figures", figures=False)):
            try:
                read()
            except (ResultsError, CompareError, ReportError) as exc:
                text = str(exc)
                assert "\n" not in text and "\x1b" not in text and len(text) < 2000, text
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - _PEAK_BEFORE[0] < MEMORY_BOUND_KB
