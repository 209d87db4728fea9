"""The peer lines of ``bench micro`` (bench/experiments/peers): the libraries a user could pick instead, timed as a
transport is. Each one's data check catches a corrupted buffer, a missing library is one line, a peer's records
have a transport's columns, and every transport's record carries ``of_peer``."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.experiments.micro import MicroError, TimedLink, plan_points, run_line
from bench.experiments.micro.sweep import Sweep, SweepSettings
from bench.experiments.peers import REGISTRY, PeerLine, peer_lines
from bench.experiments.peers.mooncake import MooncakeLine
from bench.experiments.peers.mpi import MpiLine
from bench.launch import LaunchError
from bench.launch.local import LocalLauncher
from bench.results import lines as catalogue
from bench.results import load_run
from tests import peer_faults

PEER_NAMES = catalogue.micro_peers()

ROOT = Path(__file__).resolve().parent.parent
#: a private emulated host can be made (a network namespace, root and iproute2)
NAMESPACES = os.geteuid() == 0 and shutil.which("ip") is not None
#: the MPI pair runs wherever mpirun does: in a private host, a network namespace of its own, or bound to loopback
needs_mpi = pytest.mark.system("mpirun")
HAVE_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="no NIXL here: pip install --no-deps nixl nixl-cu12")
MOONCAKE_MISSING = MooncakeLine(name="mooncake").availability().reason or None
needs_mooncake = pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=str(MOONCAKE_MISSING))


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)


def test_every_peer_is_registered_and_named_in_the_results_layer():
    assert tuple(REGISTRY) == PEER_NAMES
    assert [line.name for line in peer_lines()] == list(PEER_NAMES)
    assert [line.name for line in peer_lines(["socket", "mpi"])] == ["mpi", "socket"]  # the registry's order
    with pytest.raises(ValueError, match=r"unknown peer 'carrier_pigeon' \(known: mpi, mpi_rma, nixl, mooncake, "
                                         r"socket, torch_gloo, torch_rpc\)"):
        peer_lines(["carrier_pigeon"])


def _installed() -> list[str]:
    """The peers that can run here under the local launcher (their library, and the hosts they ask for)."""
    names = []
    for line in peer_lines():
        if not line.availability().ok:
            continue
        try:
            hosts = line.hosts(LocalLauncher())
        except LaunchError:
            continue
        if hosts.own:
            hosts.launcher.close()
        names.append(line.name)
    return names


def test_peer_records_have_a_transports_columns_and_transports_carry_of_peer(tmp_path):
    peers = _installed()
    assert "socket" in peers  # needs nothing but Python
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "1KB,64KB", "--iters", "20", "--warmup", "2", "--transports", "local",
                   "--no-references", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    run = load_run(out)
    assert run.meta["settings"]["peers"] == list(PEER_NAMES)
    records = run.records
    assert list(dict.fromkeys(records["transport"])) == [*peers, "local"]  # peers first, then the transports
    local = records[records["transport"] == "local"].set_index("size_bytes")
    measured = {c for c in local.columns if not local[c].isna().any()} - {"of_peer"}
    for peer in peers:
        rows = records[records["transport"] == peer].set_index("size_bytes")
        assert sorted(rows.index) == [1024, 65536]
        assert not rows[sorted(measured)].isna().any().any(), f"{peer} leaves a transport's column empty"
        assert (rows["iters"] == 20).all() and (rows["warmup"] == 2).all()
        assert rows["of_peer"].isna().all()  # a peer is not held against the peers
        assert rows["fabric"].iloc[0] != "none"
    for size in (1024, 65536):
        best = records[(records["transport"].isin(peers)) & (records["size_bytes"] == size)]["p50_us"].min()
        assert math.isclose(local.loc[size, "of_peer"], local.loc[size, "p50_us"] / best)
    # the summary's table has a column per peer; the lines that cannot run here are named in one line, and why
    # each cannot is in meta.json
    header = next(line for line in result.stdout.splitlines() if line.lstrip().startswith("size"))
    assert all(peer in header.split() for peer in peers), header
    missing = sorted(set(PEER_NAMES) - set(peers))
    said = [x for x in result.stderr.splitlines() if "left out" in x]
    assert len(said) == (1 if missing else 0), result.stderr
    for name in missing:
        assert name in said[0]
        why = run.meta["left_out"][name]
        # not installed; no mpirun; no namespaces; or a library of the system missing (mooncake without Debian's
        # libibverbs1), each with what to install
        assert ("is not installed here" in why or "no mpirun here" in why or "network namespace" in why
                or "cannot be loaded here" in why), why


def test_no_peers_and_a_chosen_peer(tmp_path):
    quick = ["--sizes", "1KB", "--iters", "3", "--warmup", "1", "--transports", "local", "--no-references",
             "--no-plot"]
    none = bench("micro", *quick, "--no-peers", "--out", str(tmp_path / "none"))
    assert none.returncode == 0, none.stderr[-2000:]
    run = load_run(tmp_path / "none")
    assert set(run.records["transport"]) == {"local"} and run.records["of_peer"].isna().all()
    assert run.meta["settings"]["peers"] == []
    one = bench("micro", *quick, "--peers", "socket", "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-2000:]
    assert list(dict.fromkeys(load_run(tmp_path / "one").records["transport"])) == ["socket", "local"]


@pytest.mark.parametrize(("args", "message"), [
    (["--peers", "carrier_pigeon"], "--peers: unknown peer 'carrier_pigeon' (known: mpi, mpi_rma, nixl, mooncake, "
     "socket, torch_gloo, torch_rpc)"),
    (["--peers", ","], "--peers: no peer named; pass --no-peers to measure none"),
    (["--peers", "socket", "--no-peers"], "argument --no-peers: not allowed with argument --peers"),
])
def test_bad_peer_options_are_one_line(args, message, tmp_path):
    result = bench("micro", "--sizes", "1KB", "--transports", "local", *args, "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "run").exists()


class _Missing(PeerLine):
    module = "no_such_library_for_tests"
    install = "pip install no-such-library"

    def link(self, cluster, rank):  # pragma: no cover (never made: the line is left out)
        raise AssertionError("a line that cannot be imported must not run")


def test_missing_libraries_are_one_line_and_the_run_goes_on(capsys, tmp_path):
    lines = [_Missing(name="missing"), _Missing(name="also_missing")]
    why = ("no_such_library_for_tests is not installed here (pip install no-such-library; or leave it out with "
           "--peers/--no-peers)")
    assert lines[0].availability() == (False, why, "")
    sweep = Sweep(SweepSettings(rounds=1, timeout_s=5.0), LocalLauncher(), None, lines)
    assert sweep.lines == [] and sweep.failures == []
    assert sweep.left_out == {"missing": why, "also_missing": why}
    assert capsys.readouterr().err == ""
    sweep.say_left_out(tmp_path)
    [said] = capsys.readouterr().err.splitlines()
    assert said.startswith("bench micro: not available here, left out: missing, also_missing (why, and how to add")
    assert str(tmp_path / "meta.json") in said


def test_the_mpi_lines_run_only_where_their_pair_crosses_the_runs_links():
    class EmulatedHosts(LocalLauncher):
        private_hosts = True

    with pytest.raises(LaunchError, match=r"would not cross the run's links .*--launcher local"):
        MpiLine(name="mpi").hosts(EmulatedHosts())
    if NAMESPACES:  # where it runs: a private emulated host, out of the network's reach (mpirun listens everywhere)
        hosts = MpiLine(name="mpi").hosts(LocalLauncher())
        try:
            assert hosts.own and hosts.isolated
        finally:
            hosts.launcher.close()


def _run(line: PeerLine, sizes: list[int], iters: int = 6) -> list:
    """``line`` measured at ``sizes`` on the hosts it asks the local launcher for: every point's two sides."""
    records = []
    points = plan_points(sizes, iters, 1)
    hosts = line.hosts(LocalLauncher())
    try:
        run_line(line, points, hosts.launcher, line.timeout_s,
                 on_sides=lambda point, sender, receiver: records.append((point, sender, receiver)))
    finally:
        if hosts.own:
            hosts.launcher.close()
    return records


