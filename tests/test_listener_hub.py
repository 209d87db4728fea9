"""The coordinator's hub spends nothing on a caller before its proof of the run's token (issue 59, item 6).

Its listener is the fabric stream's door (``transports/door.py``): one thread challenges every caller, a caller
costs no thread until it has proved the token, at most ``max(MAX_UNPROVEN, 4 a rank)`` wait at once (a newcomer
past that ends the oldest), and every caller ended unproven is named in the log, by address (TCP) or by process
(a Unix socket). Nothing here waits for a deadline: the handshake's time is set far beyond the tests'.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading

import pytest

from bench.launch import hub as hub_module
from bench.launch.context import connect
from bench.launch.hub import Hub, coordinate
from bench.launch.messages import Finished, Hello, LaunchError, RankSpec
from bench.launch.wire import receive_message, send_message
from tests import launch_jobs as jobs
from tests.test_listener import ended, received
from transports import Cluster

TOKEN = "the-runs-token-0123"
#: seconds any one step here may take, on a busy machine (never reached when all is well)
BOUND_S = 60.0


@pytest.fixture(autouse=True)
def no_deadline(monkeypatch):
    """No caller is dropped for its time here, only for the cap or a wrong proof."""
    monkeypatch.setattr(hub_module, "HANDSHAKE_S", 3600.0)


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "bench.launch.hub" and "refused" in r.getMessage()]


def challenged(address: tuple[str, int]) -> socket.socket:
    """A raw caller that has received the hub's challenge (so the hub has accepted it) and says nothing."""
    raw = socket.create_connection(address, timeout=BOUND_S)
    (length,) = struct.unpack("!i", received(raw, 4, "the hub hung up before its challenge"))
    body = received(raw, length, "the hub hung up in its challenge")
    assert body.startswith(b"#CHALLENGE#")
    return raw


def member(address: tuple[str, int] | str, outcome: list) -> None:
    """Rank 0 of a run, by hand: joins, takes its assignment, finishes."""
    try:
        conn = connect(address, TOKEN)
        send_message(conn, Hello(0))
        outcome.append(receive_message(conn).rank)
        send_message(conn, Finished("done", 1.0))
        conn.close()
    except Exception as exc:  # (the test reports it)
        outcome.append(exc)


def run_one_rank(hub: Hub) -> list:
    outcome: list = []
    rank = threading.Thread(target=member, args=(hub.address, outcome), daemon=True)
    rank.start()
    results = coordinate(hub, [RankSpec(jobs.hello, "member")], Cluster(("127.0.0.1:1",), token=TOKEN), BOUND_S,
                         on_report=lambda rank, payload: None, exited=lambda: {})
    rank.join(BOUND_S)
    assert outcome == [0], outcome
    return results


def test_a_thousand_idle_callers_cost_no_thread_the_oldest_are_named_and_the_run_finishes(caplog):
    caplog.set_level(logging.WARNING, logger="bench.launch.hub")
    hub = Hub(("127.0.0.1", 0), TOKEN, ranks=1)
    strangers: list[socket.socket] = []
    try:
        threads = threading.active_count()
        strangers = [challenged(hub.address) for _ in range(1000)]
        assert threading.active_count() <= threads  # the door's one thread challenged them all: none has one
        dropped = 1000 - hub_module.MAX_UNPROVEN
        assert all(ended(raw) for raw in strangers[:dropped])  # the oldest, ended by the newcomers
        assert hub.unproven == dropped
        lines = refusals(caplog)
        assert len(lines) == 100  # one a line, then tallied (transports.auth.RefusalLog)
        for raw, line in zip(strangers, lines, strict=False):
            assert f"refused a connection from 127.0.0.1:{raw.getsockname()[1]}:" in line and "oldest" in line
        results = run_one_rank(hub)  # (its caller ends the next oldest)
        assert [(r.rank, r.result) for r in results] == [(0, "done")]
        assert hub.unproven == dropped + 1
    finally:
        for raw in strangers:
            raw.close()
        hub.close()


def test_a_caller_with_a_wrong_proof_is_named_by_its_address(caplog):
    caplog.set_level(logging.WARNING, logger="bench.launch.hub")
    hub = Hub(("127.0.0.1", 0), TOKEN, ranks=1)
    try:
        with challenged(hub.address) as raw:
            raw.sendall(struct.pack("!i", 16) + bytes(16))  # a framed digest, not the token's
            assert ended(raw)
            port = raw.getsockname()[1]
        assert hub.unproven == 1
        assert refusals(caplog) == [f"the run's coordinator at 127.0.0.1:{hub.address[1]}: refused a connection "
                                    f"from 127.0.0.1:{port}: its proof of the run's token is wrong"]
        assert hub.arrivals.empty()
        assert [r.rank for r in run_one_rank(hub)] == [0]
    finally:
        hub.close()


def test_a_local_caller_with_a_wrong_token_is_named_by_its_process(tmp_path, caplog):
    """Over the hub's Unix socket a caller has no address: its process id names it."""
    caplog.set_level(logging.WARNING, logger="bench.launch.hub")
    hub = Hub(str(tmp_path / "hub"), TOKEN, ranks=1)
    try:
        with pytest.raises(LaunchError, match="do both use the same TENSOR_BENCH_TOKEN"):
            connect(hub.address, "a-wrong-token")
        # the hub logs before it hangs up, and the caller saw the hang-up
        lines = refusals(caplog)
        assert len(lines) == 1 and f"refused a connection from local process {os.getpid()} " in lines[0], lines
        assert "its proof of the run's token is wrong" in lines[0]
        assert TOKEN not in lines[0] and "a-wrong-token" not in lines[0]
    finally:
        hub.close()
