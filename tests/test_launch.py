"""The launcher layer: ranks start, talk to the coordinator, and end, whatever happens to them.

What every launcher does (results, a killed rank, silence, a stranger, nothing left behind) is in the launcher
conformance suite, ``tests/test_launcher_conformance.py``; here is what one launcher or the hub does.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from bench.launch import LaunchError, RankFailed, RankSpec, create
from bench.launch.context import connect
from bench.launch.hub import Hub
from tests import launch_jobs as jobs
from tests.launch_jobs import BOUND_S
from tests.processes import open_sockets


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def local():
    with create("local") as launcher:
        yield launcher


def test_ranks_pass_messages_through_the_coordinator_and_report_to_it(local):
    reports = []
    results = local.run([RankSpec(jobs.ping_pong, "ping"), RankSpec(jobs.ping_pong, "pong")], BOUND_S,
                        on_report=lambda rank, payload: reports.append((rank, payload)))
    # 20 rounds each way: rank 1 sees 0, 2, ..., 38 and rank 0 sees 1, 3, ..., 39
    assert [r.result for r in results] == [39, 38]
    assert len(reports) == 40
    assert {rank for rank, _ in reports} == {0, 1}


def test_a_word_told_is_in_the_other_ranks_inbox_before_tell_returns(local, tmp_path):
    # the coordinator is slow to relay (on_report pauses on rank 0's report): tell waits for the word to arrive
    def pause(rank, payload):
        time.sleep(2)

    results = local.run([RankSpec(functools.partial(jobs.word_before_mark, mark=str(tmp_path / "mark")), "teller"),
                         RankSpec(functools.partial(jobs.word_before_mark, mark=str(tmp_path / "mark")), "told")],
                        BOUND_S, on_report=pause)
    assert [r.result for r in results] == ["told", "word"]


def test_a_message_to_a_rank_that_has_finished_is_dropped_not_an_error(local):
    results = local.run([RankSpec(jobs.late_message, "sender"), RankSpec(jobs.late_message, "finished")], BOUND_S)
    assert [r.result for r in results] == ["sent", "done"]


def test_a_rank_that_raises_ends_the_run_naming_it_and_nobody_is_left(local):
    pids = []
    with pytest.raises(RankFailed, match=r"rank 1 \(bad\) failed: ValueError: rank 1 was told to fail") as failed:
        local.run([RankSpec(functools.partial(jobs.wait_forever, go_to=1), "waiter"),
                   RankSpec(functools.partial(jobs.fail, wait_for_go=True), "bad")], BOUND_S,
                  on_report=lambda rank, payload: pids.append(payload[1]))
    assert failed.value.rank == 1 and failed.value.kind == "failed"
    assert pids and not any(alive(pid) for pid in pids)


def test_a_crashed_ranks_log_tail_keeps_its_stacks_not_the_extension_modules(tmp_path):
    from bench.launch.local import log_tail

    log = tmp_path / "rank0.log"
    log.write_text("Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
                   '  File "jobs.py", line 9 in crash_here\n\n'
                   "Extension modules: " + ", ".join(f"module{i}._ext" for i in range(400)) + " (total: 400)\n")
    tail = log_tail(log)
    assert "in crash_here" in tail and "Extension modules" not in tail


@pytest.mark.parametrize("held", [False, True], ids=["stderr", "stderr-held-back"])
def test_a_rank_that_crashes_is_named_with_its_signal_and_its_stack(local, held):
    with pytest.raises(RankFailed, match=r"rank 0 \(crasher\) died \(killed by SIGSEGV\)") as failed:
        local.run([RankSpec(functools.partial(jobs.crash, while_stderr_is_held=held), "crasher")], BOUND_S)
    assert "Fatal Python error: Segmentation fault" in str(failed.value)
    assert "in crash_here" in str(failed.value)  # the faulting thread's stack, from the rank's log


def test_a_rank_that_fails_of_its_own_is_the_cause_not_the_peer_that_failed_on_it(local):
    # rank 0's failure (a consequence) reaches the coordinator first; rank 1 said it failed, then exited 0
    with pytest.raises(RankFailed) as failed:
        local.run([RankSpec(jobs.fail_after_telling, "waiter"), RankSpec(jobs.fail_after_telling, "bad")], BOUND_S)
    message = str(failed.value)
    assert message.startswith("rank 1 (bad) failed: ValueError: rank 1 broke of its own"), message
    assert "died" not in message and "exit code" not in message, message
    assert failed.value.rank == 1 and failed.value.kind == "failed"


def test_a_rank_that_stops_answering_is_named_as_the_silent_one(local):
    pids = []
    with pytest.raises(RankFailed) as failed:
        local.run([RankSpec(jobs.wait_for_anything, "waiter"), RankSpec(jobs.stop_self, "stopped")], 10,
                  on_report=lambda rank, payload: pids.append(payload[1]))
    message = str(failed.value)
    assert message.startswith("rank 1 (stopped) stopped answering: nothing from its process for"), message
    assert failed.value.rank == 1 and failed.value.kind == "silent"
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


def test_a_rank_that_cannot_start_is_named_with_its_log():
    with create("local") as launcher, pytest.raises(RankFailed, match=r"rank 0 \(broken\) (failed|died)") as failed:
        launcher.run([RankSpec(functools.partial(jobs.hello, missing=1), "broken")], BOUND_S)
    assert "unexpected keyword argument 'missing'" in str(failed.value)


def test_a_stranger_without_the_token_is_refused_and_logged(caplog):
    hub = Hub(("127.0.0.1", 0), "the-runs-token", ranks=1)
    try:
        with caplog.at_level(logging.WARNING, logger="bench.launch.hub"):
            with pytest.raises(LaunchError, match="do both use the same TENSOR_BENCH_TOKEN"):
                connect(hub.address, "a-wrong-token")
            deadline = time.monotonic() + BOUND_S
            while "refused" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert f"the run's coordinator at 127.0.0.1:{hub.address[1]}: refused a connection from 127.0.0.1:" \
            in caplog.text
        assert "the-runs-token" not in caplog.text and "a-wrong-token" not in caplog.text
        assert hub.arrivals.empty()
    finally:
        hub.close()


def test_ranks_exit_when_their_coordinator_is_killed(tmp_path):
    """A coordinator killed outright (no cleanup at all) leaves no rank behind (they see their hub close), and no
    directory: its reaper removes the hub's (TMPDIR is the test's own, so only this coordinator's is counted)."""
    script = (
        "import sys; from bench.launch import create, RankSpec; from tests import launch_jobs as jobs\n"
        "create('local').run([RankSpec(jobs.wait_forever, 'a'), RankSpec(jobs.wait_forever, 'b')], 600,\n"
        "    on_report=lambda rank, payload: print(payload[1], flush=True))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": str(tmp_path)}
    coordinator = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env,
                                   cwd=os.path.dirname(os.path.dirname(__file__)))
    pids = [int(coordinator.stdout.readline()) for _ in range(2)]
    assert all(alive(pid) for pid in pids)
    hub_dirs = list(tmp_path.glob("bench-run-*"))
    assert len(hub_dirs) == 1 and (hub_dirs[0] / "hub").exists()
    coordinator.send_signal(signal.SIGKILL)
    coordinator.wait()
    deadline = time.monotonic() + BOUND_S
    while (any(alive(pid) for pid in pids) or hub_dirs[0].exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)
    assert not hub_dirs[0].exists()


