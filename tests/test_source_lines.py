"""``bench micro --source fresh|reused``: the sender's tensor written whole before each transfer, outside the timed
interval (fresh), or sent again as it is (reused), in every sender loop we write; the records, the report and
``bench compare`` say which. Every line and plain loop runs under both sources in
``tests/test_peers.py::test_calibrate_measures_each_peer_line_beside_its_plain_loop``, checked by
:func:`assert_sources`."""

from __future__ import annotations

import math
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bench.experiments.micro import Point, plan_points
from bench.experiments.micro.sources import rewriter
from bench.experiments.references.memcpy import memcpy_records
from bench.results import RunWriter, load_run
from tests.test_results import micro_record

ROOT = Path(__file__).resolve().parent.parent
#: the tools whose loops are not ours: they reuse their buffers whatever --source says
TOOLS = {"ucx_perftest", "ucx_perftest_lat", "ib_write_bw", "ib_write_lat"}


def assert_sources(records: pd.DataFrame, source: str) -> None:
    """Every record of a run of ``--source source`` at a size no transfer of which is checked byte for byte (below
    64KB): a line whose loop is ours used ``source``, and a fresh one wrote its tensor once per transfer (warm-up
    included), each write over before its transfer's clock started; a reused one never; a tool says reused."""
    for row in records.itertuples():
        if row.transport in TOOLS:
            assert row.source == "reused" and math.isnan(row.source_writes), row.transport
            continue
        assert row.source == source, row.transport
        if source == "fresh":
            assert row.source_writes == row.warmup + row.iters, row.transport
            assert row.source_write_lead_min_us >= 0, row.transport
        else:
            assert row.source_writes == 0, row.transport
            assert math.isnan(row.source_write_lead_min_us), row.transport


def _dirty_kb(address: int) -> int:
    """Private_Dirty (kB) of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Private_Dirty:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_fresh_write_stores_every_page():
    """Every page of a tensor that was only read (anonymous memory never written: the kernel's one zero page, mapped
    over and over) is the process's own and dirty once the fresh write wrote it (``np.copyto(x, x)`` stores
    nothing, and would leave it clean). The kernel may merge the mapping with its neighbours: the pages it dirtied
    are at least the tensor's."""
    size = 4 << 20
    mapped = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    read, clean, dirty = _rewritten(mapped)
    mapped.close()
    assert read == 0
    assert dirty - clean >= size >> 10


def _rewritten(mapped: mmap.mmap) -> tuple[int, int, int]:
    """``mapped`` as a float32 tensor: the sum of what it read, its dirty kB then, and once the fresh write wrote it
    (no view of it left behind, so that it can be closed)."""
    tensor = np.frombuffer(mapped, np.float32)
    address = tensor.__array_interface__["data"][0]
    read, clean = int(tensor.sum()), _dirty_kb(address)
    write = rewriter(tensor)
    write()
    dirty = _dirty_kb(address)
    del tensor, write
    return read, clean, dirty


@pytest.mark.parametrize("dtype", [np.float32, np.uint8])
def test_a_fresh_write_keeps_every_bit(dtype):
    """What the data check expects stays, every bit: -0.0 and a NaN's payload too (a multiplication by 1 would quiet
    a signalling NaN)."""
    content = np.frombuffer(os.urandom(4096 + 3), np.uint8)[:4096 if dtype == np.float32 else 4099].copy()
    if dtype == np.float32:
        content.view(np.float32)[:2] = -0.0
        content.view(np.uint32)[1] = 0x7F801234  # a signalling NaN with a payload of its own
    tensor = content.view(dtype).copy()
    rewriter(tensor)()
    assert tensor.tobytes() == content.tobytes()


def test_a_point_names_its_source_and_micro_plans_fresh_ones():
    assert {point.source for point in plan_points([1024, 1 << 20], 5)} == {"fresh"}
    assert plan_points([1024], 5, source="reused")[0].fresh is False
    assert Point(1024, 1, 5).source == "reused"  # the soak's points send their tensor as it is
    with pytest.raises(ValueError, match="source 'stale': choose one of fresh, reused"):
        Point(1024, 1, 5, source="stale")


@pytest.mark.parametrize("source", ["fresh", "reused"])
def test_memcpy_copies_a_fresh_source_written_before_each_copy(source):
    [record] = memcpy_records([4096], lambda size: 7, source)
    assert record.source == source
    if source == "fresh":
        assert record.source_writes == 1 + 7 and record.source_write_lead_min_us >= 0
    else:
        assert record.source_writes == 0 and record.source_write_lead_min_us is None


def test_micro_help_explains_the_source():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "bench.cli", "micro", "--help"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)
    said = " ".join(done.stdout.split())
    assert "--source {fresh,reused}" in said
    assert "training never sends an unchanged tensor" in said and "as OSU and nccl-tests measure" in said


def _run(path: Path, source: str | None, lines: dict[str, str | None]) -> Path:
    """A micro run of ``--source source`` (None: from before the option), each line's record of its source."""
    writer = RunWriter(path, "micro", {"fabric": "ucx"} | ({"source": source} if source else {}))
    for line, used in lines.items():
        writer.add(micro_record(transport=line, p50_us=10.0, p99_us=20.0, mean_us=10.0, source=used))
    writer.finish()
    return path


def test_the_report_says_which_source_each_run_used(tmp_path):
    from bench.readers.report import write_report

    fresh = _run(tmp_path / "fresh", "fresh", {"zerocopy": "fresh", "grpc_tcp": "fresh", "ucx_perftest": "reused"})
    old = _run(tmp_path / "old", None, {"zerocopy": None, "grpc_tcp": None})
    page = tmp_path / "page.md"
    write_report([fresh, old], markdown_path=page)
    text = " ".join(page.read_text().split())
    assert ("Source fresh (bench micro --source): before each transfer the sender wrote its whole tensor, outside "
            "the timed interval") in text
    assert "ucx\\_perftest put\\_bw: reused, their tools' own loops" in text
    assert "Source not recorded (a run from before bench micro --source" in text


def test_compare_says_when_the_runs_used_different_sources(tmp_path):
    from bench.readers.compare import compare

    lines = {"zerocopy": None, "grpc_tcp": None}
    fresh = _run(tmp_path / "fresh", "fresh", dict.fromkeys(lines, "fresh"))
    reused = _run(tmp_path / "reused", "reused", dict.fromkeys(lines, "reused"))
    old = _run(tmp_path / "old", None, lines)
    said = compare(fresh, reused).format()
    assert ("note: the runs' senders used different sources (base fresh, new reused; bench micro --source)"
            in said)
    assert "source fresh -> reused" in said
    assert "(base not recorded (before --source: reused), new fresh;" in compare(old, fresh).format()
    assert "different sources" not in compare(fresh, fresh).format()
    assert load_run(old).records["source"].isna().all()  # an older run's records load, their source unknown
