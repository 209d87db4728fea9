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

from transports import peer_input
from transports.dtypes import dtype_text
from transports.fabric.base import RemoteRegion

MAX_NAME = 512
MAX_DIMS = peer_input.RECORD_DIMS
MAX_RKEY = peer_input.MAX_RKEY_BYTES
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


class ProtocolError(peer_input.PeerInputError):
    """A message or ``link`` call from a peer that does not parse; the text says which field is wrong."""


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
        raise ValueError(f"tensor name of {len(name)} bytes exceeds {MAX_NAME}")
    if len(message.rkey) > MAX_RKEY:
        raise ValueError(f"remote key of {len(message.rkey)} bytes exceeds {MAX_RKEY}")
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
            raise ValueError(f"a tensor of {len(meta.shape)} dimensions exceeds {MAX_DIMS}")
        if meta.nbytes > MAX_TENSOR_BYTES:
            raise ValueError(f"a tensor of {meta.nbytes} bytes exceeds {MAX_TENSOR_BYTES}")
        record["is_dead"] = meta.is_dead
        record["ndim"] = len(meta.shape)
        record["dims"][: len(meta.shape)] = meta.shape
        record["dtype"] = dtype_text(meta.dtype).encode()
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
    rkey = peer_input.remote_key(record["rkey"], int(record["rkey_size"]), required=False, error=ProtocolError)
    meta = _meta(record) if record["has_meta"] else None
    if kind == MessageType.META_DATA_RESPONSE and meta is None:
        raise ProtocolError("a META_DATA_RESPONSE without meta-data")
    return Message(
        kind,
        int(record["request_index"]),
        name=name,
        step_id=int(record["step_id"]),
        remote_addr=int(record["remote_addr"]),
        rkey=rkey,
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
    shape = peer_input.shape(record["dims"], ndim=int(record["ndim"]), error=ProtocolError)
    dtype = peer_input.dtype(bytes(record["dtype"]), error=ProtocolError)
    peer_input.size(dtype, shape, limit=MAX_TENSOR_BYTES, announced=int(record["tensor_bytes"]), error=ProtocolError)
    return TensorMeta(dtype, shape, bool(record["is_dead"]))


# setup over gRPC: the ``link`` control call ------------------------------------------

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
    addresses = tuple(peer_input.device_address(request.get("device"), error=ProtocolError))
    message = peer_input.remote_region(request.get("message"), what="'message'", length=MESSAGE.itemsize,
                                       error=ProtocolError)
    ring = peer_input.remote_region(request.get("ring"), what="'ring'", length=slots * ring_entry, error=ProtocolError)
    return LinkRequest(rank, addresses, message, ring, slots)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
