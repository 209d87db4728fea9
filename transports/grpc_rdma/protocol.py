"""The protocol messages of TensorFlow's gRPC+verbs transport, as fixed-size records.

The layout follows the design note's message structure (type, name, step_id,
request_index, remote address and key, is_dead, dtype, shape, tensor bytes,
checksum, error status), widened where UCX needs it (remote keys of up to 1 KiB).
Every message is one record of ``MESSAGE.itemsize`` bytes, written with one
one-sided write into the peer's receive message buffer.

:func:`parse` trusts nothing: every length is checked against its field, every
dtype and shape against the byte count, so a malformed record is an error, never
a crash or a write outside a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

MAX_NAME = 512
MAX_DIMS = 8
MAX_RKEY = 1024
MAX_ERROR = 512
MAX_TENSOR_BYTES = 1 << 48

MESSAGE = np.dtype(
    [
        ("type", "u1"),
        ("is_dead", "u1"),
        ("has_meta", "u1"),
        ("ndim", "u1"),
        ("name_size", "<u2"),
        ("rkey_size", "<u2"),
        ("error_size", "<u2"),
        ("step_id", "<i8"),
        ("request_index", "<u8"),
        ("remote_addr", "<u8"),
        ("checksum", "<u8"),
        ("tensor_bytes", "<u8"),
        ("dims", "<i8", (MAX_DIMS,)),
        ("dtype", "S16"),
        ("name", "u1", (MAX_NAME,)),
        ("rkey", "u1", (MAX_RKEY,)),
        ("error", "u1", (MAX_ERROR,)),
    ]
)


class MessageType(IntEnum):
    """The message types of the design note."""

    TENSOR_REQUEST = 1  # receiver -> sender: the request, with the receiver's cached meta-data
    META_DATA_RESPONSE = 2  # sender -> receiver: new or changed meta-data (and checksum)
    TENSOR_RE_REQUEST = 3  # receiver -> sender: after reallocating, where to write
    ERROR_STATUS = 4  # sender -> receiver: the request failed on the sender


class ProtocolError(ValueError):
    """A message that does not parse; the text says which field is wrong."""


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate a tensor: dtype, shape, whether it is dead."""

    dtype: np.dtype
    shape: tuple[int, ...]
    is_dead: bool = False

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:  # Python integers: no overflow for absurd shapes
            count *= d
        return count * self.dtype.itemsize

    @classmethod
    def of(cls, array: np.ndarray) -> TensorMeta:
        return cls(array.dtype, tuple(array.shape))


@dataclass(frozen=True)
class Message:
    """One protocol message; fields a type does not use stay at their defaults."""

    type: MessageType
    request_index: int
    name: str = ""
    step_id: int = 0
    remote_addr: int = 0
    rkey: bytes = b""
    meta: TensorMeta | None = None
    checksum: int = 0
    error: str = ""


def encode(message: Message, out: np.ndarray) -> None:
    """Write ``message`` into ``out`` (``MESSAGE.itemsize`` bytes, e.g. a registered send buffer)."""
    name = message.name.encode()
    error = message.error.encode()[:MAX_ERROR]
    if len(name) > MAX_NAME:
        raise ProtocolError(f"tensor name of {len(name)} bytes exceeds {MAX_NAME}")
    if len(message.rkey) > MAX_RKEY:
        raise ProtocolError(f"remote key of {len(message.rkey)} bytes exceeds {MAX_RKEY}")
    out[: MESSAGE.itemsize] = 0
    record = out[: MESSAGE.itemsize].view(MESSAGE)[0]
    record["type"] = message.type
    record["name_size"] = len(name)
    record["name"][: len(name)] = np.frombuffer(name, np.uint8)
    record["step_id"] = message.step_id
    record["request_index"] = message.request_index
    record["remote_addr"] = message.remote_addr
    record["rkey_size"] = len(message.rkey)
    record["rkey"][: len(message.rkey)] = np.frombuffer(message.rkey, np.uint8)
    record["checksum"] = message.checksum
    record["error_size"] = len(error)
    record["error"][: len(error)] = np.frombuffer(error, np.uint8)
    meta = message.meta
    record["has_meta"] = meta is not None
    if meta is not None:
        if len(meta.shape) > MAX_DIMS:
            raise ProtocolError(f"a tensor of {len(meta.shape)} dimensions exceeds {MAX_DIMS}")
        if meta.nbytes > MAX_TENSOR_BYTES:
            raise ProtocolError(f"a tensor of {meta.nbytes} bytes exceeds {MAX_TENSOR_BYTES}")
        record["is_dead"] = meta.is_dead
        record["ndim"] = len(meta.shape)
        record["dims"][: len(meta.shape)] = meta.shape
        record["dtype"] = meta.dtype.str.encode()
        record["tensor_bytes"] = meta.nbytes


