"""Listeners spend nothing on a caller before its proof (issue 59, items 1 and 6).

- A gRPC call without the run's token is refused as soon as its headers are in, not once its request body came:
  callers that never send one hold none of the control server's threads, and the rank serves its own.
- The fabric's tcp stream listener takes every connection's proof on one thread with a few bytes each; at most
  ``MAX_UNPROVEN`` wait at once (a newcomer past that ends the oldest), and every refusal names the caller.

Nothing here waits for a clock: held calls and idle connections are refused (or not) whatever the machine's speed.
"""

from __future__ import annotations

import logging
import socket
import threading
import tracemalloc
from collections.abc import Iterator
from contextlib import ExitStack

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transports import Key
from transports.auth import LOGGED_REFUSALS, TOKEN_METADATA_KEY, RefusalLog
from transports.control import CONTROL_THREADS, METHOD, ControlClient, ControlServer
from transports.fabric import stream
from transports.fabric.base import RemoteRegion
from transports.fabric.stream import _NONCE_BYTES, _PROOF_BYTES, _REQUEST, Grants, StreamChannel, StreamListener
from transports.grpc_tcp.transport import RECV_TENSOR
from transports.ports import free_port

from .conftest import SHORT_TIMEOUT_S
from .test_token import STRANGERS, started

CALL_TIMEOUT_S = 60.0  # generous: only a listener that waits for the body would come near it
TOKEN = "the-run-s-token"


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "transports.auth" and r.levelno == logging.WARNING]


class HeldBodies:
    """Request bodies that do not come until :meth:`release` (or the end of the ``with``)."""

    def __init__(self) -> None:
        self._released = threading.Event()

    def body(self) -> Iterator[bytes]:
        self._released.wait()
        yield b"{}"

    def release(self) -> None:
        self._released.set()

    def __enter__(self) -> HeldBodies:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- item 1: tokenless calls whose body never comes ------------------------------------------------------------


@pytest.mark.parametrize("metadata", STRANGERS)
def test_tokenless_calls_holding_their_body_are_refused_and_the_control_server_serves(metadata, caplog):
    """More held calls than the control server has threads: each is refused (UNAUTHENTICATED) while its body is
    still held back, each refusal names the caller and the method, and the run's own call is then served."""
    caplog.set_level(logging.WARNING, logger="transports.auth")
    held = CONTROL_THREADS + 4
    address = f"127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        server = ControlServer(address, {"ping": lambda request: {"pong": True}}, "rank 0", TOKEN)
        stack.callback(server.stop)
        bodies = stack.enter_context(HeldBodies())
        stranger = stack.enter_context(grpc.insecure_channel(address))
        calls = [stranger.stream_unary(METHOD).future(bodies.body(), timeout=CALL_TIMEOUT_S, metadata=metadata)
                 for _ in range(held)]
        codes = [call.exception(timeout=CALL_TIMEOUT_S + 10).code() for call in calls]
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * held  # the bodies are still held back
        assert TOKEN_METADATA_KEY in calls[0].exception().details()
        member = ControlClient(address, "rank 0", TOKEN)
        stack.callback(member.close)
        assert member.call("ping", timeout=CALL_TIMEOUT_S) == {"pong": True}
    lines = refusals(caplog)
    assert len(lines) == held
    assert all(METHOD in line and "from ipv4:127.0.0.1:" in line and "rank 0" in line for line in lines)
    assert not any(TOKEN in line for line in lines)