FAULTY = [
    pytest.param(peer_faults.CorruptingSocketLine, id="socket"),
    pytest.param(peer_faults.CorruptingMpiLine, id="mpi", marks=needs_mpi),
    pytest.param(peer_faults.CorruptingMpiRmaLine, id="mpi_rma", marks=needs_mpi),
    pytest.param(peer_faults.CorruptingNixlLine, id="nixl", marks=needs_nixl),
    pytest.param(peer_faults.CorruptingMooncakeLine, id="mooncake", marks=needs_mooncake),
]


def test_a_transport_and_a_peer_link_are_what_the_timing_loops_drive():
    """One protocol for both: the loops drive a ``TimedLink``, which a transport and every peer's link are."""
    import transports
    from bench.experiments.peers import PeerLink

    with transports.create("local") as transport:
        assert isinstance(transport, TimedLink)

    class Silent(PeerLink):  # the least a peer library's link writes: its send, recv and describe
        def send(self, key, tensor): ...

        def recv(self, key): ...

        def describe(self):
            return {}

    assert isinstance(Silent(timeout_s=1.0), TimedLink)

    class Half:  # what a link that cannot receive looks like: not one
        placement = None

        def send(self, key, tensor): ...

    assert not isinstance(Half(), TimedLink)


@pytest.mark.parametrize("line_class", FAULTY)
def test_each_peers_data_check_fails_on_a_corrupted_buffer(line_class):
    line = line_class(name=line_class.__name__, timeout_s=60)
    with pytest.raises(MicroError, match=r"transfer 0 of 64KB arrived wrong: element 8192 of 16384 differs"):
        _run(line, [64 << 10])


