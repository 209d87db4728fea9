"""Bad keys and dtypes are refused on the calling side, by every transport, naming the key and the problem.

Before, a name with a lone surrogate, a step of 2**63 or a name over 512 bytes failed inside grpc_rdma's
encoder on one side only (the other waited out its whole timeout), an object dtype escaped a callback
as a TypeError, a structured dtype arrived as anonymous ``|V12`` records, and grpc_tcp blamed the peer for
the sender's own object dtype. Now ``Transport._check_key`` and ``Transport._check_array`` refuse them
before anything goes on the wire, and where the protocol can tell the receiver (grpc_tcp, grpc_rdma,
local), a receiver waiting for the refused key fails at once, naming the sender, instead of timing out.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from transports import Key, TransportError, TransportTimeout
from transports.base import MAX_NAME_BYTES

from .conftest import start_pair, transport_params

#: far below the pair's timeout: a receiver that only fails at its timeout fails this
FAST_S = 8.0

BAD_KEYS = [
    pytest.param(Key("\ud800", 0, 0, 1), "UTF-8", id="lone-surrogate"),
    pytest.param(Key("é" * (MAX_NAME_BYTES // 2 + 1), 0, 0, 1), "bytes of UTF-8", id="name-over-limit"),
    pytest.param(Key("w", 2**63, 0, 1), "int64", id="step-2**63"),
    pytest.param(Key("w", -1, 0, 1), "int64", id="negative-step"),
    pytest.param(Key("w", 1.5, 0, 1), "int64", id="float-step"),
    pytest.param(Key("w", True, 0, 1), "int64", id="bool-step"),
    pytest.param(Key(b"w", 0, 0, 1), "must be a str", id="bytes-name"),
    pytest.param(Key(None, 0, 0, 1), "must be a str", id="no-name"),
    pytest.param(Key("w", 0, 0, -1), "dst", id="negative-dst"),
    pytest.param(Key("w", 0, 0, 7), "no rank 7", id="dst-outside-cluster"),
]

BAD_ARRAYS = [
    pytest.param(np.array([{"a": 1}, None], dtype=object), "Python objects", id="object"),
    pytest.param(np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]), "structured", id="structured"),
    pytest.param([1, "two", None], "Python objects", id="mixed-list"),
]


def _off_the_device(params):
    """The variants that need no RDMA device: a refusal happens before anything reaches the wire, so the fabric
    below cannot change it (the cases that cross the wire below run on the device too)."""
    return [param for param in params if not any(mark.name == "rdma" for mark in param.marks)]


@pytest.fixture(params=_off_the_device(transport_params()))
def checked_pair(request):
    """A started pair of each transport variant off the RDMA device."""
    name, options = request.param
    started = start_pair(name, **options)
    yield started
    for transport in started:
        transport.close()


@pytest.mark.parametrize(("key", "fragment"), BAD_KEYS)
def test_a_bad_key_is_refused_on_both_sides_at_once(checked_pair, key, fragment):
    pair = checked_pair
    sender, receiver = pair
    with pytest.raises(ValueError, match=fragment) as refused:
        sender.send_async(key, np.zeros(4, np.float32))
    assert sender.name in str(refused.value) and "cannot send" in str(refused.value)
    with pytest.raises(ValueError, match="dst" if key.dst in (-1, 7) else fragment):
        receiver.recv_async(key)
    # the pair still works
    good = Key("good", 0, 0, 1)
    sent = sender.send_async(good, np.arange(4))
    np.testing.assert_array_equal(receiver.recv(good), np.arange(4))
    sent.result(timeout=FAST_S)


@pytest.mark.parametrize(("array", "fragment"), BAD_ARRAYS)
def test_a_bad_dtype_is_refused_by_the_sender_naming_the_key(checked_pair, array, fragment):
    pair = checked_pair
    sender, _ = pair
    with pytest.raises(ValueError, match=fragment) as refused:
        sender.send_async(Key("w", 3, 0, 1), array)
    assert "w@3 (0->1)" in str(refused.value)
    with pytest.raises(ValueError, match=fragment):
        sender.send(Key("w", 4, 0, 1), array)


def _tells_receiver(pair) -> bool:
    # zerocopy and rdma_cp have no message that could carry the sender's failure to the receiver
    return pair[0].name in ("grpc_tcp", "grpc_rdma", "local")


@pytest.mark.parametrize("order", ["receiver-first", "sender-first"])
def test_a_receiver_learns_of_a_refused_send_without_waiting_its_timeout(pair, order):
    sender, receiver = pair
    if not _tells_receiver(pair):
        pytest.skip(f"{sender.name} has no message to tell the receiver of a failed send")
    key = Key("objects", 0, 0, 1)
    bad = np.array([object()], dtype=object)
    if order == "receiver-first":
        receiving = receiver.recv_async(key)
        time.sleep(0.2)  # the request reaches the sender (a race either way is fine)
    with pytest.raises(ValueError, match="Python objects"):
        sender.send_async(key, bad)
    if order == "sender-first":
        receiving = receiver.recv_async(key)
    with pytest.raises(TransportError) as failed:
        receiving.result(timeout=FAST_S)
    assert not isinstance(failed.value, TransportTimeout)
    message = str(failed.value)
    assert "rank 0" in message and "Python objects" in message and "objects@0" in message
    # a retry under the same key with a good array goes through
    sent = sender.send_async(key, np.arange(3))
    np.testing.assert_array_equal(receiver.recv(key), np.arange(3))
    sent.result(timeout=FAST_S)


def test_plain_void_and_other_byte_dtypes_still_travel(pair):
    sender, receiver = pair
    for step, array in enumerate([
        np.frombuffer(bytes(range(24)), dtype="V12"),
        np.array(["ab", "c"], dtype="U2"),
        np.array([b"xyz"], dtype="S3"),
        np.arange(4, dtype=">i4"),
        np.array(["2020-01-01"], dtype="datetime64[ns]"),
    ]):
        key = Key("bytes", step, 0, 1)
        sent = sender.send_async(key, array)
        received = receiver.recv(key)
        sent.result(timeout=FAST_S)
        assert received.dtype == array.dtype
        assert received.tobytes() == array.tobytes()


def test_numpy_integers_are_good_steps_and_ranks(pair):
    sender, receiver = pair
    key = Key("w", np.int64(5), np.int32(0), np.uint8(1))
    sent = sender.send_async(key, np.arange(2))
    np.testing.assert_array_equal(receiver.recv(Key("w", 5, 0, 1)), np.arange(2))
    sent.result(timeout=FAST_S)
