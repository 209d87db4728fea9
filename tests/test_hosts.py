"""Emulated hosts (bench.launch.hosts): namespaces, shaped links, teardown, the reaper and the sweep.

Everything that builds namespaces skips with the reason when ``check_support()`` refuses (not root,
no ``ip``/``tc``, a kernel or container without namespaces). Every test removes what it creates,
also when it fails; waits are generous polls, never assertions on wall time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.ground.sizes import parse_rate
from bench.launch import hosts as hosts_module
from bench.launch.hosts import (
    CommandError,
    EmulatedHosts,
    NetnsUnavailable,
    check_support,
    sweep_stale,
)

REPO = Path(__file__).resolve().parent.parent
WAIT_S = 60.0  # bound of every poll: CI machines are busy

SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
received = 0
while chunk := conn.recv(1 << 20):
    received += len(chunk)
print(received, flush=True)
"""

CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as conn:
    conn.sendall(bytes(int(sys.argv[3])))
"""

# Creates hosts, starts a process inside host 0 and forks a child outside (which must not keep the
# reaper's pipe open), reports them, then waits to be killed.
CREATOR = """
import os, subprocess, time
from bench.launch.hosts import EmulatedHosts
hosts = EmulatedHosts(2, 10**9).create()
inside = subprocess.Popen(hosts.command(0, ["sleep", "600"]))
if os.fork() == 0:
    time.sleep(600)
    os._exit(0)
