"""The paper's RDMA.zerocp: one-sided writes straight into the peer's tensor, and a flag byte.

*Static placement* (shape known from the plan): at ``plan()`` the receiver
places each incoming tensor in registered memory, followed by a flag byte.
The sender learns the slot's address and remote key over the control path
once, then every transfer is: write the data, flush, write the flag, flush.
The receiver polls the flag, clears it, and hands out a view of the slot: no
copy anywhere when the sender built the tensor in memory from ``allocate()``.

*Dynamic allocation* (shape not known ahead): the receiver keeps a fixed-size
meta-data slot per tensor; the sender writes the shape, dtype, its buffer's
address and remote key there (then the flag); the receiver allocates from its
pool, pulls the data with a one-sided read, and tells the sender its buffer is
free again.

*Never overwriting an unconsumed tensor*: a slot holds one transfer. Calling
``recv`` for a tensor is the receiver's promise that it is done with the
previous transfer of that tensor from that peer; it then grants the sender a
credit by writing the number of receives posted into a counter in the
sender's memory. The sender's transfer ``n`` waits for credit ``n + 1``. A
received tensor is therefore valid until the next ``recv`` of the same name
from the same peer, and the flag carries the transfer's sequence number so a
stale flag is never mistaken for a new one.

Waiting (for a flag or a credit) spins for a moment, then backs off in sleeps
that wake early when the fabric's progress threads see traffic, so an idle
receiver burns no core; while waiting it checks that the peer is alive.
"""

from __future__ import annotations

import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transports.base import (
    Key,
    PeerError,
    TensorSpec,
    TransportError,
    contiguous,
)
from transports.fabric.base import Channel, FabricError, RemoteRegion
from transports.fabric.pool import Block, aligned
from transports.on_fabric import FabricTransport

MAX_DIMS = 8
MAX_RKEY = 1024
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
#: a receiver's control block per tensor and peer: the meta-data record (dynamic mode), then the trailer
TRAILER_AT = aligned(META.itemsize)
CONTROL_BYTES = TRAILER_AT + TRAILER


def tag(seq: int) -> int:
    """The flag value of transfer ``seq``: never 0 (the cleared flag)."""
    return 1 + seq % 255


@dataclass(eq=False)
class _Outgoing:
    """Sender-side state of one tensor name towards one peer."""

    name: str
    dst: int
    channel: Channel
    counters: Block  # [credit, done], written by the receiver
    staging: Block  # flag byte and meta-data record to write from
    mode: str = ""
    slot: RemoteRegion | None = None  # where the data goes (static mode)
    control: RemoteRegion | None = None  # the receiver's meta-data record and trailer
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    seq: int = 0
    copy_buffer: Block | None = None  # rdma_cp's registered staging buffer
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        # [receives posted, reads done], written by the receiver; one view, polled often
        self.credit = self.counters.view(np.uint64, (2,))
        self.credit[:] = 0


@dataclass(eq=False)
class _Incoming:
    """Receiver-side state of one tensor name from one peer."""

    name: str
    src: int
    mode: str
    control: Block  # meta-data record (dynamic mode), then the trailer: step (int64) and flag byte
    data: Block | None = None  # the preallocated tensor (static mode)
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    seq: int = 0
    posted: int = 0
    sender_counters: RemoteRegion | None = None
    channel: Channel | None = None
    counter_staging: Block | None = None
    lent: Block | None = None  # a dynamically allocated tensor handed out, freed at the next recv
    lock: threading.Lock = field(default_factory=threading.Lock)  # one recv at a time
    grant_lock: threading.Lock = field(default_factory=threading.Lock)  # connection and credits


