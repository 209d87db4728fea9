"""``bench report``'s section of a ``bench predict`` run: its tables, what a step rests on, and the paper's Figure 11
ratios beside the predicted ones (bench/readers/report/sections/figure11_predicted.py)."""

from __future__ import annotations

from pathlib import Path

from bench.readers.report.build import build_report
from bench.results import RunWriter

KEY = "figure11-predicted"


def predict_run(path: Path, steps: dict[tuple[str, int], float], compute: str = "paper",
                link_rate: str = "100gbit") -> Path:
    """A ``bench predict`` run of VGG16 at batch 32: the predicted step time per (transport, servers)."""
    writer = RunWriter(path, "predict", {"compute": compute, "micro_run": "results/micro-x"})
    for (transport, servers), step in steps.items():
        writer.add({"transport": transport, "model": "vgg16", "batch_size": 32, "servers": servers,
                    "link_rate": link_rate, "link_rate_bps": {"100gbit": 1e11, "10gbit": 1e10}[link_rate],
                    "compute": compute, "compute_s": 0.5, "step_time_s": step, "throughput_batches_per_s": 1 / step,
                    "total_batches_per_s": servers / step, "scaling_efficiency": steps[(transport, 1)] / step,
                    "compute_fraction": 0.5 / step, "host_fraction": 0.1, "wire_fraction": 0.1,
                    "wait_fraction": 0.8 - 0.5 / step, "saturated": "nic:ingress:2" if servers > 1 else "cpu:0",
                    "saturated_utilisation": 0.95 if servers == 8 else 0.5, "nic_bytes_per_step": 10,
                    "micro_run": "results/micro-x"})
    writer.finish()
    return path


STEPS = {("zerocopy", 1): 0.6, ("zerocopy", 8): 0.8, ("grpc_rdma", 1): 1.2, ("grpc_rdma", 8): 2.0,
         ("grpc_tcp", 1): 1.5, ("grpc_tcp", 8): 4.0}


def section(tmp_path: Path, **kwargs):
    report = build_report([predict_run(tmp_path / "run", STEPS, **kwargs)], tmp_path / "figures", figures=False)
    found = [s for s in report.sections if s.key == KEY]
    assert len(found) == 1
    return found[0]


def test_a_predict_run_has_its_section_with_throughput_and_what_a_step_rests_on(tmp_path):
    made = section(tmp_path)
    throughput, parts = made.tables[0], made.tables[1]
    assert throughput.header == ["servers", "RDMA.zerocp", "gRPC.RDMA", "gRPC.TCP"]
    assert throughput.rows[1][:2] == ["8", "10 (0.75)"]  # 8 / 0.8 batches/s, 0.6 / 0.8 efficient
    rests = {row[0]: row for row in parts.rows}
    assert rests["RDMA.zerocp"][6] == "host 2's NIC ingress (95%)"
    assert rests["RDMA.zerocp"][7] == "8: host 2's NIC ingress"
    assert rests["gRPC.TCP"][2] == "12%"  # 0.5 s of compute in a 4 s step


def test_the_papers_figure_11_ratios_stand_beside_the_predicted_ones_with_why_they_differ(tmp_path):
    made = section(tmp_path)
    paper = next(t for t in made.tables if t.name == "predicted-paper")
    rows = {(row[1], row[2]): row for row in paper.rows}
    assert rows[("RDMA.zerocp over gRPC.RDMA", "8")][3] == "2.50x"  # 2.0 / 0.8
    assert rows[("RDMA.zerocp over gRPC.TCP", "1")][3] == "2.50x"  # 1.5 / 0.6
    assert rows[("RDMA.zerocp over 1 server", "8")][3] == "6.00x"  # (8 / 0.8) / (1 / 0.6)
    assert rows[("RDMA.zerocp over Local", "8")][3] == "5.00x"  # 10 batches/s over one at 0.5 s
    why = [note for note in made.notes if note.startswith("VGGNet-16 at 8 servers")]
    assert len(why) == 2 and "no transport can be more than 4.00x faster than gRPC.RDMA" in why[0]


def test_predictions_off_the_papers_cluster_get_no_paper_comparison(tmp_path):
    made = section(tmp_path / "replay", compute="replay")
    assert not [t for t in made.tables if t.name == "predicted-paper"]
    made = section(tmp_path / "slow", link_rate="10gbit")
    assert not [t for t in made.tables if t.name == "predicted-paper"]


def test_a_predict_run_says_how_to_check_it_against_real_runs_here(tmp_path):
    made = section(tmp_path, link_rate="10gbit")
    check = [note for note in made.notes if note.startswith("To check predictions")]
    assert len(check) == 1
    launcher = "--launcher " + "netns"  # named, not run: the command a user is told to run
    assert f"`bench scale vgg16 {launcher} --compute replay --link-rate 10gbit --servers 1,2,4`" in check[0]
    assert "--compute-from" in check[0] and "`bench report` of both runs" in check[0]
