"""``bench report``: one page with every run's figures and its ratios beside the paper's, as HTML and Markdown."""

from __future__ import annotations

import argparse
import base64
import json
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from bench.commands import report as command
from bench.ground import paper
from bench.readers.report import write_report
from bench.readers.report.text import line_name
from bench.results import MicroRecord, RunWriter
from tests.test_results import micro_record

SHARED_MEMORY = "ucx:cma,posix,sysv"
V1_FIXTURES = Path(__file__).parent / "data" / "v1"


# -- runs to report on --------------------------------------------------------------------------------------


def micro_run(path: Path) -> Path:
    """zerocopy 10 µs and 1000 µs; grpc_tcp 10x, grpc_rdma 4x, rdma_cp 1.5x its time; a ucx_perftest line."""
    writer = RunWriter(path, "micro", {"fabric": "ucx", "fabric_transport": "shm",
                                       "launcher": {"launcher": "local", "bind": "127.0.0.1"}})
    for size, base in ((1024, 10.0), (1 << 20, 1000.0)):
        for transport, factor in (("zerocopy", 1.0), ("rdma_cp", 1.5), ("grpc_rdma", 4.0), ("grpc_tcp", 10.0)):
            time_us = base * factor
            writer.add(micro_record(transport=transport, size_bytes=size, p50_us=time_us, p99_us=2 * time_us,
                                    mean_us=time_us, throughput_MBps=size / 2**20 / time_us * 1e6,
                                    fabric="none" if transport == "grpc_tcp" else SHARED_MEMORY))
        writer.add(micro_record(transport="ucx_perftest", size_bytes=size, p50_us=float("nan"), p99_us=float("nan"),
                                mean_us=base / 4, throughput_MBps=size / 2**20 / base * 4e6, fabric="ucx:auto"))
    writer.finish()
    return path


def wide_micro_run(path: Path) -> Path:
    """A sweep as wide as bench micro's default: every transport and mode, the peer and reference lines, sizes 1KB
    to 1GB, 3 rounds, samples (a ratio table of 8 columns with ranges, a peers table of 12, a distribution figure of
    121 boxes)."""
    writer = RunWriter(path, "micro", {"fabric": "ucx", "fabric_transport": "shm",
                                       "launcher": {"launcher": "local", "bind": "127.0.0.1"}})
    rng = np.random.default_rng(0)
    lines = {"zerocopy": 1.0, "rdma_cp": 1.5, "grpc_rdma": 4.0, "grpc_rdma:direct": 3.0, "grpc_tcp": 10.0,
             "local": 0.5}
    peers = {"mpi": 1.2, "mpi_rma": 1.4, "nixl": 2.0, "mooncake": 5.0, "socket": 3.0}
    for size in (1 << k for k in range(10, 31, 2)):
        base = 10.0 + size / 2**20 * 200
        for round_ in (1, 2, 3):
            writer.add(micro_record(transport="ucx_perftest", size_bytes=size, round=round_, p50_us=float("nan"),
                                    p99_us=float("nan"), mean_us=base / 4, throughput_MBps=size / 2**20 / base * 4e6,
                                    fabric="ucx:auto"))
            writer.add(micro_record(transport="memcpy", size_bytes=size, round=round_, p50_us=base / 8,
                                    p99_us=base / 4, mean_us=base / 8, throughput_MBps=size / 2**20 / base * 8e6,
                                    fabric="none"))
            for peer, factor in peers.items():
                record = MicroRecord.from_row(micro_record(
                    transport=peer, size_bytes=size, round=round_, p50_us=base * factor, p99_us=2 * base * factor,
                    mean_us=base * factor, throughput_MBps=size / 2**20 / (base * factor) * 1e6, fabric="none"))
                writer.add(record)
                times = base * factor * (1 + 0.2 * rng.random(50))
                writer.add_samples(record, {"time_us": times, "transfer_us": times})
            for transport, factor in lines.items():
                time_us = base * factor * (1 + 0.1 * rng.random())
                record = MicroRecord.from_row(micro_record(
                    transport=transport, size_bytes=size, round=round_, p50_us=time_us, p99_us=2 * time_us,
                    mean_us=time_us, throughput_MBps=size / 2**20 / time_us * 1e6, of_reference=0.25,
                    of_peer=time_us / (base * min(peers.values())),
                    fabric="none" if transport in ("grpc_tcp", "local") else SHARED_MEMORY))
                writer.add(record)
                times = time_us * (1 + 0.2 * rng.random(50))
                writer.add_samples(record, {"time_us": times, "transfer_us": times * 0.9})
    writer.finish()
    return path


