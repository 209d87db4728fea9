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
from typing import Any

import numpy as np

from transports.fabric.base import RemoteRegion

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
    ERROR_STATUS = 4  # sender -> receiver: the request failed on the sender (or was cancelled)
    # not in the note: a receiver that gave up on a request (its recv timed out) withdraws it; the
    # sender answers with ERROR_STATUS once it will write no more for it, and only then does the
    # receiver reuse the request's buffer and slot
    CANCEL = 5


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


# setup over gRPC: the ``link`` control call ------------------------------------------

#: bounds on a peer's fabric address: how many workers, how long each (UCX's are a few hundred bytes)
MAX_DEVICE_ADDRESSES = 64
MAX_DEVICE_ADDRESS_BYTES = 16 << 10


@dataclass(frozen=True)
class LinkRequest:
    """A peer's ``link`` call (or the reply to ours), validated: who it is and where to write."""

    rank: int
    device: tuple[bytes, ...]
    message: RemoteRegion
    ring: RemoteRegion
    slots: int


def parse_link(request: Any, *, cluster_size: int, own_rank: int | None, slots: int, ring_entry: int,
               want_rank: bool = True) -> LinkRequest:
    """Validate a ``link`` request (a JSON object from a peer) before anything is allocated for it.

    ProtocolError names the field: ``rank`` must be another rank of the cluster, ``device`` a short
    list of hex-encoded fabric addresses, ``message`` and ``ring`` region descriptors whose lengths
    are exactly a message record and ``slots`` ring entries, ``slots`` the queue depth this rank uses.
    """
    if not isinstance(request, dict):
        raise ProtocolError(f"a link request is a JSON object, got {type(request).__name__}")
    rank = -1
    if want_rank:
        rank = request.get("rank")
        if not _is_int(rank) or not 0 <= rank < cluster_size:
            raise ProtocolError(f"rank {_short(rank)} is not a rank of this cluster of {cluster_size}")
        if rank == own_rank:
            raise ProtocolError(f"rank {rank} is this rank's own")
    got_slots = request.get("slots")
    if not _is_int(got_slots):
        raise ProtocolError(f"slots {_short(got_slots)} is not an integer")
    if got_slots != slots:
        raise ProtocolError(f"the peer uses RDMA_QP_QUEUE_DEPTH={got_slots}, this rank {slots}; "
                            "set the same on every rank")
    device = request.get("device")
    if not isinstance(device, list) or not 1 <= len(device) <= MAX_DEVICE_ADDRESSES:
        raise ProtocolError(f"device must be a list of 1 to {MAX_DEVICE_ADDRESSES} addresses")
    addresses = tuple(_hex(address, "device", MAX_DEVICE_ADDRESS_BYTES) for address in device)
    if any(not address for address in addresses):
        raise ProtocolError("device holds an empty address")
    message = _region(request.get("message"), "message", MESSAGE.itemsize)
    ring = _region(request.get("ring"), "ring", slots * ring_entry)
    return LinkRequest(rank, addresses, message, ring, slots)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _hex(value: Any, field: str, limit: int) -> bytes:
    if not isinstance(value, str) or len(value) > 2 * limit:
        raise ProtocolError(f"{field} must hold hex strings of at most {limit} bytes")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"{field} is not hex") from None


def _region(value: Any, field: str, length: int) -> RemoteRegion:
    if not isinstance(value, dict):
        raise ProtocolError(f"{field} must be a region descriptor (addr, length, rkey)")
    addr, got = value.get("addr"), value.get("length")
    if not _is_int(addr) or not 0 < addr < 2**64 or not _is_int(got):
        raise ProtocolError(f"{field} has a malformed address or length")
    if got != length or addr + length > 2**64:
        raise ProtocolError(f"{field} is {_short(got)} bytes long, expected {length}")
    rkey = _hex(value.get("rkey"), f"{field}.rkey", MAX_RKEY)
    if not rkey:
        raise ProtocolError(f"{field} has an empty remote key")
    return RemoteRegion(addr, length, rkey)
