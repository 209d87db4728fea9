"""A full disk costs a run, a report or a plot nothing already written: rows are appended whole, every other file is
written and then renamed into place, a run stops with one line and ``meta.json`` says it failed; readers skip (and
warn about) a last row cut short.

The disks here are real: a small tmpfs mounted for the test (root only; skipped with the reason elsewhere), filled
up by the run itself or by a filler file first.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bench.cli import main
from bench.results import (
    META_FILE,
    RECORDS_FILE,
    SAMPLES_FILE,
    DiskError,
    MicroRecord,
    RunWriter,
    append_whole,
    load_run,
    replace_file,
)
from tests.test_compare import micro_run as compare_run
from tests.test_report import micro_run as report_run


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up (needs root and mount rights): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)``: a fresh tmpfs of ``size`` (``256k``), unmounted when the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda size="256k": stack.enter_context(_tmpfs(tmp_path / f"disk-{uuid.uuid4().hex[:8]}", size))


def fill(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` to the last byte with a file of zeros; the file."""
    filler = directory / "filler"
    chunk = bytes(4096)
    with open(filler, "ab", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(chunk)
        with contextlib.suppress(OSError):  # the last partial page
            while f.write(b"\0"):
                pass
    return filler


def leftovers(directory: Path) -> list[str]:
    """Temporary files a write left behind."""
    return sorted(p.name for p in directory.rglob("*") if ".tmp" in p.name)


def micro(size: int, p50_us: float) -> MicroRecord:
    return MicroRecord(transport="grpc_tcp", size_bytes=size, iters=1000, p50_us=p50_us, p99_us=2 * p50_us,
                       mean_us=p50_us, throughput_MBps=1.0, sender_cpu_s=0.1, receiver_cpu_s=0.1,
                       copied_bytes_per_transfer=0.0, fabric="none")


def samples(n: int = 1000) -> dict[str, np.ndarray]:
    times = np.linspace(10.0, 99.987654321, n)
    return {"time_us": times, "transfer_us": times / 3}


# -- the writer ---------------------------------------------------------------------------------------------


def test_rows_are_appended_whole_or_not_at_all(small_disk):
    disk = small_disk("64k")
    path = disk / "rows.csv"
    append_whole(path, "1,2\n", header="a,b\n")
    fill(disk)
    with pytest.raises(DiskError) as refused:
        append_whole(path, "3,4\n" * 5000)
    assert path.read_bytes() == b"a,b\n1,2\n"  # nothing of the refused rows
    assert refused.value.errno == errno.ENOSPC
    assert str(refused.value) == (f"cannot write {path}: No space left on device; free space there or choose "
                                  "another --out")
    with pytest.raises(DiskError):
        append_whole(disk / "new.csv", "x\n" * 5000, header="h\n")
    assert not (disk / "new.csv").exists()  # no empty file begun


def test_a_file_replaced_on_a_full_disk_keeps_its_old_content(small_disk):
    disk = small_disk("64k")
    page = disk / "page.html"
    replace_file(page, "<p>the good page</p>")
    fill(disk)
    with pytest.raises(DiskError):
        replace_file(page, "x" * 100_000)
    assert page.read_text() == "<p>the good page</p>"
    assert leftovers(disk) == []


def test_a_run_whose_disk_fills_keeps_every_point_and_says_it_failed(small_disk, capsys):
    disk = small_disk("256k")
    writer = RunWriter(disk / "run", "micro", {"sizes": "many"})
    measured = []
    with pytest.raises(DiskError) as refused:
        for i in range(1000):
            record = micro(1024 * (i + 1), 10.0 + i)
            writer.add(record)
            writer.add_samples(record, samples())
            measured.append(record.size_bytes)
    assert str(refused.value).startswith(f"cannot write {disk / 'run'}/")
    assert len(measured) >= 3
    with pytest.raises(DiskError):  # nothing lands after the gap
        writer.add(micro(1, 1.0))
    writer.finish("complete")
    meta = json.loads((disk / "run" / META_FILE).read_text())
    assert meta["status"] == "failed" and meta["reason"] == str(refused.value)
    assert leftovers(disk) == []
    for name in (RECORDS_FILE, SAMPLES_FILE):
        assert (disk / "run" / name).read_bytes().endswith(b"\r\n")
    run = load_run(disk / "run")
    points = run.points()
    assert set(measured) <= set(points["size_bytes"])
    assert 1 not in set(points["size_bytes"])
    assert (run.samples.groupby("size_bytes").size().loc[measured] == 1000).all()
    assert capsys.readouterr().err == ""  # nothing torn to warn about


def test_the_last_meta_json_goes_into_the_room_kept_for_it(small_disk):
    disk = small_disk("64k")
    writer = RunWriter(disk / "run", "micro", {})
    writer.add(micro(1024, 10.0))
    fill(disk)  # every row fitted, but nothing is left for the end
    writer.finish("complete")
    assert json.loads((disk / "run" / META_FILE).read_text())["status"] == "complete"
    assert sorted(p.name for p in (disk / "run").iterdir()) == [META_FILE, RECORDS_FILE]  # the room given back
    assert leftovers(disk) == []


def test_meta_json_that_cannot_be_renamed_into_place_is_written_into_its_own_blocks(small_disk):
    disk = small_disk("64k")
    writer = RunWriter(disk / "run", "micro", {})
    writer.add(micro(1024, 10.0))
    for reserve in (disk / "run").glob(".*reserve"):
        reserve.unlink()  # nothing kept free: the disk cannot take a new meta.json
    fill(disk)
    writer.finish("complete", left_out=["a line " * 40])
    meta = json.loads((disk / "run" / META_FILE).read_text())
    assert meta["status"] == "complete" and meta["left_out"] == ["a line " * 40]
    assert leftovers(disk) == []


def test_meta_json_that_cannot_be_rewritten_stays_as_it_was(small_disk):
    disk = small_disk("64k")
    writer = RunWriter(disk / "run", "micro", {})
    writer.add(micro(1024, 10.0))
    before = (disk / "run" / META_FILE).read_text()
    for reserve in (disk / "run").glob(".*reserve"):
        reserve.unlink()  # nothing kept free: the disk cannot take meta.json again
    fill(disk)
    with pytest.raises(DiskError):  # more than the room the first meta.json kept
        writer.finish("complete", failures=["x" * 100_000])
    assert (disk / "run" / META_FILE).read_text() == before
    assert json.loads(before)["status"] == "running"
    assert leftovers(disk) == []
    assert load_run(disk / "run").records["size_bytes"].tolist() == [1024]


def test_a_run_directory_that_cannot_be_begun_leaves_nothing(small_disk):
    disk = small_disk("64k")
    fill(disk)
    with pytest.raises(DiskError):
        RunWriter(disk / "run", "micro", {})
    assert not (disk / "run").exists()


# -- the commands -------------------------------------------------------------------------------------------


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)