def single_line_micro_run(path: Path, transport: str = "zerocopy") -> Path:
    """One transport at 1KB and 1MB, nothing to compare it with."""
    writer = RunWriter(path, "micro", {"fabric": "ucx", "fabric_transport": "shm"})
    for size, time_us in ((1024, 10.0), (1 << 20, 1000.0)):
        writer.add(micro_record(transport=transport, size_bytes=size, p50_us=time_us, p99_us=2 * time_us,
                                mean_us=time_us, throughput_MBps=size / 2**20 / time_us * 1e6, fabric=SHARED_MEMORY))
    writer.finish()
    return path


def _model_row(transport: str, model: str, batch: int, per_s: float, servers: int = 1, **extra) -> dict:
    return {"transport": transport, "model": model, "batch_size": batch, "servers": servers, "steps": 5,
            "step_time_s": 1 / per_s, "throughput_batches_per_s": per_s, "compute_s": 0.1 / per_s,
            "comm_s": 0.5 / per_s, "model_mb": {"vgg16": 512.32, "fcn5": 204.47}[model],
            "fabric": "none" if transport in ("grpc_tcp", "local") else SHARED_MEMORY, "compute": "replay",
            "launcher": "local", **extra}


def model_run(path: Path) -> Path:
    """vgg16 and fcn5: zerocopy 3 batches/s, grpc_rdma 1.2, grpc_tcp 0.5, rdma_cp 2.4, zerocopy without the
    analysis 2.5, local 6."""
    writer = RunWriter(path, "model", {"compute": "replay"})
    for model in ("vgg16", "fcn5"):
        for batch in (1, 2):
            for transport, per_s in (("zerocopy", 3.0), ("zerocopy:no_analysis", 2.5), ("rdma_cp", 2.4),
                                     ("grpc_rdma", 1.2), ("grpc_tcp", 0.5), ("local", 6.0)):
                writer.add(_model_row(transport, model, batch, per_s))
    writer.finish()
    return path


def scale_run(path: Path) -> Path:
    """vgg16 at 1, 2 and 4 servers: zerocopy scales perfectly from 2 batches/s, grpc_tcp stays at 1; local 4."""
    writer = RunWriter(path, "scale", {"compute": "replay"})
    for servers in (1, 2, 4):
        for transport, total in (("zerocopy", 2.0 * servers), ("grpc_tcp", 1.0)):
            writer.add({**_model_row(transport, "vgg16", 1, total / servers, servers=servers), "link_rate": "",
                        "total_batches_per_s": total, "scaling_efficiency": total / servers / (total / servers)})
    writer.add({**_model_row("local", "vgg16", 1, 4.0), "link_rate": "", "total_batches_per_s": 4.0,
                "scaling_efficiency": 1.0})
    writer.finish()
    return path


def converge_run(path: Path) -> Path:
    """cifar10: grpc_tcp reaches the target in 30 s, grpc_rdma in 15 s, zerocopy in 10 s."""
    writer = RunWriter(path, "converge", {"task": "cifar10", "servers": 2, "batch_size": 32,
                                          "target": "accuracy=0.5", "metric": "accuracy"})
    seconds = {"grpc_tcp": 30.0, "grpc_rdma": 15.0, "zerocopy": 10.0}
    for transport, total in seconds.items():
        for step in range(4):
            writer.add({"kind": "step", "transport": transport, "task": "cifar10", "step": step,
                        "wall_s": total * step / 3, "train_loss": 2.0 - 0.4 * step, "fabric": SHARED_MEMORY})
        writer.add({"kind": "eval", "transport": transport, "task": "cifar10", "step": 3, "wall_s": total,
                    "heldout_loss": 0.9, "metric": "accuracy", "metric_value": 0.6})
    for transport, total in seconds.items():
        writer.add({"kind": "summary", "transport": transport, "task": "cifar10", "target": "accuracy=0.5",
                    "steps_to_target": 3, "time_to_target_s": total, "speedup_vs_grpc_tcp": 30.0 / total,
                    "batch_size": 32, "servers": 2})
    writer.finish()
    return path


def models_run(path: Path) -> Path:
    """Table 2 measured: fcn5 at the paper's size, twice the paper's compute time."""
    writer = RunWriter(path, "models", {})
    writer.add({"model": "fcn5", "variables": 10, "paper_variables": 10, "model_mb": 204.47, "paper_model_mb": 204.47,
                "batch_size": 8, "compute_ms_per_sample": 9.76, "paper_compute_ms_per_sample": 4.88})
    writer.finish()
    return path


