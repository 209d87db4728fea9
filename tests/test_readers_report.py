"""The report reads as one document: one number format (the terminal's), a link per section that says which, figures
captioned by what they show, a range in every ratio cell whose points have one, each line named by both its names
once and by the paper's after, and figure titles of one short line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.readers.report import build_report, render_html, render_markdown
from bench.results import MicroRecord, RunWriter
from tests.test_report import SHARED_MEMORY, micro_run, model_run, parse_page, wide_micro_run
from tests.test_results import micro_record


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict:
    """Two micro runs and a model run, reported with figures; and a micro run with peers and 3 rounds, without:
    the HTML and Markdown."""
    root = tmp_path_factory.mktemp("pages")
    runs = [micro_run(root / "micro"), micro_run(root / "other"), model_run(root / "model")]
    report = build_report(runs, root / "figures")
    names = {figure.png: f"{i}.png" for i, figure in enumerate(f for s in report.sections for f in s.figures)}
    wide = build_report([wide_micro_run(root / "wide")], root / "none", figures=False)
    return {"html": render_html(report), "markdown": render_markdown(report, names), "wide": render_html(wide)}


def slow_run(path: Path) -> Path:
    """grpc_tcp at 1,109 µs a transfer, zerocopy at 74.9 µs."""
    writer = RunWriter(path, "micro", {"fabric": "ucx", "fabric_transport": "shm"})
    for transport, time_us in (("zerocopy", 74.9), ("grpc_tcp", 1109.2)):
        writer.add(micro_record(transport=transport, size_bytes=1 << 20, p50_us=time_us, p99_us=2 * time_us,
                                mean_us=time_us, throughput_MBps=2**20 / 2**20 / time_us * 1e6, fabric=SHARED_MEMORY))
    writer.add(micro_record(transport="mpi", size_bytes=1 << 20, p50_us=1234.5, p99_us=2000.0, mean_us=1234.5,
                            throughput_MBps=800.0, fabric="none"))
    writer.finish()
    return path


def test_numbers_are_shown_as_the_terminal_shows_them(tmp_path):
    report = build_report([slow_run(tmp_path / "run")], tmp_path / "figures", figures=False)
    page = render_markdown(report, {})
    assert not re.search(r"\d[eE][+-]\d", page), "a number in exponent notation"
    peers = parse_page(render_html(report)).tables["figure8-peers"]
    assert peers[1][:2] == ["1MB", "1,234"]  # MPI's p50, as bench micro's table prints it (not 1.23e+03)


def test_every_link_of_the_contents_names_a_section_of_its_own(pages):
    links = re.findall(r'<li><a href="#([^"]+)">([^<]+)</a>', pages["html"])
    assert len(links) >= 3
    anchors, titles = [a for a, _ in links], [t for _, t in links]
    assert len(set(anchors)) == len(anchors)
    assert len(set(titles)) == len(titles), titles
    assert "Figure 8: send/receive micro-benchmark (run micro)" in titles
    assert "Figure 8: send/receive micro-benchmark (run other)" in titles
    assert all(f'id="{anchor}"' in pages["html"] for anchor in anchors)


def test_figures_are_captioned_by_what_they_show_not_by_a_file_name(pages):
    captions = re.findall(r"<figcaption>([^<]*)</figcaption>", pages["html"])
    alts = re.findall(r'<img [^>]*alt="([^"]*)"', pages["html"])
    assert captions and alts == captions
    assert "Send/receive micro-benchmark (Figure 8): time per transfer, lower is better" in captions
    assert "Training throughput (Figure 9), higher is better" in captions
    assert not any("_" in caption for caption in captions), captions  # micro_time, model_throughput, ...
    assert "![micro_time]" not in pages["markdown"] and "![Send/receive micro-benchmark" in pages["markdown"]


def test_every_ratio_cell_whose_points_have_a_spread_shows_its_range(pages):
    peers = parse_page(pages["wide"]).tables["figure8-peers"]  # 3 rounds
    best = [i for i, title in enumerate(peers[0]) if title.endswith("/ best")]
    assert best
    for row in peers[1:]:
        for i in best:
            assert re.fullmatch(r"\d[\d.,]*x \(\d[\d.,]*x\sto\s\d[\d.,]*x\)", row[i]), row[i]


def test_each_line_is_named_by_both_its_names_once_then_by_the_papers(pages):
    for page in (pages["markdown"], pages["html"]):
        text = page.replace("\\_", "_")
        for both in ("RDMA.zerocp (zerocopy)", "gRPC.TCP (grpc_tcp)", "RDMA.cp (rdma_cp)"):
            assert text.count(both) == 1, both
        lead = text.index("RDMA.zerocp (zerocopy)")
        assert text.index("RDMA.zerocp") == lead  # the first mention names both
        assert text.count("RDMA.zerocp") > 3


def test_a_model_figures_title_is_one_short_line(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from bench.readers.plot import draw
    from bench.readers.plot.common import details_of

    writer = RunWriter(tmp_path / "model", "model", {"compute": "replay"})
    from tests.test_report import _model_row

    for transport, per_s in (("zerocopy", 3.0), ("rdma_cp", 2.4), ("grpc_rdma", 1.2), ("grpc_tcp", 0.5),
                             ("local", 6.0)):
        writer.add(_model_row(transport, "vgg16", 4, per_s))
    writer.finish()
    from bench.results import load_run

    run = load_run(tmp_path / "model")
    for stem in ("model_throughput", "model_step_time"):
        fig = draw(run, stem)
        fig.canvas.draw()
        title = fig._suptitle
        assert "\n" not in title.get_text(), title.get_text()
        width = fig.get_window_extent().width
        assert title.get_window_extent().width <= width  # no wider than the figure: nothing to wrap
        # the band above the axes (the title, the panel's name): under 15% of the height (the title was 40% of a
        # 677x597 figure)
        axes_top = max(ax.get_tightbbox().y1 for ax in fig.axes)
        assert fig.bbox.height - axes_top < 0.15 * fig.bbox.height
        assert "compute REPLAYED" in details_of(fig) and "UTC" not in title.get_text()


def test_micro_records_make_no_exponent_in_any_ratio_or_time(tmp_path):
    writer = RunWriter(tmp_path / "run", "micro", {})
    for transport, time_us in (("zerocopy", 0.5), ("grpc_tcp", 123456.0)):
        for round_ in (1, 2, 3):
            writer.add(MicroRecord.from_row(micro_record(
                transport=transport, size_bytes=1024, round=round_, p50_us=time_us * (1 + round_ / 10),
                p99_us=time_us, mean_us=time_us, throughput_MBps=1.0, fabric=SHARED_MEMORY)))
    writer.finish()
    page = render_markdown(build_report([tmp_path / "run"], tmp_path / "figures", figures=False), {})
    assert not re.search(r"\d[eE][+-]\d", page)
    assert "246,912x (" in page  # thousands separated, with its range


def test_the_cost_of_the_copy_shows_its_range_across_rounds(tmp_path):
    from tests.test_report import _model_row

    writer = RunWriter(tmp_path / "model", "model", {"compute": "replay"})
    for round_, spread in ((1, 0.9), (2, 1.0), (3, 1.1)):
        for transport, per_s in (("zerocopy", 3.0), ("zerocopy:no_analysis", 2.5)):
            writer.add(_model_row(transport, "vgg16", 4, per_s * spread, round=round_))
    writer.finish()
    page = render_html(build_report([tmp_path / "model"], tmp_path / "figures", figures=False))
    table = parse_page(page).tables["figure12-ratios"]
    column = next(i for i, title in enumerate(table[0]) if title.endswith("against RDMA.zerocp"))
    assert re.fullmatch(r"\+20% \(-\d+%\sto\s\+\d+%\)", table[1][column]), table[1][column]
