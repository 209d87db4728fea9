"""The run's token: every listener refuses a caller without it, logs the refusal and gives nothing away.

Calls are made raw, with ``grpc.insecure_channel``, as a stranger on the network would.
"""

from __future__ import annotations

import json
import logging
import pickle
from contextlib import contextmanager

import grpc
import numpy as np
import pytest

import transports
from transports import Cluster, Key, PeerError
from transports.auth import TOKEN_METADATA_KEY, call_metadata
from transports.base import Ledger
from transports.control import METHOD as CONTROL_METHOD
from transports.grpc_tcp.tensor_pb2 import RecvTensorRequest
from transports.grpc_tcp.transport import RECV_TENSOR
from transports.grpc_tcp.wire import TensorAssembler

from .conftest import SHORT_TIMEOUT_S, start_pair

CALL_TIMEOUT_S = 30.0  # generous: only a hung listener would come near it
WRONG_TOKEN = "0123456789abcdef" * 2

# the token a stranger presents: none at all, or one that is not the run's
STRANGERS = [pytest.param(None, id="no-token"), pytest.param(call_metadata(WRONG_TOKEN), id="wrong-token")]

FABRIC = pytest.mark.skipif(not transports.availability("zerocopy").ok, reason="the fabric (UCX) is not available here")


@contextmanager
def started(name: str, **options):
    pair = start_pair(name, **options)
    try:
        yield pair
    finally:
        for transport in pair:
            transport.close()


def assert_refusal_logged(caplog, listener: transports.Transport, method: str) -> None:
    """One WARNING from transports.auth naming the caller's address and the method, and no token."""
    refusals = [r for r in caplog.records if r.name == "transports.auth" and r.levelno == logging.WARNING]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
    message = refusals[0].getMessage()
    assert method in message
    assert "127.0.0.1:" in message  # the caller's address, from context.peer()
    assert f"rank {listener.rank}" in message
    for record in caplog.records:
        assert listener.cluster.token not in record.getMessage()
        assert WRONG_TOKEN not in record.getMessage()


def assert_unauthenticated(exc_info) -> None:
    error = exc_info.value
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    # names the problem and the fix, never the token
    assert TOKEN_METADATA_KEY in error.details() and "must use the same token" in error.details()
    assert WRONG_TOKEN not in error.details()


# -- the Cluster carries the token ---------------------------------------------------


def test_every_cluster_gets_a_fresh_token_unless_one_is_given():
    first, second = Cluster.on_loopback(2), Cluster.on_loopback(2)
    assert first.token and second.token and first.token != second.token
    assert Cluster(("127.0.0.1:1",)).token != Cluster(("127.0.0.1:1",)).token
    assert Cluster.on_loopback(1, token="the-run").token == "the-run"


def test_the_token_stays_out_of_repr_and_survives_pickling():
    cluster = Cluster.on_loopback(2)
    assert cluster.token not in repr(cluster) and cluster.token not in str(cluster)
    copy = pickle.loads(pickle.dumps(cluster))
    assert copy == cluster and copy.token == cluster.token


@pytest.mark.parametrize("token", ["", "has space", "non-ascii-\u00e9", 42])
def test_a_token_that_cannot_travel_as_metadata_is_refused_without_showing_it(token):
    with pytest.raises(ValueError, match="token") as exc_info:
        Cluster(("127.0.0.1:1",), token)
    if isinstance(token, str) and token:
        assert token not in str(exc_info.value)


# -- grpc_tcp: RecvTensor ------------------------------------------------------------


def raw_recv_tensor(address: str, key: Key, metadata) -> list[bytes]:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(RECV_TENSOR)
        request = RecvTensorRequest(name=key.name, step=key.step, src=key.src, dst=key.dst).SerializeToString()
        return list(call(request, timeout=CALL_TIMEOUT_S, metadata=metadata))


@pytest.mark.parametrize("metadata", STRANGERS)
def test_recv_tensor_without_the_token_is_refused_and_leaves_the_tensor(metadata, caplog):
    caplog.set_level(logging.WARNING, logger="transports.auth")
    with started("grpc_tcp") as (sender, receiver):
        key = Key("weights", 0, 0, 1)
        array = np.arange(256, dtype=np.float32)
        sent = sender.send_async(key, array)
        with pytest.raises(grpc.RpcError) as exc_info:
            raw_recv_tensor(sender.cluster.addresses[0], key, metadata)
        assert_unauthenticated(exc_info)
        assert_refusal_logged(caplog, sender, RECV_TENSOR)
        assert not sent.done()  # nobody took the tensor
        np.testing.assert_array_equal(receiver.recv(key), array)
        sent.result(timeout=SHORT_TIMEOUT_S)


@pytest.mark.parametrize("metadata", STRANGERS)
def test_recv_tensor_without_the_token_does_not_wait_for_a_tensor(metadata, caplog):
    # refused before the rendezvous: it neither waits for the key nor stands in the way of the receiver
    caplog.set_level(logging.WARNING, logger="transports.auth")
    with started("grpc_tcp") as (sender, receiver):
        key = Key("later", 0, 0, 1)
        with pytest.raises(grpc.RpcError) as exc_info:
            raw_recv_tensor(sender.cluster.addresses[0], key, metadata)
        assert_unauthenticated(exc_info)
        receiving = receiver.recv_async(key)
        sender.send_async(key, np.ones(8))
        np.testing.assert_array_equal(receiving.result(timeout=SHORT_TIMEOUT_S), np.ones(8))