def analysis_run(path: Path) -> Path:
    """A plan of 4 weights (2 MB, 64 KB, 4 KB, 1 KB) to one worker and their gradients back, one dynamic."""
    writer = RunWriter(path, "analysis", {})
    sizes = {"w0": 2 << 20, "w1": 64 << 10, "w2": 4 << 10, "w3": 1 << 10}
    for name, nbytes in sizes.items():
        for role, src, dst in (("weight", 1, 0), ("gradient", 0, 1)):
            dynamic = name == "w3" and role == "gradient"
            writer.add({"model": "fcn5", "servers": 1, "batch_size": 1, "tensor": f"{name}.{role}", "role": role,
                        "placement": "dynamic" if dynamic else "static", "dtype": "float32",
                        "bytes": None if dynamic else nbytes, "src": src, "dst": dst, "variable": name})
    writer.finish()
    return path


RUNS = {"micro": micro_run, "model": model_run, "scale": scale_run, "converge": converge_run, "models": models_run,
        "analysis": analysis_run}


# -- reading the page back ----------------------------------------------------------------------------------


class _Tables(HTMLParser):
    """Every ``<table data-table=NAME>`` of a page as ``NAME -> [header, row, ...]`` (cells as text), and the
    ``data-figure`` name and ``src`` of every image."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.images: list[tuple[str, str]] = []
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "table":
            self._table = found.get("data-table") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = []
        elif tag == "img":
            self.images.append((found.get("data-figure") or "", found.get("src") or ""))

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def parse_page(text: str) -> _Tables:
    parser = _Tables()
    parser.feed(text)
    return parser


def cell(table: list[list[str]], row_label: str, column: str) -> str:
    """The cell of ``table`` in the row whose first cell is ``row_label`` and the column headed ``column``."""
    header = table[0]
    for row in table[1:]:
        if row[0] == row_label:
            return row[header.index(column)]
    raise AssertionError(f"no row {row_label!r} in {table}")


def _markdown_cell(text: str, caption_start: str, row_label: str, column: str) -> str:
    """A cell of the Markdown table whose caption starts with ``caption_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"*{caption_start}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return cell([rows[0], *rows[2:]], row_label, column)


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """Every kind of run, reported once as HTML and Markdown; the PNGs plot_run drew for it."""
    from bench.readers import plot

    root = tmp_path_factory.mktemp("report")
    runs = [make(root / "runs" / name) for name, make in RUNS.items()]
    drawn: list[Path] = []
    real = plot.plot_run

    def spy(path, out_dir=None):
        written = real(path, out_dir=out_dir)
        drawn.extend(Path(p) for p in written if Path(p).suffix == ".png")
        return written

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plot, "plot_run", spy)
        written = write_report(runs, root / "out" / "report.html", root / "out" / "report.md")
    return {"runs": runs, "written": written, "figures": [p.stem for p in drawn],
            "html": (root / "out" / "report.html").read_text(), "markdown": (root / "out" / "report.md").read_text(),
            "out": root / "out"}


# -- the page ----------------------------------------------------------------------------------------------


def test_every_figure_is_embedded_as_an_image(reported):
    page = parse_page(reported["html"])
    assert len(reported["figures"]) >= 8  # micro, model, scale and converge draw two each at least
    assert sorted(name for name, _ in page.images) == sorted(reported["figures"])
    for _, src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.partition(",")[2])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "http://" not in reported["html"].replace(paper.CITATION, "")  # nothing to fetch
    assert "<script" not in reported["html"]


def test_figure8_ratios_are_the_other_transport_over_zero_copy(reported):
    tables = parse_page(reported["html"]).tables
    ratios = tables["figure8-ratios"]
    assert cell(ratios, "1KB", "over gRPC.TCP") == "10.0x"
    assert cell(ratios, "1MB", "over gRPC.RDMA") == "4.00x"
    assert cell(ratios, "1KB", "over RDMA.cp") == "1.50x"
    assert not any("ucx_perftest" in column for column in ratios[0])  # a reference line is no transport
    against = tables["figure8-paper"]
    assert cell(against, "gRPC.TCP", "paper") == "1.7x to 61x"
    assert cell(against, "gRPC.TCP", "here against the paper") == "within the paper's range"
    assert cell(against, "RDMA.cp", "here against the paper") == "within the paper's range"


