"""What a peer sends is checked in one place (transports/peer_input.py), against one set of limits (issue 24, item 4).

Each function is tested at and around its limits with hypothesis; then each wire format's parser is shown to
use it: a structured or object dtype is refused the same way by grpc_tcp's chunks, grpc_rdma's records and
zerocopy's ``connect`` replies and meta-data records, and the formats' limits are the module's.
"""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from transports import PeerError, peer_input
from transports.dtypes import dtype_problem
from transports.fabric.base import RemoteRegion
from transports.peer_input import (
    MAX_ADDRESS_BYTES,
    MAX_ARRAY_BYTES,
    MAX_DIMS,
    MAX_DTYPE_CHARS,
    MAX_RKEY_BYTES,
    MAX_WORKERS,
    RECORD_DIMS,
    PeerInputError,
)

ROOT = Path(__file__).resolve().parent.parent
PEER = "rank 3 at 10.0.0.7:4321"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


def refused(call, *args, **kwargs) -> PeerInputError | None:
    """The error ``call`` raised (which must be a PeerError naming PEER), or None if it accepted."""
    try:
        call(*args, peer=PEER, **kwargs)
    except PeerInputError as exc:
        assert isinstance(exc, PeerError) and isinstance(exc, ValueError)
        assert str(exc).startswith(f"{PEER} ")
        return exc
    return None


# -- device addresses -----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, MAX_ADDRESS_BYTES + 2), max_size=MAX_WORKERS + 2))
@example([MAX_ADDRESS_BYTES])
@example([MAX_ADDRESS_BYTES + 1])
@example([1] * MAX_WORKERS)
@example([1] * (MAX_WORKERS + 1))
@example([])
@example([0])
def test_a_device_address_is_1_to_max_workers_addresses_of_1_to_max_bytes(sizes):
    value = ["07" * size for size in sizes]
    error = refused(peer_input.device_address, value)
    ok = 1 <= len(sizes) <= MAX_WORKERS and all(1 <= size <= MAX_ADDRESS_BYTES for size in sizes)
    assert (error is None) == ok, error
    if ok:
        assert peer_input.device_address(value) == [bytes([7]) * size for size in sizes]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=12) | json_values, min_size=1, max_size=3) | json_values)
def test_a_device_address_that_is_not_hex_strings_is_refused(value):
    try:
        addresses = peer_input.device_address(value)
    except PeerInputError:
        return
    assert len(addresses) == len(value)
    assert all(bytes.fromhex(item) == address for item, address in zip(value, addresses, strict=True))


# -- remote regions and keys ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(-2, 2**64 + 2), st.integers(-2, 2**64 + 2), st.integers(0, MAX_RKEY_BYTES + 2),
       st.none() | st.integers(0, 64))
@example(2**64 - 16, 16, 8, None)
@example(2**64 - 16, 17, 8, None)
@example(4096, 16, MAX_RKEY_BYTES + 1, None)
@example(4096, 16, 8, 17)
def test_a_remote_region_is_in_range_does_not_wrap_and_has_the_length_asked(addr, length, key_bytes, asked):
    value = {"addr": addr, "length": length, "rkey": "ab" * key_bytes}
    error = refused(peer_input.remote_region, value, what="'slot'", length=asked)
    ok = (0 <= addr < 2**64 and 0 <= length < 2**64 and addr + length <= 2**64 and 1 <= key_bytes <= MAX_RKEY_BYTES
          and asked in (None, length))
    assert (error is None) == ok, error
    if error is not None:
        assert "'slot'" in str(error)
    else:
        assert peer_input.remote_region(value, length=asked) == RemoteRegion(addr, length, b"\xab" * key_bytes)


@settings(max_examples=200, deadline=None)
@given(json_values | st.fixed_dictionaries({"addr": json_values, "length": json_values, "rkey": json_values}))
def test_any_other_region_descriptor_is_refused(value):
    try:
        region = peer_input.remote_region(value)
    except PeerInputError:
        return
    assert region.addr + region.length <= 2**64 and 0 < len(region.rkey) <= MAX_RKEY_BYTES


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2 * MAX_RKEY_BYTES), st.integers(0, 2 * MAX_RKEY_BYTES), st.booleans())
@example(MAX_RKEY_BYTES + 1, MAX_RKEY_BYTES + 1, False)
@example(0, 8, True)
@example(9, 8, False)
def test_a_records_remote_key_fits_its_field_and_the_limit(size, field_bytes, required):
    field = np.arange(field_bytes, dtype=np.uint64).astype(np.uint8)
    error = refused(peer_input.remote_key, field, size, required=required)
    ok = (1 if required else 0) <= size <= min(field_bytes, MAX_RKEY_BYTES)
    assert (error is None) == ok, error
    if ok:
        assert peer_input.remote_key(field, size, required=required) == field[:size].tobytes()


