"""``bench report``'s section setting ``bench predict``'s predictions beside ``bench scale``'s measured points, and
the Optimus baseline (bench/readers/report/sections/predict.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.readers.report import build
from bench.readers.report.build import build_report
from bench.readers.report.html_page import render_html
from bench.readers.report.markdown_page import render_markdown
from bench.readers.report.page import Section
from bench.readers.report.sections.predict import optimus_fit, optimus_predict
from bench.results import RunWriter
from bench.results.records import PredictRecord

KEY = "figure11-predicted-measured"


def scale_run(path: Path, totals: dict[tuple[str, int], float], link_rate: str = "1gbit", model: str = "fcn5",
              batch: int = 32, compute: str = "replay") -> Path:
    """A ``bench scale`` run over netns links of ``link_rate``: total batches/s per (transport, servers)."""
    writer = RunWriter(path, "scale", {"compute": compute, "asynchronous": False,
                                       "launcher": {"launcher": "netns", "link_rate": link_rate}})
    for (transport, servers), total in totals.items():
        writer.add({"transport": transport, "model": model, "batch_size": batch, "servers": servers, "steps": 5,
                    "step_time_s": servers / total, "throughput_batches_per_s": total / servers,
                    "compute_s": 0.1, "comm_s": 0.2, "launcher": "netns", "compute": compute,
                    "link_rate": link_rate, "total_batches_per_s": total, "scaling_efficiency": 1.0})
    writer.finish()
    return path


def predict_run(path: Path, totals: dict[tuple[str, int], float], link_rate: str = "1gbit", model: str = "fcn5",
                batch: int = 32, compute: str = "replay", **extra) -> Path:
    """A ``bench predict`` run: predicted total batches/s per (transport, servers) at one link rate."""
    bps = {"1gbit": 1e9, "10gbit": 1e10}[link_rate]
    writer = RunWriter(path, "predict", {"compute": compute, "micro_run": "results/micro-x"})
    for (transport, servers), total in totals.items():
        writer.add({"transport": transport, "model": model, "batch_size": batch, "servers": servers,
                    "link_rate": link_rate, "link_rate_bps": bps, "compute": compute, "compute_s": 0.1,
                    "step_time_s": servers / total, "throughput_batches_per_s": total / servers,
                    "total_batches_per_s": total, "scaling_efficiency": 1.0, "compute_fraction": 0.4,
                    "host_fraction": 0.3, "wire_fraction": 0.2, "wait_fraction": 0.1, "saturated": "cpu:0",
                    "saturated_utilisation": 0.5, "nic_bytes_per_step": 1000, "micro_run": "results/micro-x",
                    **extra})
    writer.finish()
    return path


#: measured: zerocopy 2.0, 3.6, 5.0 batches/s at 1, 2, 4 servers; grpc_tcp 1.0, 1.2, 1.0. Optimus's fits: zerocopy
#: T(N) = 4/9 + N/18 (6.0 at 4 servers: +20%), grpc_tcp T(N) = 1/3 + 2N/3 (4/3 at 4: +33.3%)
MEASURED = {("zerocopy", 1): 2.0, ("zerocopy", 2): 3.6, ("zerocopy", 4): 5.0,
            ("grpc_tcp", 1): 1.0, ("grpc_tcp", 2): 1.2, ("grpc_tcp", 4): 1.0}
#: predicted: errors +5%, -5%, +2% (zerocopy) and -10%, +10%, -3% (grpc_tcp)
PREDICTED = {("zerocopy", 1): 2.1, ("zerocopy", 2): 3.42, ("zerocopy", 4): 5.1,
             ("grpc_tcp", 1): 0.9, ("grpc_tcp", 2): 1.32, ("grpc_tcp", 4): 0.97,
             ("zerocopy", 8): 9.0}  # no measured 8-server point: no row


def section_of(paths: list[Path], tmp_path: Path) -> Section | None:
    report = build_report(paths, tmp_path / "figures", figures=False)
    found = [s for s in report.sections if s.key == KEY]
    assert len(found) <= 1
    return found[0] if found else None


def rows_by(table, *columns: str) -> dict[tuple[str, ...], dict[str, str]]:
    """A table's rows as ``{(first cells...): {header: cell}}``."""
    return {tuple(row[:len(columns)]): dict(zip(table.header, row, strict=True)) for row in table.rows}


