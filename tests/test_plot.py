"""Figures are drawn from a run's files: valid PNG and SVG beside the records, readable at a glance (bars from
zero, nothing under a legend, one point per measured point with its spread), for every experiment and for runs
written by older versions."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.patches import Rectangle

from bench.readers import plot
from bench.readers.plot import PlotError, draw, figures, micro_time_lines, plot_run, spread_note
from bench.readers.plot.common import details_of, figure_text
from bench.results import AnalysisRecord, MicroRecord, ModelRecord, ModelsRecord, RunWriter, load_run
from bench.results import lines as catalogue
from tests.test_results import micro_record

# -- building runs -------------------------------------------------------------------------------------------


def _micro_run(path: Path, transports=("grpc_tcp", "zerocopy"), sizes=(1024, 65536, 1 << 20), rounds: int = 1,
               samples: bool = False) -> Path:
    """A micro run whose time per transfer grows with the size; every round a little slower."""
    rng = np.random.default_rng(1)
    writer = RunWriter(path, "micro", {"fabric": "ucx", "fabric_transport": "shm"})
    for r in range(1, rounds + 1):
        for size in sizes:
            for k, transport in enumerate(transports):
                times = (10.0 * (k + 1) + size / 1e3) * (1 + 0.1 * r) * rng.uniform(0.9, 1.1, 12)
                record = MicroRecord(transport=transport, size_bytes=size, round=r, iters=len(times),
                                     p50_us=float(np.median(times)), p99_us=float(times.max()),
                                     mean_us=float(times.mean()),
                                     throughput_MBps=size / 2**20 / (times.mean() / 1e6), sender_cpu_s=0.1,
                                     receiver_cpu_s=0.1, copied_bytes_per_transfer=0)
                writer.add(record)
                if samples:
                    writer.add_samples(record, {"time_us": times, "transfer_us": times * 0.9})
    writer.finish()
    return path


def _model_run(path: Path, models=("fcn5", "vgg16"), transports=("grpc_tcp", "rdma_cp", "zerocopy", "local"),
               batches=(4,), rounds: int = 1, samples: bool = False, experiment: str = "model") -> Path:
    writer = RunWriter(path, experiment, {})
    for r in range(1, rounds + 1):
        for m, model in enumerate(models):
            for k, transport in enumerate(transports):
                for batch in batches:
                    step = (0.1 + 0.2 * m) * (k + 1) * (1 + 0.1 * batch) * (1 + 0.05 * r)
                    record = ModelRecord(transport=transport, model=model, batch_size=batch, servers=2, round=r,
                                         steps=6, step_time_s=step, throughput_batches_per_s=1 / step,
                                         compute_s=0.05, comm_s=step - 0.05)
                    writer.add(record)
                    if samples:
                        writer.add_samples(record, {"worker": [0, 1] * 3,
                                                    "step_time_s": [step * f for f in (0.9, 1, 1.1, 1, 0.95, 1.2)]})
    writer.finish()
    return path


def _as_version_1(path: Path) -> Path:
    """Rewrite a run as the previous code wrote it: schema version 1, no round column, no samples."""
    meta = json.loads((path / "meta.json").read_text())
    meta["schema_version"] = 1
    (path / "meta.json").write_text(json.dumps(meta))
    records = pd.read_csv(path / "records.csv").drop(columns="round")
    records.to_csv(path / "records.csv", index=False)
    (path / "samples.csv").unlink(missing_ok=True)
    return path


def _legends(fig) -> list:
    return [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]


def _assert_legends_cover_no_axes(fig) -> None:
    """Every legend lies outside every visible axes (its data area and its tick labels)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = _legends(fig)
    assert legends, "the figure has no legend"
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            if ax.get_visible():
                assert not box.overlaps(ax.get_tightbbox(renderer)), f"the legend covers '{ax.get_title()}'"


def _series(ax) -> dict:
    """The lines of ``ax`` drawn with their spread (errorbar containers), by legend label."""
    return {c.get_label(): c.lines[0] for c in ax.containers if isinstance(c, ErrorbarContainer)}


def _visible_axes(fig) -> list:
    return [ax for ax in fig.axes if ax.get_visible()]


def _bars(ax) -> list[Rectangle]:
    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_height() > 0]


