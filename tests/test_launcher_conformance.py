"""The launcher conformance suite: what every launcher must do, written once, run over every registered launcher.

Launchers come from the launcher registry (``bench.launch.REGISTRY``). One that starts its ranks itself (local,
netns) runs each case in this process. One whose processes are started by something else and serve the runs
of process 0 (it has ``serve``: mpi, slurm) runs each case as a job, under ``mpirun`` or as a step of the
one-node Slurm of the tests (``tests/slurm.py``), this module being the job (``python -m
tests.test_launcher_conformance NAME CASE TAG``): process 0 runs the case and prints its outcome. A launcher
that cannot run here skips saying why (netns: root, ip and tc; mpi: mpi4py and mpirun; slurm: the Slurm bed).

Every launcher: results come back from every rank; a killed rank is named with its signal; silence ends the run
at its timeout naming the ranks; a stranger (a connection to the hub with a wrong token) is refused and the run
goes on; and nothing is left behind (no rank process, no ``/tmp/bench-run-*`` directory, no namespace).
"""

from __future__ import annotations

import functools
import importlib.util
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.launch import REGISTRY, Launcher, LauncherUnavailable, RankFailed, RankSpec, create
from bench.launch.messages import TOKEN_VARIABLE
from bench.launch.rendezvous import RENDEZVOUS_VARIABLE
from tests import launch_jobs as jobs
from tests.launch_jobs import BOUND_S
from tests.mpirun import MPIRUN, NO_MPIRUN, mpirun
from tests.processes import gone, rank_processes
from tests.slurm import SlurmBed, left_after_steps, srun

ROOT = Path(__file__).resolve().parent.parent
#: the run's token (TENSOR_BENCH_TOKEN), known here so that the logs can be searched for it, and a stranger's
RUN_TOKEN = "the-runs-token-0123456789abcdef"
WRONG_TOKEN = "a-wrong-token-0123456789abcdef"
#: the silence that ends a run in the silent case
SILENCE_S = 3
#: the link rate of a launcher that shapes links (--link-rate)
LINK_RATE = "1gbit"


# -- the cases: the same ranks whichever launcher runs them ------------------------------------------------


@dataclass(frozen=True)
class Case:
    ranks: list[RankSpec]
    timeout_s: float
    #: the hub logs a refusal during the run (the outcome waits for it)
    refusal: bool = False


CASES = {
    "results": lambda: Case([RankSpec(jobs.hello, "first"), RankSpec(jobs.hello, "second", host=1)], BOUND_S),
    "killed": lambda: Case([RankSpec(functools.partial(jobs.wait_forever, go_to=1), "waiter", host=0),
                            RankSpec(functools.partial(jobs.die, wait_for_go=True), "victim", host=1)], BOUND_S * 10),
    "silent": lambda: Case([RankSpec(jobs.silent, "quiet"), RankSpec(jobs.silent, "quiet too", host=1)], SILENCE_S),
    "stranger": lambda: Case([RankSpec(jobs.hello, "first"),
                              RankSpec(functools.partial(jobs.knock, token=WRONG_TOKEN), "knocker", host=1)], BOUND_S,
                             refusal=True),
}