def test_figure9_and_figure12_ratios(reported):
    tables = parse_page(reported["html"]).tables
    ratios = tables["figure9-ratios"]
    header = ratios[0]
    vgg = next(row for row in ratios[1:] if row[0] == "VGGNet-16" and row[1] == "1")
    assert vgg[header.index("over gRPC.TCP")] == "6.00x"
    assert vgg[header.index("over gRPC.RDMA")] == "2.50x"
    assert vgg[header.index("over Local")] == "0.50x"
    assert "over RDMA.zerocp (analysis off)" not in header  # that is Figure 12's
    against = tables["figure9-paper"]
    row = next(r for r in against if r[:2] == ["VGGNet-16", "gRPC.RDMA"])
    assert row[2] == "+150% (2.50x)" and row[3] == "+117% to +145%" and row[4] == "above the paper's"
    row = next(r for r in against if r[:2] == ["VGGNet-16", "gRPC.TCP"])
    assert row[3] == "25x" and row[4] == "0.24 of the paper's"
    copy = tables["figure12-ratios"]
    assert copy[1][copy[0].index("RDMA.zerocp (analysis off) against RDMA.zerocp")] == "+20%"
    assert copy[1][copy[0].index("RDMA.cp against RDMA.zerocp")] == "+25%"
    assert tables["figure12-paper"][1][:2] == ["+25%", "up to +21% at batch 8"]


def test_figure10_11_table2_and_analysis(reported):
    tables = parse_page(reported["html"]).tables
    assert cell(tables["figure10-summary"], "RDMA.zerocp", "over gRPC.TCP") == "3.00x"
    assert cell(tables["figure10-paper"], "RDMA.zerocp over gRPC.TCP", "paper") == "2.6x"
    assert cell(tables["figure10-paper"], "RDMA.zerocp over gRPC.RDMA", "here") == "+50%"
    scale = tables["figure11-vgg16-1"]
    assert scale[0] == ["servers", "RDMA.zerocp (batches/s)", "over Local", "over 1 server", "gRPC.TCP (batches/s)",
                        "over Local", "over 1 server"]
    assert scale[3] == ["4", "8", "2.00x", "4.00x", "1", "0.25x", "1.00x"]
    against = tables["figure11-paper"]
    assert against[1][:5] == ["VGGNet-16", "RDMA.zerocp", "over Local at 4 servers", "2.00x", "4.3x"]
    assert cell(tables["table2"], "FCN-5", "compute (ms/sample)") == "9.76"
    assert tables["table2"][1][-1] == "2.00x"  # twice the paper's compute time
    plan = tables["figure7-plan"]
    assert plan[1][plan[0].index("static")] == "7" and plan[1][plan[0].index("dynamic")] == "1"
    shares = tables["figure7-paper"]
    assert cell(shares, "variable tensors above 10 KB", "here") == "50%"
    assert cell(shares, "variable tensors above 1 MB", "here") == "25%"
    assert cell(shares, "bytes in tensors above 1 MB", "paper") == "96%"


def _page_of(runs: list[Path], tmp_path: Path, monkeypatch) -> tuple[str, str]:
    """The HTML and Markdown report of ``runs``, without figures (drawing them is not what is tested)."""
    from bench.readers import plot

    monkeypatch.setattr(plot, "plot_run", lambda path, out_dir=None: [])
    write_report(runs, tmp_path / "page.html", tmp_path / "page.md")
    return (tmp_path / "page.html").read_text(), (tmp_path / "page.md").read_text()


def _model_size_captions(text: str) -> list[str]:
    return re.findall(r'<table data-table="table2-model-size"><caption>([^<]*)</caption>', text)


def test_table2_appears_once_for_any_number_of_model_runs(tmp_path, monkeypatch):
    runs = [model_run(tmp_path / "model-a"), model_run(tmp_path / "model-b")]
    text, markdown = _page_of(runs, tmp_path, monkeypatch)
    assert text.count('data-section="table2"') == 1 and markdown.count("## Table 2") == 1
    assert text.count("<h2>Table 2") == 1 and text.count(paper.TABLE2_QUOTE) == 1
    assert [c.split(",")[0] for c in _model_size_captions(text)] == ["Model size moved per step by run model-a",
                                                                     "Model size moved per step by run model-b"]
    assert "run model-a: " in text and "run model-b: " in text  # the section names both runs
    assert text.count('data-section="figure9"') == 2  # the figures of the runs stay one section per run


def test_table2_of_a_models_run_and_model_runs_is_one_section_the_models_table_first(tmp_path, monkeypatch):
    runs = [model_run(tmp_path / "model-a"), model_run(tmp_path / "model-b"), models_run(tmp_path / "models")]
    text, _ = _page_of(runs, tmp_path, monkeypatch)
    assert text.count('data-section="table2"') == 1
    section = text[text.index('data-section="table2"'):]
    section = section[:section.index("</section>")]
    assert "<h2>Table 2: the benchmark models</h2>" in section
    assert section.index('data-table="table2"') < section.index('data-table="table2-model-size"')
    assert len(_model_size_captions(section)) == 2
    assert cell(parse_page(section).tables["table2"], "FCN-5", "compute (ms/sample)") == "9.76"