def test_services_run_until_the_others_finish_then_report_their_memory(local):
    results = local.run([RankSpec(jobs.hello, "client"), RankSpec(jobs.wait_forever, "server", service=True)],
                        BOUND_S)
    assert results[0].result["name"] == "client"
    assert results[1].result is None and results[1].peak_rss_mb > 10


@pytest.mark.parametrize(("name", "options", "fragment"), [
    ("local", {"link_rate": "1gbit"}, "--link-rate shapes the links between emulated hosts"),
    ("nowhere", {}, "unknown launcher 'nowhere' (known: local, netns, mpi, slurm)"),
])
def test_bad_launcher_options_are_named(name, options, fragment):
    with pytest.raises(LaunchError) as failed:
        create(name, **options)
    assert fragment in str(failed.value)


# -- emulated hosts (netns) -----------------------------------------------------------------------


def _netns_or_skip():
    from bench.launch import LauncherUnavailable

    try:
        return create("netns", link_rate="1gbit")
    except LauncherUnavailable as exc:
        pytest.skip(str(exc))


def _our_namespaces() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"tbench-{os.getpid()}-")]


def test_netns_ranks_run_on_their_own_hosts_and_the_hosts_are_removed():
    launcher = _netns_or_skip()
    with launcher:
        results = launcher.run([RankSpec(jobs.link_traffic, "server 0", host=0),
                                RankSpec(jobs.link_traffic, "server 1", host=1)], BOUND_S)
    hosts = [r.result["address"].rsplit(":", 1)[0] for r in results]
    assert hosts[0] != hosts[1] and all(h.startswith("198.18.") for h in hosts)
    # each rank sees its own link, and the bytes the other sent it crossed that link
    assert all(r.result["received"] >= jobs.LINK_PAYLOAD for r in results)
    assert launcher.fabric_transport("shm") == "tcp"
    assert launcher.describe()["link_rate"] == "1gbit"
    assert _our_namespaces() == []