@dataclass
class Outcome:
    """How a case ended, as plain data (it crosses from an MPI job as JSON)."""

    #: each rank's RankResult as a dict, when the run ended well
    results: list[dict[str, Any]] = field(default_factory=list)
    #: the run's error (RankFailed), or what ended the job when the coordinator could not say (MPI)
    error: str = ""
    #: RankFailed's kind; None when no RankFailed was raised
    kind: str | None = None
    seconds: float = 0.0
    #: processes of the run: reported by the ranks, or every process of an MPI job
    pids: list[int] = field(default_factory=list)
    #: the launcher's describe() after the run
    described: dict[str, Any] = field(default_factory=dict)
    #: what the coordinator's hub logged (WARNING and above)
    logged: list[str] = field(default_factory=list)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_case(launcher: Launcher, name: str) -> Outcome:
    """Run case ``name`` with ``launcher`` (in the coordinator's process) and say how it ended."""
    case = CASES[name]()
    reports: list[Any] = []
    hub_log = logging.getLogger("bench.launch.hub")
    collect = _Collect()
    hub_log.addHandler(collect)
    outcome = Outcome()
    started = time.monotonic()
    try:
        try:
            results = launcher.run(case.ranks, case.timeout_s, on_report=lambda rank, payload: reports.append(payload))
            outcome.results = [asdict(result) for result in results]
        except RankFailed as exc:
            outcome.error, outcome.kind = str(exc), exc.kind
        outcome.seconds = time.monotonic() - started
        deadline = time.monotonic() + BOUND_S
        while case.refusal and not any("refused" in m for m in collect.messages) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        hub_log.removeHandler(collect)
    outcome.logged = collect.messages
    outcome.pids = [payload[1] for payload in reports if isinstance(payload, tuple) and payload[0] == "pid"]
    outcome.pids += [r["result"]["pid"] for r in outcome.results if "pid" in (r["result"] or {})]
    outcome.described = launcher.describe()
    return outcome


# -- how each launcher runs a case --------------------------------------------------------------------------


def namespaces_of(pids: list[int]) -> list[str]:
    """The network namespaces that the processes ``pids`` made (``tbench-PID-...``) and that still exist."""
    if shutil.which("ip") is None:
        return []
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    prefixes = tuple(f"tbench-{pid}-" for pid in pids)
    return [line.split()[0] for line in listing.splitlines() if prefixes and line.startswith(prefixes)]