@pytest.mark.parametrize("transport", ["zerocopy", "grpc_tcp"])
def test_a_single_transport_run_has_no_empty_ratio_table(tmp_path, monkeypatch, transport):
    micro = single_line_micro_run(tmp_path / "micro", transport)
    writer = RunWriter(tmp_path / "model", "model", {"compute": "replay"})
    for batch in (1, 2):
        writer.add(_model_row(transport, "fcn5", batch, 3.0))
    writer.finish()
    text, markdown = _page_of([micro, tmp_path / "model"], tmp_path, monkeypatch)
    tables = parse_page(text).tables
    assert not {"figure8-ratios", "figure8-paper", "figure9-ratios", "figure9-paper"} & set(tables)
    for name, table in tables.items():
        assert len(table) > 1 and len(table[0]) > 1, f"{name} is empty: {table}"
    lacking = "no other transport" if transport == "zerocopy" else "no zero-copy line"
    assert cell(tables["figure8-times"], "1KB", line_name(transport)) == "10"
    assert f"Median time per transfer (µs); {lacking} to compare with" in text
    assert len(tables["figure9-throughput"]) == 3
    assert f"The run has {lacking} ({line_name(transport)} only)" in markdown


def test_divergences_are_explained_from_the_runs_data(reported):
    text = reported["html"]
    assert "UCX shared memory (cma, posix, sysv) between processes on one host, not an RDMA NIC" in text
    assert "Compute was REPLAYED" in text
    assert "launcher local" in text
    assert "this run has 1, 2 and 4 server(s) at batch 1" in text  # scale: the paper's 8 servers at batch 32
    assert "this run has batch size(s) 1 and 2" in text  # Figure 12: the paper's 21% is at batch 8
    for section in ("§5.1, Figure 8", "§5.2 Scalability, Figure 11", "§5.2 Convergence, Figure 10"):
        assert section in text


def test_markdown_has_the_tables_and_figures_beside_it(reported):
    text, out = reported["markdown"], reported["out"]
    figures = re.findall(r"!\[([^\]]*)\]\(([^)]+)\)", text)
    # each figure's file is named after it; its caption is what it shows, in words
    assert sorted(name.rsplit("-", 1)[-1].removesuffix(".png") for _, name in figures) == sorted(reported["figures"])
    assert all(caption and "_" not in caption for caption, _ in figures)
    for _, name in figures:
        assert "/" not in name and (out / name).read_bytes()[:4] == b"\x89PNG"
    assert _markdown_cell(text, "How many times faster RDMA.zerocp is", "1KB", "over gRPC.TCP") == "10.0x"
    assert _markdown_cell(text, "Time to the target", "RDMA.zerocp", "over gRPC.TCP") == "3.00x"
    assert [p.name for p in reported["written"][:2]] == ["report.html", "report.md"]


def test_the_runs_are_left_untouched(reported):
    for run in reported["runs"]:
        assert sorted(p.name for p in run.iterdir()) in (["meta.json", "records.csv"],
                                                         ["meta.json", "records.csv", "samples.csv"])


# -- the command -------------------------------------------------------------------------------------------


def bench_report(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="bench report")
    command.add_arguments(parser)
    return command.run(parser.parse_args(list(argv)))


def test_a_run_whose_figures_fail_keeps_its_tables(tmp_path, monkeypatch, capsys):
    from bench.readers import plot

    def broken(path, out_dir=None):
        raise ValueError("cannot draw this\nsecond line")

    monkeypatch.setattr(plot, "plot_run", broken)
    run = micro_run(tmp_path / "micro")
    assert bench_report(str(run), "--out", str(tmp_path / "page.html")) == 0
    page = (tmp_path / "page.html").read_text()
    assert "Figures could not be drawn: cannot draw this" in page and "second line" not in page
    assert cell(parse_page(page).tables["figure8-ratios"], "1KB", "over gRPC.TCP") == "10.0x"
    assert capsys.readouterr().out.split() == [str(tmp_path / "page.html")]


def test_a_directory_of_runs_stands_for_the_runs_in_it(tmp_path, monkeypatch):
    from bench.readers import plot

    monkeypatch.setattr(plot, "plot_run", lambda path, out_dir=None: [])
    micro_run(tmp_path / "results" / "micro-1")
    models_run(tmp_path / "results" / "models-1")
    assert bench_report(str(tmp_path / "results"), "--out", str(tmp_path / "page.md")) == 0
    text = (tmp_path / "page.md").read_text()
    assert "## Figure 8" in text and "## Table 2" in text
    assert not (tmp_path / "page.html").exists()  # .md: Markdown only


