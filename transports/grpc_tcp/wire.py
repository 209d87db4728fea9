"""Encoding tensors as ``TensorChunk`` messages with no copy beyond those gRPC forces.

Protobuf's own path copies the payload twice on each side (into a ``bytes``
field, then into the serialised message; and back). Like TensorFlow's
``grpc_tensor_coding.cc`` we write the wire format by hand instead: the small
fields go through the generated class, the content field is appended as raw
bytes, so a chunk costs one copy to build (grpcio's Python API only takes a
``bytes`` message). On receipt we parse the small fields and return the
content as a zero-copy view of the message. The bytes are byte-for-byte a
valid ``TensorChunk`` that the generated class parses (tests check it).

A padding field puts the content at a 64-byte offset in the message, so the
received view is aligned for every numpy dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from transports import peer_input
from transports.base import Ledger, memory_bytes
from transports.dtypes import dtype_text
from transports.grpc_tcp.tensor_pb2 import TensorChunk

# protobuf and gRPC cap one message below 2 GiB; chunks stay well under it.
MAX_CHUNK_BYTES = 1 << 30
# Measured here (bench micro, 1GB): one 1 GiB message ran at ~200 MB/s, 16 MiB chunks at
# ~1000 MB/s. Each fresh multi-megabyte buffer costs page faults; chunks this size are
# reused by malloc, and sending one chunk overlaps with encoding the next.
DEFAULT_CHUNK_BYTES = 16 << 20
CONTENT_ALIGNMENT = 64

#: the most dimensions a received tensor may have: what this numpy can build (NPY_MAXDIMS)
MAX_DIMS = peer_input.MAX_DIMS

_PADDING_TAG = bytes([7 << 3 | 2])
_CONTENT_TAG = bytes([8 << 3 | 2])
_CONTENT_FIELD = 8
_LENGTH_DELIMITED = 2


class WireError(peer_input.PeerInputError):
    """A message this receiver does not accept: not a well-formed tensor chunk, one describing a tensor
    it cannot hold (:mod:`transports.peer_input`'s checks), or not the tensor its plan expects."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def encode_chunks(array: np.ndarray, ledger: Ledger, chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[bytes]:
    """The serialised ``TensorChunk`` messages of a C-contiguous ``array``, in order.

    Each message is built by one join of a small header with a slice of the
    array's memory: the one copy grpcio's bytes-only message API forces.
    """
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    flat = memoryview(array.reshape(-1).view(np.uint8)) if array.nbytes else memoryview(b"")
    total = array.nbytes
    description = {"dtype": dtype_text(array.dtype), "shape": array.shape, "total_bytes": total}
    offset = 0
    while True:
        piece = flat[offset : offset + chunk_bytes]
        header = TensorChunk(offset=offset, **description).SerializeToString()
        length = _varint(len(piece))
        # content starts after header, padding tag+length(1)+pad, content tag, length
        pad = -(len(header) + 2 + 1 + len(length)) % CONTENT_ALIGNMENT
        message = b"".join((header, _PADDING_TAG, bytes([pad]), bytes(pad), _CONTENT_TAG, length, piece))
        ledger.add(copied_bytes=len(piece))
        yield message
        offset += len(piece)
        if offset >= total:
            return


@dataclass
class Chunk:
    """A parsed ``TensorChunk``: its small fields and a view of its content."""

    dtype: np.dtype
    shape: tuple[int, ...]
    total_bytes: int
    offset: int
    content: memoryview


def decode_chunk(message: bytes, limit: int | None = None) -> Chunk:
    """Parse one message; the content stays a view of ``message`` (no copy).

    The tensor it describes is checked before anyone allocates for it (:mod:`transports.peer_input`): a
    dtype that can travel as raw bytes, a shape numpy can build whose size is at most ``limit`` bytes
    (default: this machine's memory) and is the ``total_bytes`` announced, and content within those bytes.
    """
    buf = memoryview(message)
    header = bytearray()
    content = memoryview(b"")
    pos = 0
    while pos < len(buf):
        start = pos
        tag, pos = _read_varint(buf, pos)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _read_varint(buf, pos)
            if field == _CONTENT_FIELD:
                content = buf[pos : pos + length]
                pos += length
                if pos > len(buf):
                    raise WireError("content runs past the end of the message")
                continue
            pos += length
        else:
            raise WireError(f"unsupported wire type {wire_type} for field {field}")
        if pos > len(buf):
            raise WireError(f"field {field} runs past the end of the message")
        header += buf[start:pos]
    try:
        fields = TensorChunk.FromString(bytes(header))
    except DecodeError as exc:
        raise WireError(f"malformed tensor chunk: {exc}") from exc
    dtype = peer_input.dtype(fields.dtype, error=WireError)
    shape = peer_input.shape(tuple(fields.shape), error=WireError)
    expected = peer_input.size(dtype, shape, limit=limit, announced=fields.total_bytes, error=WireError)
    if fields.offset < 0 or fields.offset + len(content) > expected:
        raise WireError(f"chunk [{fields.offset}, {fields.offset + len(content)}) lies outside the tensor")
    return Chunk(dtype, shape, expected, fields.offset, content)


class TensorAssembler:
    """Rebuilds a tensor from its chunks; a single-chunk tensor is a zero-copy view.

    Every chunk is checked (:func:`decode_chunk`: at most ``limit`` bytes, by default this machine's
    memory) before it is stored, and the first one, which sizes the buffer, also against ``expected``
    (the plan's dtype and shape, if it has them).
    """

    def __init__(self, ledger: Ledger, *, limit: int | None = None,
                 expected: tuple[np.dtype, tuple[int, ...]] | None = None) -> None:
        self._ledger = ledger
        self._limit = memory_bytes() if limit is None else limit
        self._expected = expected
        self._first: Chunk | None = None
        self._buffer: np.ndarray | None = None
        self._single: memoryview | None = None
        self._filled = 0

    def add(self, message: bytes) -> None:
        chunk = decode_chunk(message, self._limit)
        if self._first is not None and self._filled == self._first.total_bytes:
            raise WireError(f"a chunk arrived after all {self._filled} bytes of the tensor")
        if not chunk.content and chunk.total_bytes:
            raise WireError(f"an empty chunk at offset {chunk.offset} of a tensor of {chunk.total_bytes} bytes")
        if self._first is None:
            if self._expected is not None and (chunk.dtype, chunk.shape) != self._expected:
                dtype, shape = self._expected
                raise WireError(f"it is {chunk.dtype.str} {chunk.shape}, where the plan says {dtype.str} {shape}")
            self._first = chunk
        elif (chunk.dtype, chunk.shape) != (self._first.dtype, self._first.shape):
            raise WireError("chunks of one tensor disagree on its dtype or shape")
        if chunk.offset != self._filled:
            raise WireError(f"chunk at offset {chunk.offset} arrived, expected {self._filled}")
        complete_in_one = chunk.offset == 0 and len(chunk.content) == chunk.total_bytes
        if not complete_in_one:
            if self._buffer is None:
                self._buffer = np.empty(chunk.total_bytes, dtype=np.uint8)
            self._buffer[chunk.offset : chunk.offset + len(chunk.content)] = np.frombuffer(chunk.content, np.uint8)
            self._ledger.add(copied_bytes=len(chunk.content))
        else:
            self._single = chunk.content
        self._filled += len(chunk.content)

    def result(self) -> np.ndarray:
        first = self._first
        if first is None:
            raise WireError("the stream ended before any chunk arrived")
        if self._filled != first.total_bytes:
            raise WireError(f"the stream ended after {self._filled} of {first.total_bytes} bytes")
        if first.total_bytes == 0:
            return np.empty(first.shape, dtype=first.dtype)
        raw = self._buffer if self._buffer is not None else self._single
        return np.frombuffer(raw, dtype=first.dtype).reshape(first.shape)