def test_bind_takes_an_interface_and_ranks_listen_on_its_address():
    with create("local", bind="lo") as launcher:
        results = launcher.run([RankSpec(jobs.hello, "only")], BOUND_S)
    assert results[0].result["address"].startswith("127.0.0.1:")
    with pytest.raises(LaunchError, match="--bind nowhere0: no such address or network interface here"):
        create("local", bind="nowhere0")


def test_hosts_whose_teardown_fails_still_reap_their_reaper(monkeypatch):
    """A failed teardown used to leave the hosts' reaper (a child of the run's process) unreaped after close()."""
    from bench.launch import hosts

    _netns_or_skip().close()
    emulated = hosts.EmulatedHosts(1).create()
    reaper = emulated._reaper._process
    real_teardown = hosts._teardown

    def failing(names):
        raise hosts.CommandError(["ip", "netns", "delete"], "refused by the test")

    monkeypatch.setattr(hosts, "_teardown", failing)
    with pytest.raises(hosts.CommandError):
        emulated.close()
    assert reaper.returncode is not None  # waited for: neither running nor a zombie
    deadline = time.monotonic() + BOUND_S
    while _our_namespaces() and time.monotonic() < deadline:  # the reaper removed them on its way out
        time.sleep(0.1)
    real_teardown(_our_namespaces())
    assert _our_namespaces() == []


def test_the_coordinator_keeps_no_port_reservation_after_a_run(local):
    # free_port reserves each rank's port in the coordinator until its listener is up; the ranks
    # run elsewhere, so the coordinator itself must drop the reservations when the run ends
    local.run([RankSpec(jobs.hello, "warm-up"), RankSpec(jobs.hello, "up", host=1)], BOUND_S)
    before = open_sockets()
    for _ in range(3):
        local.run([RankSpec(jobs.hello, "first"), RankSpec(jobs.hello, "second", host=1)], BOUND_S)
    assert open_sockets() - before == set()


def test_a_failure_is_blamed_on_a_peer_whose_death_shows_a_moment_later():
    # a killed process closes its sockets before the kernel reports it dead: its peer's failure can
    # reach the coordinator first, and the dead rank is still the cause
    from bench.launch.hub import _RankState, _root_cause
    from bench.launch.messages import RankFailed

    states = [_RankState(RankSpec(jobs.hello, "chief")), _RankState(RankSpec(jobs.hello, "ps 0"))]
    seen_dead_at = time.monotonic() + 0.5
    exited = lambda: {1: "killed by SIGKILL"} if time.monotonic() > seen_dead_at else {}  # noqa: E731
    cause = _root_cause(RankFailed(0, "chief", "failed: UnavailableError: connection reset"), states, exited)
    assert str(cause).startswith("rank 1 (ps 0) died (killed by SIGKILL); then rank 0 (chief) failed")
    alone = _root_cause(RankFailed(0, "chief", "failed: ValueError"), states, lambda: {}, grace_s=0.2)
    assert str(alone) == "rank 0 (chief) failed: ValueError"


def test_a_peer_whose_connection_closed_and_who_died_is_the_cause():
    # the dead rank's end of its connection reads as ready (EOF): that is no unread message, it is a death
    from multiprocessing import Pipe

    from bench.launch.hub import _RankState, _root_cause
    from bench.launch.messages import RankFailed

    states = [_RankState(RankSpec(jobs.hello, "chief")), _RankState(RankSpec(jobs.hello, "ps 0"))]
    ours, theirs = Pipe()
    theirs.close()
    states[1].conn = ours
    cause = _root_cause(RankFailed(0, "chief", "failed: PeerError: connection reset"), states,
                        lambda: {1: "killed by SIGKILL"}, grace_s=0.5)
    assert str(cause).startswith("rank 1 (ps 0) died (killed by SIGKILL); then rank 0 (chief) failed"), str(cause)
