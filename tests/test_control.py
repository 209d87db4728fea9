"""The control path's liveness check: a dead peer is gone at once, a slow one is not declared dead."""

from __future__ import annotations

import threading

from transports.control import ControlClient, ControlServer
from transports.ports import free_port


def test_a_slow_peer_is_alive_and_a_vanished_one_is_not():
    release = threading.Event()
    address = f"127.0.0.1:{free_port()}"
    server = ControlServer(address, {"ping": lambda request: release.wait(60) and {}}, "slow peer", "token")
    client = ControlClient(address, "slow peer", "token")
    try:
        assert client.alive(timeout=0.5)  # it does not answer in time, but it is there
    finally:
        release.set()
        server.stop()
    assert not client.alive(timeout=0.5)  # nothing listens any more: refused at once
    client.close()


def test_a_failed_call_s_error_keeps_nothing_of_grpc():
    """The PeerError of a failed call holds no gRPC error as its context: that error holds its call, and the call
    the channel's socket, for as long as anyone keeps the PeerError (a test counting descriptors saw one more)."""
    import pytest

    from transports import PeerError

    address = f"127.0.0.1:{free_port()}"
    server = ControlServer(address, {"boom": lambda request: (_ for _ in ()).throw(ValueError("no"))}, "peer", "t")
    client = ControlClient(address, "peer", "t")
    try:
        with pytest.raises(PeerError, match="control call 'boom' failed: FAILED_PRECONDITION") as failed:
            client.call("boom", timeout=10)
        assert failed.value.__context__ is None and failed.value.__cause__ is None
    finally:
        client.close()
        server.stop()
