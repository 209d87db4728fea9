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

import contextlib
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transports.base import (
    MAX_NAME_BYTES,
    Key,
    PeerError,
    TensorSpec,
    TransportClosed,
    TransportError,
    contiguous,
    dtype_problem,
)
from transports.fabric.base import Channel, FabricError, RemoteRegion
from transports.fabric.pool import Block, aligned
from transports.on_fabric import FabricTransport, parse_device

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


#: the largest tensor a peer may announce on the dynamic path (the receiver allocates it)
MAX_DYNAMIC_BYTES = 1 << 30  # the largest size bench micro measures
COUNTERS_BYTES = 16


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


def _dtype(value: Any) -> np.dtype:
    if not isinstance(value, str | bytes) or len(value) > 16:
        raise ValueError(f"'dtype' must be a short dtype string, not {value!r:.40}")
    try:
        dtype = np.dtype(value.decode("ascii") if isinstance(value, bytes) else value)
    except (TypeError, ValueError, UnicodeDecodeError, SyntaxError):
        raise ValueError(f"'dtype' {value!r:.40} is not a dtype") from None
    if (problem := dtype_problem(dtype)) is not None:
        raise ValueError(f"'dtype' {dtype}: {problem}")
    return dtype


def _shape(value: Any, dtype: np.dtype, limit: int) -> tuple[tuple[int, ...], int]:
    """A shape from a peer and its size in bytes, which must not exceed ``limit``."""
    if not isinstance(value, list | tuple) or len(value) > MAX_DIMS:
        raise ValueError(f"'shape' must be a list of at most {MAX_DIMS} dimensions")
    shape = tuple(_int(d, "shape", 0, limit) for d in value)
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
        if nbytes > limit:
            raise ValueError(f"'shape' {shape} of {dtype} exceeds {limit} bytes")
    return shape, nbytes


@dataclass(frozen=True)
class ConnectRequest:
    """A sender's ``connect``: tensor ``name`` from rank ``src``, its device, and where to write credits."""

    name: str
    src: int
    device: list[bytes]
    counters: RemoteRegion

    @classmethod
    def parse(cls, request: Any, cluster_size: int, own_rank: int) -> ConnectRequest:
        """Checks every field; ValueError says what is wrong."""
        if not isinstance(request, dict) or set(request) != {"name", "src", "device", "counters"}:
            raise ValueError("'connect' takes exactly 'name', 'src', 'device' and 'counters'")
        src = _int(request["src"], "src", 0, cluster_size - 1)
        if src == own_rank:
            raise ValueError(f"'src' {src} is this rank")
        counters = RemoteRegion.from_json(request["counters"])
        if counters.length != COUNTERS_BYTES:
            raise ValueError(f"'counters' must describe {COUNTERS_BYTES} bytes, not {counters.length}")
        return cls(_name(request["name"]), src, parse_device(request["device"]), counters)


@dataclass(frozen=True)
class ConnectReply:
    """A receiver's answer to ``connect``: the mode, its control block, and (static) the slot."""

    mode: str
    control: RemoteRegion
    slot: RemoteRegion | None = None
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None

    @classmethod
    def parse(cls, reply: Any) -> ConnectReply:
        """Checks every field; ValueError says what is wrong."""
        if not isinstance(reply, dict) or reply.get("mode") not in ("static", "dynamic"):
            raise ValueError("a 'connect' reply must say whether the tensor is 'static' or 'dynamic'")
        fields = {"mode", "control"} | ({"slot", "shape", "dtype"} if reply["mode"] == "static" else set())
        if set(reply) != fields:
            raise ValueError(f"a {reply['mode']} 'connect' reply has exactly {sorted(fields)}")
        control = RemoteRegion.from_json(reply["control"])
        if control.length != CONTROL_BYTES:
            raise ValueError(f"'control' must describe {CONTROL_BYTES} bytes, not {control.length}")
        if reply["mode"] == "dynamic":
            return cls("dynamic", control)
        dtype = _dtype(reply["dtype"])
        shape, nbytes = _shape(reply["shape"], dtype, MAX_DYNAMIC_BYTES)
        slot = RemoteRegion.from_json(reply["slot"])
        if slot.length != nbytes:
            raise ValueError(f"'slot' of {slot.length} bytes does not hold {dtype} {shape} ({nbytes} bytes)")
        return cls("static", control, slot, shape, dtype)