# -- files ---------------------------------------------------------------------------------------------------


def test_micro_figures_are_valid_images(tmp_path):
    writer = RunWriter(tmp_path / "run", "micro", {})
    for transport, scale in (("grpc_tcp", 10.0), ("local", 1.0)):
        for i, size in enumerate((1024, 4096, 16384)):
            writer.add(micro_record(transport=transport, size_bytes=size, p50_us=scale * (i + 1),
                                    p99_us=2 * scale * (i + 1), throughput_MBps=size / scale))
    writer.finish()
    written = plot_run(tmp_path / "run")
    names = sorted(p.name for p in written)
    assert names == ["micro_throughput.png", "micro_throughput.svg", "micro_time.png", "micro_time.svg"]
    for path in written:
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            height, width, _ = matplotlib.image.imread(path).shape
            assert width > 500 and height > 300
        else:
            assert ET.parse(path).getroot().tag.endswith("svg")


def test_figures_go_into_another_directory_when_asked(tmp_path):
    run = _micro_run(tmp_path / "run")
    before = (run / "meta.json").read_text()
    out = tmp_path / "figures"
    out.mkdir()
    written = plot_run(run, out)
    assert written and all(p.parent == out for p in written)
    assert not list(run.glob("*.png")) and not list(run.glob("*.svg"))
    assert (run / "meta.json").read_text() == before


def test_a_run_without_records_cannot_be_drawn(tmp_path):
    RunWriter(tmp_path / "run", "micro", {})
    with pytest.raises(Exception, match=r"no records|records\.csv"):
        plot_run(tmp_path / "run")


def test_an_experiment_without_figures_is_named(tmp_path):
    writer = RunWriter(tmp_path / "run", "soak", {})
    writer.add({"phase": "micro", "transport": "local", "process": "sender", "tensors_sent": 1, "tensors_received": 0,
                "corrupted": 0, "lost": 0, "rss_start_mb": 1.0, "rss_end_mb": 1.0})
    with pytest.raises(PlotError, match="soak"):
        plot_run(tmp_path / "run")


def test_an_unknown_figure_is_named(tmp_path):
    run = load_run(_micro_run(tmp_path / "run"))
    with pytest.raises(PlotError, match="micro_time"):
        draw(run, "model_throughput")


# -- micro: Figure 8 and the distribution --------------------------------------------------------------------


def test_several_rounds_draw_one_point_per_size_with_error_bars(tmp_path):
    sizes = (1024, 65536, 1 << 20)
    run = load_run(_micro_run(tmp_path / "run", sizes=sizes, rounds=3))
    assert len(run.records) == 3 * 3 * 2
    for stem, column in (("micro_time", "p50_us"), ("micro_throughput", "throughput_MBps")):
        fig = draw(run, stem)
        ax = fig.axes[0]
        lines = _series(ax)
        assert set(lines) == {catalogue.line("grpc_tcp").label, catalogue.line("zerocopy").label}
        for name in ("grpc_tcp", "zerocopy"):
            xs = list(lines[catalogue.line(name).label].get_xdata())
            assert xs == list(sizes)  # one point per size: no zig-zag through the rounds
            rows = run.records[run.records["transport"] == name]
            medians = rows.groupby("size_bytes")["p50_us"].median()
            if column == "throughput_MBps":  # the time figure's statistic: size / the median time
                medians = medians.index.to_series() / 2**20 / (medians / 1e6)
            assert list(lines[catalogue.line(name).label].get_ydata()) == pytest.approx(list(medians))
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer) and c.has_yerr]
        assert len(bars) == 2
        assert "3 rounds" in figure_text(fig) and "range" in figure_text(fig)
        plt.close(fig)


def test_the_time_lines_come_from_points(tmp_path):
    run = load_run(_micro_run(tmp_path / "run", rounds=2))
    lines = micro_time_lines(run.points())
    assert [line.transport for line in lines] == ["grpc_tcp", "zerocopy"]
    for line in lines:
        assert len(line.sizes) == 3
        assert (line.low <= line.time).all() and (line.time <= line.high).all()
        assert (line.low < line.high).all()