print(hosts.prefix, inside.pid, flush=True)
time.sleep(600)
"""


@functools.cache
def _support_problem() -> str | None:
    try:
        check_support()
    except NetnsUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture
def netns() -> None:
    """Skip the test, with the reason, where emulated hosts cannot be built."""
    problem = _support_problem()
    if problem is not None:
        pytest.skip(f"emulated hosts unavailable here: {problem}")


@pytest.fixture
def shaped(netns) -> Iterator[EmulatedHosts]:
    """Two hosts with 1gbit links, closed after the test whatever happens."""
    with EmulatedHosts(2, parse_rate("1gbit")) as emulated:
        yield emulated


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def pids_in(namespace: str) -> set[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return {int(pid) for pid in done.stdout.split()}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def processes_mentioning(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (a reaper names its namespaces)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {WAIT_S:.0f} s waiting for {what}")
        time.sleep(0.1)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("10gbit", 10 * 10**9),
        ("500mbit", 500 * 10**6),
        ("100kbit", 100 * 10**3),
        ("1.5gbit", 1_500_000_000),
        ("800bit", 800),
        ("10Gbit", 10 * 10**9),
    ],
)
def test_parse_rate_accepts(text: str, bps: int) -> None:
    assert parse_rate(text) == bps


@pytest.mark.parametrize(
    "text", ["", "10", "gbit", "10gbps", "10 gigabit", "-1gbit", "0bit", "1.5bit", "1e9bit", "10mbit/s", "fast"]
)
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_rate(text)
    assert repr(text) in str(err.value)
    if text not in {"0bit", "1.5bit"}:
        assert "gbit" in str(err.value) and "kbit" in str(err.value)


def test_names_addresses_and_description_need_no_network() -> None:
    first, second = EmulatedHosts(3, parse_rate("100mbit")), EmulatedHosts(3)
    assert first.prefix != second.prefix
    assert first.namespace(0).startswith(f"tbench-{os.getpid()}-")
    assert first.command(2, ["true"]) == ["ip", "netns", "exec", first.namespace(2), "true"]
    described = first.describe()
    assert described["addresses"] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    assert described["link_rate_bps"] == 100 * 10**6
    assert described["qdisc"]["kind"] == "tbf"
    assert described["interface"] == EmulatedHosts.INTERFACE
    assert second.describe()["qdisc"] is None
    with pytest.raises(ValueError, match="out of range"):
        first.address(3)
    first.close()  # never created: nothing to do


@pytest.mark.system("netns")
def test_namespaces_exist_while_open_and_are_gone_after_close(netns) -> None:
    hosts = EmulatedHosts(2, parse_rate("1gbit")).create()
    try:
        names = {hosts.namespace(0), hosts.namespace(1), hosts.switch}
        assert names <= netns_names()
        assert processes_mentioning(hosts.prefix), "the reaper is not running"
    finally:
        hosts.close()
    assert not names & netns_names()
    assert not processes_mentioning(hosts.prefix), "the reaper outlived its hosts"
    hosts.close()  # idempotent


@pytest.mark.system("netns")
def test_links_are_shaped_at_both_ends(shaped: EmulatedHosts) -> None:
    for host in range(2):
        out = subprocess.run(
            ["tc", "-n", shaped.namespace(host), "qdisc", "show", "dev", EmulatedHosts.INTERFACE],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in out and "rate 1Gbit" in out, out
    switch = subprocess.run(
        ["tc", "-n", shaped.switch, "qdisc", "show"], capture_output=True, text=True, check=True
    ).stdout
    shaped_ports = [line for line in switch.splitlines() if "tbf" in line and "rate 1Gbit" in line]
    assert len(shaped_ports) == 2, switch


@pytest.mark.system("netns")
def test_tcp_from_host0_to_host1_is_counted_on_both_links(shaped: EmulatedHosts) -> None:
    nbytes = 4 << 20
    tx0, _ = shaped.link_bytes(0)
    _, rx1 = shaped.link_bytes(1)
    server = subprocess.Popen(
        shaped.command(1, [sys.executable, "-c", SERVER, shaped.address(1)]), stdout=subprocess.PIPE, text=True
    )
    try:
        port = server.stdout.readline().strip()
        assert port.isdigit(), "the server inside host 1 did not start"
        subprocess.run(
            shaped.command(0, [sys.executable, "-c", CLIENT, shaped.address(1), port, str(nbytes)]),
            check=True,
            timeout=WAIT_S,
        )
        received, _ = server.communicate(timeout=WAIT_S)
    finally:
        stop(server)
    assert int(received) == nbytes
    assert shaped.link_bytes(0)[0] - tx0 >= nbytes
    assert shaped.link_bytes(1)[1] - rx1 >= nbytes


@pytest.mark.system("netns")
def test_close_kills_what_runs_inside_and_nothing_else(netns) -> None:
    outside = subprocess.Popen(["sleep", "600"])
    hosts = EmulatedHosts(2)
    inside = None
    try:
        hosts.create()
        inside = subprocess.Popen(hosts.command(1, ["sleep", "600"]))
        wait_until(lambda: inside.pid in pids_in(hosts.namespace(1)), "sleep to enter host 1")
        hosts.close()
        assert inside.wait(timeout=WAIT_S) == -signal.SIGKILL
        assert outside.poll() is None, "close() killed a process outside its namespaces"
    finally:
        hosts.close()
        stop(outside)
        if inside is not None:
            stop(inside)


@pytest.mark.system("netns")
def test_a_failing_command_names_itself_and_the_half_built_network_is_removed(netns, monkeypatch) -> None:
    real_run = hosts_module._run

    def broken_tc(argv: list[str], **kwargs) -> str:
        return real_run(["nosuchqdisc" if arg == "tbf" else arg for arg in argv], **kwargs)

    monkeypatch.setattr(hosts_module, "_run", broken_tc)
    hosts = EmulatedHosts(2, parse_rate("1gbit"))
    try:
        with pytest.raises(CommandError) as err:
            hosts.create()
        assert "tc -n" in str(err.value) and "nosuchqdisc" in str(err.value)
        assert err.value.detail, "the error does not carry the command's stderr"
        assert not set(hosts.namespaces()) & netns_names()
        assert not processes_mentioning(hosts.prefix), "the reaper outlived its hosts"
    finally:
        monkeypatch.undo()
        hosts.close()


@pytest.mark.parametrize("kill", ["creator", "process_group"])
@pytest.mark.system("netns")
def test_the_reaper_cleans_up_after_the_creator_is_killed(netns, kill: str) -> None:
    creator = subprocess.Popen(
        [sys.executable, "-c", CREATOR], stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    try:
        report = creator.stdout.readline().split()
        assert len(report) == 2, "the creating process failed (its stderr is above)"
        prefix, inside = report[0], int(report[1])
        names = {f"{prefix}-h0", f"{prefix}-h1", f"{prefix}-sw"}
        assert names <= netns_names()
        wait_until(lambda: inside in pids_in(f"{prefix}-h0"), "sleep to enter host 0")
        if kill == "creator":  # its forked child lives on and must not keep the reaper waiting
            os.kill(creator.pid, signal.SIGKILL)
        else:  # the reaper has a session of its own and survives this
            os.killpg(creator.pid, signal.SIGKILL)
        creator.wait(timeout=WAIT_S)
        wait_until(lambda: not names & netns_names(), "the reaper to delete the namespaces")
        wait_until(lambda: not alive(inside), "the process inside host 0 to be killed")
        wait_until(lambda: not processes_mentioning(prefix), "the reaper to exit")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(creator.pid, signal.SIGKILL)  # the forked child
        creator.wait()
        creator.stdout.close()
        sweep_stale()


@pytest.mark.system("netns")
def test_sweep_stale_removes_dead_owners_namespaces_only(netns) -> None:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)
    stale = f"tbench-{dead_pid}-{secrets.token_hex(4)}-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    inside = None
    try:
        inside = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
        wait_until(lambda: inside.pid in pids_in(stale), "sleep to enter the stale namespace")
        with EmulatedHosts(1) as live:
            removed = sweep_stale()
            # A parallel session may sweep it first: it has to be gone, not necessarily by us.
            assert stale not in netns_names()
            assert inside.wait(timeout=WAIT_S) == -signal.SIGKILL
            assert set(live.namespaces()) <= netns_names()
            assert not set(live.namespaces()) & set(removed)
            assert all(name.startswith("tbench-") and not alive(int(name.split("-")[1])) for name in removed)
    finally:
        if inside is not None:
            stop(inside)
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)