# -- dtypes ---------------------------------------------------------------------------------------------

DTYPE_TEXT = st.text(alphabet="<>|=fiuUSVbBcmMOe?,()[]0123456789 ns", max_size=20)
PLAIN = ["<f4", "|u1", "<c16", "|b1", "|V12", "<U2", "|S3", ">i4", "<M8[ns]", "<m8[us]", "<f2", "|V1", "<M8[25us]"]
REFUSED = ["|O", "O", "f4,i4", "(2,)f4", "u1,(2,)i4", "V0", "U0", "S0"]


@settings(max_examples=400, deadline=None)
@given(DTYPE_TEXT | st.sampled_from(PLAIN + REFUSED) | st.integers(0, 40).map(lambda zeros: f"<U{'0' * zeros}1")
       | st.binary(max_size=MAX_DTYPE_CHARS + 4) | json_values)
@example("<U" + "0" * (MAX_DTYPE_CHARS - 3) + "1")  # the longest name taken (numpy reads <U1)
@example("<U" + "0" * (MAX_DTYPE_CHARS - 2) + "1")  # a dtype numpy knows, named by a string one too long
@example(b"<m8[1000000000ns]")  # the longest dtype.str of a dtype that travels
@example("f4,i4")
@example("O")
def test_a_dtype_is_a_short_string_of_one_that_travels_as_raw_bytes(value):
    error = refused(peer_input.dtype, value)
    try:
        parsed = np.dtype(value.decode("ascii") if isinstance(value, bytes) else value)
    except Exception:
        parsed = None
    ok = (isinstance(value, str | bytes) and len(value) <= MAX_DTYPE_CHARS and parsed is not None
          and dtype_problem(parsed) is None)
    assert (error is None) == ok, error
    if ok:
        assert peer_input.dtype(value) == parsed and not parsed.hasobject and parsed.names is None
    elif isinstance(value, str | bytes) and len(value) <= MAX_DTYPE_CHARS and parsed is not None:
        assert dtype_problem(parsed) in str(error)  # refused for the rule a sender's arrays meet, in its words


@pytest.mark.parametrize("text", PLAIN)
def test_dtypes_that_travel_are_taken_as_text_and_as_bytes(text):
    assert peer_input.dtype(text) == peer_input.dtype(text.encode()) == np.dtype(text)


# -- shapes ---------------------------------------------------------------------------------------------

dims = (st.integers(-2, 3) | st.integers(2**31, 2**64) | st.booleans() | st.floats(0, 4) | st.none()
        | st.text(max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.lists(dims, max_size=MAX_DIMS + 3) | st.lists(st.integers(0, 2), max_size=MAX_DIMS + 3).map(tuple)
       | json_values, st.sampled_from([MAX_DIMS, RECORD_DIMS, 1]))
@example([1] * MAX_DIMS, MAX_DIMS)
@example([1] * (MAX_DIMS + 1), MAX_DIMS)
@example([1] * (RECORD_DIMS + 1), RECORD_DIMS)
@example([True], MAX_DIMS)
@example([-1], MAX_DIMS)
def test_a_shape_is_at_most_max_dims_non_negative_integers(value, max_dims):
    error = refused(peer_input.shape, value, max_dims=max_dims)
    ok = (isinstance(value, list | tuple) and len(value) <= max_dims
          and all(type(d) is int and d >= 0 for d in value))
    assert (error is None) == ok, error
    if ok:
        assert peer_input.shape(value, max_dims=max_dims) == tuple(value)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 2**63 - 1), min_size=RECORD_DIMS, max_size=RECORD_DIMS), st.integers(0, 255))