@pytest.mark.parametrize("name", ["socket", pytest.param("mpi", marks=needs_mpi),
                                  pytest.param("mpi_rma", marks=needs_mpi), pytest.param("nixl", marks=needs_nixl),
                                  pytest.param("mooncake", marks=needs_mooncake)])
def test_each_peer_moves_every_size_intact_and_counts_what_it_moved(name):
    [line] = peer_lines([name], timeout_s=60)
    sizes = [1 << 10, 1_000_001, 4 << 20]  # a size that is no whole number of floats goes as bytes
    measured = _run(line, sizes)
    assert [point.size_bytes for point, _, _ in measured] == sizes
    for point, sender, receiver in measured:
        moved = point.transfers - point.warmup  # the timed transfers, and the checked ones between them
        assert sender.transfers == receiver.transfers == point.transfers
        assert len(sender.times) == len(receiver.times) == point.iters
        assert sender.stats.tensors_sent == receiver.stats.tensors_received == moved
        assert sender.stats.payload_bytes_sent == moved * point.size_bytes
        assert sender.stats.copied_bytes == receiver.stats.copied_bytes == 0
        assert sender.fabric["fabric"] in {"socket", "mpi", "nixl", "mooncake"}


_REAPER = """
import ctypes, json, os, sys, time
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of the run come to this process
from bench.experiments import peers
from transports.common import Registry
peers.REGISTRY = Registry("peer", {"mpi": "tests.peer_faults:DyingMpiLine"})  # the mpi line, dying
from bench.cli import main
code = main(sys.argv[1:])
from tests.processes import children_of
deadline = time.monotonic() + 60
while True:  # every process the run started is gone once it is reaped; a live one is left behind
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    left = children_of(os.getpid())
    if not left or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print(json.dumps({"code": code, "left": list(left.values())}))
"""


