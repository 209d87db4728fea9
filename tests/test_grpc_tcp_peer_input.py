"""grpc_tcp receiving from a peer that holds the run's token but sends what it should not (issue 23, item 5).

The peer's description of a tensor (dtype, shape, total size) is checked before the receiver allocates
for it: a shape whose size overflows, a size beyond this machine's memory, or a tensor other than the
plan's is a PeerError naming the peer, and the receiver goes on receiving other tensors.

The fake peer is rank 0 of the cluster: a gRPC server at its address, checking the run's token, that
answers ``RecvTensor`` with raw ``TensorChunk`` messages given per tensor name.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from transports import Cluster, Key, PeerError, TensorSpec
from transports.auth import TokenCheck
from transports.base import Ledger, memory_bytes
from transports.grpc_tcp.tensor_pb2 import DESCRIPTOR, RecvTensorRequest, TensorChunk
from transports.grpc_tcp.transport import GrpcTcpTransport
from transports.grpc_tcp.wire import MAX_DIMS, TensorAssembler, WireError, decode_chunk, encode_chunks
from transports.ports import release_port

from .conftest import SHORT_TIMEOUT_S, start_pair

PEER = r"rank 0 at 127\.0\.0\.1:\d+"


def chunk(dtype: str, shape, total: int, offset: int = 0, content: bytes = b"") -> bytes:
    return TensorChunk(dtype=dtype, shape=shape, total_bytes=total, offset=offset, content=content).SerializeToString()


class FakeSender:
    """Rank 0 of ``cluster``, holding its token: answers RecvTensor for a name with ``streams[name]``, as given."""

    def __init__(self, cluster: Cluster) -> None:
        self.streams: dict[str, list[bytes]] = {}
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)],
                                  interceptors=(TokenCheck(cluster.token, "fake rank 0"),))
        service = DESCRIPTOR.services_by_name["TensorTransport"].full_name
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            service, {"RecvTensor": grpc.unary_stream_rpc_method_handler(self._serve)}),))
        assert self.server.add_insecure_port(cluster.addresses[0])
        self.server.start()
        release_port(cluster.addresses[0])

    def _serve(self, request: bytes, context: grpc.ServicerContext):
        name = RecvTensorRequest.FromString(request).name
        if name not in self.streams:
            context.abort(grpc.StatusCode.NOT_FOUND, f"the fake sends no '{name}'")
        yield from self.streams[name]

    def close(self) -> None:
        self.server.stop(None)


@pytest.fixture
def fake():
    """(fake rank 0, real grpc_tcp rank 1)"""
    cluster = Cluster.on_loopback(2)
    peer = FakeSender(cluster)
    receiver = GrpcTcpTransport(timeout_s=SHORT_TIMEOUT_S)
    receiver.start(cluster, 1)
    yield peer, receiver
    receiver.close()
    peer.close()


def still_receives(peer: FakeSender, receiver: GrpcTcpTransport, step: int = 0) -> None:
    """A refusal left nothing behind: the receiver takes a good tensor from the same peer."""
    array = np.arange(1000, dtype=np.int32)
    peer.streams["good"] = list(encode_chunks(array, Ledger(), chunk_bytes=1000))
    np.testing.assert_array_equal(receiver.recv(Key("good", step, 0, 1)), array)


# -- the three findings, each over the wire ----------------------------------------------------


def test_a_shape_whose_size_wraps_int64_is_refused_naming_the_peer(fake):
    # before: np.prod wrapped to 0, the chunk was accepted and np.empty raised a bare ValueError
    peer, receiver = fake
    peer.streams["wrap"] = [chunk("<f4", [2**32, 2**32], 0)]
    with pytest.raises(PeerError, match=rf"{PEER}.*wrap@0 \(0->1\).*\(4294967296, 4294967296\)"):
        receiver.recv(Key("wrap", 0, 0, 1))
    still_receives(peer, receiver)


def test_a_first_chunk_announcing_more_than_memory_is_refused_before_allocating(fake):
    # before: the receiver tried np.empty(2**40) (MemoryError)
    peer, receiver = fake
    announced = max(2**40, 2 * memory_bytes())
    peer.streams["huge"] = [chunk("|u1", [announced], announced, 0, b"x" * 16)]
    refusal = rf"{PEER}.*huge@0 \(0->1\).*\({announced},\).*more than this rank can hold: it exceeds \d+ bytes"
    with pytest.raises(PeerError, match=refusal):
        receiver.recv(Key("huge", 0, 0, 1))
    still_receives(peer, receiver)


def test_a_tensor_other_than_the_plans_is_refused(fake):
    # before: recv returned the float64 (3,) array silently
    peer, receiver = fake
    receiver.placement.plan([TensorSpec("w", (16,), np.float32, 0, 1)])
    peer.streams["w"] = list(encode_chunks(np.zeros(3, np.float64), Ledger()))
    with pytest.raises(PeerError, match=rf"{PEER}.*w@0 \(0->1\).*<f8 \(3,\).*plan.*<f4 \(16,\)"):
        receiver.recv(Key("w", 0, 0, 1))
    peer.streams["w"] = list(encode_chunks(np.ones(16, np.float32), Ledger(), chunk_bytes=24))
    np.testing.assert_array_equal(receiver.recv(Key("w", 1, 0, 1)), np.ones(16, np.float32))
    still_receives(peer, receiver)


def test_a_real_sender_of_the_wrong_tensor_fails_only_that_receive():
    sender, receiver = pair = start_pair("grpc_tcp", chunk_bytes=1000)
    try:
        receiver.placement.plan([TensorSpec("w", (4, 250), np.float32, 0, 1), TensorSpec("g", None, np.float32, 0, 1)])
        sender.send_async(Key("w", 0, 0, 1), np.zeros((250, 4), np.float32))  # the same bytes, another shape
        with pytest.raises(PeerError, match=rf"{PEER}.*w@0.*\(250, 4\).*plan.*\(4, 250\)"):
            receiver.recv(Key("w", 0, 0, 1))
        right = np.arange(1000, dtype=np.float32).reshape(4, 250)
        sender.send_async(Key("w", 1, 0, 1), right)
        np.testing.assert_array_equal(receiver.recv(Key("w", 1, 0, 1)), right)
        # a tensor the plan knows only by name (shape None: dynamic) takes any shape; one it does not know too
        for name, array in (("g", np.ones((2, 3), np.float32)), ("other", np.arange(5.0))):
            sender.send_async(Key(name, 0, 0, 1), array)
            np.testing.assert_array_equal(receiver.recv(Key(name, 0, 0, 1)), array)
    finally:
        for transport in pair:
            transport.close()


def test_too_many_dimensions_are_refused(fake):
    peer, receiver = fake
    peer.streams["deep"] = [chunk("|u1", [1] * (MAX_DIMS + 1), 1, 0, b"x")]
    with pytest.raises(PeerError, match=rf"{PEER}.*deep@0.*{MAX_DIMS + 1} dimensions"):
        receiver.recv(Key("deep", 0, 0, 1))
    still_receives(peer, receiver)


# -- properties of the checks themselves (no network) -----------------------------------------

LIMIT = 1 << 16  # a receiver that can hold 64 KiB: whatever is accepted can be built here
DTYPES = ["|u1", "<i2", "<f4", "<c16", "|b1", "|S3", "<U2", "|V5"]
dims = st.integers(0, 3) | st.integers(4, 70) | st.integers(2**20, 2**63 - 1)


def _size(dtype: str, shape) -> int:
    size = np.dtype(dtype).itemsize
    for d in shape:
        size *= d
    return size


@st.composite
def descriptions(draw):
    """A first chunk's (dtype, shape, total_bytes): mostly consistent, sometimes any int64 total."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(dims, max_size=MAX_DIMS + 2))
    true = _size(dtype, shape)
    wrapped = (true + 2**63) % 2**64 - 2**63  # what an int64 product would say
    total = draw(st.sampled_from([wrapped, min(true, 2**63 - 1)]) | st.integers(-(2**63), 2**63 - 1))
    return dtype, shape, total