def test_recv_tensor_with_the_token_is_served(caplog):
    # the same raw call as a stranger's, with the run's token: it gets the tensor
    caplog.set_level(logging.WARNING, logger="transports.auth")
    with started("grpc_tcp") as (sender, _receiver):
        key = Key("weights", 0, 0, 1)
        array = np.arange(16, dtype=np.int64)
        sender.send_async(key, array)
        messages = raw_recv_tensor(sender.cluster.addresses[0], key, call_metadata(sender.cluster.token))
        assembler = TensorAssembler(Ledger())
        for message in messages:
            assembler.add(message)
        np.testing.assert_array_equal(assembler.result(), array)
    assert not [r for r in caplog.records if r.name == "transports.auth"]


def test_grpc_tcp_ranks_with_different_tokens_cannot_talk():
    cluster = Cluster.on_loopback(2)
    sender, receiver = (transports.create("grpc_tcp", timeout_s=SHORT_TIMEOUT_S) for _ in range(2))
    sender.start(cluster, 0)
    receiver.start(Cluster(cluster.addresses, token=WRONG_TOKEN), 1)
    try:
        sender.send_async(Key("w", 0, 0, 1), np.ones(4))
        with pytest.raises(PeerError, match=r"UNAUTHENTICATED.*must use the same token"):
            receiver.recv(Key("w", 0, 0, 1))
    finally:
        sender.close()
        receiver.close()


# -- the control path: zerocopy, rdma_cp and grpc_rdma -------------------------------

# each fabric transport with the control operation that hands out its regions and remote keys
CONTROL = [
    pytest.param("zerocopy", "_on_connect", "connect", id="zerocopy", marks=FABRIC),
    pytest.param("grpc_rdma", "_on_link", "link", id="grpc_rdma", marks=FABRIC),
]


def raw_control_call(address: str, op: str, metadata, **request) -> dict:
    with grpc.insecure_channel(address) as channel:
        reply = channel.unary_unary(CONTROL_METHOD)(
            json.dumps({"op": op, **request}).encode(), timeout=CALL_TIMEOUT_S, metadata=metadata)
    return json.loads(reply)


def spy_on_handlers(monkeypatch, name: str, handlers: dict[str, str]) -> list[str]:
    """Record every run of the given control handlers (attribute -> op) of transport ``name``."""
    cls = transports.transport_class(name)
    ran: list[str] = []
    for attribute, op in handlers.items():
        original = getattr(cls, attribute)

        def recording(self, request, original=original, op=op):
            ran.append(op)
            return original(self, request)

        monkeypatch.setattr(cls, attribute, recording)
    return ran


@pytest.mark.parametrize("metadata", STRANGERS)
@pytest.mark.parametrize(("name", "attribute", "op"), CONTROL)
def test_a_control_call_without_the_token_is_refused_and_gets_nothing(name, attribute, op, metadata,
                                                                      monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="transports.auth")
    ran = spy_on_handlers(monkeypatch, name, {"_on_hello": "hello", attribute: op})
    with started(name, fabric_transport="shm") as (listener, peer):
        address = listener.cluster.addresses[0]
        for operation in ("hello", op):
            with pytest.raises(grpc.RpcError) as exc_info:
                # well-formed enough that the handler would answer with an address or a remote key
                raw_control_call(address, operation, metadata, name="w", src=1, rank=1)
            assert_unauthenticated(exc_info)
        assert ran == []  # no handler ran: no endpoint, region or remote key left the rank
        refusals = [r for r in caplog.records if r.name == "transports.auth"]
        assert len(refusals) == 2
        assert all(CONTROL_METHOD in r.getMessage() and "127.0.0.1:" in r.getMessage() for r in refusals)
        # the run itself goes on
        array = np.arange(64, dtype=np.float32)
        sent = listener.send_async(Key("w", 0, 0, 1), array)
        np.testing.assert_array_equal(peer.recv(Key("w", 0, 0, 1)), array)
        sent.result(timeout=SHORT_TIMEOUT_S)
        assert ran  # the ranks' own calls did reach the handlers


@pytest.mark.parametrize("metadata", STRANGERS)
@FABRIC
def test_a_refused_control_call_is_logged_with_the_callers_address(metadata, caplog):
    caplog.set_level(logging.WARNING, logger="transports.auth")
    with started("rdma_cp", fabric_transport="shm") as (listener, _peer):
        with pytest.raises(grpc.RpcError) as exc_info:
            raw_control_call(listener.cluster.addresses[0], "ping", metadata)
        assert_unauthenticated(exc_info)
        assert_refusal_logged(caplog, listener, CONTROL_METHOD)


@FABRIC
def test_a_control_call_with_the_token_is_served():
    with started("zerocopy", fabric_transport="shm") as (listener, _peer):
        reply = raw_control_call(listener.cluster.addresses[0], "hello", call_metadata(listener.cluster.token))
        assert reply["device"]


@FABRIC
@pytest.mark.parametrize("name", ["zerocopy", "grpc_rdma"])
def test_fabric_ranks_with_different_tokens_cannot_talk(name):
    cluster = Cluster.on_loopback(2)
    sender, receiver = (transports.create(name, timeout_s=SHORT_TIMEOUT_S, fabric_transport="shm")
                        for _ in range(2))
    sender.start(cluster, 0)
    receiver.start(Cluster(cluster.addresses, token=WRONG_TOKEN), 1)
    try:
        key = Key("w", 0, 0, 1)
        sent = sender.send_async(key, np.ones(4))
        receiving = receiver.recv_async(key)
        # zerocopy's sender calls first, grpc_rdma's receiver: whichever it is, its call is refused
        active = sent if name == "zerocopy" else receiving
        with pytest.raises(PeerError, match=r"UNAUTHENTICATED.*must use the same token"):
            active.result(timeout=SHORT_TIMEOUT_S)
    finally:
        sender.close()
        receiver.close()