@needs_mpi
def test_an_mpi_process_that_dies_mid_run_ends_the_line_with_its_name_and_leaves_nothing(tmp_path):
    """The receiver of the MPI pair kills itself at transfer 3 (``tests.peer_faults.DIE_AT``): the line fails
    naming itself (a warning: a peer's failure does not fail the run), the transports still run, and no process
    of the run is left (the run is started under a process that adopts orphans)."""
    script = tmp_path / "reaper.py"
    script.write_text(_REAPER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    done = subprocess.run([sys.executable, str(script), "micro", "--sizes", "64KB", "--iters", "10", "--warmup", "1",
                           "--transports", "local", "--no-references", "--no-plot", "--peers", "mpi",
                           "--timeout", "60", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["left"] == [], f"left behind: {outcome['left']}"
    assert outcome["code"] == 0  # a peer line is not a transport: the run completes without it
    [warning] = [line for line in done.stderr.splitlines() if "no mpi line" in line]
    assert "mpi: rank 0 (mpirun) failed" in warning and "the MPI receiver" in warning
    assert set(load_run(tmp_path / "run").records["transport"]) == {"local"}


def _run_with_peers(path: Path) -> Path:
    """A micro run: two peers and two transports at two sizes, each transport's of_peer set as bench micro sets it."""
    from bench.results import RunWriter
    from tests.test_results import micro_record

    writer = RunWriter(path, "micro", {"fabric": "ucx", "fabric_transport": "shm"})
    p50 = {"mpi": (10.0, 300.0), "socket": (30.0, 200.0), "zerocopy": (20.0, 100.0), "grpc_tcp": (400.0, 900.0)}
    for i, size in enumerate((1024, 1 << 20)):
        best = min(p50["mpi"][i], p50["socket"][i])
        for line, times in p50.items():
            transport = line not in PEER_NAMES
            writer.add(micro_record(transport=line, size_bytes=size, p50_us=times[i], p99_us=times[i] * 2,
                                    mean_us=times[i], throughput_MBps=size / 2**20 / (times[i] / 1e6),
                                    of_peer=times[i] / best if transport else None))
    writer.finish()
    return path


def test_the_report_holds_every_transport_against_the_best_peer_and_compare_treats_peers_as_references(tmp_path):
    from bench.readers.compare import compare
    from bench.readers.report import write_report
    from tests.test_report import cell, parse_page

    run = _run_with_peers(tmp_path / "run")
    page = tmp_path / "page.html"
    write_report([run], page)
    tables = parse_page(page.read_text()).tables
    peers = tables["figure8-peers"]
    assert cell(peers, "1KB", "MPI Send/Recv p50 (µs)") == "10"
    assert cell(peers, "1KB", "RDMA.zerocp / best") == "2.00x"
    assert cell(peers, "1MB", "RDMA.zerocp / best") == "0.50x"
    assert cell(peers, "1MB", "gRPC.TCP / best") == "4.50x"
    ratios = tables["figure8-ratios"]
    assert "over MPI Send/Recv" not in ratios[0]  # zero copy's ratios are over transports; peers have their table
    comparison = compare(run, run)
    assert {row.point[0] for row in comparison.rows if row.reference} == {"mpi", "socket"}


@needs_mpi
@pytest.mark.parametrize("source", ["fresh", "reused"])
def test_calibrate_measures_each_peer_line_beside_its_plain_loop(tmp_path, source):
    """``--calibrate``: each peer line's plain loop (mpi_plain, mpi_rma_plain, socket_plain, and nixl_plain and
    mooncake_plain where their libraries are installed) runs beside it, a reference record of a transport's columns
    per size, never the best peer; the harness line runs in every run below 64KB. Under both ``--source``s, every
    line whose sender loop is ours (every transport, local, memcpy, the harness, the peers and their plain loops)
    used it: a fresh tensor written once per transfer, outside the timed interval
    (``tests.test_source_lines.assert_sources``)."""
    from tests.test_source_lines import assert_sources

    out = tmp_path / "run"
    peers = ["mpi", "mpi_rma", "socket", *(["nixl"] if HAVE_NIXL else []),
             *(["mooncake"] if MOONCAKE_MISSING is None else [])]
    result = bench("micro", "--sizes", "1KB", "--iters", "20", "--warmup", "2", "--source", source,
                   "--peers", ",".join(peers), "--calibrate", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    run = load_run(out)
    assert run.meta["settings"]["source"] == source
    assert_sources(run.records, source)
    records = run.records.set_index("transport")
    plain = [f"{peer}_plain" for peer in peers]
    assert {*peers, *plain, "harness", "memcpy", "local", "zerocopy"} <= set(records.index)
    for name in plain:
        assert records.loc[name, "line_kind"] == "reference"
        assert records.loc[name, "iters"] == 20 and records.loc[name, "p50_us"] > 0
    assert records.loc["harness", "line_kind"] == "reference"
    assert records.loc["mpi_plain", "fabric"].startswith("mpi:")
    assert records.loc["mpi_rma_plain", "fabric"].startswith("mpi:")
    assert records.loc["socket_plain", "fabric"] == "socket"
    if HAVE_NIXL:
        assert records.loc["nixl_plain", "fabric"] == "nixl"
    if MOONCAKE_MISSING is None:
        assert records.loc["mooncake_plain", "fabric"] == "mooncake"
    assert run.meta["settings"]["calibrate"] is True
    # of_peer divides by the best peer line's p50, never a plain loop's
    best = records.loc[peers, "p50_us"].min()
    assert records.loc["local", "of_peer"] == pytest.approx(records.loc["local", "p50_us"] / best)
