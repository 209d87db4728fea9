"""What every transport running on the RDMA fabric shares, written once.

A fabric transport owns a device (opened by backend name from the fabric
registry: ``ucx`` or ``verbs``), a registered memory pool, a control
server (gRPC, setup only, refusing callers without the run's token) and a
client per peer; it waits in the fabric (flags, counters, blocking transfers)
in slices of a second, checking between them that the peer lives, with a
watchdog for transfers in flight; and ``close()`` interrupts those waits and
waits for operations in flight before tearing the device down.

*The contract zerocopy and grpc_rdma (and rdma_cp, a zerocopy) build on.* A subclass of
:class:`FabricTransport` writes its protocol; this class gives it, and nothing else of it is meant to be used:

- its state, after :meth:`FabricTransport.start`: ``device`` (the opened fabric ``Device``), ``pool`` (registered
  memory, per-peer segments), ``rank``, ``cluster``, ``ledger`` (every copy and control message counted),
  ``timeout_s``, ``_lock`` (the transport's one lock for its tables) and ``_closed`` (set once closing);
- setup: ``control_handlers()`` (override to add the protocol's control calls, e.g. zerocopy's ``connect``;
  call the base's), ``_peer(rank)`` (the control client of a rank), ``_peer_device(rank)`` (its device
  address, asked once), ``_channel(rank, lane, device)`` (a lane to it, connected through the control path
  where the backend needs a handshake);
- waits and failures: ``_await(wait, what, ...)`` (a fabric wait in slices, the peers checked between them),
  ``_blocking(what, peer, channel, operation, *args)`` (one blocking fabric transfer, its failure as ours),
  ``_failure(what, peer, exc)`` (a fabric error as a ``TransportError`` naming the peer), ``_check_peer``,
  ``_fabric(channel, future, what, peer)`` (a future's result, the same way), ``_submit(fn, *args)``
  (background work on the transport's pool, waited for at close);
- closing: ``_before_device_close()`` (join the protocol's own threads; the device is still open);
- memory: :class:`FabricPlacement`, the placement a fabric transport hands out (registered memory, the
  registration cache's sites).
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from transports import fabric as fabrics
from transports import peer_input
from transports.base import (
    DEFAULT_TIMEOUT_S,
    Cluster,
    PeerError,
    Transport,
    TransportClosed,
    TransportError,
    TransportStats,
    TransportTimeout,
)
from transports.common import Availability, data_pointer
from transports.control import ControlClient, ControlServer
from transports.fabric.base import (
    SHARED_SPIN_S,
    Channel,
    Device,
    FabricError,
    FabricInterrupted,
    FabricTimeout,
    RemoteRegion,
)
from transports.fabric.netdev import cluster_interfaces
from transports.fabric.pool import RegisteredPool
from transports.fabric.settings import SettingsError, read_settings
from transports.memory import Memory
from transports.placement import Placement
from transports.ports import release_cluster_ports
from transports.tensors import allocation

#: grpc_rdma's poller: spin this long, then sleep in growing steps up to MAX_BACKOFF_S (flags and
#: counters of the other fabric transports are waited for in the fabric, see Device.flag_set)
SPIN_S = 0.002
MAX_BACKOFF_S = 0.001
#: how often a waiter checks that its peer lives
LIVENESS_EVERY_S = 1.0


def mapping_of(address: int) -> tuple[int, int]:
    """``[start, end)`` of the mapping of this process's memory that holds ``address`` (``/proc/self/maps``).

    ValueError when no mapping holds it, or when it is not private anonymous memory (a file, a stack):
    only an allocator's heap regions are registered whole.
    """
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, _, high = fields[0].partition("-")
            if int(low, 16) <= address < int(high, 16):
                if len(fields) > 5 and fields[5] and not fields[5].startswith("[anon"):
                    raise ValueError(f"address {address:#x} is in {fields[5]}, not an allocator's anonymous memory")
                if "rw" not in fields[1]:
                    raise ValueError(f"address {address:#x} is in memory mapped {fields[1]}, not writable heap")
                return int(low, 16), int(high, 16)
    raise ValueError(f"no mapping of this process holds address {address:#x}")


class _Operation:
    """``with transport._operation:`` counts an operation in flight; close() waits for none to be left.

    No lock: an operation is counted (one entry appended; appends and pops of a list are atomic) before it
    looks at the close, and close() sets the close before it looks at the count, so either the operation
    sees the close and backs out, or close() sees the operation and waits for it."""

    __slots__ = ("_transport", "closed", "inflight")

    def __init__(self, transport: FabricTransport) -> None:
        self._transport = transport
        #: one entry per operation under way
        self.inflight: list[None] = []
        #: set by close() (as the transport's ``_closed``, before it looks at ``inflight``): a plain attribute,
        #: read on every operation's way in and out
        self.closed = False

    def __enter__(self) -> None:
        self.inflight.append(None)
        if self.closed:
            self.__exit__(None, None, None)
            transport = self._transport
            raise TransportClosed(f"{transport.name} rank {transport.rank} was closed")

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        self.inflight.pop()
        if self.closed:
            idle = self._transport._idle
            with idle:
                idle.notify_all()


class DeviceBlock:
    """``nbytes`` of GPU memory in an allocation of its own, registered with the fabric device: zerocopy's receive
    slots of a tensor planned in device memory at both ends, rdma_cp's staging buffer for a tensor it sends from
    device memory, grpc_rdma's results and clones of such a tensor (direct mode). The device's counterpart of a pool
    block (``transports/fabric/pool.py``): typed views, and the descriptor a peer writes with. Its own allocation
    (``cudaMalloc``, not CuPy's pool) because CUDA IPC hands a peer the whole allocation an address lies in: the key
    to these slots reaches nothing else. Its registration lives as long as the block (or until the device closes)."""

    def __init__(self, device: Device, nbytes: int, memory: Memory, peer: int | None = None) -> None:
        self.nbytes, self.memory = nbytes, memory
        #: the rank whose key reaches the block (None: no peer's), as a pool block's segment says
        self.peer = peer
        self.array = allocation(nbytes, memory)
        self.region = device.register(self.array)

    def view(self, dtype: np.dtype, shape: tuple[int, ...], offset: int = 0) -> Any:
        """A typed view of the block's device memory, starting ``offset`` bytes in."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        return self.array[offset: offset + nbytes].view(dtype).reshape(shape)

    def remote(self, offset: int = 0, length: int | None = None) -> RemoteRegion:
        """The descriptor a peer needs to reach ``[offset, offset + length)`` of this block."""
        length = self.nbytes - offset if length is None else length
        return self.region.export().at(data_pointer(self.array) - self.region.address + offset, length)


class FabricTransport(Transport):
    """Base of the transports that move tensors with one-sided operations on the fabric."""

    uses_fabric = True
    #: whether the transport's protocol writes a planned device tensor where it lies, into the receiver's device
    #: memory, where its fabric moves device memory (zerocopy, rdma_cp, grpc_rdma's direct mode); False: it stages
    #: device memory through host memory on any fabric (grpc_rdma's buffered mode: its proxy buffer is host memory)
    writes_device_memory: bool = False

    @property
    def device_memory(self) -> bool:
        """Whether this transport moves device memory itself (see :attr:`writes_device_memory`): its protocol does,
        and its fabric device registers GPU memory and puts into it (``Device.moves_device_memory``)."""
        device = self.device
        return self.writes_device_memory and device is not None and device.moves_device_memory

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, fabric: str = fabrics.DEFAULT,
                 fabric_transport: str = "auto", progress_threads: int = 1, lanes_per_peer: int = 1) -> None:
        super().__init__(timeout_s=timeout_s)
        backend = fabrics.backend(fabric)  # UnknownFabric (a ValueError) names the known ones
        if fabric_transport not in backend.fabric_transports:
            raise ValueError(f"unknown fabric transport '{fabric_transport}' for the {fabric} fabric "
                             f"(known: {', '.join(backend.fabric_transports)})")
        try:
            #: the RDMA_* variables, which every backend applies as far as it can (see Device.without_effect)
            self.settings = read_settings()
        except SettingsError as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        self.fabric = fabric
        self.fabric_transport = fabric_transport
        self.progress_threads = progress_threads
        self.lanes_per_peer = lanes_per_peer
        self._closed = threading.Event()
        self._idle = threading.Condition()  # close() waits on it for the operations under way to end
        self._lock = threading.Lock()
        self._peers: dict[int, ControlClient] = {}
        self._peer_devices: dict[int, list[bytes]] = {}
        self.device: Device | None = None
        #: how long a poller of this transport's own (grpc_rdma's) spins before it sleeps (see share_cores)
        self.poller_spin_s = SPIN_S
        self._registrations_at_close = 0
        #: brackets a send or recv (``with self._operation:``) so that close() waits for it before tearing the
        #: device down
        self._operation = _Operation(self)
        #: blocking transfers under way: token -> (peer, channel, start), watched by the watchdog
        self._inflight: dict[object, tuple[int, Channel, float]] = {}
        self._watchdog: threading.Thread | None = None
        self.placement: FabricPlacement = FabricPlacement(self)

    @classmethod
    def availability(cls) -> Availability:
        """Available where the default fabric is (``--fabric`` picks another; opening it says if it cannot run)."""
        return fabrics.availability(fabrics.DEFAULT)

    @classmethod
    def variants(cls) -> dict[str, dict[str, Any]]:
        return {"shm": {"fabric_transport": "shm"}, "tcp": {"fabric_transport": "tcp"}, "verbs": {"fabric": "verbs"},
                "ucx-rdma": {"fabric_transport": "rdma"}}

    def control_handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """The control-path operations this transport serves, besides ``ping`` and ``hello``."""
        return {}

    def interfaces(self, cluster: Cluster) -> list[str]:
        """The network interfaces of this host that hold the cluster's addresses: where the fabric may listen.

        UCX otherwise opens a TCP listener on every interface (external ones too): a loopback
        cluster's fabric listens on loopback only.
        """
        return cluster_interfaces([address.rpartition(":")[0] for address in cluster.addresses])

    # lifecycle -------------------------------------------------------------

    def start(self, cluster: Cluster, rank: int) -> None:
        if not 0 <= rank < cluster.size:
            raise ValueError(f"{self.name}: rank {rank} is not in a cluster of {cluster.size}")
        self.cluster, self.rank = cluster, rank
        self.device = fabrics.open_device(self.fabric, self.fabric_transport, self.progress_threads,
                                          self.lanes_per_peer, interfaces=self.interfaces(cluster),
                                          settings=self.settings)
        self.device.require_token(cluster.token)  # what listens (the tcp stream) admits the run's ranks alone
        self.pool = RegisteredPool(self.device)
        self._executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix=f"{self.name}-{rank}")
        handlers = {"ping": lambda request: {}, "hello": self._on_hello, "fabric": self._on_fabric,
                    **self.control_handlers()}
        try:
            self._control = ControlServer(cluster.addresses[rank], handlers, f"{self.name} rank {rank}",
                                          cluster.token)
        except BaseException:  # nothing of this start may outlive it, and close() must find nothing to do
            self._executor.shutdown(wait=False)
            self.device.close()
            self.device = None
            raise

    def share_cores(self) -> None:
        self.poller_spin_s = SHARED_SPIN_S
        if self.device is not None:
            self.device.share_cores()

    def close(self) -> None:
        if self._closed.is_set() or self.device is None:
            self._closed.set()
            self._operation.closed = True
            return
        self._closed.set()
        self._operation.closed = True
        self.device.interrupt_waits()  # waits and transfers in the fabric return now
        self._control.stop()
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._idle:  # waiting operations notice the close within one back-off period
            self._idle.wait_for(lambda: not self._operation.inflight, timeout=10)
        self._before_device_close()
        for client in self._peers.values():
            client.close()
        self._registrations_at_close = self.device.registrations_made
        self.device.close()
        release_cluster_ports(self.cluster.addresses)
        # dropped, not only stopped and closed: gRPC's core (its poller and threads) lives as long as
        # any server or channel object does, and this transport object may outlive its close()
        with self._lock:
            self._peers = {}
        self._control = None

    def _before_device_close(self) -> None:
        """Hook: stop anything that still uses the device (pollers)."""

    def describe(self) -> dict[str, Any]:
        """The fabric actually used (for ``meta.json``)."""
        return self.device.describe() if self.device else {"fabric": self.fabric}

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._closed.is_set():
            raise TransportClosed(f"{self.name} rank {self.rank} was closed")
        return self._executor.submit(fn, *args)

    # control path ----------------------------------------------------------

    def _peer(self, rank: int) -> ControlClient:
        with self._lock:
            if self._closed.is_set():
                raise TransportClosed(f"{self.name} rank {self.rank} was closed")
            if rank not in self._peers:
                self._peers[rank] = ControlClient(self.cluster.addresses[rank], self.peer_name(rank),
                                                  self.cluster.token)
            return self._peers[rank]

    def _peer_device(self, rank: int) -> list[bytes]:
        """Rank ``rank``'s device address, as its own control server (at its address in the cluster) tells it."""
        if rank not in self._peer_devices:
            reply = self._peer(rank).call("hello", timeout=self.timeout_s)
            try:
                device = peer_input.device_address(reply.get("device"), self.peer_name(rank))
            except PeerError as exc:
                raise PeerError(f"{self.name}: in its answer to 'hello', {exc}") from None
            self.ledger.add(control_messages=1)
            with self._lock:
                self._peer_devices.setdefault(rank, device)
        return self._peer_devices[rank]

    def _on_hello(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"device": [a.hex() for a in self.device.address]}

    def _on_fabric(self, request: dict[str, Any]) -> dict[str, Any]:
        """A peer's device asks ours to agree on a connection (verbs: queue pair numbers); ValueError if malformed.

        The request names the asking rank; the device takes it only for the device that rank's own
        control server (at its address in the cluster) says it has.
        """
        rank = request.pop("rank", None)
        if type(rank) is not int or not 0 <= rank < self.cluster.size or rank == self.rank:
            raise ValueError(f"a fabric request must name the asking rank, another of the cluster's "
                             f"{self.cluster.size}, not {rank!r:.20}")
        return self.device.accept(request, self._peer_device(rank))

    def _channel(self, rank: int, lane: int = 0, device: list[bytes] | None = None) -> Channel:
        """The fabric channel to rank ``rank`` over ``lane``; ``device``: its device address, when already known.

        A backend that must agree on the connection with the peer's device does it over the control path.
        """
        def exchange(request: dict[str, Any]) -> dict[str, Any]:
            reply = self._peer(rank).call("fabric", timeout=self.timeout_s, rank=self.rank, **request)
            self.ledger.add(control_messages=1)
            return reply

        return self.device.channel(device if device is not None else self._peer_device(rank), lane, exchange)

    # waiting ---------------------------------------------------------------

    def _check_peer(self, peer: int, what: str, channel: Channel | None) -> None:
        reason = channel.failed() if channel is not None else None
        # a peer we have never heard from may still be starting (importing TensorFlow, building its model):
        # only one that answered before and answers no more is gone; the others get until the deadline
        if reason is None and peer in self._peer_devices and not self._peer(peer).alive():
            reason = "it does not answer on the control path (the process is gone?)"
        if reason is not None:
            raise PeerError(f"{self.name}: {what}: peer {self.peer_name(peer)} failed: {reason}")

    def _await(self, wait: Callable[[float], Any], what: Callable[[], str],
               peers: Callable[[], list[tuple[int, Channel | None]]], deadline: float,
               timeout: float | None = None, waited: bool = False) -> Any:
        """The first answer of ``wait(slice_s)`` (a wait in the fabric that returns None when a slice of
        time passes without it); between slices, no more often than once a second, check the close,
        the deadline and that the peers ``peers()`` still live. ``what()`` names what is awaited;
        ``timeout``: the time the deadline allowed (the transport's timeout when None), for the message;
        ``waited``: the caller has waited a slice already, without an answer (the checks come first)."""
        while True:
            if waited:
                if self._closed.is_set():
                    raise TransportClosed(f"{self.name} rank {self.rank} was closed while waiting for {what()}")
                for peer, channel in peers():
                    self._check_peer(peer, what(), channel)
            now = time.monotonic()
            if now > deadline:
                names = ", ".join(self.peer_name(peer) for peer, _ in peers()[:3])
                allowed = self.timeout_s if timeout is None else timeout
                raise TransportTimeout(f"{self.name}: {what()} did not complete within {allowed:g} s "
                                       f"(peer {names})")
            try:
                answer = wait(min(LIVENESS_EVERY_S, deadline - now))
            except FabricInterrupted:
                raise TransportClosed(f"{self.name} rank {self.rank} was closed while waiting for {what()}") from None
            if answer is not None:
                return answer
            waited = True

    def _blocking(self, what: Any, peer: int, channel: Channel, operation: Callable[..., Any], *args: Any,
                  watched: bool = True) -> Any:
        """Run a blocking fabric transfer on ``channel`` (``write_flagged``, ``read_now``); its failures, as ours.

        ``what`` names the transfer (a Key: "writing" it), formatted only when it fails. While it runs
        (in C, for as long as the timeout), the watchdog checks that the peer lives (see :meth:`_watch`);
        ``watched=False`` for an operation that cannot wait on the peer for long (a copy into its memory
        mapped here, a wait of a short slice).
        """
        if not watched:
            try:
                return operation(*args, timeout=self.timeout_s)
            except FabricError as exc:
                raise self._failure(what, peer, exc) from None
        token = object()
        self._inflight[token] = (peer, channel, time.monotonic())
        if self._watchdog is None:
            self._start_watchdog()
        try:
            return operation(*args, timeout=self.timeout_s)
        except FabricError as exc:
            raise self._failure(what, peer, exc) from None
        finally:
            self._inflight.pop(token, None)

    def _failure(self, what: Any, peer: int, exc: FabricError) -> TransportError:
        """What a failed fabric transfer (``what``, see :meth:`_blocking`) with ``peer`` is, as ours."""
        what = f"writing {what}" if isinstance(what, tuple) else what
        if isinstance(exc, FabricInterrupted):
            return TransportClosed(f"{self.name} rank {self.rank} was closed during {what}")
        if isinstance(exc, FabricTimeout):
            return TransportTimeout(f"{self.name}: {what} did not complete within {self.timeout_s:g} s "
                                    f"(peer {self.peer_name(peer)})")
        return PeerError(f"{self.name}: {what} with peer {self.peer_name(peer)} failed: {exc}")

    def _start_watchdog(self) -> None:
        with self._lock:
            if self._watchdog is None and not self._closed.is_set():
                self._watchdog = threading.Thread(target=self._watch, name=f"{self.name}-{self.rank}-watchdog",
                                                  daemon=True)
                self._watchdog.start()

    def _watch(self) -> None:
        """Once a second: a transfer running for a second or more to a peer that answered before and no
        longer does (its process is gone) has its channel marked failed, so that it returns at once.

        Without this a transfer to a dead peer would wait out its timeout: the UCX backend's own detection
        of failed peers is off (see its ``peer_errors``), and a verbs queue pair retries before it fails.
        """
        while not self._closed.wait(LIVENESS_EVERY_S):
            now = time.monotonic()
            for peer, channel, started in list(self._inflight.values()):
                if now - started < LIVENESS_EVERY_S or channel.failed() is not None or peer not in self._peer_devices:
                    continue
                try:
                    alive = self._peer(peer).alive()
                except TransportError:
                    return  # closed
                if not alive:
                    channel.fail()

    def stats(self) -> TransportStats:
        """The ledger, whose ``registrations`` are every memory registration the device made since start.

        Over UCX that is every ``ucp_mem_map``: pool segments, and tensors registered so a peer can read
        them (the dynamic path); UCP takes any memory as the source of a write (where a UCX transport
        needs it registered, UCX registers it through its own cache; none of this machine's does).
        Over verbs the source of a write must be registered too, through the device's cache.
        """
        made = self.device.registrations_made if self.device is not None else self._registrations_at_close
        return replace(self.ledger.snapshot(), registrations=made)

    def _fabric(self, channel: Channel, future: Future, what: str, peer: int) -> Any:
        """Wait for a fabric operation; a failure becomes a PeerError naming the peer."""
        try:
            return channel.wait(future, self.timeout_s)
        except FabricError as exc:
            raise PeerError(f"{self.name}: {what} with peer {self.peer_name(peer)} failed: {exc}") from None


