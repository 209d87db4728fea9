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

*Never overwriting an unconsumed tensor*: a slot holds one transfer. Posting
a receive for a tensor is the receiver's promise that it is done with the
previous transfer of that tensor from that peer; it then grants the sender a
credit: the number of receives posted, in the sender's credit table towards
this receiver (one entry per tensor). A received tensor is therefore valid
until the next receive of the same name from the same peer, and the flag
carries the transfer's sequence number so a stale flag is never mistaken for a
new one. *Credits ahead*: a static tensor of up to ``TWO_SLOTS_UP_TO`` bytes has
two slots (a larger one has one), written in turn, each with
its own trailer; transfer ``n`` goes to slot ``n % slots`` and waits for credit
``n + 2 - slots``: with two slots, for the receive of transfer ``n - 1`` to be
posted (which frees ``n - 2``'s slot), so a sender is never held up by a
receive that is merely late, only by one two transfers behind. The receiver
keeps a mirror of each sender's table and writes the span of entries it
changed in one write: receives posted together (``recv_many``: a step's
weights) cost one credit message per peer, not one per tensor.

*The per-transfer path* is one call into the fabric on each side: the sender's
``write_flagged`` (data, flush, trailer, flush) and the receiver's wait on the
flags of every receive it posted (``FlagSet.wait_any``), both in C without the
GIL; a wait spins for a moment, then sleeps in growing steps, so an idle
receiver burns no core. *Waiting*: a receive of a static tensor whose sender
maps its memory sleeps on its slot's doorbell, a word in the slot's bell past
the trailer that it sets first and the sender rings after each write. Between
slices of a second a waiter checks that its peers are alive. *Pulls*: over
shared memory, a sender of a large static tensor that finds the receiver
waiting for it asks the receiver (through the bell) to copy the data itself,
which leaves it in the reader's cache (see ``Channel.send_plan``).

*Device memory* (the paper's GPUDirect case): a static tensor planned on a GPU at both ends, where the fabric
registers GPU memory (``Device.moves_device_memory``: UCX with its CUDA transports), has its slots in device
memory of an allocation of their own (``DeviceBlock``): the sender puts from its device array (CUDA IPC within
a node, the put complete on the GPU before the flush returns), then puts the trailer, which stays in host memory
where polling it is cheap. No doorbell, no pull, no copy of the sender's own into mapped memory for such slots.
rdma_cp stages such a tensor on its GPU (a device-to-device copy, counted). Any other transfer of a device tensor
is staged through host memory by the base class (``transports/base.py``).

Why one module of 990 lines: the sender's and the receiver's paths of one protocol (static, dynamic,
pull), each reading the state the other's connect made; the wire format is ``protocol.py``, the credits
``credits.py``, the persistent transfers ``persistent.py``, where the slots and sends are placed
``placement.py``, and rdma_cp's sending policy (stage every send) ``transports/rdma_cp/transport.py``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
import zlib
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from transports.base import (
    MAX_STEP,
    Key,
    PeerError,
    TransportClosed,
    TransportError,
    TransportTimeout,
    keys_text,
    memory_bytes,
)
from transports.common import settle
from transports.dtypes import dtype_text
from transports.fabric.base import (
    BELL_BYTES,
    Channel,
    CounterPlan,
    FabricError,
    FabricInterrupted,
    FlagSet,
    RemoteRegion,
    SendPlan,
    TakePlan,
)
from transports.fabric.pool import Block
from transports.fabric_transport import LIVENESS_EVERY_S, DeviceBlock, FabricTransport
from transports.memory import memory_of
from transports.tensors import contiguous, read_by_now, ready, to_host
from transports.zerocopy.credits import CreditMirror, Credits, CreditTables
from transports.zerocopy.persistent import CREDIT_SLICE_S, PlannedInbound, PlannedOutbound
from transports.zerocopy.placement import PoolPlacement
from transports.zerocopy.protocol import (
    BELL_AT,
    CONTROL_BYTES,
    COUNTERS_BYTES,
    MAX_DIMS,
    MAX_DYNAMIC_BYTES,
    MAX_RKEY,
    META,
    TRAILER,
    TRAILER_AT,
    TRAILER_STRIDE,
    ConnectReply,
    ConnectRequest,
    Meta,
    slot_stride,
    slots_bytes,
    slots_for,
    tag,
)


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The strides of a C-contiguous array of ``shape`` and ``itemsize`` (as numpy gives a fresh one)."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


#: a write of this many bytes or more is spread over every lane to the peer
SPREAD_BYTES = 1 << 20

@dataclass(eq=False)
class _Outgoing:
    """Sender-side state of one tensor name towards one peer."""

    name: str
    dst: int
    lanes: list[Channel]  # every lane to ``dst``; the tensor's own lane first
    table: Block  # the credit table towards ``dst`` this tensor's counters are an entry of
    index: int  # the entry: [receives posted, reads done], written by the receiver
    staging: Block  # trailer and meta-data record to write from
    mode: str = ""
    control: RemoteRegion | None = None  # the receiver's meta-data record and trailers
    slot_targets: list[RemoteRegion] = field(default_factory=list)  # where the data goes, per slot (static)
    flag_targets: list[RemoteRegion] = field(default_factory=list)  # the slots' trailers in ``control``
    bell_targets: list[RemoteRegion] = field(default_factory=list)  # the slots' bells in ``control``
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    strides: tuple[int, ...] | None = None  # a C-contiguous array's of that shape and dtype
    slots: int = 1
    seq: int = 0
    copy_buffer: Block | DeviceBlock | None = None  # rdma_cp's registered staging buffer (device memory: a device's)
    #: the whole send in one call into the fabric (static, sent in place), where the fabric has one
    plan: SendPlan | None = None
    #: the array it was last sent from (weakly) and its ledger count (ZeroCopyTransport._source_count)
    last_source: tuple[Any, str] = (None, "")
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        # [receives posted, reads done], written by the receiver; each a one-element view, polled often
        counters = self.table.view(np.uint64, (2,), offset=COUNTERS_BYTES * self.index)
        counters[:] = 0
        self.posted, self.reads_done = counters[0:1], counters[1:2]
        self.trailer = self.staging.array[TRAILER_AT: TRAILER_AT + TRAILER]
        self.step = self.trailer[:8].view(np.int64)

    @property
    def channel(self) -> Channel:
        """The tensor's own lane: its trailers, and every write not spread over the lanes."""
        return self.lanes[0]

    @property
    def credit_above(self) -> int:
        """Transfer ``seq`` may go once the receives posted exceed this (see *Credits ahead*): its slot's last
        transfer, ``slots`` before it, is consumed once the receive after that one is posted."""
        return self.seq + 1 - self.slots

    def connected(self, reply: ConnectReply) -> None:
        """Where the receiver's ``reply`` says each transfer goes."""
        self.mode, self.control, self.slots = reply.mode, reply.control, reply.slots
        self.flag_targets = [reply.control.at(TRAILER_AT + TRAILER_STRIDE * k, TRAILER) for k in range(reply.slots)]
        self.bell_targets = [reply.control.at(TRAILER_AT + TRAILER_STRIDE * k + BELL_AT, BELL_BYTES)
                             for k in range(reply.slots)]
        if reply.slot is not None:
            nbytes = math.prod(reply.shape) * reply.dtype.itemsize
            self.slot_targets = [reply.slot.at(slot_stride(nbytes) * k, nbytes) for k in range(reply.slots)]
        self.shape, self.dtype = reply.shape, reply.dtype
        if reply.shape is not None:  # (numpy gives an empty array other strides: it goes the general way)
            self.strides = c_strides(reply.shape, reply.dtype.itemsize)

    @property
    def counters(self) -> RemoteRegion:
        return self.table.remote(COUNTERS_BYTES * self.index, COUNTERS_BYTES)


@dataclass(eq=False)
class _Queued:
    """A send waiting in the send poller for its credit."""

    outgoing: _Outgoing
    key: Key
    array: np.ndarray
    future: Future
    deadline: float


@dataclass(eq=False)
class _Incoming:
    """Receiver-side state of one tensor name from one peer."""

    name: str
    src: int
    mode: str
    control: Block  # meta-data record (dynamic mode), then a trailer per slot: step (int64) and flag byte
    #: the preallocated tensor's slots, one after the other (static mode): in the pool, or in device memory
    data: Block | DeviceBlock | None = None
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    slots: int = 1
    seq: int = 0
    posted: int = 0
    #: a receive is posted and its transfer not yet taken (a receive that timed out stays posted)
    waiting: bool = False
    mirror: CreditMirror | None = None  # the sender's credit table (once it connected)
    index: int = 0  # this tensor's entry in it
    connected_by: Any = None  # the ConnectRequest that connected it (a tensor is connected once)
    channel: Channel | None = None
    lent: Block | None = None  # a dynamically allocated tensor handed out, freed at the next recv
    #: its credit (receives posted) set in the mirror and at the sender through one call, where the fabric can
    credit: CounterPlan | None = None
    #: its receives taken through one call each (wait, then the trailer), where the fabric can (static mode)
    take: TakePlan | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one receive at a time
    grant_lock: threading.Lock = field(default_factory=threading.Lock)  # connection and credits

    def __post_init__(self) -> None:
        at = [TRAILER_AT + TRAILER_STRIDE * k for k in range(self.slots)]
        self.trailers = [self.control.array[a: a + TRAILER] for a in at]
        self.bells = [self.control.array[a + BELL_AT: a + BELL_AT + BELL_BYTES] for a in at]
        self.flags = [trailer[8:9] for trailer in self.trailers]
        #: the received tensor of each slot, always in the same place (static mode)
        if self.data is not None:
            stride = slot_stride(math.prod(self.shape) * np.dtype(self.dtype).itemsize)
            self.arrays = [self.data.view(self.dtype, self.shape, offset=stride * k) for k in range(self.slots)]
        else:
            self.arrays = [None]
        self.waiters: list[FlagSet | None] = [None] * self.slots  # a wait on one slot's flag alone (recv)
        #: its slots are in device memory, where the receiver's work on a transfer is queued, not done
        self.on_device = isinstance(self.data, DeviceBlock)

    def finish_reads(self) -> None:
        """Wait for the work queued on the transfers its slots hold (device memory): a receive posted lets the
        sender overwrite the slot of an earlier one (``tensors.read_by_now``)."""
        if self.on_device:
            read_by_now(self.arrays[0])

    @property
    def next_slot(self) -> int:
        """The slot the next transfer lands in."""
        return self.seq % self.slots


class SendInPlace:
    """How zerocopy's sender writes a tensor: from where it is. With the analysis on, ``allocate()`` hands out
    registered memory (reserved by ``plan()``), so a tensor built there goes without a copy; any other tensor is
    registered on the fly (the registration cache)."""

    #: ``allocate()`` places the tensors to send in registered memory (the analysis on)
    places_sends = True
    #: what the run's records say the analysis does, when it is on
    analysis = "on"

    def static_source(self, transport: ZeroCopyTransport, outgoing: _Outgoing, array: np.ndarray) -> np.ndarray:
        """What a static send writes: the tensor's own bytes."""
        return array

    def source(self, transport: ZeroCopyTransport, outgoing: _Outgoing, flat: np.ndarray) -> np.ndarray:
        """What a dynamic send offers: the tensor's bytes (``flat``) where they are."""
        return flat


class ZeroCopyTransport(FabricTransport):
    """RDMA.zerocp over the fabric (UCX); see the module docstring for the protocol."""

    name = "zerocopy"
    #: the analysis off is a model-training comparison (Figure 12), not a line of every micro-benchmark
    optional_modes = ("no_analysis",)
    #: how a tensor leaves the sender (rdma_cp: :class:`StageEverySend`)
    sender: ClassVar[SendInPlace] = SendInPlace()
    #: a tensor planned in device memory at both ends is put from the sender's device into slots on the receiver's
    #: (where the fabric moves device memory: ``Device.moves_device_memory``); its trailer stays in host memory
    writes_device_memory = True

    def __init__(self, *, analysis: bool = True, **options: Any) -> None:
        super().__init__(**options)
        #: False (``zerocopy:no_analysis``): the plan's shapes are ignored, every tensor goes by dynamic
        #: allocation and is sent from wherever it is (registered on the fly through the cache)
        self.analysis = bool(analysis)
        self.placement: PoolPlacement = PoolPlacement(self)
        self._outgoing: dict[tuple[str, int], _Outgoing] = {}
        self._sending: dict[Key, object] = {}  # the keys being sent, each with its claim
        self._incoming: dict[tuple[str, int], _Incoming] = {}
        #: the persistent transfers keyed sends and receives go through, per (name, dst) and (name, src), made
        #: after a tensor's first keyed transfer where it goes the planned way (see send and recv)
        self._keyed_sends: dict[tuple[str, int], PlannedOutbound] = {}
        self._keyed_recvs: dict[tuple[str, int], PlannedInbound] = {}
        #: the sender's credit tables, one entry per tensor it sends (credits.py)
        self.credit_tables = CreditTables(self)
        #: the receiver's credits: a mirror of each sender's table, and the grants (credits.py)
        self.credits = Credits(self)
        #: connects this rank has in flight, (name, dst) -> what it sent, for the receiver's ``verify``
        self._connecting: dict[tuple[str, int], dict[str, Any]] = {}
        #: what this rank's memory holds: no static slot is placed beyond it
        self.memory_bytes = memory_bytes()
        #: the largest tensor a peer may announce on the dynamic path
        self.max_dynamic_bytes = min(MAX_DYNAMIC_BYTES, self.memory_bytes)
        #: sends for the send poller, and the count of them queued so far (which its wait watches)
        self._queue: deque[_Queued] = deque()
        self._doorbell = np.zeros(1, np.uint64)
        self._poller: threading.Thread | None = None

    @classmethod
    def modes(cls) -> dict[str, dict[str, Any]]:
        """``zerocopy:no_analysis``: the graph analysis off (the paper's Figure 12), see ``__init__``."""
        return {"no_analysis": {"analysis": False}}

    def describe(self) -> dict[str, Any]:
        analysis = self.sender.analysis if self.analysis else "off"
        return {**super().describe(), "analysis": analysis}

    def control_handlers(self) -> dict[str, Any]:
        return {"connect": self._on_connect, "verify": self._on_verify}

    def _outbound(self, name: str, dst: int) -> PlannedOutbound:
        return PlannedOutbound(self, name, dst)

    def _inbound(self, name: str, src: int) -> PlannedInbound:
        return PlannedInbound(self, name, src)

    # planning and allocation -------------------------------------------------

    # setup over the control path ---------------------------------------------

    def _incoming_slot(self, name: str, src: int) -> _Incoming:
        """The receive slot for ``name`` from ``src``: static when the plan knows its shape."""
        incoming = self._incoming.get((name, src))  # slots are only ever added: no lock to find one
        if incoming is not None:
            return incoming
        with self._lock:
            key = (name, src)
            if key not in self._incoming:
                spec = self.placement.spec(name, src, self.rank)
                # in segments of src's alone: the key src is given reaches no other rank's slots or trailers
                control = self.pool.alloc(CONTROL_BYTES, peer=src)
                control.array[TRAILER_AT:] = 0
                if spec is not None and spec.shape is not None:
                    slots = slots_for(spec.nbytes)
                    on_device = self.moves_device(spec)
                    data = (DeviceBlock(self.device, slots_bytes(spec.nbytes, slots), spec.dst_memory, src) if on_device
                            else self.pool.alloc(slots_bytes(spec.nbytes, slots), peer=src))
                    incoming = _Incoming(name, src, "static", control, data, spec.shape, spec.dtype, slots)
                    # slots in device memory: the sender puts into them (never a copy of its own into memory it
                    # maps, so no doorbell), and nothing is pulled into them; the trailers stay in host memory
                    incoming.take = (self.device.take_plan(incoming.trailers) if on_device else
                                     self.device.take_plan(incoming.trailers, incoming.bells, incoming.arrays))
                else:
                    incoming = _Incoming(name, src, "dynamic", control)
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
                channel = self._channel(connect.src, 0, connect.device)
            except FabricError as exc:
                raise ValueError(f"cannot connect to the device of {self.peer_name(connect.src)}: {exc}") from None
        incoming = self._incoming_slot(connect.name, connect.src)
        with incoming.grant_lock:
            if incoming.connected_by is not None and incoming.connected_by != connect:
                raise ValueError(f"{key} is already connected by {self.peer_name(connect.src)}; a rank connects once")
            if incoming.connected_by is None:
                mirror = self.credits.mirror(connect, channel)
                with self._lock:  # verified: its device, and that it was heard from (its death counts)
                    self._peer_devices.setdefault(connect.src, connect.device)
                incoming.channel = channel
                incoming.mirror = mirror
                incoming.index = connect.index
                incoming.credit = self.credits.plan(incoming)
                if incoming.take is not None:  # a sender whose memory is mapped here maps this memory: it rings
                    incoming.take.use_bells(incoming.credit is not None and incoming.credit.mapped)
                incoming.connected_by = connect
                if incoming.posted:  # credits go out on the transport's threads, never the control path's
                    self.credits.submit(incoming)
        reply = {"mode": incoming.mode, "control": incoming.control.remote().to_json()}
        if incoming.mode == "static":
            reply.update(slot=incoming.data.remote().to_json(), shape=list(incoming.shape),
                         dtype=dtype_text(incoming.dtype), slots=incoming.slots)
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

    def _connect(self, name: str, dst: int) -> _Outgoing:
        outgoing = self._outgoing.get((name, dst))  # only ever added: no lock to find one
        if outgoing is not None:
            return outgoing
        # tensors are spread over the lanes (and so the progress threads) by name; a large one over all of them
        peer, first = self._peer_device(dst), zlib.crc32(name.encode())
        lanes = [self._channel(dst, first + i, peer) for i in range(self.lanes_per_peer)]
        table, index = self.credit_tables.entry(dst)
        outgoing = _Outgoing(name, dst, lanes, table, index, staging=self.pool.alloc(CONTROL_BYTES))
        request = {"name": name, "src": self.rank, "device": [a.hex() for a in self.device.address],
                   "counters": outgoing.counters.to_json(), "index": index}
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
            raise PeerError(f"{self.name}: {self.peer_name(dst)} answered 'connect' for '{name}': {exc}") from None
        outgoing.connected(answer)
        if answer.mode == "static" and self.sender.places_sends:
            outgoing.plan = self._plan(outgoing)
        with self._lock:
            return self._outgoing.setdefault((name, dst), outgoing)

    def _plan(self, outgoing: _Outgoing) -> SendPlan | None:
        """The one-call send of a connected static tensor, where the fabric has one and one lane serves it (a
        write spread over lanes stays on the general path unless it lands in memory mapped here)."""
        try:
            plan = outgoing.channel.send_plan(outgoing.slot_targets, outgoing.flag_targets, outgoing.trailer,
                                              outgoing.posted, outgoing.bell_targets)
        except (FabricError, ValueError):
            return None  # the general path says what is wrong, when the tensor is sent
        large = outgoing.slot_targets[0].length >= SPREAD_BYTES and len(outgoing.lanes) > 1
        return plan if plan is not None and (plan.mapped or not large) else None

    # sending ---------------------------------------------------------------

    def send(self, key: Key, array: np.ndarray, timeout: float | None = None) -> None:
        """A key whose tensor has a persistent send of its own (made once it is connected, static and mapped here:
        :meth:`_keep_persistent_send`) goes through it, one lookup: the obvious loop of
        ``send(Key(name, step, src, dst), x)`` pays what ``outbound(name, dst).send(step, x)`` pays. Anything else
        goes :meth:`_send_by_key`."""
        if type(key) is Key and key.src == self.rank:
            outbound = self._keyed_sends.get((key.name, key.dst)) or self._keep_persistent_send(key.name, key.dst)
            if outbound is not None:
                outbound.send(key.step, array, timeout)
                return
        self._send_by_key(key, array, timeout)

    def _keep_persistent_send(self, name: str, dst: int) -> PlannedOutbound | None:
        """The persistent send the keys of ``name`` to ``dst`` go through from now on, made where its sends can go
        the planned way (:meth:`_planned_outgoing`); else None (they go :meth:`_send_by_key`)."""
        if self._planned_outgoing(name, dst) is None:
            return None
        return self._keyed_sends.setdefault((name, dst), PlannedOutbound(self, name, dst))

    def _planned_outgoing(self, name: str, dst: int) -> _Outgoing | None:
        """The sender-side state of ``name`` to ``dst`` where its sends can go the planned way (connected, static,
        its slots mapped here: one call into C), else None."""
        outgoing = self._outgoing.get((name, dst))
        if outgoing is None or outgoing.plan is None or not outgoing.plan.mapped:
            return None
        return outgoing

    def _send_by_key(self, key: Key, array: np.ndarray, timeout: float | None = None) -> None:
        """A connected static tensor sent from where it is goes the planned way: the checks the general path
        makes of this key and array (its name and peer were checked when it connected), the claim, and one
        call into the fabric (credit, data, trailer); anything else goes the general way."""
        outgoing = self._outgoing.get((key.name, key.dst)) if type(key) is Key else None
        plan = None if outgoing is None else outgoing.plan
        if (plan is None or type(array) is not np.ndarray or array.shape != outgoing.shape
                or array.strides != outgoing.strides  # C-contiguous (a contiguous array strided otherwise: general)
                or (array.dtype is not outgoing.dtype and array.dtype != outgoing.dtype) or key.src != self.rank
                or type(key.step) is not int or not 0 <= key.step <= MAX_STEP):
            super().send(key, array, timeout)
            return
        self._claim(key)
        try:
            with self._operation, outgoing.lock:
                seq, step = outgoing.seq, key.step
                if plan.mapped:  # a copy into memory mapped here: no peer to watch (see _blocking), called direct
                    try:
                        sent = plan.send(array, seq, step, CREDIT_SLICE_S, self.timeout_s)
                    except FabricError as exc:
                        raise self._failure(key, key.dst, exc) from None
                else:
                    sent = self._blocking(key, key.dst, outgoing.channel, plan.send, array, seq, step, CREDIT_SLICE_S)
                if not sent:  # the credit is late: from now on, as the general path waits
                    deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
                    while not sent:
                        self._await_counter(outgoing, outgoing.posted, outgoing.credit_above, f"credit to send {key}",
                                            deadline, timeout)
                        sent = self._blocking(key, key.dst, outgoing.channel, plan.send, array, seq, step,
                                              CREDIT_SLICE_S, watched=not plan.mapped)
                outgoing.seq += 1
        finally:
            self._unclaim(key)
        self.ledger.sent(array.nbytes, self._source_count(outgoing, array))

    def _send_and_wait(self, key: Key, array: np.ndarray, timeout: float | None) -> None:
        self._check_key(key, "send")
        self._claim(key)
        self._send_claimed(key, array, timeout)

    def _claim(self, key: Key) -> None:
        claim = object()
        if self._sending.setdefault(key, claim) is not claim:  # one call: atomic, no lock needed
            raise ValueError(f"{self.name}: {key} is already being sent")

    def _unclaim(self, key: Key) -> None:
        self._sending.pop(key, None)

    def _send_claimed(self, key: Key, array: np.ndarray, timeout: float | None = None) -> None:
        try:
            with self._operation:
                self._send(key, array, time.monotonic() + (self.timeout_s if timeout is None else timeout), timeout)
        finally:
            self._unclaim(key)

    def _send(self, key: Key, array: np.ndarray, deadline: float, timeout: float | None) -> None:
        """One send the general way, by ``deadline`` (``timeout`` seconds from its start: None, the transport's)."""
        try:
            outgoing = self._connect(key.name, key.dst)
        except FabricError as exc:
            raise PeerError(f"{self.name}: cannot reach {self.peer_name(key.dst)}: {exc}") from None
        array = contiguous(array, self.ledger)
        if outgoing.mode != "static" and type(array) is not np.ndarray:
            # a device tensor the receiver did not place (its plan has no such tensor, or another shape): the
            # dynamic path lends the receiver host memory to read, so it goes through host memory (counted)
            array = to_host(array, self.ledger)
        if outgoing.mode != "static" and array.nbytes > MAX_DYNAMIC_BYTES:  # the receiver would refuse its meta-data
            raise ValueError(f"{self.name}: {key} is {array.nbytes} bytes; dynamic allocation moves at most "
                             f"{MAX_DYNAMIC_BYTES} (a tensor planned with its shape is placed statically, of any size)")
        self.ledger.add(**{self._source_count(outgoing, array): 1})
        with outgoing.lock:
            seq = outgoing.seq
            if outgoing.posted[0] <= outgoing.credit_above:
                self._await_counter(outgoing, outgoing.posted, outgoing.credit_above, f"credit to send {key}",
                                    deadline, timeout)
            if outgoing.mode == "static":
                self._send_static(outgoing, key, array, seq)
            else:
                self._send_dynamic(outgoing, key, array, seq, deadline, timeout)
            outgoing.seq += 1
        self.ledger.sent(array.nbytes)

    def _await_counter(self, outgoing: _Outgoing, counter: np.ndarray, above: int, what: str,
                       deadline: float, timeout: float | None) -> None:
        """Wait until ``counter`` exceeds ``above``, by ``deadline`` (``timeout`` seconds from the operation's
        start, which a timeout's message names: None, the transport's)."""
        device, peers = self.device, [(outgoing.dst, outgoing.channel)]
        self._await(lambda slice_s: device.wait_counter(counter, above, slice_s) or None, lambda: what,
                    lambda: peers, deadline, timeout)

    def _start_send(self, key: Key, array: np.ndarray) -> Future:
        """A send that waits for its credit in the send poller (one thread for all of them), once connected.

        The first send of a tensor connects it on the transport's threads, and so does every send on the
        dynamic path (it waits for the receiver's read); a static tensor's later sends are queued for
        the poller, which writes each as soon as its credit is in.
        """
        self._check_key(key, "send")
        self._claim(key)  # now, so that a duplicate fails even before this send runs
        outgoing = self._outgoing.get((key.name, key.dst))
        if outgoing is None or outgoing.mode != "static":
            return self._submit(self._send_claimed, key, array)
        try:
            array = contiguous(array, self.ledger)
            if self._closed.is_set():
                raise TransportClosed(f"{self.name} rank {self.rank} was closed")
        except BaseException:
            self._unclaim(key)
            raise
        future: Future = Future()
        self._queue.append(_Queued(outgoing, key, array, future, time.monotonic() + self.timeout_s))
        self._doorbell[0] += 1
        if self._poller is None:
            with self._lock:
                if self._poller is None:
                    self._poller = threading.Thread(target=self._poll_sends, name=f"{self.name}-{self.rank}-sends",
                                                    daemon=True)
                    self._poller.start()
        return future

    def _poll_sends(self) -> None:
        """The send poller: writes each queued transfer once its credit is in, in order per tensor."""
        waiting: dict[_Outgoing, deque[_Queued]] = {}
        try:
            while True:
                seen = int(self._doorbell[0])
                while self._queue:
                    queued = self._queue.popleft()
                    waiting.setdefault(queued.outgoing, deque()).append(queued)
                if self._closed.is_set():
                    raise TransportClosed(f"{self.name} rank {self.rank} was closed")
                sent = busy = False
                for outgoing, queue in list(waiting.items()):
                    while queue and outgoing.posted[0] > outgoing.credit_above:
                        if not outgoing.lock.acquire(blocking=False):
                            busy = True  # a blocking send of this tensor is under way
                            break
                        try:
                            # again, under the lock: a send that held it may have taken the credit seen above
                            if outgoing.posted[0] <= outgoing.credit_above:
                                break
                            self._send_queued(outgoing, queue.popleft())
                        finally:
                            outgoing.lock.release()
                        sent = True
                    if not queue:
                        del waiting[outgoing]
                if sent:
                    continue
                if busy:
                    time.sleep(20e-6)
                    continue
                heads = list(waiting)
                nearest = min((queue[0].deadline for queue in waiting.values()), default=time.monotonic() + 1.0)
                found = self.device.wait_counters([o.posted for o in heads] + [self._doorbell],
                                                  [o.credit_above for o in heads] + [seen],
                                                  max(0.0, min(LIVENESS_EVERY_S, nearest - time.monotonic())))
                if found is None:
                    self._expire(waiting)
        except FabricInterrupted:
            error: BaseException = TransportClosed(f"{self.name} rank {self.rank} was closed")
        except BaseException as exc:  # nothing queued may wait forever
            error = exc
        for queue in waiting.values():
            for queued in queue:
                self._settle(queued, error)
        while self._queue:
            self._settle(self._queue.popleft(), error)

    def _send_queued(self, outgoing: _Outgoing, queued: _Queued) -> None:
        self.ledger.add(**{self._source_count(outgoing, queued.array): 1})
        try:
            self._send_static(outgoing, queued.key, queued.array, outgoing.seq)
        except BaseException as exc:
            self._settle(queued, exc)
            return
        outgoing.seq += 1
        self.ledger.sent(queued.array.nbytes)
        self._settle(queued)

    def _expire(self, waiting: dict[_Outgoing, deque[_Queued]]) -> None:
        """Fail the queued sends whose time is up, and those to a peer that is gone (with what follows them)."""
        now = time.monotonic()
        for outgoing, queue in list(waiting.items()):
            error: TransportError | None = None
            if queue[0].deadline < now:
                error = TransportTimeout(f"{self.name}: credit to send {queue[0].key} did not come within "
                                         f"{self.timeout_s:g} s (peer {self.peer_name(outgoing.dst)})")
            else:
                try:
                    self._check_peer(outgoing.dst, f"credit to send {queue[0].key}", outgoing.channel)
                except TransportError as exc:
                    error = exc
            if error is not None:
                for queued in queue:
                    self._settle(queued, error)
                del waiting[outgoing]

    def _settle(self, queued: _Queued, error: BaseException | None = None) -> None:
        self._unclaim(queued.key)
        settle(queued.future, error=error)

    def _before_device_close(self) -> None:
        if self._poller is not None:
            self._poller.join(timeout=10)
        self.credits.close()

    def _source_count(self, outgoing: _Outgoing, array: np.ndarray) -> str:
        """The ledger's count for sending ``array``: a registration-cache hit (it lies in registered memory
        already) or a miss; remembered for the array the tensor was last sent from (mostly the same one)."""
        source, counted = outgoing.last_source
        if source is None or source() is not array:
            counted = "sends_registered" if self.placement.registered(array) else "sends_unregistered"
            outgoing.last_source = weakref.ref(array), counted
        return counted

    def _flat(self, outgoing: _Outgoing, array: np.ndarray) -> np.ndarray:
        """``array``'s bytes, from where they are written: the tensor itself, or (rdma_cp) a staging copy."""
        flat = array.reshape(-1).view(np.uint8) if array.nbytes else np.empty(0, np.uint8)
        return self.sender.source(self, outgoing, flat)

    def _stage(self, outgoing: _Outgoing, flat: np.ndarray) -> np.ndarray:
        """A copy of ``flat`` in the tensor's registered staging buffer (grown when too small), counted: host
        memory in the pool, device memory (a tensor this transport moves on its device) in a device block, the copy
        finished before the buffer is sent from."""
        on_device = type(flat) is not np.ndarray
        buffer = outgoing.copy_buffer
        if buffer is None or buffer.nbytes < flat.nbytes or isinstance(buffer, DeviceBlock) != on_device:
            if isinstance(buffer, Block):
                self.pool.free(buffer)
            outgoing.copy_buffer = buffer = (DeviceBlock(self.device, flat.nbytes, memory_of(flat)) if on_device
                                             else self.pool.alloc(flat.nbytes, peer=outgoing.dst))
        staged = buffer.array[: flat.nbytes]
        staged[...] = flat
        if on_device:
            ready(staged)
            self.ledger.add(device_to_device_bytes=flat.nbytes)
        else:
            self.ledger.add(copied_bytes=flat.nbytes)
        return staged

    def _readable(self, outgoing: _Outgoing, flat: np.ndarray) -> tuple[np.ndarray, RemoteRegion]:
        """``flat``, or where it was staged, and the descriptor a peer needs to read it: pool memory, or
        ``flat`` registered now. An allocator's region registered for sending (``register_site``) is
        never handed to a peer: the tensor is staged into the pool instead (a copy, counted); nor is a pool
        segment that is not this receiver's (a tensor placed for another receiver, or a tensor received and sent
        on): its key would reach the other blocks of that segment."""
        region = self.pool.segment_of(flat)
        if region is not None and self.pool.peer_of(flat) != outgoing.dst:
            flat = self._stage(outgoing, flat)
            region = self.pool.segment_of(flat)
        if region is None:
            region = self.device.register(flat)
            if self.placement.is_site(region):
                flat = self._stage(outgoing, flat)
                region = self.pool.segment_of(flat)
        start = flat.__array_interface__["data"][0] - region.address
        return flat, region.export().at(start, flat.nbytes)

    def _write_flagged(self, outgoing: _Outgoing, data: np.ndarray, target: RemoteRegion, seq: int,
                       key: Key) -> None:
        """One transfer: write the data, flush, write the trailer (step, then the flag byte last), flush."""
        trailer, flag_target = outgoing.trailer, outgoing.flag_targets[seq % outgoing.slots]
        outgoing.step[0] = key.step
        trailer[8] = tag(seq)
        if data.nbytes >= SPREAD_BYTES and len(outgoing.lanes) > 1:
            self._blocking(key, key.dst, outgoing.channel, self.device.write_flagged_lanes, outgoing.lanes, data,
                           target, trailer, flag_target)
        else:
            self._blocking(key, key.dst, outgoing.channel, outgoing.channel.write_flagged, data, target, trailer,
                           flag_target)

    def _send_static(self, outgoing: _Outgoing, key: Key, array: np.ndarray, seq: int) -> None:
        if array.shape != outgoing.shape or array.dtype != outgoing.dtype:
            raise ValueError(
                f"{self.name}: {key} has {array.dtype} {array.shape}, but the receiver placed it as "
                f"{outgoing.dtype} {outgoing.shape}"
            )
        data = self.sender.static_source(self, outgoing, array)
        self._write_flagged(outgoing, data, outgoing.slot_targets[seq % outgoing.slots], seq, key)

    def _send_dynamic(self, outgoing: _Outgoing, key: Key, array: np.ndarray, seq: int, deadline: float,
                      timeout: float | None) -> None:
        if array.ndim > MAX_DIMS:
            raise ValueError(f"{self.name}: {key} has {array.ndim} dimensions; at most {MAX_DIMS} are supported")
        flat = self._flat(outgoing, array)
        source = None
        if array.nbytes:
            flat, source = self._readable(outgoing, flat)
        self.ledger.add(dynamic_transfers=1)
        if source is not None and len(source.rkey) > MAX_RKEY:
            raise TransportError(f"{self.name}: a remote key of {len(source.rkey)} bytes exceeds {MAX_RKEY}")
        meta = outgoing.staging.array[: META.itemsize].view(META)[0]
        meta["nbytes"] = array.nbytes
        meta["addr"] = source.addr if source is not None else 0
        meta["ndim"] = array.ndim
        meta["dims"][: array.ndim] = array.shape
        meta["dtype"] = dtype_text(array.dtype).encode()
        meta["rkey_len"] = len(source.rkey) if source is not None else 0
        if source is not None:
            meta["rkey"][: len(source.rkey)] = np.frombuffer(source.rkey, np.uint8)
        record = outgoing.staging.array[: META.itemsize]
        self._write_flagged(outgoing, record, outgoing.control.at(0, META.itemsize), seq, key)
        # the sender's buffer is in use until the receiver has read it
        if outgoing.reads_done[0] <= seq:
            self._await_counter(outgoing, outgoing.reads_done, seq, f"the receiver to read {key}", deadline, timeout)

    # receiving -------------------------------------------------------------

    def recv(self, key: Key, timeout: float | None = None) -> np.ndarray:
        """A key whose tensor has a persistent receive of its own (made once its slot is static, its sender connected
        and its credit mapped here: :meth:`_keep_persistent_recv`) is taken through it, one lookup (see
        :meth:`send`); anything else goes :meth:`_recv_by_key`."""
        if type(key) is Key and timeout is None and key.dst == self.rank:
            inbound = self._keyed_recvs.get((key.name, key.src)) or self._keep_persistent_recv(key.name, key.src)
            if inbound is not None:
                return inbound.recv(key.step)
        return self._recv_by_key(key, timeout)

    def _keep_persistent_recv(self, name: str, src: int) -> PlannedInbound | None:
        """The persistent receive the keys of ``name`` from ``src`` go through from now on, made where its receives
        can go the planned way (static, its sender connected, its credit mapped here) into host memory as planned;
        else None (they go :meth:`_recv_by_key`)."""
        if self.placement.device_receives or self._planned_incoming(name, src) is None:
            return None
        return self._keyed_recvs.setdefault((name, src), PlannedInbound(self, name, src))

    def _planned_incoming(self, name: str, src: int) -> _Incoming | None:
        """The receiver-side state of ``name`` from ``src`` where its receives can go the planned way (static, its
        sender connected, its credit a store into memory mapped here), else None."""
        incoming = self._incoming.get((name, src))
        if (incoming is None or incoming.take is None or incoming.mirror is None or incoming.credit is None
                or not incoming.credit.mapped):
            return None
        return incoming

    def _recv_by_key(self, key: Key, timeout: float | None = None) -> np.ndarray:
        """A static tensor is taken the planned way (:meth:`_take_planned`) with the checks the general path makes
        of this key (its name and peer were checked when its slot was made); anything else goes the general way."""
        incoming = self._incoming.get((key.name, key.src)) if type(key) is Key else None
        if (incoming is None or incoming.take is None or key.dst != self.rank or type(key.step) is not int
                or not 0 <= key.step <= MAX_STEP):
            return super().recv(key, timeout)
        array = self._take_planned(incoming, key, timeout)
        return self._delivered(key, array) if self.placement.device_receives else array

    def _recv_and_wait(self, key: Key, timeout: float | None) -> np.ndarray:
        """One receive: :meth:`recv_each` of one key, without its generator (the micro-benchmark's path)."""
        incoming = self._incoming_slot(key.name, key.src)
        if incoming.take is not None:
            return self._take_planned(incoming, key, timeout)
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._operation, incoming.lock:
            self.credits.post([incoming])
            slot = incoming.next_slot
            waiter = incoming.waiters[slot]
            if waiter is None:
                waiter = incoming.waiters[slot] = self.device.flag_set([incoming.flags[slot]])
            waiter.reset()
            self._await(waiter.wait_any, lambda: f"recv of {key}", lambda: [(key.src, incoming.channel)], deadline,
                        timeout)
            return self._take(incoming, key)

    def _take_planned(self, incoming: _Incoming, key: Key, timeout: float | None) -> np.ndarray:
        """One receive of a static tensor: its credit posted, then one call into the fabric (the wait and the
        trailer) for a first slice of the wait; only when that slice passes, the general wait's checks between
        slices (:meth:`_await`)."""
        allowed = self.timeout_s if timeout is None else timeout
        with self._operation, incoming.lock:
            if not incoming.waiting:  # (a receive that timed out is posted still: it holds its credit already)
                self.credits.post_one(incoming)
            try:
                taken = incoming.take.take(incoming.seq, key.step,
                                           LIVENESS_EVERY_S if allowed > LIVENESS_EVERY_S else allowed)
            except FabricInterrupted:
                raise self._closed_during(key) from None
            return self._after_first_take(incoming, key, taken, timeout)

    def _closed_during(self, key: Key) -> TransportClosed:
        return TransportClosed(f"{self.name} rank {self.rank} was closed while waiting for recv of {key}")

    def _after_first_take(self, incoming: _Incoming, key: Key, taken: bool | None,
                          timeout: float | None) -> np.ndarray:
        """The rest of a planned receive (``incoming`` held by the caller) whose first slice of the wait
        (:attr:`LIVENESS_EVERY_S` at most) answered ``taken`` (as :meth:`TakePlan.take`): the general wait's
        checks between slices while not raised, what is wrong with another transfer's trailer, or the array."""
        allowed = self.timeout_s if timeout is None else timeout
        seq, step, take = incoming.seq, key.step, incoming.take.take
        if taken is None:
            taken = self._await(lambda slice_s: take(seq, step, slice_s), lambda: f"recv of {key}",
                                lambda: [(key.src, incoming.channel)],
                                time.monotonic() + allowed - LIVENESS_EVERY_S, timeout, waited=True)
        if not taken:  # another transfer's trailer: _accept says what is wrong
            return self._accept(incoming, key, *incoming.take.last)
        incoming.seq = seq + 1
        incoming.waiting = False
        array = incoming.arrays[seq % incoming.slots]
        self.ledger.received(array.nbytes)
        return array

    def _start_recv(self, key: Key) -> Future:
        return self._submit(self._recv_and_wait, key, None)

    def recv_each(self, keys, timeout: float | None = None):
        """All receives posted at once (credits: one write per sender), then one wait over all their flags."""
        keys = self._check_keys(keys)
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._operation:
            incomings = [self._incoming_slot(key.name, key.src) for key in keys]
            if len({id(incoming) for incoming in incomings}) != len(incomings):
                raise ValueError(f"{self.name}: one recv_many cannot take two steps of one tensor from one peer")
            with contextlib.ExitStack() as held:
                for incoming in sorted(incomings, key=lambda i: (i.src, i.name)):  # one order: no deadlock
                    held.enter_context(incoming.lock)
                self.credits.post(incomings)
                flags = self.device.flag_set([incoming.flags[incoming.next_slot] for incoming in incomings])
                pending = dict(enumerate(keys))

                def what() -> str:
                    return f"recv of {keys_text(pending.values())}"

                def peers() -> list[tuple[int, Channel | None]]:
                    return list({key.src: incomings[i].channel for i, key in pending.items()}.items())

                while pending:
                    index = self._await(flags.wait_any, what, peers, deadline, timeout)
                    flags.done(index)
                    key = pending.pop(index)
                    array = self._take(incomings[index], key)
                    yield key, self._delivered(key, array) if self.placement.device_receives else array

    def _take(self, incoming: _Incoming, key: Key) -> np.ndarray:
        """The transfer whose flag is up in ``incoming`` (held by the caller), checked, as an array."""
        trailer = incoming.trailers[incoming.next_slot]
        flag = int(trailer[8])
        trailer[8] = 0
        return self._accept(incoming, key, flag, int(trailer[:8].view(np.int64)[0]))

    def _accept(self, incoming: _Incoming, key: Key, flag: int, step: int) -> np.ndarray:
        """The transfer whose trailer (``flag``, ``step``, the flag lowered) was taken from ``incoming`` (held by
        the caller), checked, as an array."""
        seq = incoming.seq
        slot = seq % incoming.slots  # incoming.next_slot
        if flag != tag(seq):
            raise PeerError(f"{self.name}: {self.peer_name(key.src)} raised flag {flag} for {key}, "
                            f"where transfer {seq} raises {tag(seq)}: a malformed trailer")
        incoming.seq += 1
        incoming.waiting = False
        if step != key.step:
            raise PeerError(
                f"{self.name}: asked for {key} but step {step} arrived: transfers of one tensor must be "
                "received in the order they are sent"
            )
        array = incoming.arrays[slot] if incoming.arrays[slot] is not None else self._pull(incoming, key, seq)
        self.ledger.received(array.nbytes)
        return array

    def _pull(self, incoming: _Incoming, key: Key, seq: int) -> np.ndarray:
        try:
            meta = Meta.parse(incoming.control.array[: META.itemsize], self.max_dynamic_bytes)
        except ValueError as exc:
            raise PeerError(f"{self.name}: {self.peer_name(key.src)} sent a meta-data record for {key} that is "
                            f"malformed: {exc}") from None
        block = self.pool.alloc(meta.nbytes)  # read into here; exported to no one
        try:
            if meta.source is not None:
                try:
                    self._blocking(f"reading {key}", key.src, incoming.channel, incoming.channel.read_now, block.array,
                                   meta.source)
                except ValueError as exc:
                    raise PeerError(f"{self.name}: {self.peer_name(key.src)} sent a meta-data record for {key} "
                                    f"that cannot be read: {exc}") from None
        except BaseException:
            self.pool.free(block)
            raise
        self.credits.grant(incoming.mirror, [incoming], reads_done=seq + 1)  # the sender may reuse its buffer
        incoming.lent = block
        return block.view(meta.dtype, meta.shape)
