"""The README installs ``[mpi]``: bench micro's MPI lines run wherever that install ran. Before, without iproute2
(a bare Debian root) or in a container that makes no network namespace, they were left out ("`ip` not found"), so
"level with MPI's Send/Recv" could not be reproduced from the README.

Now: in a private emulated host where one can be made; else in a network namespace of their own (no ``ip`` needed);
else on the host's network with every address the pair binds put on loopback, said in one line and in meta.json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.experiments.peers import isolation, mpi
from bench.launch import hosts as emulated_hosts
from bench.launch import netns
from bench.results import load_run

pytestmark = pytest.mark.system("mpirun")

ROOT = Path(__file__).resolve().parent.parent


def _path_without(tmp_path: Path, *programs: str) -> str:
    """A PATH with every program of this one but ``programs`` (as on a machine without them)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in [Path(sys.executable).parent, *map(Path, os.environ.get("PATH", "").split(os.pathsep))]:
        if not directory.is_dir():
            continue
        for program in directory.iterdir():
            if program.name not in programs and not (bin_dir / program.name).exists():
                (bin_dir / program.name).symlink_to(program)
    return str(bin_dir)


def _micro(out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.cli", "micro", "--sizes", "1KB,64KB", "--iters", "20",
                           "--transports", "local", "--peers", "mpi,mpi_rma", "--no-references", "--no-plot",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})})


def test_without_iproute2_the_mpi_lines_run_in_a_network_namespace_of_their_own(tmp_path):
    """A bare Debian root has no ``ip``: the pair gets a namespace of its own (unshare), isolated as before."""
    if (why := isolation.own_namespace_problem()) is not None:
        pytest.skip(f"needs a kernel that makes network namespaces here: {why}")
    result = _micro(tmp_path / "run", {"PATH": _path_without(tmp_path, "ip", "tc")})
    assert result.returncode == 0, result.stderr
    run = load_run(tmp_path / "run")
    assert sorted(set(run.records["transport"])) == ["local", "mpi", "mpi_rma"]
    assert "left_out" not in run.meta or not run.meta["left_out"]
    assert "isolation" not in run.meta and "weaker isolation" not in result.stderr  # isolated: nothing to say


def test_where_no_namespace_can_be_made_the_mpi_lines_bind_to_loopback_and_say_so(tmp_path, monkeypatch, capsys):
    """A container: neither an emulated host nor a namespace of the pair's own. The lines run, their listeners on
    loopback (the relay checks the kernel's table before the first transfer), and the weaker isolation is said in
    one line and kept in meta.json."""
    if isolation.compiler_problem() is not None:
        pytest.skip(f"needs a C compiler: {isolation.compiler_problem()}")

    def refused() -> None:
        raise emulated_hosts.NetnsUnavailable("`ip` not found on PATH: install iproute2")

    monkeypatch.setattr(emulated_hosts, "check_support", refused)
    monkeypatch.setattr(netns, "check_support", refused)
    monkeypatch.setattr(mpi, "own_namespace_problem", lambda: "unshare: Operation not permitted")
    from bench.cli import main

    out = tmp_path / "run"
    code = main(["micro", "--sizes", "1KB,64KB", "--iters", "20", "--transports", "local", "--peers", "mpi,mpi_rma",
                 "--no-references", "--no-plot", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    run = load_run(out)
    assert sorted(set(run.records["transport"])) == ["local", "mpi", "mpi_rma"], printed.err
    said = [line for line in printed.err.splitlines() if "isolation" in line]
    assert said == [f"bench micro: weaker isolation for mpi, mpi_rma: no network namespace can be made here (unshare: "
                    f"Operation not permitted): mpirun and its MPI processes run on the host's network with every "
                    f"address they bind put on loopback, reachable from this host's other users but not from other "
                    f"hosts ('isolation' in {out / 'meta.json'})"]
    kept = json.loads((out / "meta.json").read_text())["isolation"]  # whole (a reader cuts long strings)
    assert set(kept) == {"mpi", "mpi_rma"} and all("put on loopback" in how for how in kept.values())


def test_a_listener_off_loopback_is_found_and_one_on_it_is_not():
    """What the relay checks before the first transfer, on this process's own listeners."""
    with socket.socket() as anywhere, socket.socket() as loopback, socket.socket(socket.AF_INET6) as loopback6:
        anywhere.bind(("0.0.0.0", 0))
        anywhere.listen()
        loopback.bind(("127.0.0.1", 0))
        loopback.listen()
        loopback6.bind(("::1", 0))
        loopback6.listen()
        found = isolation.listening_off_loopback({os.getpid()})
        assert found == [f"0.0.0.0:{anywhere.getsockname()[1]}"]


def test_where_neither_can_be_done_the_lines_are_left_out_saying_both_reasons(monkeypatch):
    def refused() -> None:
        raise emulated_hosts.NetnsUnavailable("`ip` not found on PATH: install iproute2")

    monkeypatch.setattr(emulated_hosts, "check_support", refused)
    monkeypatch.setattr(netns, "check_support", refused)
    monkeypatch.setattr(mpi, "own_namespace_problem", lambda: "unshare: Operation not permitted")
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    from bench.launch import LaunchError
    from bench.launch.local import LocalLauncher

    with pytest.raises(LaunchError) as refusal:
        mpi.MpiLine(name="mpi").hosts(LocalLauncher())
    assert str(refusal.value) == (
        "mpirun and its MPI processes listen on every interface, and here no network namespace can be made (unshare: "
        f"Operation not permitted) nor their listeners bound to loopback (no C compiler ({isolation.compiler()}) to "
        "build the library that does it); or pass --peers without mpi and mpi_rma")


def test_the_library_puts_mpiruns_listeners_on_loopback(tmp_path):
    """mpirun as Open MPI starts it listens off loopback (PRRTE binds INADDR_ANY), which the relay's check finds;
    with the library preloaded, nothing of it does."""
    if isolation.compiler_problem() is not None:
        pytest.skip(f"needs a C compiler: {isolation.compiler_problem()}")
    from tests.mpirun import MPIRUN

    script = tmp_path / "hold.py"
    script.write_text("import sys, time\nfrom mpi4py import MPI\nprint('up', flush=True)\ntime.sleep(60)\n")
    base = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "TMPDIR": str(tmp_path)}
    found = {}
    for how, env in (("as is", base), ("preloaded", {**base, **isolation.loopback_environment(str(tmp_path), base)})):
        with subprocess.Popen([MPIRUN, "-np", "2", "--oversubscribe", sys.executable, str(script)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as job:
            try:
                up = 0
                while up < 2:  # both MPI processes initialised: every listener is open
                    line = job.stdout.readline()
                    assert line, "mpirun ended before both processes started"
                    up += line.strip() == "up"
                found[how] = isolation.listening_off_loopback(isolation.process_tree(job.pid))
            finally:
                job.terminate()
                job.wait(timeout=60)
    assert found["as is"], "mpirun listened on loopback only without the library: the check would prove nothing"
    assert found["preloaded"] == []
