"""The ``verbs`` fabric: reliable-connected queue pairs on an RDMA NIC, through rdma-core's pyverbs.

The paper's RDMA device (its Table 1 and section 3.1) as it describes it: ``num_cqs`` completion
queues (``progress_threads``), each served by its own progress thread, and ``num_qps_per_peer``
RC queue pairs per peer (``lanes_per_peer``), lane ``i`` on CQ ``i % num_cqs``. A work request's
completion, routed by ``wr_id``, completes the Future the caller holds. A flagged write posts the
data unsignaled and the trailer (whose last byte is the flag) signaled right behind it on the same
queue pair: RC executes a queue pair's requests in order and the send queue completes in order, so
the trailer's one completion says both are at the peer, and the peer sees the data before the flag
(the in-order placement one-sided protocols on RC rely on; the fabric conformance suite checks it
on the device). Queue pairs are agreed with the peer once per peer over the control path
(``channel(..., exchange)`` here, :meth:`VerbsDevice.accept` there, which takes a request only from
the device it claims to be); when two devices connect to each other at once, the connection of
the one with the smaller address stands. The decisions that need no hardware (device, port and GID
choice, queue-pair attributes, the exchange's encoding, lane mapping) are in ``decide.py``.

pyverbs is imported only when a device is opened or asked whether it can run, so this module
imports without it. A progress thread sleeps on its CQ's completion channel (``select`` on the
channel's descriptor: pyverbs' own blocking wait holds the GIL); a caller blocked on a transfer
polls the CQ itself for a moment first, which saves the wake-up for small transfers. Soft-RoCE
(``rdma_rxe``) in ``tools/softroce``'s guest is where this runs in the tests.

This module opens the device, registers memory and agrees on queue pairs with a peer. The rest, by role:
finding pyverbs and describing the hardware ``hardware.py``; the completions and the waits on them
``completions.py``; the channels and progress threads ``channel.py``; the decisions without hardware
``decide.py``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from transports.common import Availability, aligned_empty, settle
from transports.fabric.base import (
    Channel,
    Device,
    Exchange,
    FabricError,
    FabricInterrupted,
    FabricTimeout,
    MemRegion,
    RemoteRegion,
    Tool,
)
from transports.fabric.registrations import start_of
from transports.fabric.settings import RdmaSettings, read_settings
from transports.fabric.verbs.channel import (
    CQES_PER_QP,
    RECV_WR_ID,
    WAIT_SLICE_S,
    VerbsChannel,
    _Pending,
    _Poller,
)
from transports.fabric.verbs.completions import Completions
from transports.fabric.verbs.decide import (
    ACCESS_FLAGS,
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_READ,
    Choice,
    DeviceAddress,
    LaneEndpoint,
    QpAttributes,
    choose,
    connect_deferral,
    connect_reply,
    connect_request,
    cq_index,
    decode_address,
    encode_address,
    inactive_reason,
    init_attributes,
    new_address,
    parse_reply,
    parse_request,
    perftest_arguments,
    qp_index,
    rd_atomic_limit,
    rtr_attributes,
    rts_attributes,
    spread,
    wins,
)
from transports.fabric.verbs.hardware import PYVERBS_MISSING, _hardware, _pyverbs, _pyverbs_version, qp_attr

ALIGNMENT = 64
#: how long a device whose connection request the peer deferred waits for the peer's own
CONNECT_WAIT_S = 60.0


class VerbsRegion(MemRegion):
    """A memory region (``ibv_reg_mr``) over ``array``'s memory, ``length`` bytes from its start.

    Writable memory is registered for local write, remote write and remote read; read-only memory
    (a registered source only) for remote read alone.
    """

    def __init__(self, device: VerbsDevice, array: np.ndarray, length: int, writable: bool = True) -> None:
        access = ACCESS_FLAGS if writable else IBV_ACCESS_REMOTE_READ
        try:
            self.mr = device._pv.mr.MR(device.pd, length, access, address=start_of(array))
        except device._pv.pyverbs_error.PyverbsError as exc:
            raise FabricError(f"verbs: registering {length} bytes at {start_of(array):#x} failed: {exc} "
                              f"(locked-memory limit? see ulimit -l)") from None
        self.device = device
        self.array = array
        self.busy = 0  # work requests in flight that use this region's key
        self._released = False
        self._exported: RemoteRegion | None = None

    @property
    def lkey(self) -> int:
        return self.mr.lkey

    def export(self) -> RemoteRegion:
        if self._exported is None:
            self._exported = RemoteRegion(self.address, self.nbytes, self.mr.rkey.to_bytes(4, "little"))
        return self._exported

    def release(self) -> None:
        """Deregister: the remote key is revoked. The memory (numpy's) stays valid for views of it."""
        if not self._released:
            self._released = True
            self.mr.close()
            self.device._forget(self)


class VerbsDevice(Completions, Device):
    """An opened RDMA device: context, protection domain, ``progress_threads`` CQs and their threads.

    ``fabric_transport``: only ``auto`` (RDMA_DEVICE, else the first device with an active port);
    ``interfaces`` are not used (an RDMA device is chosen by RDMA_DEVICE, not by network interface);
    ``settings``: the RDMA_* variables, all honoured (see ``decide.py``).
    """

    name = "verbs"
    fabric_transports: ClassVar[dict[str, str]] = {
        "auto": "the RDMA device RDMA_DEVICE names, else the first with an active port"}
    immediates = True
    reference_tools = ("ib_write_bw", "ib_write_lat")

    def __init__(self, fabric_transport: str = "auto", progress_threads: int = 1, lanes_per_peer: int = 1,
                 interfaces: list[str] | tuple[str, ...] = (), settings: RdmaSettings | None = None) -> None:
        super().__init__(progress_threads, lanes_per_peer, settings, fabric_transport)
        try:
            self._pv = pv = _pyverbs()
        except ImportError:
            raise FabricError(f"verbs: {PYVERBS_MISSING}") from None
        self.choice: Choice = choose(_hardware(pv, self.settings.gid_index), self.settings)
        self._activity = threading.Condition()
        self._immediates: list[tuple[tuple[bytes, ...], int]] = []
        self._stopping = threading.Event()  # close(): progress threads end
        self._wr_ids = itertools.count(RECV_WR_ID + 1)
        #: wr_id -> the signaled send work requests in flight
        self._pending: dict[int, _Pending] = {}
        self._allocated: dict[tuple[int, int], VerbsRegion] = {}
        self._peers: dict[bytes, list[VerbsChannel]] = {}  # peer address -> its lanes
        self._extra: list[VerbsChannel] = []  # lanes of a connection a later one with the same peer replaced
        self._by_qp: dict[int, VerbsChannel] = {}
        self._connecting: dict[bytes, threading.Lock] = {}
        self._outgoing: set[bytes] = set()  # peers this device is connecting to now (in channel())
        self._incoming: set[bytes] = set()  # peers whose connection request accept() is serving now
        self._connected = threading.Condition(self._lock)  # a connection was recorded (_keep)
        self.context = pv.device.Context(name=self.choice.device)
        try:
            attr = self.context.query_device()
            depth = self.settings.queue_depth
            if depth > attr.max_qp_wr:
                raise FabricError(f"RDMA_QP_QUEUE_DEPTH={depth} is more than {self.choice.device} allows per queue "
                                  f"pair ({attr.max_qp_wr})")
            self.rd_atomic = rd_atomic_limit(attr.max_qp_rd_atom, attr.max_qp_init_rd_atom)
            self._max_cqe = attr.max_cqe
            self.pd = pv.pd.PD(self.context)
            self._scratch_memory = aligned_empty((ALIGNMENT,), np.uint8, ALIGNMENT)
            # the key of the zero-length scatter entries of receives and empty writes (not counted as a registration)
            self._scratch = pv.mr.MR(self.pd, ALIGNMENT, IBV_ACCESS_LOCAL_WRITE, address=start_of(self._scratch_memory))
            initial = min(self._max_cqe, CQES_PER_QP * depth)
            self._pollers = [_Poller(self, index, initial) for index in range(progress_threads)]
        except pv.pyverbs_error.PyverbsError as exc:
            self.context.close()
            raise FabricError(f"verbs: setting up {self.choice.device}: {exc}") from None
        except BaseException:
            self.context.close()
            raise
        self._device_address: DeviceAddress = new_address(self.choice, self.rd_atomic)
        self._address = encode_address(self._device_address)
        for poller in self._pollers:
            poller.start()

    # -- what the backend is ----------------------------------------------------------------------

    @classmethod
    def availability(cls, fabric_transport: str = "auto") -> Availability:
        try:
            pv = _pyverbs()
        except ImportError:
            return Availability(False, PYVERBS_MISSING)
        try:
            hardware = _hardware(pv)
        except FabricError as exc:
            return Availability(False, str(exc))
        reason = inactive_reason(hardware)
        return Availability(reason is None, reason or "")

    @classmethod
    def without_effect(cls, settings: RdmaSettings) -> dict[str, str]:
        """None: verbs applies every RDMA_* variable (queue depth as each queue pair's send and receive depth)."""
        return {}

    @classmethod
    def links(cls) -> dict[str, list[str]]:
        """``{"rc": [DEVICE:PORT, ...]}``: the active ports pyverbs lists; empty without pyverbs or a device."""
        try:
            hardware = _hardware(_pyverbs())
        except (ImportError, FabricError):
            return {}
        ports = [f"{device.name}:{port.number}" for device in hardware for port in device.ports if port.active]
        return {"rc": ports} if ports else {}

    @classmethod
    def _tool(cls, name: str, fabric_transport: str) -> Tool:
        """perftest's ``ib_write_bw`` / ``ib_write_lat`` from PATH, with ``-d``/``-i``/``-x`` from RDMA_*."""
        path = shutil.which(name)
        if path is None:
            raise FabricError(f"{name} is not installed (it is perftest's): apt install perftest")
        return Tool(name, Path(path), dict(os.environ), perftest_arguments(read_settings()))

    # -- memory ----------------------------------------------------------------------------------

    def alloc(self, nbytes: int, shared: bool = True) -> MemRegion:
        """64-byte aligned process memory, registered. ``shared`` changes nothing: the NIC reaches any memory."""
        self._check_open()
        backing = aligned_empty((max(nbytes, 1),), np.uint8, ALIGNMENT)
        region = VerbsRegion(self, backing[:nbytes], backing.nbytes, True)
        self._count_region(region)
        with self._lock:
            self._allocated[(region.address, region.address + backing.nbytes)] = region
        return region

    def _registered(self, array: np.ndarray, start: int, end: int) -> MemRegion | None:
        """Memory the device allocated is found first."""
        with self._lock:
            for (lo, hi), region in self._allocated.items():
                if lo <= start and end <= hi:
                    return region
        return self._cache.find(start, end)

    def _register_span(self, array: np.ndarray, start: int, end: int, owner: np.ndarray) -> MemRegion:
        if end == start:
            raise ValueError("cannot register an empty array")
        view = np.frombuffer((ctypes.c_uint8 * (end - start)).from_address(start), dtype=np.uint8)
        writable = bool(owner.flags.writeable)
        view.flags.writeable = writable
        return VerbsRegion(self, view, end - start, writable)

    def _evictable(self, region: MemRegion) -> bool:
        """A registration a work request in flight uses is never evicted."""
        return not region.busy

    def _sge(self, array: np.ndarray):
        """The scatter-gather entry of ``array`` (registered through the cache) and its region."""
        if not array.nbytes:
            return self._empty_sge(), None
        if not array.flags.c_contiguous:
            raise ValueError("verbs transfers need C-contiguous memory")
        region = self.register(array)
        return self._pv.wr.SGE(start_of(array), array.nbytes, region.lkey), region

    def _empty_sge(self):
        return self._pv.wr.SGE(start_of(self._scratch_memory), 0, self._scratch.lkey)

    def _forget(self, region: VerbsRegion) -> None:
        with self._lock:
            for key, value in list(self._allocated.items()):
                if value is region:
                    del self._allocated[key]
        self._cache.forget(region)

    # -- connections --------------------------------------------------------------------------------

    @property
    def address(self) -> list[bytes]:
        return [self._address]

    def _modify(self, channel: VerbsChannel, attributes: QpAttributes, state: str) -> None:
        try:
            channel.qp.modify(qp_attr(self._pv, attributes), attributes.mask)
        except self._pv.pyverbs_error.PyverbsError as exc:
            raise FabricError(f"verbs: moving a queue pair to {state} failed: {exc}") from None

    def _new_lanes(self, peer: bytes) -> list[VerbsChannel]:
        """``lanes_per_peer`` queue pairs for ``peer`` in INIT, their receives (for immediates) posted."""
        lanes: list[VerbsChannel] = []
        try:
            for lane in range(self.lanes_per_peer):
                poller = self._pollers[cq_index(lane, len(self._pollers))]
                poller.reserve(self.settings.queue_depth, self._max_cqe)
                try:
                    channel = VerbsChannel(self, peer, poller)
                except BaseException:
                    with self._lock:
                        poller.queue_pairs -= 1
                    raise
                lanes.append(channel)
                self._modify(channel, init_attributes(self.choice), "INIT")
                for _ in range(self.settings.queue_depth):
                    channel.qp.post_recv(channel.recv_wr)
                with self._lock:
                    self._by_qp[channel.qp_num] = channel
        except self._pv.pyverbs_error.PyverbsError as exc:
            self._discard(lanes)
            raise FabricError(f"verbs: creating a queue pair failed: {exc}") from None
        except BaseException:
            self._discard(lanes)
            raise
        return lanes

    def _connect_lanes(self, lanes: list[VerbsChannel], remote: DeviceAddress, theirs: list[LaneEndpoint]) -> None:
        """INIT -> RTR -> RTS, each of our queue pairs with the peer's of the same lane."""
        try:
            for channel, their in zip(lanes, theirs, strict=True):
                self._modify(channel, rtr_attributes(self.choice, remote, their, self.rd_atomic, self.settings), "RTR")
                self._modify(channel, rts_attributes(channel.psn, remote, self.rd_atomic, self.settings), "RTS")
        except BaseException:
            self._discard(lanes)
            raise

    def _discard(self, lanes: list[VerbsChannel]) -> None:
        with self._lock:
            for channel in lanes:
                self._by_qp.pop(channel.qp_num, None)
                channel.poller.queue_pairs -= 1
        for channel in lanes:
            channel.close()

    def _keep(self, peer: bytes, lanes: list[VerbsChannel]) -> list[VerbsChannel]:
        """Record a connection with ``peer`` and wake whoever waits for it. A second one (the peer connected
        again: its first attempt failed on its side) replaces the first for sending; the first still delivers
        what the peer sent on it."""
        with self._connected:
            closed = self._closed
            if not closed:
                if peer in self._peers:
                    self._extra.extend(self._peers[peer])
                self._peers[peer] = lanes
                self._connected.notify_all()
        if closed:
            self._discard(lanes)
            self._check_open()
        return lanes

    def _wait_connected(self, peer: bytes, timeout: float) -> list[VerbsChannel]:
        """The lanes the peer's own connection (accepted here) brings, once it has come."""
        deadline = time.monotonic() + timeout
        with self._connected:
            while peer not in self._peers:
                self._check_open()
                if self.interrupted.is_set():
                    raise FabricInterrupted("verbs: waiting for a peer's connection was interrupted (closing)")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise FabricTimeout(f"verbs: the peer deferred to its own connection, which did not come in "
                                        f"{timeout:g} s")
                self._connected.wait(min(remaining, WAIT_SLICE_S))
            return self._peers[peer]

    def channel(self, peer: list[bytes], lane: int = 0, exchange: Exchange | None = None) -> Channel:
        """Lane ``lane`` to ``peer``: the first call for a peer agrees on all its queue pairs with one exchange.

        The peer may defer (it is connecting to us at the same time and its connection stands, see
        :func:`decide.wins`, or it is connected already): ours are dropped and its connection is used.
        """
        if not peer:
            raise FabricError("verbs: a peer address is empty")
        key = bytes(peer[0])
        index = qp_index(lane, self.lanes_per_peer)
        with self._lock:
            self._check_open()
            lanes = self._peers.get(key)
            connecting = self._connecting.setdefault(key, threading.Lock())
        if lanes is not None:
            return lanes[index]
        if exchange is None:
            raise FabricError("verbs: a connection to a new peer is agreed with it over the control path: "
                              "channel() needs the exchange that reaches the peer's accept()")
        try:
            remote = decode_address(key)
        except ValueError as exc:
            raise FabricError(f"verbs: the peer's address is malformed: {exc}") from None
        with connecting:
            with self._connected:
                while key in self._incoming and key not in self._peers:  # the peer's own request is being served
                    self._check_open()
                    self._connected.wait(WAIT_SLICE_S)
                lanes = self._peers.get(key)
                if lanes is None:
                    self._outgoing.add(key)
            if lanes is not None:
                return lanes[index]
            try:
                lanes = self._new_lanes(key)
                try:
                    reply = exchange(connect_request(self._address, [channel.endpoint for channel in lanes]))
                    theirs = parse_reply(reply, self.lanes_per_peer)
                except ValueError as exc:
                    self._discard(lanes)
                    raise FabricError(f"verbs: the peer's connect reply is malformed: {exc}") from None
                except BaseException:
                    self._discard(lanes)
                    raise
                if theirs is None:
                    self._discard(lanes)
                    lanes = self._wait_connected(key, CONNECT_WAIT_S)
                else:
                    self._connect_lanes(lanes, remote, theirs)
                    lanes = self._keep(key, lanes)
            finally:
                with self._lock:
                    self._outgoing.discard(key)
        return lanes[index]

    def accept(self, request: dict[str, Any], peer: list[bytes]) -> dict[str, Any]:
        """Queue pairs for the requester (ValueError if the request is malformed, or names another device than
        ``peer``, the requester's address as its own control server gives it), connected to its own; the reply
        carries ours. A later ``channel(requester)`` uses them without another exchange. To a peer connected
        already, or one we are connecting to and whose connection yields to ours, the reply defers."""
        raw, remote, theirs = parse_request(request, self.lanes_per_peer)
        if not peer or raw != bytes(peer[0]):
            raise ValueError("a verbs connect request names another device than the rank that sent it: refused")
        self._check_open()
        with self._lock:
            if raw in self._peers or raw in self._incoming or (raw in self._outgoing and wins(self._address, raw)):
                return connect_deferral()
            self._incoming.add(raw)
        try:
            lanes = self._new_lanes(raw)
            self._connect_lanes(lanes, remote, theirs)
            reply = connect_reply([channel.endpoint for channel in lanes])
            self._keep(raw, lanes)
        finally:
            with self._connected:
                self._incoming.discard(raw)
                self._connected.notify_all()
        return reply

    def _write_spread(self, channels: list[Channel], data: np.ndarray, remote: RemoteRegion,
                      trailer: np.ndarray, trailer_remote: RemoteRegion, timeout: float) -> None:
        """The data cut in one piece per lane (:func:`decide.spread`), all posted, all waited for; then the
        trailer on the first lane."""
        pieces = spread(data.nbytes, len(channels))
        if len(pieces) <= 1:
            channels[0].write_flagged(data, remote, trailer, trailer_remote, timeout)
            return
        if data.nbytes > remote.length:
            raise remote.too_small(data.nbytes, "RDMA write")
        deadline = time.monotonic() + timeout
        flat = data.reshape(-1).view(np.uint8)
        write = self._pv.enums.IBV_WR_RDMA_WRITE
        lanes: list[VerbsChannel] = list(channels)
        posted = [(lane, lane._post(write, flat[offset : offset + length], remote.at(offset, length), "RDMA write"))
                  for lane, (offset, length) in zip(lanes, pieces, strict=False)]
        for lane, future in posted:
            lane._blocking(future, deadline, "RDMA write")
        flag = lanes[0]._post(write, trailer, trailer_remote, "RDMA write of a flag")
        lanes[0]._blocking(flag, deadline, "RDMA write of a flag")

    # -- the rest -----------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        choice = self.choice
        description: dict[str, Any] = {
            **super().describe(),
            "used": [f"rc/{choice.device}:{choice.port}"],
            "device": choice.device,
            "port": choice.port,
            "gid_index": choice.gid_index,
            "link_layer": choice.link_layer_name,
            "mtu": choice.mtu,
            "queue_depth": self.settings.queue_depth,
        }
        if (version := _pyverbs_version()) is not None:
            description["pyverbs_version"] = version
        return description

    def _shut(self) -> list[Channel]:
        """Stop the progress threads, fail what is in flight; hand over the queue pairs."""
        with self._lock:
            lanes: list[Channel] = [channel for channels in self._peers.values() for channel in channels] + self._extra
            self._peers.clear()
            self._extra.clear()
            self._by_qp.clear()
        self._stopping.set()
        for poller in self._pollers:
            poller.stop()
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for entry in pending:
            settle(entry.future, error=FabricError("verbs: the device is closed"))
        return lanes

    def _free(self) -> None:
        """Destroy the CQs, PD and context (the queue pairs and regions are gone)."""
        self._scratch.close()
        for poller in self._pollers:
            poller.close()
        self.pd.close()
        self.context.close()
        with self._activity:
            self._activity.notify_all()