# -- Optimus -----------------------------------------------------------------------------------------------

steps = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False)
#: no deadline: a busy machine (or scipy's first import) must not fail a property
SOME = settings(max_examples=50, deadline=None)


@SOME
@given(steps, st.floats(min_value=1.0, max_value=2.0))
def test_optimus_goes_through_two_points_whose_step_grows_with_servers(t1, grows):
    a, b = optimus_fit([(1, t1), (2, t1 * grows)])  # T(2) between T(1) and 2 T(1): a, b >= 0 fit them exactly
    assert b >= 0 and a >= 0
    assert a + b == pytest.approx(t1, rel=1e-9) and a + 2 * b == pytest.approx(t1 * grows, rel=1e-9)
    assert optimus_predict((a, b), 1) == pytest.approx(1 / t1, rel=1e-9)
    assert optimus_predict((a, b), 2) == pytest.approx(2 / (t1 * grows), rel=1e-9)
    assert optimus_predict((a, b), 4) == pytest.approx(4 / (a + 4 * b), rel=1e-12)


@SOME
@given(steps, st.floats(min_value=0.01, max_value=0.99))
def test_optimus_clamps_b_to_zero_when_two_servers_step_faster(t1, shrinks):
    a, b = optimus_fit([(1, t1), (2, t1 * shrinks)])
    assert b == 0
    assert a == pytest.approx((t1 + t1 * shrinks) / 2, rel=1e-9)  # the least squares of a alone: the mean step


@SOME
@given(steps, st.floats(min_value=2.01, max_value=100.0))
def test_optimus_clamps_a_to_zero_when_throughput_falls_with_the_second_server(t1, grows):
    a, b = optimus_fit([(1, t1), (2, t1 * grows)])  # T(2) > 2 T(1): 2 / T(2) < 1 / T(1)
    assert a == 0
    assert b == pytest.approx((t1 + 2 * t1 * grows) / 5, rel=1e-9)  # the least squares of b alone


@SOME
@given(st.lists(st.tuples(st.integers(1, 64), steps), min_size=2, max_size=8).filter(
    lambda points: len({n for n, _ in points}) >= 2))
def test_optimus_is_the_non_negative_least_squares_fit(points):
    scipy = pytest.importorskip("scipy.optimize")
    a, b = optimus_fit(points)
    assert a >= 0 and b >= 0
    (a_ref, b_ref), _ = scipy.nnls([[1.0, float(n)] for n, _ in points], [t for _, t in points])

    def residual(fit):
        return sum((fit[0] + fit[1] * n - t) ** 2 for n, t in points)

    assert residual((a, b)) <= residual((a_ref, b_ref)) * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("points", [[], [(1, 0.5)], [(2, 0.5), (2, 0.6)]])
def test_optimus_refuses_fewer_than_two_server_counts(points):
    with pytest.raises(ValueError, match="two server counts"):
        optimus_fit(points)


# -- the section -------------------------------------------------------------------------------------------