@example([1] * RECORD_DIMS, RECORD_DIMS + 1)
@example([-1] + [0] * (RECORD_DIMS - 1), 1)
@example([-1] + [0] * (RECORD_DIMS - 1), 0)
def test_a_records_shape_is_its_first_ndim_dimensions_and_ndim_fits_the_field(field, ndim):
    record = np.array(field, dtype="<i8")
    error = refused(peer_input.shape, record, ndim=ndim)
    ok = ndim <= RECORD_DIMS and all(d >= 0 for d in field[:ndim])
    assert (error is None) == ok, error
    if ok:
        parsed = peer_input.shape(record, ndim=ndim)
        assert parsed == tuple(field[:ndim]) and all(type(d) is int for d in parsed)


# -- sizes ----------------------------------------------------------------------------------------------

LIMIT = 1 << 16
big_dims = st.integers(0, 3) | st.integers(4, 300) | st.integers(2**20, 2**64)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(["|u1", "<f4", "<c16", "|V5", "<U3"]), st.lists(big_dims, max_size=12),
       st.none() | st.integers(0, 2 * LIMIT), st.sampled_from([LIMIT, MAX_ARRAY_BYTES, 2**70]))
@example("<f4", (2**32, 2**32), 0, LIMIT)  # an int64 product wraps to 0
@example("<f4", (2**62, 0), 0, MAX_ARRAY_BYTES)  # empty, but numpy cannot build it
@example("|u1", (2**40, 0), 0, LIMIT)  # empty, and numpy builds it: 0 bytes
@example("|u1", (LIMIT,), LIMIT, LIMIT)
@example("|u1", (LIMIT + 1,), None, LIMIT)
@example("<f4", (3,), 13, LIMIT)
def test_a_size_is_exact_within_the_limit_and_buildable(dtype, shape, announced, limit):
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    true = dtype.itemsize * int(np.prod(shape, dtype=object))
    extent = dtype.itemsize * int(np.prod([d for d in shape if d], dtype=object))  # what numpy checks
    error = refused(peer_input.size, dtype, shape, limit=limit, announced=announced)
    ok = true <= min(limit, MAX_ARRAY_BYTES) and extent <= MAX_ARRAY_BYTES and announced in (None, true)
    assert (error is None) == ok, error
    if ok:
        assert peer_input.size(dtype, shape, limit=limit, announced=announced) == true
        if true <= LIMIT:
            assert np.empty(shape, dtype).nbytes == true  # what is accepted can be built
    elif true > min(limit, MAX_ARRAY_BYTES) or extent > MAX_ARRAY_BYTES:
        assert f"{shape}" in str(error) and "exceeds" in str(error)
    else:
        assert "does not match" in str(error)


def test_the_default_limit_is_this_machines_memory(monkeypatch):
    monkeypatch.setattr(peer_input, "memory_bytes", lambda: 1000)
    assert peer_input.size(np.dtype("|u1"), (1000,)) == 1000
    with pytest.raises(PeerInputError, match="exceeds 1000 bytes"):
        peer_input.size(np.dtype("|u1"), (1001,))
    # a format's own limit replaces it (zerocopy's sender takes a static slot of any size an array can have)
    assert peer_input.size(np.dtype("|u1"), (1001,), limit=MAX_ARRAY_BYTES) == 1001


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(2**40, 2**64), min_size=2, max_size=MAX_DIMS))
def test_an_overflowing_shape_is_refused_without_allocating(shape):
    """The product grows dimension by dimension and stops past the bound: nothing of the size is ever built."""
    for dtype in (np.dtype("<c16"), np.dtype("|u1")):
        tracemalloc.start()
        try:
            with pytest.raises(PeerInputError, match="exceeds"):
                peer_input.size(dtype, tuple(shape), limit=MAX_ARRAY_BYTES)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 << 10


# -- every wire format: the module's checks, the module's limits -----------------------------------------


def _grpc_tcp(text: str, nbytes: int) -> None:
    from transports.grpc_tcp.tensor_pb2 import TensorChunk
    from transports.grpc_tcp.wire import WireError, decode_chunk

    try:
        decode_chunk(TensorChunk(dtype=text, shape=[1], total_bytes=nbytes).SerializeToString())
    except WireError as exc:  # the format's own error class, which is the module's
        assert isinstance(exc, PeerInputError)
        raise