class ZeroCopyTransport(FabricTransport):
    """RDMA.zerocp over the fabric (UCX); see the module docstring for the protocol."""

    name = "zerocopy"
    #: whether the sender copies every tensor into registered memory first (rdma_cp)
    stages_sends = False

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._outgoing: dict[tuple[str, int], _Outgoing] = {}
        self._sending: set[Key] = set()
        self._incoming: dict[tuple[str, int], _Incoming] = {}

    def control_handlers(self) -> dict[str, Any]:
        return {"connect": self._on_connect}

    # planning and allocation -------------------------------------------------

    def plan(self, specs) -> None:
        specs = list(specs)
        super().plan(specs)
        incoming = [s for s in specs if s.dst == self.rank and s.shape is not None]
        outgoing = [s for s in specs if s.src == self.rank and s.shape is not None]
        sizes = [s.nbytes for s in incoming] + [CONTROL_BYTES] * len(incoming)
        if not self.stages_sends:
            sizes += [s.nbytes for s in outgoing]
        self.pool.reserve(sizes)
        for spec in incoming:
            self._incoming_slot(spec.name, spec.src)

    def allocate(self, spec: TensorSpec) -> np.ndarray:
        if spec.shape is None:
            raise ValueError(f"cannot allocate tensor '{spec.name}': its shape is not known statically")
        if self.stages_sends:  # RDMA.cp: the analysis is off, tensors live in ordinary memory
            return super().allocate(spec)
        return self.pool.alloc(spec.nbytes).view(spec.dtype, spec.shape)

    # setup over the control path ---------------------------------------------

    def _incoming_slot(self, name: str, src: int) -> _Incoming:
        """The receive slot for ``name`` from ``src``: static when the plan knows its shape."""
        with self._lock:
            key = (name, src)
            if key not in self._incoming:
                spec = self.specs.get((name, src, self.rank))
                control = self.pool.alloc(CONTROL_BYTES)
                control.array[TRAILER_AT:] = 0
                if spec is not None and spec.shape is not None:
                    incoming = _Incoming(name, src, "static", control, self.pool.alloc(spec.nbytes), spec.shape,
                                         spec.dtype)
                else:
                    incoming = _Incoming(name, src, "dynamic", control)
                incoming.counter_staging = self.pool.alloc(8)
                self._incoming[key] = incoming
            return self._incoming[key]

    def _on_connect(self, request: dict[str, Any]) -> dict[str, Any]:
        """A sender introduces itself for one tensor; answer with the slot to write into."""
        src = int(request["src"])
        incoming = self._incoming_slot(request["name"], src)
        with incoming.grant_lock:
            self._peer_devices[src] = [bytes.fromhex(a) for a in request["device"]]
            incoming.channel = self.device.channel(self._peer_devices[src])
            incoming.sender_counters = RemoteRegion.from_json(request["counters"])
            if incoming.posted:
                self._grant(incoming)
        reply = {"mode": incoming.mode, "control": incoming.control.remote().to_json()}
        if incoming.mode == "static":
            reply.update(slot=incoming.data.remote().to_json(), shape=list(incoming.shape), dtype=incoming.dtype.str)
        return reply

    def _connect(self, name: str, dst: int) -> _Outgoing:
        with self._lock:
            outgoing = self._outgoing.get((name, dst))
        if outgoing is not None:
            return outgoing
        # tensors are spread over the lanes (and so the progress threads) by name
        channel = self.device.channel(self._peer_device(dst), lane=zlib.crc32(name.encode()))
        outgoing = _Outgoing(name, dst, channel, counters=self.pool.alloc(16),
                             staging=self.pool.alloc(CONTROL_BYTES))
        reply = self._peer(dst).call(
            "connect", timeout=self.timeout_s, name=name, src=self.rank,
            device=[a.hex() for a in self.device.address], counters=outgoing.counters.remote().to_json(),
        )
        self.ledger.add(control_messages=1)
        outgoing.mode = reply["mode"]
        outgoing.control = RemoteRegion.from_json(reply["control"])
        if outgoing.mode == "static":
            outgoing.slot = RemoteRegion.from_json(reply["slot"])
            outgoing.shape, outgoing.dtype = tuple(reply["shape"]), np.dtype(reply["dtype"])
        with self._lock:
            return self._outgoing.setdefault((name, dst), outgoing)

    # sending ---------------------------------------------------------------

    def send(self, key: Key, array: np.ndarray, timeout: float | None = None) -> None:
        self._check_key(key, "send")
        self._claim(key)
        self._send_claimed(key, array, timeout)

    def _claim(self, key: Key) -> None:
        with self._lock:
            if key in self._sending:
                raise ValueError(f"{self.name}: {key} is already being sent")
            self._sending.add(key)

    def _send_claimed(self, key: Key, array: np.ndarray, timeout: float | None = None) -> None:
        try:
            with self._operation():
                self._send(key, array, time.monotonic() + (self.timeout_s if timeout is None else timeout))
        finally:
            with self._lock:
                self._sending.discard(key)

    def _send(self, key: Key, array: np.ndarray, deadline: float) -> None:
        try:
            outgoing = self._connect(key.name, key.dst)
        except FabricError as exc:
            raise PeerError(f"{self.name}: cannot reach {self.peer_name(key.dst)}: {exc}") from None
        array = contiguous(np.asarray(array), self.ledger)
        with outgoing.lock:
            seq = outgoing.seq
            self._wait_until(lambda: outgoing.credit[0] > seq, f"credit to send {key}", key.dst, deadline,
                             outgoing.channel)
            if outgoing.mode == "static":
                self._send_static(outgoing, key, array, seq)
            else:
                self._send_dynamic(outgoing, key, array, seq, deadline)
            outgoing.seq += 1
        self.ledger.add(tensors_sent=1, payload_bytes_sent=array.nbytes)

    def send_async(self, key: Key, array: np.ndarray) -> Future:
        self._check_key(key, "send")
        self._claim(key)  # now, so that a duplicate fails even before this send runs
        return self._submit(self._send_claimed, key, array)

    def _source(self, outgoing: _Outgoing, array: np.ndarray) -> tuple[np.ndarray, RemoteRegion]:
        """Registered memory holding ``array``'s bytes, and its descriptor for a peer's read."""
        flat = array.reshape(-1).view(np.uint8) if array.nbytes else np.empty(0, np.uint8)
        if self.stages_sends:
            if outgoing.copy_buffer is None or outgoing.copy_buffer.nbytes < array.nbytes:
                if outgoing.copy_buffer is not None:
                    self.pool.free(outgoing.copy_buffer)
                outgoing.copy_buffer = self.pool.alloc(array.nbytes)
            staged = outgoing.copy_buffer.array[: array.nbytes]
            staged[...] = flat
            self.ledger.add(copied_bytes=array.nbytes)
            return staged, outgoing.copy_buffer.remote(0, max(array.nbytes, 1))
        region = self.pool.segment_of(flat)
        if region is None:
            if not self.device.is_registered(flat):
                self.ledger.add(registrations=1)
            region = self.device.register(flat)
        start = flat.__array_interface__["data"][0] - region.address
        return flat, region.export().at(start, array.nbytes)

    def _write_then_flag(self, outgoing: _Outgoing, data: np.ndarray, target: RemoteRegion, seq: int,
                         key: Key) -> None:
        """Write the data, flush, write the trailer (step, then the flag byte last), flush."""
        channel = outgoing.channel
        if data.nbytes:
            self._fabric(channel, channel.write(data, target), f"writing {key}", key.dst)
            self._fabric(channel, channel.flush(), f"flushing {key}", key.dst)
        trailer = outgoing.staging.array[TRAILER_AT:]
        trailer[:8].view(np.int64)[0] = key.step
        trailer[8] = tag(seq)
        self._fabric(channel, channel.write(trailer, outgoing.control.at(TRAILER_AT, TRAILER)),
                     f"writing the flag of {key}", key.dst)
        self._fabric(channel, channel.flush(), f"flushing the flag of {key}", key.dst)
        self.ledger.add(control_messages=1)

    def _send_static(self, outgoing: _Outgoing, key: Key, array: np.ndarray, seq: int) -> None:
        if array.shape != outgoing.shape or array.dtype != outgoing.dtype:
            raise ValueError(
                f"{self.name}: {key} has {array.dtype} {array.shape}, but the receiver placed it as "
                f"{outgoing.dtype} {outgoing.shape}"
            )
        data, _ = self._source(outgoing, array)
        self._write_then_flag(outgoing, data, outgoing.slot, seq, key)

    def _send_dynamic(self, outgoing: _Outgoing, key: Key, array: np.ndarray, seq: int, deadline: float) -> None:
        if array.ndim > MAX_DIMS:
            raise ValueError(f"{self.name}: {key} has {array.ndim} dimensions; at most {MAX_DIMS} are supported")
        _, source = self._source(outgoing, array)
        if len(source.rkey) > MAX_RKEY:
            raise TransportError(f"{self.name}: a remote key of {len(source.rkey)} bytes exceeds {MAX_RKEY}")
        meta = outgoing.staging.array[: META.itemsize].view(META)[0]
        meta["nbytes"] = array.nbytes
        meta["addr"] = source.addr if array.nbytes else 0
        meta["ndim"] = array.ndim
        meta["dims"][: array.ndim] = array.shape
        meta["dtype"] = array.dtype.str.encode()
        meta["rkey_len"] = len(source.rkey) if array.nbytes else 0
        if array.nbytes:
            meta["rkey"][: len(source.rkey)] = np.frombuffer(source.rkey, np.uint8)
        record = outgoing.staging.array[: META.itemsize]
        self._write_then_flag(outgoing, record, outgoing.control.at(0, META.itemsize), seq, key)
        # the sender's buffer is in use until the receiver has read it
        done = outgoing.credit
        self._wait_until(lambda: done[1] > seq, f"the receiver to read {key}", key.dst, deadline, outgoing.channel)

    # receiving -------------------------------------------------------------

    def recv(self, key: Key, timeout: float | None = None) -> np.ndarray:
        self._check_key(key, "recv")
        with self._operation():
            return self._recv(key, time.monotonic() + (self.timeout_s if timeout is None else timeout))

    def _recv(self, key: Key, deadline: float) -> np.ndarray:
        incoming = self._incoming_slot(key.name, key.src)
        with incoming.lock:
            if incoming.lent is not None:  # the previous transfer is consumed: its buffer is free again
                self.pool.free(incoming.lent)
                incoming.lent = None
            with incoming.grant_lock:
                incoming.posted += 1
                if incoming.channel is not None:
                    self._grant(incoming)
            seq = incoming.seq
            trailer = incoming.control.array[TRAILER_AT:]
            self._wait_until(lambda: trailer[8] == tag(seq), f"recv of {key}", key.src, deadline, incoming.channel)
            trailer[8] = 0
            incoming.seq += 1
            step = int(trailer[:8].view(np.int64)[0])
            if step != key.step:
                raise TransportError(
                    f"{self.name}: asked for {key} but step {step} arrived: transfers of one tensor must be "
                    "received in the order they are sent"
                )
            if incoming.mode == "static":
                array = incoming.data.view(incoming.dtype, incoming.shape)
            else:
                array = self._pull(incoming, key, seq)
        self.ledger.add(tensors_received=1, payload_bytes_received=array.nbytes)
        return array

    def recv_async(self, key: Key) -> Future:
        self._check_key(key, "recv")
        return self._submit(self.recv, key)

    def _grant(self, incoming: _Incoming, counter: int = 0, value: int | None = None) -> None:
        """Write ``value`` (default: receives posted) into the sender's counter ``counter``.

        The caller holds ``incoming.grant_lock``.
        """
        staging = incoming.counter_staging.view(np.uint64, (1,))
        staging[0] = incoming.posted if value is None else value
        target = incoming.sender_counters.at(8 * counter, 8)
        channel = incoming.channel
        self._fabric(channel, channel.write(incoming.counter_staging.array, target), "granting a credit", incoming.src)
        self._fabric(channel, channel.flush(), "granting a credit", incoming.src)
        self.ledger.add(control_messages=1)

    def _pull(self, incoming: _Incoming, key: Key, seq: int) -> np.ndarray:
        meta = incoming.control.array[: META.itemsize].view(META)[0]
        ndim, nbytes = int(meta["ndim"]), int(meta["nbytes"])
        try:
            dtype = np.dtype(meta["dtype"].decode())
        except (TypeError, UnicodeDecodeError):
            raise PeerError(f"{self.name}: {self.peer_name(key.src)} sent an unknown dtype for {key}") from None
        shape = tuple(int(d) for d in meta["dims"][:ndim])
        if ndim > MAX_DIMS or int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != nbytes:
            raise PeerError(f"{self.name}: {self.peer_name(key.src)} sent inconsistent meta-data for {key}")
        block = self.pool.alloc(nbytes)
        if nbytes:
            source = RemoteRegion(int(meta["addr"]), nbytes, bytes(meta["rkey"][: int(meta["rkey_len"])]))
            channel = incoming.channel
            self._fabric(channel, channel.read(block.array, source), f"reading {key}", key.src)
        with incoming.grant_lock:
            self._grant(incoming, counter=1, value=seq + 1)  # the sender may reuse its buffer
        incoming.lent = block
        return block.view(dtype, shape)