def test_each_measured_point_a_prediction_covers_has_its_error_and_optimus(tmp_path):
    measured = scale_run(tmp_path / "scale-1g", {**MEASURED, ("local", 1): 4.0})
    other_batch = scale_run(tmp_path / "scale-b64", {("zerocopy", 1): 2.0, ("zerocopy", 2): 3.0}, batch=64)
    section = section_of([predict_run(tmp_path / "predict", PREDICTED), measured, other_batch], tmp_path)
    assert section is not None
    table = next(t for t in section.tables if t.name.startswith("predicted-measured-fcn5-32-1gbit"))
    rows = rows_by(table, "line", "servers")
    assert set(rows) == {(line, str(n)) for line in ("RDMA.zerocp", "gRPC.TCP") for n in (1, 2, 4)}
    assert [(r["measured"], r["predicted"], r["error"]) for r in (rows[("RDMA.zerocp", "4")],
                                                                 rows[("gRPC.TCP", "2")])] == [
        ("5", "5.1", "+2.0%"), ("1.2", "1.32", "+10.0%")]
    assert rows[("RDMA.zerocp", "4")]["Optimus"] == "6" and rows[("RDMA.zerocp", "4")]["Optimus error"] == "+20.0%"
    assert rows[("gRPC.TCP", "4")]["Optimus"] == "1.33" and rows[("gRPC.TCP", "4")]["Optimus error"] == "+33.3%"
    assert rows[("RDMA.zerocp", "1")]["Optimus error"] == "0.0% (fitted)"  # exact at 1 and 2 servers
    assert rows[("gRPC.TCP", "2")]["Optimus error"] == "0.0% (fitted)"
    errors = next(t for t in section.tables if t.name == "predicted-measured-errors")
    assert errors.rows == [["FCN-5, batch 32, 1gbit", "6", "5.0%", "10.0%", "2", "2.5%", "3.0%", "26.7%", "33.3%"]]
    assert any(note.startswith("FCN-5, batch 32, 1gbit: over the 2 point(s) beyond 2 servers the median absolute "
                               "error is 2.5% predicted, 26.7% with Optimus's fit: ours is lower.")
               for note in section.notes)
    assert any("zero by construction" in note for note in section.notes)
    assert [label for label, _ in section.runs] == ["predict", "scale-1g", "scale-b64"]
    report = build_report([tmp_path / "predict", measured], tmp_path / "f", figures=False)
    assert f'data-section="{KEY}"' in render_html(report)
    assert "## Figure 11 predicted against measured\n\nRun predict: " in render_markdown(report, {})


def test_optimus_is_fitted_across_runs_and_clamped_where_two_servers_step_faster(tmp_path):
    """rdma_cp's 2-server step (0.8 s) is faster than its 1-server one (1 s): b = 0, a = 0.9, so 4/0.9 at 4
    servers; its 1- and 2-server points were measured by another run than its 4-server one."""
    ones = scale_run(tmp_path / "scale-12", {("rdma_cp", 1): 1.0, ("rdma_cp", 2): 2.5})
    fours = scale_run(tmp_path / "scale-4", {("rdma_cp", 4): 4.0})
    predicted = predict_run(tmp_path / "predict", {("rdma_cp", 1): 1.0, ("rdma_cp", 2): 2.0, ("rdma_cp", 4): 4.4})
    section = section_of([predicted, ones, fours], tmp_path)
    table = next(t for t in section.tables if t.name.startswith("predicted-measured-"))
    rows = rows_by(table, "line", "servers")
    assert rows[("RDMA.cp", "4")]["Optimus"] == "4.44" and rows[("RDMA.cp", "4")]["Optimus error"] == "+11.1%"
    assert rows[("RDMA.cp", "1")]["Optimus error"] == "+11.1% (fitted)"  # not exact: b was clamped
    assert rows[("RDMA.cp", "4")]["measured in"] == "scale-4" and rows[("RDMA.cp", "1")]["measured in"] == "scale-12"
    errors = next(t for t in section.tables if t.name == "predicted-measured-errors")
    assert errors.rows[0][4:] == ["1", "10.0%", "10.0%", "11.1%", "11.1%"]


def test_two_link_rates_are_two_tables_and_a_row_for_both(tmp_path):
    slow = scale_run(tmp_path / "scale-1g", MEASURED)
    fast = scale_run(tmp_path / "scale-10g", {("zerocopy", 1): 2.0, ("zerocopy", 2): 4.0, ("zerocopy", 4): 6.0},
                     link_rate="10gbit")  # Optimus: T(N) = 0.5, 8 at 4 servers: +33.3%
    predicted = [predict_run(tmp_path / "predict-1g", PREDICTED),
                 predict_run(tmp_path / "predict-10g", {("zerocopy", 4): 6.6}, link_rate="10gbit")]  # +10%
    section = section_of([*predicted, slow, fast], tmp_path)
    errors = next(t for t in section.tables if t.name == "predicted-measured-errors")
    assert [row[0] for row in errors.rows] == ["FCN-5, batch 32, 1gbit (run predict-1g)",
                                               "FCN-5, batch 32, 10gbit (run predict-10g)", "all tables"]
    assert errors.rows[2][1:] == ["7", "5.0%", "10.0%", "3", "3.0%", "10.0%", "33.3%", "33.3%"]
    assert ("All tables together: over the 3 point(s) beyond 2 servers the median absolute error is 3.0% "
            "predicted, 33.3% with Optimus's fit: ours is lower.") in section.notes