def test_the_distribution_figure_is_drawn_only_from_samples(tmp_path):
    sizes = (1024, 65536)
    with_samples = _micro_run(tmp_path / "with", sizes=sizes, samples=True)
    names = {p.name for p in plot_run(with_samples)}
    assert {"micro_distribution.png", "micro_distribution.svg"} <= names
    fig = draw(load_run(with_samples), "micro_distribution")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    boxes = [p for p in ax.patches if p.get_visible()]
    assert len(boxes) == len(sizes) * 2  # per size, each transport's box side by side
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1KB", "64KB"]
    plt.close(fig)

    without = _micro_run(tmp_path / "without", sizes=sizes)  # --no-samples, or a version 1 run
    assert not (without / "samples.csv").exists()
    assert "micro_distribution.png" not in {p.name for p in plot_run(without)}


def test_a_wide_sweep_wraps_its_distribution_onto_rows_that_stay_legible(tmp_path):
    """bench micro's default sweep (11 sizes) over 6 transports and 5 peer lines: 121 boxes would make a figure
    24 inches wide, shown at a third of its dots on a page; wrapped onto rows it stays within BOXES_MAX_WIDTH."""
    lines = ("local", "grpc_tcp", "grpc_rdma", "grpc_rdma:direct", "rdma_cp", "zerocopy", "mpi", "mpi_rma", "nixl",
             "mooncake", "socket")
    sizes = tuple(1 << k for k in range(10, 31, 2))
    fig = draw(load_run(_micro_run(tmp_path / "run", transports=lines, sizes=sizes, samples=True)),
               "micro_distribution")
    assert fig.get_figwidth() <= plot.BOXES_MAX_WIDTH
    rows = _visible_axes(fig)
    assert len(rows) > 1
    labels = [t.get_text() for ax in rows for t in ax.get_xticklabels()]
    assert labels == ["1KB", "4KB", "16KB", "64KB", "256KB", "1MB", "4MB", "16MB", "64MB", "256MB", "1GB"]
    assert max(len(ax.get_xticklabels()) for ax in rows) - min(len(ax.get_xticklabels()) for ax in rows) <= 1
    assert sum(len([p for p in ax.patches if p.get_visible()]) for ax in rows) == len(sizes) * len(lines)
    assert all(ax.get_yscale() == "log" for ax in rows)
    _assert_legends_cover_no_axes(fig)
    plt.close(fig)


def test_a_single_round_with_samples_draws_their_confidence_interval(tmp_path):
    run = load_run(_micro_run(tmp_path / "run", samples=True))
    points = run.points()
    assert set(points["spread"]) == {"samples"}
    assert "95% confidence interval of the median" in spread_note(points)
    fig = draw(run, "micro_time")
    assert [c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer) and c.has_yerr]
    assert "95% confidence interval" in figure_text(fig)
    plt.close(fig)


def test_the_spread_is_named(tmp_path):
    once = load_run(_micro_run(tmp_path / "once")).points()
    assert "no error bars" in spread_note(once)
    rounds = load_run(_micro_run(tmp_path / "rounds", rounds=4)).points()
    assert "4 rounds" in spread_note(rounds) and "range" in spread_note(rounds)


def _micro_run_with_references(tmp_path):
    """zerocopy, ucx_perftest (put_bw: no median, time = size / bandwidth) and ucx_perftest_lat up to 1MB."""
    nan = float("nan")
    writer = RunWriter(tmp_path / "run", "micro", {})
    sizes = (1024, 65536, 1 << 20, 4 << 20)
    for size in sizes:
        bw = 10000.0 if size == 1024 else 8000.0
        writer.add(micro_record(transport="ucx_perftest", size_bytes=size, p50_us=nan, p99_us=nan,
                                mean_us=size / 2**20 / bw * 1e6, throughput_MBps=bw, of_reference=1.0))
        if size <= 1 << 20:
            writer.add(micro_record(transport="ucx_perftest_lat", size_bytes=size, p50_us=0.1 + size / 1e4,
                                    p99_us=nan, mean_us=0.2 + size / 1e4,
                                    throughput_MBps=size / 2**20 / (0.2 + size / 1e4) * 1e6))
        writer.add(micro_record(transport="zerocopy", size_bytes=size, p50_us=20 + size / 1e3, p99_us=30 + size / 1e3,
                                mean_us=25 + size / 1e3, throughput_MBps=size / 2**20 / (25 + size / 1e3) * 1e6))
    writer.finish()
    return tmp_path / "run"