def _grpc_rdma(text: str, nbytes: int) -> None:
    from transports.grpc_rdma.protocol import MESSAGE, Message, MessageType, encode, parse

    buffer = np.zeros(MESSAGE.itemsize, np.uint8)
    encode(Message(MessageType.META_DATA_RESPONSE, 1, name="w"), buffer)
    record = buffer.view(MESSAGE)[0]
    record["has_meta"], record["ndim"], record["dtype"], record["tensor_bytes"] = 1, 1, text.encode(), nbytes
    record["dims"][0] = 1
    parse(buffer)


def _zerocopy_reply(text: str, nbytes: int) -> None:
    from transports.zerocopy.protocol import CONTROL_BYTES, ConnectReply

    ConnectReply.parse({"mode": "static", "control": {"addr": 4096, "length": CONTROL_BYTES, "rkey": "ab" * 8},
                        "slot": {"addr": 1 << 20, "length": nbytes, "rkey": "ab" * 8}, "shape": [1], "dtype": text})


def _zerocopy_meta(text: str, nbytes: int) -> None:
    from transports.zerocopy.protocol import META, Meta

    record = np.zeros(1, META)
    record["ndim"], record["dtype"], record["nbytes"] = 1, text.encode(), nbytes
    record["rkey_len"], record["addr"] = 8, 4096
    record["dims"][0, 0] = 1
    Meta.parse(record.view(np.uint8))


FORMATS = {"grpc_tcp": _grpc_tcp, "grpc_rdma": _grpc_rdma, "zerocopy connect reply": _zerocopy_reply,
           "zerocopy meta-data record": _zerocopy_meta}


@pytest.mark.parametrize("text", ["f4,i4", "(2,)f4", "u1,(2,)i4", "O", "|O", "V0"])
def test_a_structured_or_object_dtype_is_refused_the_same_way_by_every_wire_format(text):
    problem = dtype_problem(np.dtype(text))
    assert problem is not None
    messages = {}
    for name, parse in FORMATS.items():
        with pytest.raises(PeerError) as raised:
            parse(text, 8)
        assert isinstance(raised.value, PeerInputError), name
        messages[name] = str(raised.value)
    assert all(message == f"the peer sent a dtype this rank does not take: {problem}" for message in
               messages.values()), messages


@pytest.mark.parametrize("text", PLAIN)
def test_a_dtype_that_travels_is_taken_by_every_wire_format(text):
    for parse in FORMATS.values():
        parse(text, np.dtype(text).itemsize)


def test_the_wire_formats_limits_are_the_modules():
    from transports.grpc_rdma import protocol
    from transports.grpc_tcp import wire
    from transports.zerocopy import transport as zerocopy

    assert wire.MAX_DIMS == MAX_DIMS
    assert protocol.MAX_DIMS == zerocopy.MAX_DIMS == RECORD_DIMS
    assert protocol.MAX_RKEY == zerocopy.MAX_RKEY == MAX_RKEY_BYTES
    assert protocol.MESSAGE["dims"].shape == zerocopy.META["dims"].shape == (RECORD_DIMS,)
    assert protocol.MESSAGE["rkey"].shape == zerocopy.META["rkey"].shape == (MAX_RKEY_BYTES,)
    assert protocol.MESSAGE["dtype"].itemsize == zerocopy.META["dtype"].itemsize <= MAX_DTYPE_CHARS
    assert len(np.dtype("<m8[1000000000ns]").str) <= MAX_DTYPE_CHARS  # the longest a dtype that travels has


def test_no_wire_format_parses_what_a_peer_sent_itself():
    """Hex strings and dtype strings from peers are decoded only here (and by the fabric's region descriptor and
    verbs' own fixed-size address, below the transports), and no module keeps a limit of its own."""
    allowed = {"transports/peer_input.py", "transports/base.py", "transports/dtypes.py"}
    offenders = []
    for path in sorted((ROOT / "transports").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name in allowed or name.startswith("transports/fabric/"):
            continue
        text = path.read_text()
        if re.search(r"bytes\.fromhex\(|dtype_problem\(|MAX_(DEVICE_)?ADDRESS|MAX_WORKERS|np\.iinfo\(np\.intp\)", text):
            offenders.append(name)
    assert offenders == []
