"""grpc_tcp only: its hand-written wire format, chunked streaming, copies and failing peers."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transports import Cluster, Key, PeerError, TransportError
from transports.base import Ledger
from transports.grpc_tcp.tensor_pb2 import TensorChunk
from transports.grpc_tcp.transport import GrpcTcpTransport
from transports.grpc_tcp.wire import CONTENT_ALIGNMENT, TensorAssembler, WireError, decode_chunk, encode_chunks

from .conftest import start_pair


def test_hand_encoded_chunks_are_valid_protobuf():
    array = np.arange(10, dtype=np.float64).reshape(2, 5)
    (message,) = encode_chunks(array, Ledger())
    parsed = TensorChunk.FromString(message)
    assert parsed.dtype == "<f8" and list(parsed.shape) == [2, 5]
    assert parsed.total_bytes == array.nbytes and parsed.offset == 0
    assert parsed.content == array.tobytes()


def test_content_is_aligned_and_received_without_a_copy():
    array = np.arange(1000, dtype=np.float32)
    (message,) = encode_chunks(array, Ledger())
    chunk = decode_chunk(message)
    start = bytes(message).index(array.tobytes())
    assert start % CONTENT_ALIGNMENT == 0
    ledger = Ledger()
    assembler = TensorAssembler(ledger)
    assembler.add(message)
    received = assembler.result()
    assert np.shares_memory(received, np.frombuffer(message, dtype=np.uint8))
    assert ledger.snapshot().copied_bytes == 0
    assert chunk.dtype == np.float32


def test_encoding_counts_one_copy_per_payload_byte():
    ledger = Ledger()
    list(encode_chunks(np.zeros(4096, dtype=np.uint8), ledger, chunk_bytes=1000))
    assert ledger.snapshot().copied_bytes == 4096


def test_chunked_transfer_reassembles_in_order():
    pair = start_pair("grpc_tcp", chunk_bytes=1000)  # not a multiple of the item size
    try:
        array = np.random.default_rng(0).standard_normal(3001)
        before = [t.stats() for t in pair]
        sent = pair[0].send_async(Key("big", 0, 0, 1), array)
        np.testing.assert_array_equal(pair[1].recv(Key("big", 0, 0, 1)), array)
        sent.result(timeout=10)
        copied = sum((t.stats() - b).copied_bytes for t, b in zip(pair, before, strict=True))
        # join + grpcio slice on the sender, grpcio bytes + reassembly on the receiver
        assert copied == 4 * array.nbytes
    finally:
        for transport in pair:
            transport.close()


def test_single_message_transfer_copies_three_times():
    pair = start_pair("grpc_tcp")
    try:
        array = np.ones(1 << 16, dtype=np.float32)
        before = [t.stats() for t in pair]
        pair[0].send_async(Key("w", 0, 0, 1), array)
        pair[1].recv(Key("w", 0, 0, 1))
        sender, receiver = (t.stats() - b for t, b in zip(pair, before, strict=True))
        assert sender.copied_bytes == 2 * array.nbytes and sender.serialisations == 1
        assert receiver.copied_bytes == array.nbytes and receiver.deserialisations == 1
    finally:
        for transport in pair:
            transport.close()


@pytest.mark.parametrize(
    ("tamper", "fragment"),
    [
        (lambda m: m[: len(m) // 2], "past the end"),
        (lambda m: TensorChunk(dtype="<f4", shape=[3], total_bytes=99).SerializeToString(), "does not match"),
        (lambda m: TensorChunk(dtype="O", shape=[1], total_bytes=8).SerializeToString(), "Python objects"),
        (lambda m: TensorChunk(dtype="nonsense", shape=[1], total_bytes=8).SerializeToString(), "unknown dtype"),
        # numpy's parser raises SyntaxError and ValueError too (they escaped the receiver before)
        (lambda m: TensorChunk(dtype="f4,,", shape=[1], total_bytes=8).SerializeToString(), "unknown dtype"),
        (lambda m: TensorChunk(dtype="(1000000000,1000000000)f4", shape=[1], total_bytes=8).SerializeToString(),
         "unknown dtype"),
        (lambda m: TensorChunk(dtype="f4,i4", shape=[1], total_bytes=8).SerializeToString(), "structured dtype"),
        (lambda m: TensorChunk(dtype="<f4", shape=[2**32, 2**32], total_bytes=0).SerializeToString(), "spans more"),
        (lambda m: TensorChunk(dtype="<f4", shape=[2], total_bytes=8, offset=4, content=b"12345678")
         .SerializeToString(), "outside the tensor"),
        (lambda m: b"\x0f", "wire type"),
    ],
)
def test_malformed_chunks_are_rejected(tamper, fragment):
    (message,) = encode_chunks(np.zeros(64, dtype=np.float32), Ledger())
    with pytest.raises(WireError, match=fragment):
        decode_chunk(tamper(message))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_parser(data):
    try:
        chunk = decode_chunk(data)
    except WireError:
        return
    assert chunk.offset + len(chunk.content) <= chunk.total_bytes


def test_a_port_in_use_is_a_clear_error():
    cluster = Cluster.on_loopback(1)
    first = GrpcTcpTransport(timeout_s=5)
    first.start(cluster, 0)
    try:
        with pytest.raises(TransportError, match=r"cannot listen on 127\.0\.0\.1"):
            GrpcTcpTransport(timeout_s=5).start(cluster, 0)
    finally:
        first.close()


def test_sender_closing_fails_the_waiting_receiver_naming_it():
    pair = start_pair("grpc_tcp")
    try:
        receiving = pair[1].recv_async(Key("never", 0, 0, 1))
        time.sleep(0.3)
        pair[0].close()
        with pytest.raises(PeerError, match=r"rank 0 at 127\.0\.0\.1"):
            receiving.result(timeout=15)
    finally:
        pair[1].close()


def _serve_then_die(cluster: Cluster, ready) -> None:
    transport = GrpcTcpTransport(timeout_s=30)
    transport.start(cluster, 0)
    # a large tensor whose request is served while the process is killed
    transport.send_async(Key("huge", 0, 0, 1), np.ones(1 << 28, dtype=np.uint8))
    ready.set()
    time.sleep(60)


def test_a_peer_killed_mid_transfer_is_an_error_naming_it_within_bounded_time():
    ctx = mp.get_context("spawn")
    cluster = Cluster.on_loopback(2)
    ready = ctx.Event()
    peer = ctx.Process(target=_serve_then_die, args=(cluster, ready), daemon=True)
    peer.start()
    receiver = GrpcTcpTransport(timeout_s=60)
    receiver.start(cluster, 1)
    try:
        assert ready.wait(30)
        receiving = receiver.recv_async(Key("huge", 0, 0, 1))
        time.sleep(0.05)
        peer.kill()
        started = time.monotonic()
        with pytest.raises(PeerError, match=r"rank 0 at 127\.0\.0\.1"):
            receiving.result(timeout=30)
        assert time.monotonic() - started < 30
    finally:
        receiver.close()
        peer.join(5)


def test_recv_many_of_more_keys_than_grpc_holds_untaken_receives_them_all():
    """2,000 keys posted at once (recv_many): gRPC's server cancels calls beyond the 1,000 it holds untaken, so the
    receiver starts at most CALLS_STARTING at a time, and each one taken makes room for the next."""
    pair = start_pair("grpc_tcp")
    try:
        keys = [Key(f"many{i}", 0, 0, 1) for i in range(2000)]
        sends = [pair[0].send_async(key, np.full(2, i, np.int32)) for i, key in enumerate(keys)]
        received = pair[1].recv_many(keys)
        assert len(received) == 2000
        assert all((array == i).all() for i, array in enumerate(received))
        assert all(sent.result(timeout=60) is None for sent in sends)
    finally:
        for transport in pair:
            transport.close()


def test_calls_waiting_for_their_tensors_do_not_hold_back_the_others():
    """More keys than CALLS_STARTING, sent one by one (each send waits until received) in the reverse of the
    order they were posted in: a call whose tensor is not there yet makes room for the next once the sender's
    server has taken it, so the last key posted is asked for, and the sender goes on."""
    from transports.grpc_tcp.transport import CALLS_STARTING

    pair = start_pair("grpc_tcp")
    try:
        keys = [Key(f"late{i}", 0, 0, 1) for i in range(CALLS_STARTING + 50)]
        receiving = [pair[1].recv_async(key) for key in keys]
        for i, key in reversed(list(enumerate(keys))):
            pair[0].send(key, np.full(2, i, np.int32))
        assert all((future.result(timeout=60) == i).all() for i, future in enumerate(receiving))
    finally:
        for transport in pair:
            transport.close()


def test_a_sender_closed_right_after_its_send_is_done_still_delivers_the_stream_in_flight(monkeypatch):
    """A send is done once its bytes are handed to gRPC; a slow receiver still reads the rest after the sender's
    close (a worker's last gradients at 1 Gbit/s): the close waits for the stream instead of cancelling it."""
    from transports.grpc_tcp import wire

    slow_add = wire.TensorAssembler.add

    def add(self, message):  # a receiver taking 0.5 s a chunk, as a slow link delivers them
        time.sleep(0.5)
        slow_add(self, message)

    monkeypatch.setattr(wire.TensorAssembler, "add", add)
    pair = start_pair("grpc_tcp", chunk_bytes=16 << 20)
    try:  # more than gRPC's flow-control windows hold, so the sender's last chunks wait for the receiver
        array = np.arange(64 << 20, dtype=np.float32)  # 256 MiB: sixteen chunks
        key = Key("last", 0, 0, 1)
        received = pair[1].recv_async(key)
        pair[0].send_async(key, array).result(timeout=60)
        pair[0].close()  # as soon as the send is done, as a worker ends its run
        np.testing.assert_array_equal(received.result(timeout=60), array)
    finally:
        for t in pair:
            t.close()