def _drawn_lines(run, stem):
    fig = draw(run, stem)
    lines = {label: (list(line.get_xdata()), list(line.get_ydata())) for label, line in _series(fig.axes[0]).items()}
    plt.close(fig)
    return lines


def test_a_latency_tool_is_drawn_in_the_time_figure_and_a_bandwidth_tool_in_the_throughput_figure(tmp_path):
    path = _micro_run_with_references(tmp_path)
    run = load_run(path)
    time_lines, throughput_lines = _drawn_lines(run, "micro_time"), _drawn_lines(run, "micro_throughput")
    lat, bw = catalogue.line("ucx_perftest_lat").label, catalogue.line("ucx_perftest").label
    # time: the latency line is its median, half a round trip, up to 1MB only; put_bw (pipelined) is not there
    sizes, times = time_lines[lat]
    assert sizes == [1024, 65536, 1 << 20]
    assert times == pytest.approx([0.1 + s / 1e4 for s in sizes])
    assert bw not in time_lines
    # throughput: put_bw's bandwidth; the latency line is not there; zerocopy's is size / its median time
    sizes, mbps = throughput_lines[bw]
    assert sizes == [1024, 65536, 1 << 20, 4 << 20]
    assert mbps == pytest.approx([10000.0 if s == 1024 else 8000.0 for s in sizes])
    assert lat not in throughput_lines
    sizes, mbps = throughput_lines[catalogue.line("zerocopy").label]
    assert mbps == pytest.approx([s / 2**20 / ((20 + s / 1e3) / 1e6) for s in sizes])
    plot_run(path)
    assert "latency floor" in (path / "micro_time.svg").read_text()
    assert "median time" in (path / "micro_throughput.svg").read_text()


def test_an_old_micro_run_is_drawn(tmp_path):
    # written before ucx_perftest_lat and of_reference: put_bw with its mean repeated as the median
    writer = RunWriter(tmp_path / "run", "micro", {})
    for transport in ("zerocopy", "ucx_perftest"):
        for size in (1024, 4096):
            writer.add(micro_record(transport=transport, size_bytes=size, p50_us=1.0, p99_us=1.0, mean_us=1.0))
    writer.finish()
    text = (tmp_path / "run" / "records.csv").read_text().splitlines()
    header = text[0].split(",")
    drop = header.index("of_reference")
    (tmp_path / "run" / "records.csv").write_text(
        "\n".join(",".join(v for i, v in enumerate(line.split(",")) if i != drop) for line in text) + "\n")
    assert "of_reference" not in (tmp_path / "run" / "records.csv").read_text()
    assert len(plot_run(tmp_path / "run")) == 4


def test_a_version_1_micro_run_is_drawn(tmp_path):
    path = _as_version_1(_micro_run(tmp_path / "run", samples=True))
    assert "round" not in (path / "records.csv").read_text().splitlines()[0]
    names = sorted(p.name for p in plot_run(path) if p.suffix == ".png")
    assert names == ["micro_throughput.png", "micro_time.png"]
    lines = _drawn_lines(load_run(path), "micro_time")
    assert lines[catalogue.line("zerocopy").label][0] == [1024, 65536, 1 << 20]


# -- model: Figures 9 and 12 ---------------------------------------------------------------------------------


def test_figure_9_for_one_batch_size_is_bars_from_zero_per_model(tmp_path):
    transports = ("grpc_tcp", "rdma_cp", "zerocopy", "local")
    run = load_run(_model_run(tmp_path / "run", transports=transports, batches=(4,)))
    fig = draw(run, "model_throughput")
    axes = _visible_axes(fig)
    assert [ax.get_title() for ax in axes] == ["FCN-5", "VGGNet-16"]
    for ax in axes:
        assert len(_bars(ax)) == len(transports)  # one bar per transport
        assert ax.get_ylim()[0] == 0
        assert not [line for line in ax.get_lines() if len(line.get_xdata()) > 1]  # no lines through lone points
    heights = sorted(bar.get_height() for bar in _bars(axes[0]))
    expected = sorted(run.records[run.records["model"] == "fcn5"]["throughput_batches_per_s"])
    assert heights == pytest.approx(expected)
    _assert_legends_cover_no_axes(fig)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [catalogue.line(n).label for n in ("local", "grpc_tcp", "rdma_cp", "zerocopy")]
    plt.close(fig)