@settings(max_examples=500, deadline=None)
@given(descriptions())
@example(("<f4", [2**32, 2**32], 0))  # the product wraps int64 to 0
@example(("<f4", [2**62, 0], 0))  # empty, but numpy cannot build it
@example(("|u1", [1] * (MAX_DIMS + 1), 1))
@example(("|u1", [LIMIT + 1], LIMIT + 1))
def test_a_chunk_is_accepted_only_with_a_size_that_is_exact_and_can_be_held(description):
    dtype, shape, total = description
    content = b"\0" * total if 0 < total <= LIMIT else b""
    try:
        parsed = decode_chunk(chunk(dtype, shape, total, 0, content), LIMIT)
    except WireError:
        extent = np.dtype(dtype).itemsize * int(np.prod([d for d in shape if d], dtype=object))
        assert len(shape) > MAX_DIMS or extent > LIMIT or total != _size(dtype, shape)
        return
    assert len(parsed.shape) <= MAX_DIMS and parsed.total_bytes == total == _size(dtype, shape) <= LIMIT
    # what is accepted can be built: the assembler's result, never a numpy error
    assembler = TensorAssembler(Ledger(), limit=LIMIT)
    assembler.add(chunk(dtype, shape, total, 0, content))
    result = assembler.result()
    assert result.shape == tuple(shape) and result.dtype == np.dtype(dtype) and result.nbytes == total


streams = st.lists(st.builds(chunk, st.sampled_from(DTYPES), st.lists(dims, max_size=3), dims | st.integers(-4, 0),
                             st.integers(0, 40) | dims, st.binary(max_size=24)), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(streams, st.integers(0, LIMIT))
def test_any_chunk_stream_is_a_tensor_within_the_limit_or_a_wire_error(messages, limit):
    assembler = TensorAssembler(Ledger(), limit=limit)
    try:
        for message in messages:
            assembler.add(message)
        result = assembler.result()
    except WireError:
        return
    assert result.nbytes <= limit


planned = st.tuples(st.sampled_from(["<f4", "<f8", "<i4", "|u1"]), st.lists(st.integers(0, 6), max_size=3))


@settings(max_examples=300, deadline=None)
@given(planned, planned, st.integers(1, 64))
@example(("<f4", [16]), ("<f8", [3]), 64)
@example(("<f4", [4, 2]), ("<f4", [2, 4]), 4)
def test_a_planned_tensor_is_accepted_exactly_as_planned_and_refused_at_its_first_chunk(plan, sent, chunk_bytes):
    (plan_dtype, plan_shape), (sent_dtype, sent_shape) = plan, sent
    array = np.zeros(sent_shape, sent_dtype)
    messages = list(encode_chunks(array, Ledger(), chunk_bytes))
    assembler = TensorAssembler(Ledger(), limit=LIMIT, expected=(np.dtype(plan_dtype), tuple(plan_shape)))
    if (np.dtype(plan_dtype), tuple(plan_shape)) != (array.dtype, array.shape):
        with pytest.raises(WireError, match="the plan"):
            assembler.add(messages[0])  # before any buffer is made for the stream
        return
    for message in messages:
        assembler.add(message)
    assert assembler.result().shape == tuple(plan_shape)
