"""zerocopy's wire format: what a sender and a receiver exchange and where each byte lies in the receiver's memory.

- A receiver's control block per tensor and peer: the dynamic path's meta-data record (:data:`META`), then a
  trailer per slot (:data:`TRAILER` bytes: the int64 step, then the flag byte), :data:`TRAILER_STRIDE` apart, each
  followed by its bell at :data:`BELL_AT`.
- A static tensor's slots, one after another (:func:`slot_stride`, :func:`slots_for`, :func:`slots_bytes`).
- A sender's credit table towards one receiver: an entry per tensor of :data:`COUNTERS_BYTES` (receives posted,
  reads done), written only by that receiver.
- The control path's ``connect`` request and its reply (:class:`ConnectRequest`, :class:`ConnectReply`) and the
  dynamic path's meta-data record (:class:`Meta`), each parsed and checked as peer input
  (:mod:`transports.peer_input`): a malformed field is a ValueError that says what is wrong.

The protocol that uses them is ``transports/zerocopy/transport.py``'s (its docstring tells the story).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from transports import peer_input
from transports.base import MAX_NAME_BYTES
from transports.fabric.base import RemoteRegion
from transports.fabric.pool import aligned

MAX_DIMS = peer_input.RECORD_DIMS
MAX_RKEY = peer_input.MAX_RKEY_BYTES
META = np.dtype(
    [
        ("nbytes", "<u8"),
        ("addr", "<u8"),
        ("ndim", "<u4"),
        ("rkey_len", "<u4"),
        ("dims", "<i8", (MAX_DIMS,)),
        ("dtype", "S16"),
        ("rkey", "u1", (MAX_RKEY,)),
    ]
)
TRAILER = 9  # int64 step, then the flag byte
#: trailers of a tensor's slots lie this far apart in its control block (a cache line each)
TRAILER_STRIDE = 64
#: past each trailer, at this offset from its start, the slot's bell (BELL_BYTES): the doorbell a receiver sleeps on
#: and a sender that writes into memory it maps rings (see *Waiting*), and a sender's ask to pull (*Pulls*)
BELL_AT = 16
#: receive slots of a static tensor (see *Credits ahead*); a dynamic one has one
SLOTS = 2
#: a static tensor larger than this has one slot: its own transfer takes far longer than a late credit,
#: and two slots used in turn double what its transfers pass through the caches (measured here, p50 of
#: zerocopy with two slots against one: 4MB 202 against 132 µs, 16MB 1485 against 1098 µs)
TWO_SLOTS_UP_TO = 1 << 20
#: a receiver's control block per tensor and peer: the meta-data record (dynamic mode), then a trailer per slot
TRAILER_AT = aligned(META.itemsize)
CONTROL_BYTES = TRAILER_AT + SLOTS * TRAILER_STRIDE


def slot_stride(nbytes: int) -> int:
    """Bytes from one slot of an ``nbytes`` tensor to the next (aligned as every pool block is; 0 when empty)."""
    return aligned(nbytes) if nbytes else 0


def slots_for(nbytes: int) -> int:
    """Receive slots of a static tensor of ``nbytes``."""
    return SLOTS if nbytes <= TWO_SLOTS_UP_TO else 1


def slots_bytes(nbytes: int, slots: int) -> int:
    """Bytes of ``slots`` slots of an ``nbytes`` tensor, one after the other."""
    return (slots - 1) * slot_stride(nbytes) + nbytes


#: the largest tensor a peer may announce on the dynamic path, where the receiver allocates what the peer
#: announces: a bound on what one meta-data record can make it allocate (and never more than its memory).
#: Static placement has no such bound: the receiver placed the slot itself, for any size its memory holds.
MAX_DYNAMIC_BYTES = 1 << 30
COUNTERS_BYTES = 16  # [receives posted, reads done], uint64 each
#: entries of a sender's credit table towards one receiver (more tensors: another table)
CREDIT_TABLE_ENTRIES = 1024
CREDIT_TABLE_BYTES = CREDIT_TABLE_ENTRIES * COUNTERS_BYTES


def tag(seq: int) -> int:
    """The flag value of transfer ``seq``: never 0 (the cleared flag)."""
    return 1 + seq % 255


def _int(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"'{what}' must be an integer in [{low}, {high}], not {value!r:.40}")
    return value


def _name(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("'name' must be a string")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError("'name' is not encodable as UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"'name' is {size} bytes, more than {MAX_NAME_BYTES}")
    return value


@dataclass(frozen=True)
class ConnectRequest:
    """A sender's ``connect``: tensor ``name`` from rank ``src``, its device, and where to write credits."""

    name: str
    src: int
    device: list[bytes]
    counters: RemoteRegion
    #: the counters' entry in the sender's credit table (which starts ``16 * index`` bytes before them)
    index: int

    @property
    def table(self) -> RemoteRegion:
        """The whole credit table the counters lie in (the sender's memory, written only by this receiver)."""
        return RemoteRegion(self.counters.addr - COUNTERS_BYTES * self.index, CREDIT_TABLE_BYTES, self.counters.rkey)

    @classmethod
    def parse(cls, request: Any, cluster_size: int, own_rank: int) -> ConnectRequest:
        """Checks every field; ValueError says what is wrong."""
        if not isinstance(request, dict) or set(request) != {"name", "src", "device", "counters", "index"}:
            raise ValueError("'connect' takes exactly 'name', 'src', 'device', 'counters' and 'index'")
        src = _int(request["src"], "src", 0, cluster_size - 1)
        if src == own_rank:
            raise ValueError(f"'src' {src} is this rank")
        counters = peer_input.remote_region(request["counters"], what="'counters'", length=COUNTERS_BYTES)
        index = _int(request["index"], "index", 0, CREDIT_TABLE_ENTRIES - 1)
        if counters.addr < COUNTERS_BYTES * index or \
                counters.addr - COUNTERS_BYTES * index + CREDIT_TABLE_BYTES > 2**64:
            raise ValueError(f"'counters' at {counters.addr:#x} cannot be entry {index} of a credit table")
        return cls(_name(request["name"]), src, peer_input.device_address(request["device"]), counters, index)