def parse(raw: np.ndarray | bytes) -> Message:
    """The message in ``raw`` (at least ``MESSAGE.itemsize`` bytes); ProtocolError if malformed."""
    buffer = np.frombuffer(raw, np.uint8) if isinstance(raw, bytes | bytearray) else raw
    if buffer.nbytes < MESSAGE.itemsize:
        raise ProtocolError(f"a message needs {MESSAGE.itemsize} bytes, got {buffer.nbytes}")
    record = buffer[: MESSAGE.itemsize].view(MESSAGE)[0]
    try:
        kind = MessageType(int(record["type"]))
    except ValueError:
        raise ProtocolError(f"unknown message type {int(record['type'])}") from None
    name = _text(record, "name", MAX_NAME)
    error = _text(record, "error", MAX_ERROR)
    rkey_size = int(record["rkey_size"])
    if rkey_size > MAX_RKEY:
        raise ProtocolError(f"rkey_size {rkey_size} exceeds the field's {MAX_RKEY} bytes")
    meta = _meta(record) if record["has_meta"] else None
    if kind == MessageType.META_DATA_RESPONSE and meta is None:
        raise ProtocolError("a META_DATA_RESPONSE without meta-data")
    return Message(
        kind,
        int(record["request_index"]),
        name=name,
        step_id=int(record["step_id"]),
        remote_addr=int(record["remote_addr"]),
        rkey=bytes(record["rkey"][:rkey_size]),
        meta=meta,
        checksum=int(record["checksum"]),
        error=error,
    )


def _text(record, field: str, limit: int) -> str:
    size = int(record[f"{field}_size"])
    if size > limit:
        raise ProtocolError(f"{field}_size {size} exceeds the field's {limit} bytes")
    try:
        return bytes(record[field][:size]).decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"{field} is not UTF-8") from None


def _meta(record) -> TensorMeta:
    ndim = int(record["ndim"])
    if ndim > MAX_DIMS:
        raise ProtocolError(f"ndim {ndim} exceeds {MAX_DIMS}")
    shape = tuple(int(d) for d in record["dims"][:ndim])
    if any(d < 0 for d in shape):
        raise ProtocolError(f"negative dimension in shape {shape}")
    try:
        dtype = np.dtype(bytes(record["dtype"]).decode("ascii"))
    except (TypeError, ValueError, SyntaxError, UnicodeDecodeError):
        raise ProtocolError(f"unknown dtype {bytes(record['dtype'])!r}") from None
    if dtype.hasobject or dtype.itemsize == 0:
        raise ProtocolError(f"dtype {dtype} cannot be transferred as raw bytes")
    nbytes = TensorMeta(dtype, shape).nbytes
    if nbytes > MAX_TENSOR_BYTES or nbytes != int(record["tensor_bytes"]):
        raise ProtocolError(f"tensor_bytes {int(record['tensor_bytes'])} does not match {dtype} {shape}")
    return TensorMeta(dtype, shape, bool(record["is_dead"]))