def test_bench_micro_on_a_full_disk_stops_with_one_line_and_keeps_its_points(small_disk):
    disk = small_disk("160k")  # room for the first few of the six sizes' samples (about 30 kB each)
    out = disk / "run"
    done = bench("micro", "--sizes", "1KB-1MB", "--transports", "local", "--no-references", "--no-peers", "--iters",
                 "1000",
                 "--out", str(out))
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"bench micro: error: cannot write {out}/")
    assert "No space left on device; free space there or choose another --out" in lines[0]
    meta = json.loads((out / META_FILE).read_text())
    assert meta["status"] == "failed" and "No space left on device" in meta["reason"]
    assert leftovers(disk) == []
    run = load_run(out)
    points = run.points()
    assert len(points) >= 2 and points["p50_us"].notna().all()
    whole = run.samples.groupby("size_bytes").size()
    assert (whole == 1000).all()  # every point's samples whole, or none at all


def left_free(disk: Path, free: int) -> None:
    """Fill ``disk`` up but for ``free`` bytes."""
    filler = fill(disk)
    os.truncate(filler, filler.stat().st_size - free)


def test_bench_micro_begun_on_an_almost_full_disk_says_failed_not_running(small_disk, capsys):
    # room for meta.json and a row, but not for the room kept beside it nor for a point's samples: the disk
    # refuses the samples at once, and a new meta.json cannot be made any more
    disk = small_disk("256k")
    left_free(disk, 8 * 1024)
    out = disk / "run"
    done = bench("micro", "--sizes", "1KB-64KB", "--transports", "local", "--no-references", "--no-peers", "--iters",
                 "1000", "--no-plot", "--out", str(out))
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "No space left on device; free space there or choose another --out" in lines[0]
    meta = json.loads((out / META_FILE).read_text())
    assert meta["status"] == "failed" and "No space left on device" in meta["reason"], meta
    assert meta["end_time"] is not None
    assert leftovers(disk) == []
    assert load_run(out).meta["status"] == "failed"  # not "killed", as a run left at "running" reads
    capsys.readouterr()
    assert main(["report", str(out), "--out", str(disk.parent / "report.md")]) == 0
    page = (disk.parent / "report.md").read_text()
    assert "(micro, failed)" in page and "killed" not in page