def test_a_line_without_one_and_two_server_points_has_no_optimus(tmp_path):
    measured = scale_run(tmp_path / "scale", {("zerocopy", 1): 2.0, ("zerocopy", 4): 5.0})
    section = section_of([predict_run(tmp_path / "predict", PREDICTED), measured], tmp_path)
    rows = rows_by(next(t for t in section.tables if t.name.startswith("predicted-measured-fcn5")), "line", "servers")
    assert rows[("RDMA.zerocp", "4")]["Optimus"] == "—" and rows[("RDMA.zerocp", "4")]["error"] == "+2.0%"
    assert any("RDMA.zerocp not measured at both 1 and 2 servers" in note and "--servers 1,2,4" in note
               for note in section.notes)


def test_no_matching_measured_point_is_one_line_with_the_fix(tmp_path):
    unshaped = scale_run(tmp_path / "scale", MEASURED, link_rate="")  # launcher local: no link rate
    other_rate = scale_run(tmp_path / "scale-10g", MEASURED, link_rate="10gbit")
    section = section_of([predict_run(tmp_path / "predict", PREDICTED), unshaped, other_rate], tmp_path)
    assert section.tables == []
    emulated = "netns"  # the fix names the launcher; this test only reads the line (it starts no emulated host)
    assert section.notes[0] == (
        "None of the 12 measured scale point(s) (6 of them unshaped: no link rate to predict at) is one a prediction "
        "covers (the same model, framework, batch size, transport, servers and link rate): measure one with bench "
        f"scale fcn5 --launcher {emulated} --link-rate 1gbit --batch-size 32 --compute replay.")


def test_paper_compute_is_not_set_beside_compute_measured_here(tmp_path):
    section = section_of([predict_run(tmp_path / "predict", PREDICTED, compute="paper"),
                          scale_run(tmp_path / "scale", MEASURED)], tmp_path)
    assert section.tables == [] and section.notes[0].endswith("--compute paper.")


def test_no_section_without_both_predictions_and_measured_runs(tmp_path):
    assert section_of([predict_run(tmp_path / "predict", PREDICTED)], tmp_path) is None
    assert section_of([scale_run(tmp_path / "scale", MEASURED)], tmp_path) is None


def test_the_section_says_which_cluster_the_predictions_assumed(tmp_path):
    section = section_of([predict_run(tmp_path / "predict", PREDICTED), scale_run(tmp_path / "scale", MEASURED)],
                         tmp_path)
    assert ("The predictions of run predict assumed hosts of 8 cores, each with one NIC at the link rate, a "
            "non-blocking switch and synchronous steps.") in section.notes
    if "shared_cores" not in PredictRecord.columns():
        pytest.skip("PredictRecord records no cluster yet")
    shared = predict_run(tmp_path / "predict-shared", PREDICTED, shared_cores=2, oversubscription=4.0)
    section = section_of([shared, scale_run(tmp_path / "scale-2", MEASURED)], tmp_path)
    assert any(note.startswith("The predictions of run predict-shared assumed 2 shared cores, oversubscribed 4:1")
               for note in section.notes)


def test_a_section_across_runs_that_fails_says_why_and_the_runs_keep_theirs(tmp_path, monkeypatch):
    def broken(runs):
        raise KeyError("link_rate_bps")

    kinds = tuple(dataclasses.replace(k, across=broken) if k.key == KEY else k for k in build.SECTIONS)
    monkeypatch.setattr(build, "SECTIONS", kinds)
    report = build_report([predict_run(tmp_path / "predict", PREDICTED), scale_run(tmp_path / "scale", MEASURED)],
                          tmp_path / "figures", figures=False)
    assert any(s.key == "figure11" for s in report.sections)
    assert [w for w in report.warnings if "tables could not be made (KeyError" in w] == [
        "predict and scale: the figure11-predicted-measured tables could not be made (KeyError: 'link_rate_bps')"]