def _empty_directory(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def _a_file(tmp: Path) -> Path:
    (tmp / "file.csv").write_text("a,b\n")
    return tmp / "file.csv"


def _broken_meta(tmp: Path) -> Path:
    (tmp / "bad").mkdir()
    (tmp / "bad" / "meta.json").write_text("{not json")
    (tmp / "bad" / "records.csv").write_text("transport\n")
    return tmp / "bad"


@pytest.mark.parametrize("make", [lambda tmp: tmp / "missing", _empty_directory, _a_file, _broken_meta],
                         ids=["missing", "empty-directory", "a-file", "broken-meta"])
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, make):
    path = make(tmp_path)
    assert bench_report(str(path), "--out", str(tmp_path / "page.html")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench report: error: ") and str(path) in err
    assert "Traceback" not in err and not (tmp_path / "page.html").exists()


def test_an_unwritable_output_is_one_line_and_status_2(tmp_path, capsys, monkeypatch):
    from bench.readers import plot

    monkeypatch.setattr(plot, "plot_run", lambda path, out_dir=None: [])
    (tmp_path / "taken").write_text("a file where a directory should be")
    assert bench_report(str(models_run(tmp_path / "run")), "--out", str(tmp_path / "taken" / "page.html")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "choose another --out" in err


def test_an_output_that_is_a_directory_is_named_before_the_work(tmp_path, capsys, monkeypatch):
    """``--out DIR`` of a directory there: one line naming DIR (not a temporary file of the page's), before any run
    is read or drawn, and nothing written into DIR."""
    from bench.readers import plot

    drawn = []
    monkeypatch.setattr(plot, "plot_run", lambda path, out_dir=None: drawn.append(path) or [])
    pages = tmp_path / "pages"
    pages.mkdir()
    assert bench_report(str(models_run(tmp_path / "run")), "--out", str(pages)) == 2
    err = capsys.readouterr().err
    assert err == (f"bench report: error: --out {pages}: is a directory, not a file; give the file's path, e.g. "
                   f"{pages / 'report.html'}\n")
    assert not drawn and list(pages.iterdir()) == []
    assert bench_report(str(models_run(tmp_path / "run2")), "--out", str(pages), "--format", "markdown") == 2
    assert f"e.g. {pages / 'report.md'}" in capsys.readouterr().err


# -- results written by earlier versions -------------------------------------------------------------------


def _as_version_1(run: Path) -> Path:
    """A run rewritten as schema version 1 wrote it: no round column, no samples."""
    meta = json.loads((run / "meta.json").read_text())
    meta["schema_version"] = 1
    (run / "meta.json").write_text(json.dumps(meta))
    lines = (run / "records.csv").read_text().splitlines()
    header = lines[0].split(",")
    if "round" in header:
        at = header.index("round")
        lines = [",".join(v for i, v in enumerate(line.split(",")) if i != at) for line in lines]
    (run / "records.csv").write_text("\n".join(lines) + "\n")
    return run


def test_a_version_1_run_is_reported(tmp_path, monkeypatch):
    from bench.readers import plot

    monkeypatch.setattr(plot, "plot_run", lambda path, out_dir=None: [])
    run = _as_version_1(micro_run(tmp_path / "micro"))
    assert "round" not in (run / "records.csv").read_text().splitlines()[0]
    write_report([run], tmp_path / "page.html")
    page = (tmp_path / "page.html").read_text()
    assert cell(parse_page(page).tables["figure8-ratios"], "1MB", "over gRPC.TCP") == "10.0x"
    assert "results schema 1" in page


@pytest.mark.skipif(not V1_FIXTURES.is_dir(), reason=f"no version 1 fixtures in {V1_FIXTURES}")
def test_the_version_1_fixtures_are_reported(tmp_path):
    runs = sorted(p for p in V1_FIXTURES.iterdir() if (p / "meta.json").is_file())
    written = write_report(runs, tmp_path / "page.html")
    page = parse_page(written[0].read_text())
    experiments = {json.loads((p / "meta.json").read_text())["experiment"] for p in runs}
    expected = {"micro": "figure8-ratios", "model": "figure9-ratios", "scale": "figure11-paper",
                "converge": "figure10-summary", "soak": "soak"}
    for experiment in experiments & set(expected):
        assert len(page.tables[expected[experiment]]) > 1, experiment
    assert len(page.images) >= 2 * len(experiments & {"micro", "model", "scale", "converge"})


# -- in a real browser -------------------------------------------------------------------------------------

#: appended to a copy of the page: after load, whether every image decoded (and has pixels of more than one
#: colour) and every ratio table is laid out, written where --dump-dom shows it
_CHECK = """<script>
window.addEventListener('load', function () {
  var images = Array.from(document.images), decoded = 0, painted = 0;
  images.forEach(function (img) {
    if (!(img.complete && img.naturalWidth > 0 && img.naturalHeight > 0)) return;
    decoded++;
    var canvas = document.createElement('canvas');
    canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
    var context = canvas.getContext('2d');
    context.drawImage(img, 0, 0);
    var data = context.getImageData(0, 0, canvas.width, canvas.height).data, colours = new Set();
    for (var k = 0; k < data.length && colours.size < 3; k += 4 * 101) {
      colours.add(data[k] + ',' + data[k + 1] + ',' + data[k + 2]);
    }
    if (colours.size >= 3) painted++;
  });
  var tables = Array.from(document.querySelectorAll('table[data-table]'));
  var shown = tables.filter(function (t) {
    var box = t.getBoundingClientRect();
    return box.width > 0 && box.height > 0;
  });
  var out = document.createElement('div');
  out.id = 'browser-check';
  out.setAttribute('data-images', images.length);
  out.setAttribute('data-decoded', decoded);
  out.setAttribute('data-painted', painted);
  out.setAttribute('data-tables', tables.length);
  out.setAttribute('data-shown', shown.length);
  document.body.appendChild(out);
});
</script>"""
_BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]


def _browser() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
                 if (found := shutil.which(name))), None)