def test_bench_report_on_a_full_disk_keeps_the_old_page(small_disk, tmp_path, capsys):
    run = report_run(tmp_path / "micro")
    disk = small_disk("2m")
    page = disk / "report.html"
    assert main(["report", str(run), "--out", str(page)]) == 0
    good = page.read_bytes()
    fill(disk)
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(page)]) == 1
    err = capsys.readouterr().err
    assert err == f"bench report: error: cannot write {page}: No space left on device; free space there or choose " \
                  "another --out\n"
    assert page.read_bytes() == good
    assert leftovers(disk) == []


def test_bench_analyze_on_a_full_disk_keeps_the_old_plan_and_says_so_in_one_line(small_disk, tmp_path, capsys):
    disk = small_disk("1m")
    plan = disk / "plan.json"
    plan.write_text("the old plan\n")
    fill(disk)
    capsys.readouterr()
    assert main(["analyze", "tests.tiny_models:TINY", "--json", str(plan), "--out", str(tmp_path / "run"),
                 "--no-plot"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"bench analyze: error: cannot write {plan}: No space left on device; free space there or choose "
                   "another --out"]
    assert plan.read_text() == "the old plan\n"
    assert leftovers(disk) == []


def test_bench_plot_on_a_full_disk_leaves_no_half_figure(small_disk, tmp_path, capsys):
    disk = small_disk("1m")
    run = report_run(disk / "micro")
    fill(disk)
    assert main(["plot", str(run)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"bench plot: error: cannot write {run}/micro_time.png: No space")
    assert sorted(p.name for p in run.iterdir()) == [META_FILE, RECORDS_FILE]


# -- reading a row cut short --------------------------------------------------------------------------------


def torn(run: Path) -> Path:
    """Cut ``run``'s records.csv in the middle of its last row, as a writer stopped by a full disk once did."""
    records = run / RECORDS_FILE
    data = records.read_bytes()
    last = data.rstrip(b"\r\n").rfind(b"\n") + 1
    records.write_bytes(data[: last + 12])
    return run


TORN_WARNING = "its last row is cut short"


def test_the_reader_skips_a_torn_last_row_and_warns(tmp_path, capsys):
    run = torn(compare_run(tmp_path / "run"))
    whole = load_run(compare_run(tmp_path / "whole")).records
    capsys.readouterr()
    pd.testing.assert_frame_equal(load_run(run).records, whole.iloc[:-1])  # the rows before it, as written
    err = capsys.readouterr().err
    assert f"warning: {run / RECORDS_FILE}: {TORN_WARNING}" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("command", ["plot", "report", "compare"])
def test_plot_report_and_compare_warn_about_a_torn_last_row(command, tmp_path, capsys):
    run = torn(compare_run(tmp_path / "run", rounds=(1.0,)))  # the torn row: a point's only round
    args = {"plot": [str(run)], "report": [str(run), "--out", str(tmp_path / "report.html")],
            "compare": [str(compare_run(tmp_path / "base", rounds=(1.0,))), str(run)]}[command]
    status = main([command, *args])
    out, err = capsys.readouterr()
    assert status == (1 if command == "compare" else 0), err  # compare: a row it could not read is lost
    assert TORN_WARNING in err
    if command == "compare":  # the torn point (zerocopy at the last size) is one the new run did not measure
        assert "only in base (removed): zerocopy 64KB" in out
        assert out.rstrip().splitlines()[-1].startswith("lost:")