class FabricPlacement(Placement):
    """A fabric transport's placement: memory registered with its device (its pool, the device's registration
    cache) and the allocation sites the runtime asks it to register for sending from."""

    def __init__(self, transport: FabricTransport) -> None:
        super().__init__()
        self._transport = transport
        self._lock = threading.Lock()
        #: allocator regions registered for sending from (register_site): id(region) -> (region, its view)
        self._sites: dict[int, tuple[Any, np.ndarray]] = {}

    def registered(self, array: np.ndarray) -> bool:
        transport = self._transport
        if transport.device is None:
            return False
        return (not array.nbytes or transport.pool.segment_of(array) is not None
                or transport.device.registered(array))

    def register_site(self, array: np.ndarray) -> int:
        """Register the mapping of process memory that holds ``array`` (its allocator's region), once.

        The region stays registered until close: its view is kept here, so the registration cache never
        expires it. It is for sending from only: :meth:`is_site` tells the transports never to hand
        a peer a key to it (a tensor there that a peer must read is staged into the pool instead).
        """
        device = self._transport.device
        if device is None or not array.nbytes or self.registered(array):
            return 0
        low, high = mapping_of(array.__array_interface__["data"][0])
        view = np.frombuffer((ctypes.c_uint8 * (high - low)).from_address(low), dtype=np.uint8)
        region = device.register(view)
        with self._lock:
            self._sites[id(region)] = (region, view)
        return high - low

    def is_site(self, region: Any) -> bool:
        """Whether ``region`` is an allocator's region registered by :meth:`register_site` (never exported)."""
        return id(region) in self._sites