@pytest.mark.parametrize("metadata", STRANGERS)
def test_grpc_tcp_refuses_a_tokenless_call_holding_its_body_and_serves_the_run(metadata, caplog):
    """The asyncio server of grpc_tcp: a RecvTensor call without the token is refused before its request comes."""
    caplog.set_level(logging.WARNING, logger="transports.auth")
    with started("grpc_tcp") as (sender, receiver), HeldBodies() as bodies, \
            grpc.insecure_channel(sender.cluster.addresses[0]) as stranger:
        calls = [stranger.stream_stream(RECV_TENSOR)(bodies.body(), timeout=CALL_TIMEOUT_S, metadata=metadata)
                 for _ in range(4)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as exc_info:
                list(call)
            assert exc_info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the body is still held back
        key = Key("w", 0, 0, 1)
        sent = sender.send_async(key, np.arange(8.0))
        np.testing.assert_array_equal(receiver.recv(key), np.arange(8.0))
        sent.result(timeout=SHORT_TIMEOUT_S)
    lines = refusals(caplog)
    assert len(lines) == 4 and all(RECV_TENSOR in line and "127.0.0.1:" in line for line in lines)


def test_refusals_past_the_first_hundred_are_tallied_at_every_power_of_ten(caplog):
    caplog.set_level(logging.WARNING, logger="transports.auth")
    refused = RefusalLog("rank 3")
    for number in range(1, 10_001):
        refused.refused("a call", f"10.0.0.1:{number}", "it lacks the run's token")
    lines = refusals(caplog)
    assert len(lines) == LOGGED_REFUSALS + 2  # 1..100, then 1000 and 10000
    assert "later refusals are tallied" in lines[LOGGED_REFUSALS - 1]
    assert lines[-2].startswith("rank 3: 1000 refusals so far") and "10.0.0.1:1000:" in lines[-2]
    assert lines[-1].startswith("rank 3: 10000 refusals so far") and "10.0.0.1:10000:" in lines[-1]


# -- item 6: the fabric's tcp stream listener ------------------------------------------------------------------


@pytest.fixture
def listener():
    """A stream listener that asks for the run's token, granting one 64-byte region."""
    grants = Grants()
    memory = np.zeros(64, np.uint8)
    key = grants.grant(memory)
    listening = StreamListener("127.0.0.1", grants, lambda: None)
    listening.require_token(TOKEN)
    listening.memory, listening.region = memory, RemoteRegion(memory.ctypes.data, 64, key)
    yield listening
    listening.close()


def host_port(listener: StreamListener) -> tuple[str, int]:
    host, _, port = listener.address.split(b":", 1)[1].decode().rpartition(":")
    return host, int(port)


def serving_threads() -> int:
    return sum(thread.name == "fabric-tcp-serve" for thread in threading.enumerate())


def challenged(listener: StreamListener) -> socket.socket:
    """A raw connection that has received the listener's challenge (so the listener has accepted it)."""
    raw = socket.create_connection(host_port(listener), timeout=CALL_TIMEOUT_S)
    received(raw, _NONCE_BYTES, "the listener hung up before its challenge")
    return raw


def received(raw: socket.socket, nbytes: int, hung_up: str) -> bytes:
    """The next ``nbytes`` bytes on ``raw``; fails saying ``hung_up`` if the other side closes first."""
    data = b""
    while len(data) < nbytes:
        piece = raw.recv(nbytes - len(data))
        assert piece, hung_up
        data += piece
    return data


def ended(raw: socket.socket) -> bool:
    """Whether the listener ended the connection (waits for it, as long as the socket's timeout)."""
    try:
        return raw.recv(1) == b""
    except ConnectionResetError:
        return True


def member_writes(listener: StreamListener, value: int) -> None:
    member = StreamChannel(listener.address, stopped=lambda: False, wait_counter=lambda counter, above, timeout: True,
                           token=TOKEN)
    try:
        member.write_flagged(np.full(64, value, np.uint8), listener.region, timeout=CALL_TIMEOUT_S)
    finally:
        member.close()
    assert listener.memory.tolist() == [value] * 64


def test_idle_strangers_cost_no_thread_nor_buffer_the_oldest_are_dropped_and_named(listener, monkeypatch, caplog):
    """More idle connections than MAX_UNPROVEN: none gets a thread or a receive buffer; those past the cap end the
    oldest, each refusal naming the caller's address; a member of the run still gets through."""
    caplog.set_level(logging.WARNING, logger="transports.auth")
    monkeypatch.setattr(stream, "HANDSHAKE_S", 3600.0)  # none is dropped for its time here: only for the cap
    extra = 16
    threads = serving_threads()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        strangers = [challenged(listener) for _ in range(stream.MAX_UNPROVEN + extra)]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    try:
        assert serving_threads() <= threads  # no thread for a connection that proved nothing
        # (a 256 KiB receive buffer each was 20 MiB here; what is left is this side's sockets and the bookkeeping)
        assert grown < 2 << 20, grown
        assert all(ended(raw) for raw in strangers[:extra])  # the oldest, ended by the newcomers
        assert listener.unproven == extra
        lines = refusals(caplog)
        assert len(lines) == extra
        for raw, line in zip(strangers[:extra], lines, strict=True):
            assert f"from 127.0.0.1:{raw.getsockname()[1]}:" in line and "oldest" in line
        member_writes(listener, 7)  # (its connection ends the next oldest)
        assert serving_threads() <= threads + 1
    finally:
        for raw in strangers:
            raw.close()


def test_a_stranger_that_never_proves_the_token_is_dropped_in_time_and_named(listener, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="transports.auth")
    monkeypatch.setattr(stream, "HANDSHAKE_S", 0.5)
    with challenged(listener) as raw:
        assert ended(raw)
        port = raw.getsockname()[1]
    assert listener.unproven == 1
    assert refusals(caplog) == [f"fabric tcp stream at {host_port(listener)[0]}:{host_port(listener)[1]}: refused a "
                                f"connection from 127.0.0.1:{port}: it did not prove the run's token within 0.5 s"]
    monkeypatch.setattr(stream, "HANDSHAKE_S", 3600.0)
    member_writes(listener, 3)


def test_a_proof_in_pieces_with_requests_right_behind_it_is_served(listener):
    """The listener reads the proof and not a byte past it: requests sent in the proof's last piece are served."""
    raw = socket.create_connection(host_port(listener), timeout=CALL_TIMEOUT_S)
    with raw:
        nonce = b""
        while len(nonce) < _NONCE_BYTES:
            nonce += raw.recv(_NONCE_BYTES - len(nonce))
        proof = stream._proof(TOKEN, nonce)
        for byte in proof[:-1]:
            raw.sendall(bytes([byte]))
        region = listener.region
        raw.sendall(proof[-1:] + _REQUEST.pack(1, region.rkey, region.addr, 64) + b"\x05" * 64
                    + _REQUEST.pack(3, bytes(16), 0, 0))
        answer = b""
        while len(answer) < stream._ANSWER.size:
            answer += raw.recv(stream._ANSWER.size - len(answer))
        assert stream._ANSWER.unpack(answer) == (0, 0)
    assert listener.memory.tolist() == [5] * 64


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.binary(min_size=1, max_size=48), min_size=1, max_size=4))
def test_any_bytes_but_the_proof_are_refused_and_reach_nothing(listener, pieces):
    """Whatever a stranger sends in place of the proof (any bytes, in any pieces) ends its connection; nothing it
    sends after the proof's length is read as a request."""
    sent = b"".join(pieces)
    listener.memory[:] = 0
    refused = listener.unproven
    with challenged(listener) as raw:
        try:
            for piece in pieces:
                raw.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # ended already
        if len(sent) < _PROOF_BYTES:
            raw.shutdown(socket.SHUT_WR)  # the rest of the proof never comes
        # (a stranger cannot know the nonce: a proof of full length is wrong)
        assert ended(raw)
    assert listener.unproven == refused + 1
    assert not listener.memory.any()


def test_a_member_token_is_not_logged_and_the_listener_names_itself(listener, caplog):
    caplog.set_level(logging.WARNING, logger="transports.auth")
    member_writes(listener, 9)
    assert refusals(caplog) == []
    with challenged(listener) as raw:
        raw.sendall(bytes(_PROOF_BYTES))
        assert ended(raw)
    (line,) = refusals(caplog)
    assert line.startswith(f"fabric tcp stream at 127.0.0.1:{host_port(listener)[1]}: refused a connection from")
    assert line.endswith("its proof of the run's token is wrong") and TOKEN not in line