def _run_browser(browser: str, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="bench-report-browser-") as profile:
        return subprocess.run([browser, *_BROWSER_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=120)


@pytest.mark.system("chromium")
def test_a_browser_shows_every_figure_and_table(reported, tmp_path):
    browser = _browser()
    page = reported["out"] / "report.html"
    text = page.read_text()
    checked = tmp_path / "checked.html"
    checked.write_text(text.replace("</body>", _CHECK + "</body>"))
    dom = _run_browser(browser, "--virtual-time-budget=10000", "--dump-dom", checked.as_uri())
    found = re.search(r'<div id="browser-check"([^>]*)>', dom.stdout)
    assert found, f"the page did not finish loading in {browser}: {dom.stderr[-2000:]}"
    values = dict(re.findall(r'data-(\w+)="(\d+)"', found.group(1)))
    figures, tables = len(reported["figures"]), text.count("<table data-table=")
    assert values == {"images": str(figures), "decoded": str(figures), "painted": str(figures),
                      "tables": str(tables), "shown": str(tables)}

    shot = tmp_path / "page.png"
    _run_browser(browser, f"--screenshot={shot}", "--window-size=1400,4000", page.as_uri())
    assert shot.is_file(), f"{browser} wrote no screenshot"
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (4000, 1400)
    rgb = (pixels.reshape(-1, 3) * 255).astype(np.uint32)
    colours = np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2])
    assert len(colours) > 50  # figures and tables, not a blank or one-colour page
    assert (pixels.min(axis=2) < 0.5).mean() > 0.01  # dark ink on a good part of it


#: appended to a copy of the page: in the window it is shown in, how wide the page is against the window, every
#: element that reaches past the window's right edge or scrolls sideways in a box of its own, every table, figure
#: and image wider than the box it stands in, and how much the figures are scaled (shown width / drawn width)
_FIT = """<script>
window.addEventListener('load', function () {
  var viewport = document.documentElement.clientWidth, past = [], scrolling = [], overflowing = [], scales = [];
  function name(el) {
    var label = el.getAttribute('data-table') || el.getAttribute('data-figure') || el.className || el.id;
    return el.tagName.toLowerCase() + (label ? '[' + label + ']' : '');
  }
  Array.from(document.body.querySelectorAll('*')).forEach(function (el) {
    if (el.getBoundingClientRect().right > viewport + 0.5) past.push(name(el));
    var overflow = getComputedStyle(el).overflowX;
    if ((overflow === 'auto' || overflow === 'scroll') && el.scrollWidth > el.clientWidth) scrolling.push(name(el));
  });
  Array.from(document.querySelectorAll('table, figure, img')).forEach(function (el) {
    var box = el.getBoundingClientRect(), around = el.parentElement.getBoundingClientRect();
    if (box.right > around.right + 0.5 || box.left < around.left - 0.5) overflowing.push(name(el));
  });
  Array.from(document.images).forEach(function (img) {
    scales.push((img.getBoundingClientRect().width / img.naturalWidth).toFixed(3));
  });
  var out = document.createElement('div');
  out.id = 'fit-check';
  out.setAttribute('data-window', window.innerWidth);
  out.setAttribute('data-page', document.documentElement.scrollWidth);
  out.setAttribute('data-past', past.join(' '));
  out.setAttribute('data-scrolling', scrolling.join(' '));
  out.setAttribute('data-overflowing', overflowing.join(' '));
  out.setAttribute('data-scales', scales.join(' '));
  out.setAttribute('data-tables', document.querySelectorAll('table[data-table]').length);
  document.body.appendChild(out);
});
</script>"""