@dataclass(frozen=True)
class Meta:
    """A dynamic transfer's meta-data record, as the sender wrote it into the receiver's control block."""

    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    source: RemoteRegion | None  # the sender's buffer (None for an empty tensor)

    @classmethod
    def parse(cls, record: np.ndarray, limit: int = MAX_DYNAMIC_BYTES) -> Meta:
        """Reads and checks a record (``META``); ValueError says what is wrong.

        The receiver allocates ``nbytes`` and reads that many bytes from ``addr``: the size must
        agree with shape and dtype and stay under ``limit``, and the source must not wrap.
        """
        meta = record.view(META)[0] if record.dtype != META else record
        ndim, nbytes, rkey_len = int(meta["ndim"]), int(meta["nbytes"]), int(meta["rkey_len"])
        if ndim > MAX_DIMS:
            raise ValueError(f"{ndim} dimensions, more than {MAX_DIMS}")
        dtype = _dtype(bytes(meta["dtype"]).rstrip(b"\0"))
        shape, size = _shape([int(d) for d in meta["dims"][:ndim]], dtype, limit)
        if size != nbytes:
            raise ValueError(f"{nbytes} bytes announced for {dtype} {shape} ({size} bytes)")
        if nbytes == 0:
            return cls(dtype, shape, 0, None)
        addr = int(meta["addr"])
        if not 0 < rkey_len <= MAX_RKEY:
            raise ValueError(f"a remote key of {rkey_len} bytes")
        if addr + nbytes > 2**64:
            raise ValueError(f"a source of {nbytes} bytes at {addr:#x} wraps around the address space")
        return cls(dtype, shape, nbytes, RemoteRegion(addr, nbytes, bytes(meta["rkey"][:rkey_len])))


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
    connected_by: Any = None  # the ConnectRequest that connected it (a tensor is connected once)
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
        #: connects this rank has in flight, (name, dst) -> what it sent, for the receiver's ``verify``
        self._connecting: dict[tuple[str, int], dict[str, Any]] = {}
        #: the largest tensor a peer may announce on the dynamic path
        self.max_dynamic_bytes = MAX_DYNAMIC_BYTES

    def control_handlers(self) -> dict[str, Any]:
        return {"connect": self._on_connect, "verify": self._on_verify}

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
        """A sender introduces itself for one tensor; answer with the slot to write into.

        Nothing is allocated or changed before the request is checked: its fields, then that rank
        ``src`` itself is connecting (asked on its own control server, at its address in the cluster:
        every caller holds the run's token, so the claim of a rank is what needs checking), then that
        its device is usable. A tensor is connected once: a second, different connect for the same
        name and source is refused (the same one again is answered alike).
        """
        try:
            connect = ConnectRequest.parse(request, self.cluster.size, self.rank)
        except ValueError as exc:
            raise ValueError(f"malformed 'connect': {exc}") from None
        key = (connect.name, connect.src)
        with self._lock:
            existing = self._incoming.get(key)
        if existing is not None and existing.connected_by is not None and existing.connected_by != connect:
            raise ValueError(f"{key} is already connected by {self.peer_name(connect.src)}; a rank connects once")
        if existing is None or existing.connected_by != connect:
            self._verify_claim(connect, request)
            try:
                channel = self.device.channel(connect.device)
            except FabricError as exc:
                raise ValueError(f"cannot connect to the device of {self.peer_name(connect.src)}: {exc}") from None
        incoming = self._incoming_slot(connect.name, connect.src)
        with incoming.grant_lock:
            if incoming.connected_by is not None and incoming.connected_by != connect:
                raise ValueError(f"{key} is already connected by {self.peer_name(connect.src)}; a rank connects once")
            if incoming.connected_by is None:
                with self._lock:  # verified: its device, and that it was heard from (its death counts)
                    self._peer_devices.setdefault(connect.src, connect.device)
                incoming.channel = channel
                incoming.sender_counters = connect.counters
                incoming.connected_by = connect
                if incoming.posted:  # credits go out on the transport's threads, never the control path's
                    self._submit_grant(incoming)
        reply = {"mode": incoming.mode, "control": incoming.control.remote().to_json()}
        if incoming.mode == "static":
            reply.update(slot=incoming.data.remote().to_json(), shape=list(incoming.shape), dtype=incoming.dtype.str)
        return reply

    def _verify_claim(self, connect: ConnectRequest, request: dict[str, Any]) -> None:
        """Ask rank ``connect.src`` whether it is connecting to us with exactly this request."""
        try:
            answer = self._peer(connect.src).call("verify", timeout=self.timeout_s, dst=self.rank,
                                                   request=request)
        except PeerError as exc:
            raise ValueError(f"'connect' as {self.peer_name(connect.src)} could not be verified: {exc}") from None
        if answer != {"connecting": True}:
            raise ValueError(f"'connect' claims to come from {self.peer_name(connect.src)}, which denies it")

    def _on_verify(self, request: dict[str, Any]) -> dict[str, Any]:
        """A receiver asks whether this rank sent ``request`` (a connect) to it: only if it did, exactly."""
        if not isinstance(request, dict) or set(request) != {"dst", "request"}:
            raise ValueError("'verify' takes exactly 'dst' and 'request'")
        sent = request["request"]
        key = (sent.get("name"), request["dst"]) if isinstance(sent, dict) else None
        with self._lock:
            mine = self._connecting.get(key) if key is not None and isinstance(key[0], str) else None
        return {"connecting": mine is not None and mine == sent}

    def _submit_grant(self, incoming: _Incoming) -> None:
        def grant() -> None:
            # a failure here is found by the receiver, which waits for this peer and checks it
            with incoming.grant_lock, contextlib.suppress(TransportError):
                self._grant(incoming)

        with contextlib.suppress(TransportClosed):
            self._submit(grant)

    def _connect(self, name: str, dst: int) -> _Outgoing:
        with self._lock:
            outgoing = self._outgoing.get((name, dst))
        if outgoing is not None:
            return outgoing
        # tensors are spread over the lanes (and so the progress threads) by name
        channel = self.device.channel(self._peer_device(dst), lane=zlib.crc32(name.encode()))
        outgoing = _Outgoing(name, dst, channel, counters=self.pool.alloc(COUNTERS_BYTES),
                             staging=self.pool.alloc(CONTROL_BYTES))
        request = {"name": name, "src": self.rank, "device": [a.hex() for a in self.device.address],
                   "counters": outgoing.counters.remote().to_json()}
        with self._lock:
            self._connecting[(name, dst)] = request
        try:
            reply = self._peer(dst).call("connect", timeout=self.timeout_s, **request)
        finally:
            with self._lock:
                self._connecting.pop((name, dst), None)
        self.ledger.add(control_messages=1)
        try:
            answer = ConnectReply.parse(reply)
        except ValueError as exc:
            raise PeerError(f"{self.name}: {self.peer_name(dst)} answered 'connect' for '{name}' with {exc}") from None
        outgoing.mode, outgoing.control = answer.mode, answer.control
        outgoing.slot, outgoing.shape, outgoing.dtype = answer.slot, answer.shape, answer.dtype
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

            def arrived() -> bool:
                flag = trailer[8]
                if flag and flag != tag(seq):
                    trailer[8] = 0
                    raise PeerError(f"{self.name}: {self.peer_name(key.src)} raised flag {flag} for {key}, "
                                    f"where transfer {seq} raises {tag(seq)}: a malformed trailer")
                return flag == tag(seq)

            self._wait_until(arrived, f"recv of {key}", key.src, deadline, incoming.channel)
            trailer[8] = 0
            incoming.seq += 1
            step = int(trailer[:8].view(np.int64)[0])
            if step != key.step:
                raise PeerError(
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
        try:
            meta = Meta.parse(incoming.control.array[: META.itemsize], self.max_dynamic_bytes)
        except ValueError as exc:
            raise PeerError(f"{self.name}: {self.peer_name(key.src)} sent a malformed meta-data record for {key}: "
                            f"{exc}") from None
        block = self.pool.alloc(meta.nbytes)
        try:
            if meta.source is not None:
                channel = incoming.channel
                try:
                    future = channel.read(block.array, meta.source)
                except (FabricError, ValueError) as exc:
                    raise PeerError(f"{self.name}: {self.peer_name(key.src)} sent a meta-data record for {key} "
                                    f"that cannot be read: {exc}") from None
                self._fabric(channel, future, f"reading {key}", key.src)
        except BaseException:
            self.pool.free(block)
            raise
        with incoming.grant_lock:
            self._grant(incoming, counter=1, value=seq + 1)  # the sender may reuse its buffer
        incoming.lent = block
        return block.view(meta.dtype, meta.shape)