@dataclass(frozen=True)
class ConnectReply:
    """A receiver's answer to ``connect``: the mode, its control block, and (static) the slots, one after the
    other in ``slot`` (``slots`` of them, 1 when the reply does not say)."""

    mode: str
    control: RemoteRegion
    slot: RemoteRegion | None = None
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    slots: int = 1

    @classmethod
    def parse(cls, reply: Any, limit: int = peer_input.MAX_ARRAY_BYTES) -> ConnectReply:
        """Checks every field (:mod:`transports.peer_input`); ValueError says what is wrong.

        A static slot's shape and dtype must describe at most ``limit`` bytes and exactly the slot's length.
        """
        if not isinstance(reply, dict) or reply.get("mode") not in ("static", "dynamic"):
            raise ValueError("a 'connect' reply must say whether the tensor is 'static' or 'dynamic'")
        fields = {"mode", "control"} | ({"slot", "shape", "dtype"} if reply["mode"] == "static" else set())
        if set(reply) - {"slots"} != fields or ("slots" in reply and reply["mode"] != "static"):
            raise ValueError(f"a {reply['mode']} 'connect' reply has exactly {sorted(fields)}"
                             + (" and may have 'slots'" if reply["mode"] == "static" else ""))
        control = peer_input.remote_region(reply["control"], what="'control'", length=CONTROL_BYTES)
        if reply["mode"] == "dynamic":
            return cls("dynamic", control)
        dtype = peer_input.dtype(reply["dtype"])
        shape = peer_input.shape(reply["shape"], max_dims=MAX_DIMS)
        nbytes = peer_input.size(dtype, shape, limit=limit)
        slots = _int(reply.get("slots", 1), "slots", 1, SLOTS)
        slot = peer_input.remote_region(reply["slot"], what="'slot'")
        if slot.length != slots_bytes(nbytes, slots):
            raise ValueError(f"'slot' of {slot.length} bytes does not hold {slots} of {dtype} {shape} "
                             f"({nbytes} bytes each, {slot_stride(nbytes)} apart)")
        return cls("static", control, slot, shape, dtype, slots)


@dataclass(frozen=True)
class Meta:
    """A dynamic transfer's meta-data record, as the sender wrote it into the receiver's control block."""

    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    source: RemoteRegion | None  # the sender's buffer (None for an empty tensor)

    @classmethod
    def parse(cls, record: np.ndarray, limit: int = MAX_DYNAMIC_BYTES) -> Meta:
        """Reads and checks a record (``META``, with :mod:`transports.peer_input`); ValueError says what is wrong.

        The receiver allocates ``nbytes`` and reads that many bytes from ``addr``: the size must
        agree with shape and dtype and stay under ``limit``, and the source must not wrap.
        """
        meta = record.view(META)[0] if record.dtype != META else record
        shape = peer_input.shape(meta["dims"], ndim=int(meta["ndim"]))
        dtype = peer_input.dtype(bytes(meta["dtype"]).rstrip(b"\0"))
        nbytes = peer_input.size(dtype, shape, limit=limit, announced=int(meta["nbytes"]))
        if nbytes == 0:
            return cls(dtype, shape, 0, None)
        addr = int(meta["addr"])
        rkey = peer_input.remote_key(meta["rkey"], int(meta["rkey_len"]))
        if addr + nbytes > 2**64:
            raise ValueError(f"a source of {nbytes} bytes at {addr:#x} wraps around the address space")
        return cls(dtype, shape, nbytes, RemoteRegion(addr, nbytes, rkey))