class InProcess:
    """A launcher that starts its ranks itself: this process coordinates."""

    #: the kind of RankFailed a death raises
    death_kind = "died"

    def __init__(self, name: str, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        options = {"link_rate": LINK_RATE} if "link_rate" in REGISTRY.load(name).options else {}
        monkeypatch.setenv(TOKEN_VARIABLE, RUN_TOKEN)
        monkeypatch.setattr(tempfile, "tempdir", str(workdir))  # the run's /tmp/bench-run-* is made here
        self.workdir = workdir
        try:
            self.launcher = create(name, **options)
        except LauncherUnavailable as exc:
            pytest.skip(str(exc))

    def run(self, case: str) -> Outcome:
        return run_case(self.launcher, case)

    @staticmethod
    def death(rank: int, name: str, signum: signal.Signals) -> str:
        """What names rank ``rank`` (``name``) killed by ``signum``: the launcher's error."""
        return rf"rank {rank} \({re.escape(name)}\) died \(killed by {signum.name}\)"

    def assert_nothing_left(self, outcome: Outcome) -> None:
        assert [pid for pid in outcome.pids if not gone(pid)] == []
        assert [pid for pid in rank_processes(os.getpid()) if not gone(pid)] == []
        assert list(self.workdir.glob("bench-run-*")) == []
        assert namespaces_of([os.getpid()]) == []

    def close(self) -> None:
        self.launcher.close()


class AsJob:
    """A launcher whose every process runs the same command, started by something else (mpirun, srun); process 0
    coordinates. Each case runs as a job of this module (``main``), whose process 0 prints the outcome."""

    def __init__(self, name: str, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.name = name
        self.workdir = workdir
        self.tag = ""
        self.processes: list[int] = []

    def start(self, processes: int, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        """Run ``python ARGV`` as a job of ``processes`` processes to its end."""
        raise NotImplementedError

    def run(self, case: str) -> Outcome:
        self.tag = f"conformance-{uuid.uuid4().hex}"  # in every process's command line: what is left is found
        started = time.monotonic()
        done = self.start(len(CASES[case]().ranks), ["-m", "tests.test_launcher_conformance", self.name, case,
                                                     self.tag], {"TMPDIR": str(self.workdir),
                                                                 TOKEN_VARIABLE: RUN_TOKEN})
        seconds = time.monotonic() - started
        lines = done.stdout.splitlines()
        printed = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("OUTCOME ")]
        outcome = Outcome(**printed[0]) if printed else Outcome(error=done.stdout + done.stderr, seconds=seconds)
        self.processes = [int(line.split()[1]) for line in lines if line.startswith("PROCESS ")]
        outcome.pids += self.processes
        return outcome

    def _tagged(self) -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and self.tag.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
        return [pid for pid in found if not gone(pid)]

    def assert_nothing_left(self, outcome: Outcome) -> None:
        assert self.processes, "the job's processes did not say who they were"
        deadline = time.monotonic() + BOUND_S  # the job has returned: its processes are ending, if not yet ended
        while (self._tagged() or not all(gone(pid) for pid in outcome.pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self._tagged() == [] and [pid for pid in outcome.pids if not gone(pid)] == []
        assert list(self.workdir.glob("bench-run-*")) == []
        assert namespaces_of(self.processes) == []

    def close(self) -> None:
        pass


class UnderMpi(AsJob):
    """Under ``mpirun``."""

    #: MPI ends the whole job when one of its processes dies, the coordinator with it: MPI names the dead
    death_kind = None

    def __init__(self, name: str, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        if importlib.util.find_spec("mpi4py") is None:
            pytest.skip(f"--launcher {name} needs mpi4py: pip install -e '.[mpi]'")
        if MPIRUN is None:
            pytest.skip(NO_MPIRUN)
        super().__init__(name, workdir, monkeypatch)

    def start(self, processes: int, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        return mpirun(processes, *argv, cwd=ROOT, env=env)

    @staticmethod
    def death(rank: int, name: str, signum: signal.Signals) -> str:
        """What names rank ``rank`` killed by ``signum``: mpirun's words (the rank is process ``rank``)."""
        return rf"process rank {rank} with PID \d+ on node \S+ exited on\s+signal {int(signum)} " \
               rf"\({re.escape(signal.strsignal(signum))}\)"


class UnderSrun(AsJob):
    """As the tasks of a step of the one-node Slurm (``tests/slurm.py``); task 0 coordinates."""

    #: task 0 survives a task's death and names the rank (a task on another node: how it ended is not known there)
    death_kind = "died"

    def __init__(self, name: str, workdir: Path, monkeypatch: pytest.MonkeyPatch, bed: SlurmBed) -> None:
        super().__init__(name, workdir, monkeypatch)
        self.bed = bed
        self.rendezvous = workdir / "rendezvous"

    def start(self, processes: int, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        return srun(self.bed, processes, sys.executable, *argv, timeout=600,
                    env={**env, "PYTHONPATH": os.pathsep.join(sys.path), RENDEZVOUS_VARIABLE: str(self.rendezvous)})

    @staticmethod
    def death(rank: int, name: str, signum: signal.Signals) -> str:
        """What names rank ``rank``: task 0's error (the rank is task ``rank``)."""
        return rf"rank {rank} \({re.escape(name)}\) died"

    def assert_nothing_left(self, outcome: Outcome) -> None:
        super().assert_nothing_left(outcome)
        assert left_after_steps(self.bed, BOUND_S) == []
        assert not self.rendezvous.exists() or list(self.rendezvous.iterdir()) == []


def harness_for(name: str) -> type[InProcess] | type[AsJob]:
    """Whether launcher ``name`` runs a case here, or as a job whose processes serve (``serve``): under srun for
    slurm, under mpirun otherwise."""
    if not hasattr(REGISTRY.load(name), "serve"):
        return InProcess
    return UnderSrun if name == "slurm" else UnderMpi


#: what each launcher's cases need of the system (the mark ``system``: tests/conftest.py)
NEEDS = {"netns": ("netns",), "mpi": ("mpirun",), "slurm": ("slurm",)}


@pytest.fixture(params=[pytest.param(name, marks=[pytest.mark.system(*NEEDS[name])] if name in NEEDS else [])
                        for name in REGISTRY.names()])
def launcher(request, tmp_path_factory, monkeypatch):
    harness_class = harness_for(request.param)
    extra = [request.getfixturevalue("slurm_bed")] if harness_class is UnderSrun else []
    harness = harness_class(request.param, tmp_path_factory.mktemp("run"), monkeypatch, *extra)
    yield harness
    harness.close()


# -- what every launcher does ----------------------------------------------------------------------------------


def test_results_come_back_from_every_rank_with_their_peak_memory(launcher):
    outcome = launcher.run("results")
    assert outcome.error == "", outcome.error
    results = outcome.results
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["result"]["name"] for r in results] == ["first", "second"]
    assert all(r["result"]["size"] == 2 for r in results)
    assert all(r["peak_rss_mb"] > 10 for r in results)
    addresses = [r["result"]["address"] for r in results]
    assert len(set(addresses)) == 2
    hosts = [address.rsplit(":", 1)[0] for address in addresses]
    if "bind" in outcome.described:  # ranks listen on the bind address: loopback by default
        assert outcome.described["bind"] == "127.0.0.1" and hosts == ["127.0.0.1"] * 2
    else:  # every server an emulated host of its own, with its address in the launcher's subnet
        subnet = ipaddress.ip_network(outcome.described["subnet"])
        assert hosts[0] != hosts[1] and all(ipaddress.ip_address(host) in subnet for host in hosts)
    launcher.assert_nothing_left(outcome)


def test_a_killed_rank_is_named_with_its_signal_and_the_others_are_ended(launcher):
    outcome = launcher.run("killed")
    assert re.search(launcher.death(1, "victim", signal.SIGKILL), outcome.error), outcome.error
    assert outcome.kind == launcher.death_kind
    assert outcome.seconds < BOUND_S  # the death, not the run's timeout, ended it
    assert outcome.pids  # the waiter said who it was (under MPI: every process of the job)
    launcher.assert_nothing_left(outcome)


def test_silence_ends_the_run_at_its_timeout_naming_the_ranks(launcher):
    outcome = launcher.run("silent")
    assert outcome.kind == "silent", outcome.error
    # a rank whose heartbeats were late on a busy machine is named as the one that stopped answering: either way
    # the run ended at its timeout and names the ranks still running
    assert re.search(rf"(no rank said anything|no rank made progress) for {SILENCE_S} s "
                     r"\(still running: rank 0 \(quiet\), rank 1 \(quiet too\)\)", outcome.error), outcome.error
    assert SILENCE_S <= outcome.seconds < BOUND_S
    launcher.assert_nothing_left(outcome)


def test_a_stranger_with_a_wrong_token_is_refused_and_logged_and_the_run_goes_on(launcher):
    outcome = launcher.run("stranger")
    assert outcome.error == "", outcome.error
    assert [r["rank"] for r in outcome.results] == [0, 1]
    assert outcome.results[0]["result"]["name"] == "first"
    answer = outcome.results[1]["result"]["answer"]
    assert "do both use the same TENSOR_BENCH_TOKEN" in answer, answer
    refusals = [m for m in outcome.logged
                if m.startswith("the run's coordinator at ") and ": refused a connection from " in m]
    assert len(refusals) == 1, outcome.logged
    for said in [answer, *outcome.logged]:  # neither token is given away
        assert RUN_TOKEN not in said and WRONG_TOKEN not in said
    launcher.assert_nothing_left(outcome)


# -- a case as a job under mpirun -----------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    """``python -m tests.test_launcher_conformance NAME CASE TAG`` in every process of a job (mpirun, srun)."""
    name, case = argv[0], argv[1]
    print(f"PROCESS {os.getpid()}", flush=True)
    with create(name) as launcher:
        if not launcher.is_coordinator:
            return launcher.serve()
        outcome = run_case(launcher, case)
        print(f"OUTCOME {json.dumps(asdict(outcome))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
