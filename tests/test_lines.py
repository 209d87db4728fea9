"""The catalogue of lines (``bench/results/lines.py``): a line's identity written once, and every reader asking it.

A peer added as one catalogue entry shows up in the figures, the report and ``bench compare`` with its kind, name
and label; no module of ``bench`` keeps a list of line names of its own; runs written before records carried
``line_kind`` load with it filled in.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
from matplotlib.container import ErrorbarContainer

from bench.readers import plot
from bench.readers.compare import compare
from bench.readers.report import write_report
from bench.results import MicroRecord, RunWriter, load_run
from bench.results import lines as catalogue

ROOT = Path(__file__).resolve().parent.parent
#: modules whose literals name lines for another reason: launcher names (``local`` and ``mpi`` are launchers too)
ALLOWED = {"bench/launch/__init__.py"}
FAKE = catalogue.Line("fake_peer", "peer", "Fake peer P", "Fake peer (a test's line)",
                      {"color": "#123456", "marker": "p"}, about="a line that exists only in this test")


def test_no_module_keeps_a_list_of_line_names_of_its_own():
    """A tuple, list, set or dict literal naming two lines or more is a name list: the catalogue is the one."""
    names = {name for kind in catalogue.KINDS for name in catalogue.names(kind)}
    found = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "bench/results/lines.py" or relative in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                elements = node.elts
            elif isinstance(node, ast.Dict):
                elements = [*(key for key in node.keys if key is not None), *node.values]
            else:
                continue
            named = {e.value for e in elements if isinstance(e, ast.Constant) and e.value in names}
            if len(named) >= 2:
                found.append(f"{relative}:{node.lineno} {sorted(named)}")
    assert found == []


def test_the_registries_of_peers_and_references_are_the_catalogue_s():
    from bench.experiments.peers import CALIBRATIONS
    from bench.experiments.peers import REGISTRY as PEERS
    from bench.experiments.references import REGISTRY as REFERENCES

    assert tuple(PEERS) == catalogue.micro_peers()
    # the references, and the peers' plain loops (reference lines measured only with --calibrate)
    assert tuple(REFERENCES) + tuple(CALIBRATIONS) == tuple(sorted(
        catalogue.names("reference"), key=lambda name: name in CALIBRATIONS))
    assert all(catalogue.line(name).implementation == PEERS[name] for name in PEERS)


def _run(path: Path, transports: tuple[str, ...], slower: float = 1.0) -> Path:
    writer = RunWriter(path, "micro", {"fabric": "ucx", "fabric_transport": "shm"})
    for size in (1024, 65536):
        for k, transport in enumerate(transports):
            p50 = (10.0 * (k + 1) + size / 1e3) * (slower if transport == FAKE.name else 1.0)
            writer.add(MicroRecord(transport=transport, size_bytes=size, iters=10, p50_us=p50, p99_us=p50 * 1.2,
                                   mean_us=p50, throughput_MBps=size / 2**20 / (p50 / 1e6), sender_cpu_s=0.1,
                                   receiver_cpu_s=0.1, copied_bytes_per_transfer=0))
    writer.finish()
    return path


def test_a_peer_added_in_one_entry_is_in_the_figures_the_report_and_compare(tmp_path):
    with catalogue.added(FAKE):
        base = _run(tmp_path / "base", ("grpc_tcp", "zerocopy", FAKE.name))
        new = _run(tmp_path / "new", ("grpc_tcp", "zerocopy", FAKE.name), slower=2.0)
        run = load_run(base)
        assert run.records.set_index("transport")["line_kind"].to_dict() == {
            "grpc_tcp": "transport", "zerocopy": "transport", FAKE.name: "peer"}
        # the figures: its label in the legend, its colour on its line
        figure = plot.draw(run, "micro_time")
        drawn = {c.get_label(): c.lines[0] for ax in figure.axes for c in ax.containers
                 if isinstance(c, ErrorbarContainer)}
        assert FAKE.label in drawn and drawn[FAKE.label].get_color() == "#123456"
        # the report: in the peers' table under its short name, never among the transports' ratios
        [page] = write_report([base], tmp_path / "report.html")
        html = page.read_text()
        assert f"{FAKE.paper} p50 (µs)" in html and f"over {FAKE.paper}" not in html
        # compare: a peer got slower, which is no regression of this code
        comparison = compare(base, new)
        fake_rows = [row for row in comparison.rows if row.point[0] == FAKE.name]
        assert fake_rows and all(row.reference for row in fake_rows)
    assert not catalogue.known(FAKE.name)


def test_a_name_the_catalogue_does_not_know_is_a_transport_drawn_in_a_spare_colour():
    line = catalogue.line("my_transport")
    assert (line.kind, line.paper, line.label) == ("transport", "my_transport", "my_transport")
    # the same in every figure: chosen by the name alone, so another process (another hash seed) chooses it too
    chosen = subprocess.run([sys.executable, "-c", "from bench.results import lines\n"
                             "print(lines.line('my_transport').style['color'])"], capture_output=True, text=True,
                            check=True, env={**os.environ, "PYTHONHASHSEED": "12345"}, cwd=ROOT).stdout.strip()
    assert line.style["color"] == chosen
    assert line.style["color"] not in {known.style.get("color") for kind in catalogue.KINDS
                                       for known in catalogue.of_kind(kind)}
    assert catalogue.line("my_peer", kind="peer").kind == "peer"


def test_a_run_written_before_line_kinds_loads_with_them(tmp_path):
    path = _run(tmp_path / "old", ("grpc_tcp", "mpi", "memcpy"))
    records = (path / "records.csv").read_text().splitlines()
    header = records[0].split(",")
    drop = header.index("line_kind")
    (path / "records.csv").write_text("\n".join(",".join(c for i, c in enumerate(line.split(",")) if i != drop)
                                                for line in records) + "\n")
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "schema_version": 2}))
    run = load_run(path)
    assert run.records.set_index("transport")["line_kind"].to_dict() == {
        "grpc_tcp": "transport", "mpi": "peer", "memcpy": "reference"}
    assert list(run.records.columns[:2]) == ["transport", "line_kind"]


def test_the_tables_take_zero_copy_first_and_the_legends_last():
    present = ["local", "grpc_tcp", "mpi", "zerocopy", "rdma_cp", "memcpy", "tf_grpc", "zerocopy:no_analysis"]
    assert catalogue.table_order(present) == ["zerocopy", "zerocopy:no_analysis", "rdma_cp", "grpc_tcp", "tf_grpc",
                                              "local", "mpi", "memcpy"]
    assert catalogue.order(present)[:5] == ["local", "grpc_tcp", "rdma_cp", "zerocopy:no_analysis", "zerocopy"]


@pytest.mark.parametrize("kind", ["transport", "peer"])
def test_an_unknown_kind_is_refused_in_one_line(kind):
    with pytest.raises(ValueError, match="unknown kind"):
        catalogue.Line("x", "nonsense", "x", "x")
    assert catalogue.names(kind)
    with pytest.raises(ValueError, match="unknown kind of line"):
        catalogue.names("nonsense")


def test_records_say_their_kind_and_keep_one_given():
    record = MicroRecord(transport="socket", size_bytes=1, iters=1, p50_us=1.0, p99_us=1.0, mean_us=1.0,
                         throughput_MBps=1.0, sender_cpu_s=None, receiver_cpu_s=None, copied_bytes_per_transfer=None)
    assert record.line_kind == "peer"
    given = MicroRecord(transport="mine", line_kind="peer", size_bytes=1, iters=1, p50_us=1.0, p99_us=1.0,
                        mean_us=1.0, throughput_MBps=1.0, sender_cpu_s=None, receiver_cpu_s=None,
                        copied_bytes_per_transfer=np.nan)
    assert given.line_kind == "peer"


def test_training_lines_are_one_abc_in_one_registry_and_no_experiment_is_named():
    """Training's lines as micro's: an ABC (a line without ``train`` is no line), the ones that are not a
    transport in a registry; the harness shapes records by what the command hands it, not by its name."""
    import ast
    import inspect

    from bench import LOCAL, TF_GRPC
    from bench.experiments import training
    from bench.experiments.training import REGISTRY, LocalTraining, TfGrpcTraining, TrainingLine, TransportTraining

    with pytest.raises(TypeError):
        TrainingLine()
    from bench.experiments.torch_training import TorchDdpTraining, TorchRpcTraining
    from bench.results.lines import TORCH_DDP, TORCH_RPC

    assert list(REGISTRY) == [LOCAL, TF_GRPC, TORCH_RPC, TORCH_DDP]
    assert [type(training.line_of(name)) for name in (LOCAL, TF_GRPC, TORCH_RPC, TORCH_DDP, "zerocopy", "grpc_tcp")] \
        == [LocalTraining, TfGrpcTraining, TorchRpcTraining, TorchDdpTraining, TransportTraining, TransportTraining]
    compared = [node for node in ast.walk(ast.parse(inspect.getsource(training.Trainings)))
                if isinstance(node, ast.Compare) and any(isinstance(side, ast.Constant) and side.value in
                                                         ("model", "scale") for side in [node.left, *node.comparators])]
    assert compared == []
