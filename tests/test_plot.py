"""Figures are drawn from a run's files: valid PNG and SVG beside the records."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import matplotlib.image
import pytest

from bench.plot import PlotError, plot_run
from bench.results import RunWriter
from tests.test_results import micro_record


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


def test_a_run_without_records_cannot_be_drawn(tmp_path):
    RunWriter(tmp_path / "run", "micro", {})
    with pytest.raises(Exception, match=r"no records|records\.csv"):
        plot_run(tmp_path / "run")


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


def test_scale_figures_draw_the_local_line_and_name_replayed_compute(tmp_path):
    writer = RunWriter(tmp_path / "run", "scale", {})
    for transport, per_worker in (("zerocopy", 3.0), ("grpc_tcp", 1.0)):
        for servers in (1, 2, 4):
            writer.add({"transport": transport, "model": "vgg16", "batch_size": 1, "servers": servers, "steps": 5,
                        "step_time_s": 1 / per_worker, "throughput_batches_per_s": per_worker / servers ** 0.5,
                        "compute_s": 0.1, "comm_s": 0.0, "launcher": "local", "compute": "replay", "link_rate": "",
                        "total_batches_per_s": per_worker * servers ** 0.5, "scaling_efficiency": servers ** -0.5})
    writer.add({"transport": "local", "model": "vgg16", "batch_size": 1, "servers": 1, "steps": 5, "step_time_s": 0.2,
                "throughput_batches_per_s": 5.0, "compute_s": 0.2, "comm_s": 0.0, "launcher": "local",
                "compute": "replay", "link_rate": "", "total_batches_per_s": 5.0, "scaling_efficiency": 1.0})
    writer.finish()
    names = sorted(p.name for p in plot_run(tmp_path / "run"))
    assert names == ["scale_efficiency.png", "scale_efficiency.svg", "scale_throughput.png", "scale_throughput.svg"]
    svg = (tmp_path / "run" / "scale_throughput.svg").read_text()
    assert "REPLAYED" in svg and "Local (no transfer) x servers" in svg


def test_an_experiment_without_figures_is_named(tmp_path):
    writer = RunWriter(tmp_path / "run", "soak", {})
    writer.add({"phase": "micro", "transport": "local", "process": "sender", "tensors_sent": 1, "tensors_received": 0,
                "corrupted": 0, "lost": 0, "rss_start_mb": 1.0, "rss_end_mb": 1.0})
    with pytest.raises(PlotError, match="soak"):
        plot_run(tmp_path / "run")


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


def _drawn_figures(monkeypatch):
    from bench import plot

    figures = {}
    save = plot._save

    def keep(fig, run, stem):
        figures[stem] = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                         for line in fig.axes[0].get_lines()}
        return save(fig, run, stem)

    monkeypatch.setattr(plot, "_save", keep)
    return figures


def test_micro_figures_draw_the_latency_reference_line(tmp_path, monkeypatch):
    from bench.plot import LABELS, TIME_FROM_MEAN

    path = _micro_run_with_references(tmp_path)
    figures = _drawn_figures(monkeypatch)
    plot_run(path)
    lat = LABELS["ucx_perftest_lat"]
    # time: the latency line is its median, half a round trip, up to 1MB only
    sizes, times = figures["micro_time"][lat]
    assert sizes == [1024, 65536, 1 << 20]
    assert times == pytest.approx([0.1 + s / 1e4 for s in sizes])
    # throughput: the latency line's throughput
    sizes, mbps = figures["micro_throughput"][lat]
    assert mbps == pytest.approx([s / 2**20 / (0.2 + s / 1e4) * 1e6 for s in sizes])
    # put_bw has no median: on the time figure it is size / bandwidth, labelled as no latency
    sizes, times = figures["micro_time"][TIME_FROM_MEAN["ucx_perftest"]]
    assert sizes == [1024, 65536, 1 << 20, 4 << 20]
    assert times == pytest.approx([s / 2**20 / (10000.0 if s == 1024 else 8000.0) * 1e6 for s in sizes])
    assert LABELS["ucx_perftest"] in figures["micro_throughput"]
    assert "not a latency" in TIME_FROM_MEAN["ucx_perftest"]
    for stem in ("micro_time", "micro_throughput"):
        svg = (path / f"{stem}.svg").read_text()
        assert "latency floor" in svg


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