@pytest.mark.system("chromium")
def test_in_a_1300_px_window_nothing_needs_a_sideways_scroll_bar(tmp_path):
    """A report of the runs a newcomer has (a micro sweep of every line, sizes and rounds; a model run, a models
    run, and the runs of earlier versions) read in a window 1300 pixels wide: nothing reaches past the window or
    scrolls sideways, no table or figure is wider than where it stands, figures are scaled down, never up."""
    browser = _browser()
    runs = [wide_micro_run(tmp_path / "runs" / "micro"), model_run(tmp_path / "runs" / "model"),
            models_run(tmp_path / "runs" / "models"),
            *sorted(p for p in V1_FIXTURES.iterdir() if (p / "meta.json").is_file())]
    page = tmp_path / "report.html"
    write_report(runs, page)
    text = page.read_text()
    assert text.count('data-section="table2"') == 1
    checked = tmp_path / "checked.html"
    checked.write_text(text.replace("</body>", _FIT + "</body>"))
    dom = _run_browser(browser, "--window-size=1300,900", "--virtual-time-budget=10000", "--dump-dom",
                       checked.as_uri())
    found = re.search(r'<div id="fit-check"([^>]*)>', dom.stdout)
    assert found, f"the page did not finish loading in {browser}: {dom.stderr[-2000:]}"
    values = dict(re.findall(r'data-(\w+)="([^"]*)"', found.group(1)))
    assert values["window"] == "1300"
    assert int(values["page"]) <= 1300  # no part of the page off to the right
    assert values["past"] == ""  # no element reaches past the window's right edge
    assert values["scrolling"] == ""  # no table (or anything else) scrolls sideways in a box of its own
    assert values["overflowing"] == ""  # every table, figure and image fits where it stands
    assert int(values["tables"]) >= 15
    scales = [float(v) for v in values["scales"].split()]
    assert len(scales) >= 10 and max(scales) <= 0.64 + 0.01  # at most the drawn size (150 dpi at 96 CSS px/inch)
    assert min(scales) >= 0.45  # the widest (micro's distribution) scaled to the page, 8-point text still legible


def gpu_micro_run(path: Path) -> Path:
    """--memory cuda: zerocopy and grpc_tcp staged through the host (2 crossings per transfer), ucx_perftest -m
    cuda beside them; grpc_tcp 20x zerocopy's time."""
    writer = RunWriter(path, "micro", {"fabric": "ucx", "fabric_transport": "auto", "memory": ["cuda:0", "cuda:0"]})
    device = {"sender_memory": "cuda:0", "receiver_memory": "cuda:0"}
    for size, base in ((1024, 20.0), (1 << 20, 200.0)):
        for transport, factor in (("zerocopy", 1.0), ("grpc_tcp", 20.0)):
            time_us = base * factor
            writer.add(micro_record(transport=transport, size_bytes=size, p50_us=time_us, p99_us=2 * time_us,
                                    mean_us=time_us, throughput_MBps=size / 2**20 / time_us * 1e6,
                                    device_to_host_bytes_per_transfer=float(size),
                                    host_to_device_bytes_per_transfer=float(size), of_reference=0.5, **device))
        writer.add(micro_record(transport="ucx_perftest", size_bytes=size, p50_us=float("nan"), p99_us=float("nan"),
                                mean_us=base / 4, throughput_MBps=size / 2**20 / base * 4e6, fabric="ucx:auto",
                                **device))
    writer.finish()
    return path


def test_a_gpu_run_is_set_beside_the_papers_table3(tmp_path, monkeypatch):
    text, markdown = _page_of([gpu_micro_run(tmp_path / "gpu"), micro_run(tmp_path / "host")], tmp_path, monkeypatch)
    tables = parse_page(text).tables
    here = tables["table3-here"]
    assert cell(here, "1KB", f"{line_name('zerocopy')} p50 (µs)") == "20"
    assert cell(here, "1MB", f"{line_name('zerocopy')} bus crossings") == "2"
    assert cell(here, "1MB", f"{line_name('grpc_tcp')} / {line_name('zerocopy')}").startswith("20")
    assert cell(here, "1KB", "of UCX's own on device memory (put bw)") == "0.5"
    assert cell(tables["table3-paper"], "FCN-5", "improvement") == "+54%"
    assert "Table 3: tensors in GPU memory (cuda:0 to cuda:0)" in text
    assert "Staged through host memory here" in markdown
    assert text.count('data-table="table3-here"') == 1  # the host run has no Table 3 section