def test_figure_9_for_several_batch_sizes_is_lines_from_zero(tmp_path):
    run = load_run(_model_run(tmp_path / "run", batches=(1, 2, 4), rounds=2))
    fig = draw(run, "model_throughput")
    for ax in _visible_axes(fig):
        lines = list(_series(ax).values())
        assert len(lines) == 4
        assert all(list(line.get_xdata()) == [1, 2, 4] for line in lines)
        assert ax.get_ylim()[0] == 0
        assert [c for c in ax.containers if isinstance(c, ErrorbarContainer) and c.has_yerr]
    assert "2 rounds" in figure_text(fig)
    plt.close(fig)


def test_model_figures_are_drawn(tmp_path):
    writer = RunWriter(tmp_path / "run", "model", {})
    for model in ("fcn5", "vgg16"):
        for transport, speed in (("zerocopy", 3.0), ("rdma_cp", 2.0), ("grpc_tcp", 0.5)):
            for batch in (1, 2, 4):
                writer.add({"transport": transport, "model": model, "batch_size": batch, "servers": 1, "steps": 5,
                            "step_time_s": 1 / speed, "throughput_batches_per_s": speed, "compute_s": 0.1,
                            "comm_s": 0.0})
    writer.finish()
    names = sorted(p.name for p in plot_run(tmp_path / "run"))
    assert names == ["model_step_time.png", "model_step_time.svg", "model_throughput.png", "model_throughput.svg"]
    assert (tmp_path / "run" / "model_throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_the_step_time_figure_splits_off_the_computation(tmp_path):
    run = load_run(_model_run(tmp_path / "run", models=("fcn5",), transports=("grpc_tcp", "zerocopy")))
    fig = draw(run, "model_step_time")
    ax = _visible_axes(fig)[0]
    heights = sorted(round(bar.get_height(), 6) for bar in _bars(ax))
    # two steps and, over each, its computation (0.05 s) paled
    assert heights == pytest.approx(sorted([0.05, 0.05, *run.records["step_time_s"]]))
    assert ax.get_ylim()[0] == 0
    plt.close(fig)


def test_the_step_time_distribution_is_drawn_only_from_samples(tmp_path):
    with_samples = _model_run(tmp_path / "with", samples=True)
    fig = draw(load_run(with_samples), "model_step_distribution")
    assert fig is not None
    assert len([p for p in fig.axes[0].patches if p.get_visible()]) == 2 * 4  # models x transports
    plt.close(fig)
    assert "model_step_distribution.png" in {p.name for p in plot_run(with_samples)}
    without = _model_run(tmp_path / "without")
    assert draw(load_run(without), "model_step_distribution") is None
    assert "model_step_distribution.png" not in {p.name for p in plot_run(without)}


def test_the_copy_overhead_figure_is_drawn_when_the_analysis_ran_on_and_off(tmp_path):
    writer = RunWriter(tmp_path / "run", "model", {})
    for model in ("vgg16", "embedding"):
        for transport, seconds, copied, misses in (("zerocopy", 1.0, 0, 0), ("zerocopy:no_analysis", 1.2, 0, 32),
                                                    ("rdma_cp", 1.3, 5e8, 32)):
            writer.add({"transport": transport, "model": model, "batch_size": 1, "servers": 1, "steps": 5,
                        "step_time_s": seconds, "throughput_batches_per_s": 1 / seconds, "compute_s": 0.5,
                        "comm_s": 0.1, "copied_bytes_per_step": copied, "unregistered_sends_per_step": misses,
                        "analysis": "off" if transport.endswith("no_analysis") else "on"})
    writer.finish()
    names = sorted(p.name for p in plot_run(tmp_path / "run"))
    assert "copy_overhead.png" in names and "copy_overhead.svg" in names
    svg = (tmp_path / "run" / "copy_overhead.svg").read_text()
    assert "+20%" in svg  # the analysis's gain is written above each model's bars
    _, width, _ = matplotlib.image.imread(tmp_path / "run" / "copy_overhead.png").shape
    assert width > 800


def test_a_version_1_model_run_is_drawn(tmp_path):
    path = _as_version_1(_model_run(tmp_path / "run", batches=(1, 2), samples=True))
    names = sorted(p.name for p in plot_run(path) if p.suffix == ".png")
    assert names == ["model_step_time.png", "model_throughput.png"]


# -- scale: Figure 11 ----------------------------------------------------------------------------------------


def _scale_run(path: Path, rounds: int = 1) -> Path:
    writer = RunWriter(path, "scale", {})
    for r in range(1, rounds + 1):
        for transport, per_worker in (("zerocopy", 3.0), ("grpc_tcp", 1.0)):
            for servers in (1, 2, 4):
                tp = per_worker / servers**0.5 * (1 + 0.05 * r)
                writer.add({"transport": transport, "model": "vgg16", "batch_size": 1, "servers": servers,
                            "round": r, "steps": 5, "step_time_s": 1 / tp, "throughput_batches_per_s": tp,
                            "compute_s": 0.1, "comm_s": 0.0, "launcher": "local", "compute": "replay",
                            "link_rate": "", "total_batches_per_s": tp * servers,
                            "scaling_efficiency": servers**-0.5})
        writer.add({"transport": "local", "model": "vgg16", "batch_size": 1, "servers": 1, "round": r, "steps": 5,
                    "step_time_s": 0.2, "throughput_batches_per_s": 5.0, "compute_s": 0.2, "comm_s": 0.0,
                    "launcher": "local", "compute": "replay", "link_rate": "", "total_batches_per_s": 5.0,
                    "scaling_efficiency": 1.0})
    writer.finish()
    return path


def test_scale_figures_draw_the_local_line_and_name_replayed_compute(tmp_path):
    path = _scale_run(tmp_path / "run")
    names = sorted(p.name for p in plot_run(path))
    assert names == ["scale_efficiency.png", "scale_efficiency.svg", "scale_throughput.png", "scale_throughput.svg"]
    svg = (path / "scale_throughput.svg").read_text()
    assert "REPLAYED" in svg and "Local (no transfer) x servers" in svg


def test_scale_rounds_draw_one_point_per_server_count(tmp_path):
    run = load_run(_scale_run(tmp_path / "run", rounds=3))
    fig = draw(run, "scale_throughput")
    ax = _visible_axes(fig)[0]
    lines = _series(ax)
    assert list(lines[catalogue.line("zerocopy").label].get_xdata()) == [1, 2, 4]
    assert list(lines["Local (no transfer) x servers"].get_ydata()) == pytest.approx([5.0, 10.0, 20.0])
    assert ax.get_ylim()[0] == 0
    assert [c for c in ax.containers if isinstance(c, ErrorbarContainer) and c.has_yerr]
    plt.close(fig)


# -- models: Table 2, and analysis: Figure 7 -----------------------------------------------------------------


def _models_run(path: Path) -> Path:
    writer = RunWriter(path, "models", {})
    for model, mb, variables, ms in (("vgg16", 512.32, 32, 30.92), ("fcn5", 204.47, 10, 4.88)):
        writer.add(ModelsRecord(model=model, variables=variables, paper_variables=variables, model_mb=mb,
                                paper_model_mb=mb, batch_size=8, compute_ms_per_sample=ms * 5,
                                paper_compute_ms_per_sample=ms))
    writer.add(ModelsRecord(model="embedding", variables=3, model_mb=24.4, batch_size=8, compute_ms_per_sample=1.5))
    writer.finish()
    return path


def test_the_models_figure_draws_measured_beside_the_paper(tmp_path):
    path = _models_run(tmp_path / "run")
    assert sorted(p.name for p in plot_run(path)) == ["models_vs_paper.png", "models_vs_paper.svg"]
    fig = draw(load_run(path), "models_vs_paper")
    size_ax, variables_ax, compute_ax = _visible_axes(fig)
    # measured for three models, the paper for the two it has
    assert sorted(b.get_height() for b in _bars(size_ax)) == pytest.approx(sorted([512.32, 204.47, 24.4] * 1
                                                                                  + [512.32, 204.47]))
    assert sorted(b.get_height() for b in _bars(compute_ax)) == pytest.approx(
        sorted([30.92 * 5, 4.88 * 5, 1.5, 30.92, 4.88]))
    assert [t.get_text() for t in compute_ax.get_xticklabels()] == ["VGGNet-16", "FCN-5", "embedding"]
    for ax in (size_ax, variables_ax, compute_ax):
        assert ax.get_ylim()[0] == 0
    _assert_legends_cover_no_axes(fig)
    plt.close(fig)


def _analysis_run(path: Path) -> Path:
    """Two models, each variable sent to two workers (so listed twice) and its gradient back."""
    writer = RunWriter(path, "analysis", {})
    plans = {"fcn5": [40, 4096, 1 << 20, 64 << 20], "lstm": [4096, 16 << 20]}
    for model, sizes in plans.items():
        for i, size in enumerate(sizes):
            for worker in (2, 3):
                for role, src, dst in (("weight", 0, worker), ("gradient", worker, 0)):
                    writer.add(AnalysisRecord(model=model, servers=2, batch_size=8, tensor=f"v{i}/{role}", role=role,
                                              placement="static", shape=f"({size // 4},)", dtype="float32",
                                              bytes=size, src=src, dst=dst, variable=f"v{i}", site="ps"))
    writer.finish()
    return path


def test_figure_7_draws_one_ccdf_per_model_over_its_variables(tmp_path):
    path = _analysis_run(tmp_path / "run")
    assert sorted(p.name for p in plot_run(path)) == ["analysis_tensor_sizes.png", "analysis_tensor_sizes.svg"]
    fig = draw(load_run(path), "analysis_tensor_sizes")
    count_ax = fig.axes[0]
    lines = {line.get_label().split(" (")[0]: line for line in count_ax.get_lines()
             if not line.get_label().startswith("_")}
    assert set(lines) == {"FCN-5", "LSTM"}
    xs, ys = list(lines["FCN-5"].get_xdata()), list(lines["FCN-5"].get_ydata())
    # each variable once (not once per worker, no gradients): 4 steps of 25%, from 100% to 0
    assert xs == [40, 40, 4096, 1 << 20, 64 << 20, 64 << 20]
    assert ys == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    assert "4 tensors" in lines["FCN-5"].get_label()
    assert count_ax.get_xscale() == "log"
    _assert_legends_cover_no_axes(fig)
    plt.close(fig)


def test_an_analysis_without_weights_has_nothing_to_draw(tmp_path):
    writer = RunWriter(tmp_path / "run", "analysis", {})
    writer.add(AnalysisRecord(model="embedding", servers=1, batch_size=8, tensor="g", role="gradient",
                              placement="dynamic", dtype="float32", src=1, dst=0))
    writer.finish()
    with pytest.raises(PlotError, match="nothing"):
        plot_run(tmp_path / "run")


# -- every figure: no legend over the data --------------------------------------------------------------------


def _converge_run(path: Path) -> Path:
    writer = RunWriter(path, "converge", {"task": "digits", "target": "accuracy=0.9", "metric": "accuracy"})
    for transport, pace in (("grpc_tcp", 2.0), ("zerocopy", 1.0)):
        for step in range(0, 30, 5):
            writer.add({"kind": "step", "transport": transport, "task": "digits", "step": step, "wall_s": step * pace,
                        "train_loss": 2.0 / (1 + step)})
            if step % 10 == 0:
                writer.add({"kind": "eval", "transport": transport, "task": "digits", "step": step,
                            "wall_s": step * pace, "heldout_loss": 2.0 / (1 + step), "metric": "accuracy",
                            "metric_value": step / 30})
    writer.finish()
    return path


RUNS = {
    "micro": lambda p: _micro_run(p, transports=(*catalogue.names("local"), *catalogue.names("transport")), rounds=2,
                                  samples=True),
    "model": lambda p: _model_run(p, models=("alexnet", "inception_v3", "vgg16", "lstm", "gru", "fcn5", "embedding"),
                                  transports=("local", "grpc_tcp", "grpc_rdma", "grpc_rdma:direct", "rdma_cp",
                                              "zerocopy", "zerocopy:no_analysis", "tf_grpc"), samples=True),
    "scale": _scale_run,
    "converge": _converge_run,
    "models": _models_run,
    "analysis": _analysis_run,
}


@pytest.mark.parametrize("experiment", list(RUNS))
def test_no_legend_covers_data(tmp_path, experiment):
    run = load_run(RUNS[experiment](tmp_path / "run"))
    drawn = []
    for stem, fig in figures(run):
        _assert_legends_cover_no_axes(fig)
        assert fig._suptitle is not None and run.meta["host"] in details_of(fig)  # where it ran, in small print
        assert "\n" not in fig.get_suptitle()  # the title: one line, what is drawn
        drawn.append(stem)
        plt.close(fig)
    assert drawn == [stem for stem, _ in plot.FIGURES[experiment] if stem != "copy_overhead" or experiment == "model"]


# -- the command: a run, or a directory of runs ------------------------------------------------------------------


def bench_plot(*argv: str) -> int:
    import argparse

    from bench.commands import plot as command

    parser = argparse.ArgumentParser(prog="bench plot")
    command.add_arguments(parser)
    return command.run(parser.parse_args(list(argv)))


def test_a_directory_of_runs_draws_each_run_in_it(tmp_path, capsys):
    results = tmp_path / "results"
    micro, model = _micro_run(results / "micro-1"), _model_run(results / "model-1")
    (results / "report-1.html").write_text("<html></html>")  # what else lies in results/: not a run, passed over
    assert bench_plot(str(results)) == 0
    out = capsys.readouterr().out.split()
    for run, stems in ((micro, ("micro_time", "micro_throughput")), (model, ("model_throughput",))):
        for stem in stems:
            for suffix in (".png", ".svg"):
                assert str(run / f"{stem}{suffix}") in out and (run / f"{stem}{suffix}").is_file()
    assert {Path(p).parent for p in out} == {micro, model}  # every file printed is one drawn beside a run's records


def test_a_run_in_the_directory_that_cannot_be_drawn_is_named_and_the_others_drawn(tmp_path, capsys):
    results = tmp_path / "results"
    micro = _micro_run(results / "micro-1")
    writer = RunWriter(results / "soak-1", "soak", {})
    writer.add({"phase": "micro", "transport": "local", "process": "sender", "tensors_sent": 1, "tensors_received": 0,
                "corrupted": 0, "lost": 0, "rss_start_mb": 1.0, "rss_end_mb": 1.0})
    writer.finish()
    assert bench_plot(str(results)) == 0
    captured = capsys.readouterr()
    assert str(micro / "micro_time.png") in captured.out.split()
    assert captured.err.count("\n") == 1 and captured.err.startswith("bench plot: warning: ")
    assert "soak" in captured.err


def test_a_single_run_is_drawn_as_before(tmp_path, capsys):
    run = _micro_run(tmp_path / "micro")
    assert bench_plot(str(run)) == 0
    assert sorted(Path(p).name for p in capsys.readouterr().out.split()) == [
        "micro_throughput.png", "micro_throughput.svg", "micro_time.png", "micro_time.svg"]


@pytest.mark.parametrize("make", [lambda tmp: (tmp / "empty").mkdir() or tmp / "empty",
                                  lambda tmp: (tmp / "other" / "notes").mkdir(parents=True) or tmp / "other",
                                  lambda tmp: tmp / "missing"],
                         ids=["empty", "no-run-inside", "missing"])
def test_a_directory_without_runs_is_one_line_and_status_2(tmp_path, capsys, make):
    path = make(tmp_path)
    assert bench_plot(str(path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench plot: error: ") and str(path) in err
    assert "Traceback" not in err


def test_a_directory_whose_runs_all_fail_is_status_2(tmp_path, capsys):
    RunWriter(tmp_path / "results" / "micro-1", "micro", {})  # no records
    assert bench_plot(str(tmp_path / "results")) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("bench plot: warning: ") and "micro-1" in err[0]
    assert err[-1].startswith("bench plot: error: none of the 1 run(s)")


def test_the_help_says_a_directory_of_runs_is_drawn(capsys):
    from bench.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["plot", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "or a directory holding them" in text and "each run in it is drawn" in text
