"""The "RDMA device" of the paper (its Table 1), independent of the backend.

| paper                                     | here                                      |
|-------------------------------------------|-------------------------------------------|
| CreateRdmaDevice(num_cqs, num_qps, ep)    | ``open_device(backend, progress_threads, lanes_per_peer)`` |
| AllocateMemRegion(size)                   | ``device.alloc(nbytes) -> MemRegion``      |
| (register foreign memory)                 | ``device.register(array) -> MemRegion``    |
| GetChannel(remote_endpoint, qp_idx)       | ``device.channel(peer, lane) -> Channel``  |
| Memcpy(local, remote, size, dir, cb)      | ``channel.write/read(...) -> Future``, ``flush`` |
| address distribution over a vanilla RPC   | ``region.export() -> RemoteRegion``        |

Backends (``ucx``, ``verbs``) implement :class:`Device`, :class:`Channel`, :class:`MemRegion` and
:class:`FlagSet`; the registry in ``transports/fabric/__init__.py`` opens them by name. Nothing
above the fabric imports a backend module.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from transports.common import Availability, data_pointer, done_future
from transports.fabric.errors import FabricError, FabricInterrupted, FabricTimeout
from transports.fabric.plans import BELL_BYTES, CounterPlan, FlagSet, SendPlan, TakePlan
from transports.fabric.registrations import RegistrationCache, owner_of, span_of, start_of
from transports.fabric.settings import RdmaSettings
from transports.fabric.waits import DEFAULT_SPIN_S, SHARED_SPIN_S, PolledFlagSet
from transports.fabric.waits import wait_counter as _polled_counter
from transports.fabric.waits import wait_counters as _polled_counters

#: what the transports import from here, though other modules of the fabric define it
__all__ = ["BELL_BYTES", "DEFAULT_SPIN_S", "SHARED_SPIN_S", "CounterPlan", "FabricError", "FabricInterrupted",
           "FabricTimeout", "FlagSet", "SendPlan", "TakePlan"]

#: the longest remote key a peer may send (UCX's are under 100 bytes here)
MAX_RKEY_BYTES = 1024


@dataclass(frozen=True)
class RemoteRegion:
    """What a peer needs to access a region with one-sided operations: address, length, remote key."""

    addr: int
    length: int
    rkey: bytes

    def at(self, offset: int, length: int) -> RemoteRegion:
        """The sub-range ``[offset, offset + length)`` of this region."""
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"range [{offset}, {offset + length}) lies outside a remote region of {self.length} bytes")
        return RemoteRegion(self.addr + offset, length, self.rkey)

    def too_small(self, nbytes: int, what: str) -> ValueError:
        """The error to raise for ``what`` (an operation) of ``nbytes`` bytes that does not fit this region (the
        callers compare ``nbytes > length`` themselves, on the per-transfer path)."""
        return ValueError(f"{what} of {nbytes} bytes does not fit a remote region of {self.length}")

    def to_json(self) -> dict[str, Any]:
        return {"addr": self.addr, "length": self.length, "rkey": self.rkey.hex()}

    @classmethod
    def from_json(cls, data: Any) -> RemoteRegion:
        """The region a peer described with :meth:`to_json`; ValueError says what is wrong with it.

        It comes from another process: address and length must be integers of the fabric's 64-bit
        range (no bool, float or string), the region must not wrap, and the remote key must be hex
        of a plausible size. Whether the key really covers the region, the device checks.
        """
        if not isinstance(data, dict) or set(data) != {"addr", "length", "rkey"}:
            raise ValueError("a region descriptor must be an object with exactly 'addr', 'length' and 'rkey'")
        addr, length, rkey = data["addr"], data["length"], data["rkey"]
        for field, value in (("addr", addr), ("length", length)):
            if type(value) is not int or not 0 <= value < 2**64:
                raise ValueError(f"a region descriptor's '{field}' must be an integer in [0, 2**64), not {value!r:.40}")
        if addr + length > 2**64:
            raise ValueError(f"a region of {length} bytes at {addr:#x} wraps around the address space")
        if not isinstance(rkey, str) or not 0 < len(rkey) <= 2 * MAX_RKEY_BYTES:
            raise ValueError(f"a region descriptor's 'rkey' must be a hex string of 1 to {MAX_RKEY_BYTES} bytes")
        try:
            key = bytes.fromhex(rkey)
        except ValueError:
            raise ValueError("a region descriptor's 'rkey' is not hex") from None
        return cls(addr, length, key)


class MemRegion(ABC):
    """Registered memory: a numpy byte view plus what peers need to reach it. A region of device memory (a GPU's,
    registered by :meth:`Device.register` where the device :attr:`~Device.moves_device_memory`) has the device array
    it was made for as ``array``: there is no host view of it."""

    array: np.ndarray  # uint8, C-contiguous

    @property
    def address(self) -> int:
        return data_pointer(self.array)

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    @abstractmethod
    def export(self) -> RemoteRegion:
        """The descriptor to send to a peer over the control path."""

    @abstractmethod
    def release(self) -> None:
        """Deregister (and free, if the device allocated it)."""

    def contains(self, array: np.ndarray) -> bool:
        """Whether ``array``'s memory lies inside this region."""
        start = data_pointer(array)
        return self.address <= start and start + array.nbytes <= self.address + self.nbytes


class Channel(ABC):
    """A connection to one peer over one lane: one-sided reads and writes."""

    @abstractmethod
    def write(self, local: np.ndarray, remote: RemoteRegion) -> Future:
        """Copy ``local`` (registered memory) into ``remote``; done when ``local`` may be reused."""

    @abstractmethod
    def read(self, local: np.ndarray, remote: RemoteRegion) -> Future:
        """Copy ``remote`` into ``local`` (registered memory); done when the data is in ``local``."""

    @abstractmethod
    def flush(self) -> Future:
        """Done when every write issued before it is complete at the peer."""

    def notify(self) -> Future:
        """Wake the peer's progress threads (and whoever waits on them) with an empty message.

        One-sided writes into mapped memory raise no event at the target; a verbs write with
        immediate would. Writers that a sleeping peer must notice ring this doorbell after them.
        (Default: nothing to wake, the peer polls.)
        """
        return done_future()

    def close(self) -> None:
        """Release the connection (:meth:`Device.close` calls it; default: nothing held)."""
        return None

    def wait(self, future: Future, timeout: float | None = None):
        """The result of an operation's future; backends may progress from the caller meanwhile."""
        return future.result(timeout)

    @abstractmethod
    def failed(self) -> str | None:
        """Why the connection failed, or None while it is healthy."""

    @abstractmethod
    def fail(self) -> None:
        """Mark the connection failed (its peer is known to be gone): transfers in flight on it return an error."""

    # the per-transfer path: one blocking call per transfer, no future, no Python in between

    def write_flagged(self, data: np.ndarray, remote: RemoteRegion, trailer: np.ndarray | None = None,
                      trailer_remote: RemoteRegion | None = None, timeout: float = 60.0) -> None:
        """Write ``data`` to ``remote``, flush, then ``trailer`` (its last byte a flag) to ``trailer_remote``, flush.

        Returns once both are at the peer: a peer that sees the flag sees the data. ``data`` may be
        empty. Raises FabricTimeout after ``timeout`` seconds, FabricInterrupted when the device's
        waits are interrupted, FabricError when the transfer fails. (Default: those four operations, each
        waited for; a backend does it in one call.)
        """
        deadline = time.monotonic() + timeout
        if data.nbytes:
            self._wait_until(self.write(data, remote), deadline, "a write")
            self._wait_until(self.flush(), deadline, "a flush")
        if trailer is not None:
            self._wait_until(self.write(trailer, trailer_remote), deadline, "a flag's write")
            self._wait_until(self.flush(), deadline, "a flush")

    def _wait_until(self, future: Future, deadline: float, what: str) -> None:
        """:meth:`wait` for ``future`` until ``deadline``: FabricTimeout naming ``what`` after it."""
        try:
            self.wait(future, max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise FabricTimeout(f"{what} did not complete in time") from None

    def send_plan(self, slots: list[RemoteRegion], trailers: list[RemoteRegion], trailer: np.ndarray,
                  credits: np.ndarray, bells: list[RemoteRegion] | None = None) -> SendPlan | None:
        """A static tensor's whole send (credit, data, trailer) as one call, planned once (see :class:`SendPlan`):
        its data goes to ``slots`` in turn, each followed by ``trailer`` (9 bytes of registered memory: step,
        flag) at the matching one of ``trailers``; ``credits`` (one uint64) counts the peer's receives posted.
        ``bells`` (:data:`BELL_BYTES` per slot at the peer, see :meth:`Device.take_plan`), where the peer's
        memory is mapped here: a send rings the slot's doorbell after its write, where the peer sleeps on it;
        and a send of a large tensor that finds the peer waiting in its take asks it to pull the data itself
        (the copy then ends in the reader's cache; :attr:`SendPlan.pulled`). None where the backend has no such
        path (the caller then waits and writes with :meth:`write_flagged`)."""
        return None

    def counter_plan(self, local: np.ndarray, remote: RemoteRegion) -> CounterPlan | None:
        """A counter the peer reads at ``remote`` (8 bytes), kept here in ``local`` (one uint64), set through one
        call each time (:class:`CounterPlan`); None where the backend has no such path (the caller writes
        ``local`` with :meth:`write_flagged`)."""
        return None

    def read_now(self, local: np.ndarray, remote: RemoteRegion, timeout: float = 60.0) -> None:
        """Read ``remote`` into ``local`` and return once it is there (errors as :meth:`write_flagged`)."""
        if local.nbytes:
            self._wait_until(self.read(local, remote), time.monotonic() + timeout, "a read")

    def write_with_imm(self, data: np.ndarray, remote: RemoteRegion, imm: int, timeout: float = 60.0) -> None:
        """Write ``data`` (may be empty) to ``remote`` and deliver the 32-bit ``imm`` to the peer after it.

        Only where the device's :attr:`Device.immediates` is true (verbs' RDMA WRITE_WITH_IMM: the
        peer's completion queue receives ``imm`` once the data is in place; the peer collects it with
        :meth:`Device.take_immediates`). Errors as :meth:`write_flagged`.
        """
        raise NotImplementedError(f"{type(self).__name__} has no write with immediate (see Device.immediates)")


@dataclass(frozen=True)
class Tool:
    """A benchmark program that ships beside a backend's library (``ucx_perftest``, ``ib_write_bw``):
    the executable, the environment it needs and the arguments that pick the device the fabric uses."""

    name: str
    path: Path
    environment: dict[str, str]
    arguments: tuple[str, ...] = ()


#: ``exchange(request) -> reply``: one round trip to the peer's :meth:`Device.accept` over the control path
Exchange = Callable[[dict[str, Any]], dict[str, Any]]


class Device(ABC):
    """One process's endpoint on the fabric.

    Open one through the registry (``transports.fabric.open_device``). The class attributes and
    class methods say what a backend is before one is opened: whether it can run here, which
    ``--fabric-transport`` choices and RDMA_* settings it takes, and its reference tools.

    *The contract.* A backend writes the abstract methods of this class (whether it can run here, its address,
    allocating and registering memory, channels, sleeping until traffic, and the two halves of closing), of
    :class:`MemRegion` (export, release) and of :class:`Channel` (write, read, flush, and its health): the
    paper's Table 1. This class does the rest once for every backend: the registration cache and its count
    (:meth:`register` around the backend's :meth:`_register_span`), :meth:`close` (idempotent: threads stopped,
    channels closed, registrations released), the "device is closed" check, the common keys of :meth:`describe`,
    and the waits on flags and counters (polled from Python by ``waits.py``, interrupted through
    :attr:`interrupted`). Everything else has a default a backend may replace with a faster path: the
    per-transfer calls composed of writes, reads and flushes, no plans (``plans.py``; the transports then take
    the general path). ``docs/fabric-backend.md`` walks through one.
    """

    #: how long this device's waits spin before they sleep (the backend's default; :meth:`share_cores` shortens it)
    spin_s: float = DEFAULT_SPIN_S

    def __init__(self, progress_threads: int = 1, lanes_per_peer: int = 1, settings: RdmaSettings | None = None,
                 fabric_transport: str = "auto") -> None:
        self._check_transport(fabric_transport)
        if progress_threads < 1 or lanes_per_peer < 1:
            raise ValueError("progress_threads and lanes_per_peer must be at least 1")
        self.fabric_transport = fabric_transport
        self.progress_threads = progress_threads
        self.lanes_per_peer = lanes_per_peer
        self.settings = settings or RdmaSettings()
        #: set by :meth:`interrupt_waits`: every wait of this device then raises FabricInterrupted
        self.interrupted = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        #: the live regions, and the registrations of foreign memory among them (``registrations.py``)
        self._cache: RegistrationCache[Any] = RegistrationCache()
        self._registrations_made = 0

    def share_cores(self) -> None:
        """This process's waits share the machine's cores with compute (TensorFlow's, a parameter server's apply):
        from now on a wait spins :data:`SHARED_SPIN_S` at most, then gives its core back and sleeps until the write
        rings its doorbell (where the peer maps the memory) or its naps end. A spinning waiter took a core from the
        compute beside it for as long as it spun. Plans made before keep the spin they were made with."""
        self.spin_s = min(self.spin_s, SHARED_SPIN_S)

    #: the backend's name in the fabric registry
    name: ClassVar[str]
    #: the ``--fabric-transport`` choices this backend takes, each with a line saying what it selects
    fabric_transports: ClassVar[dict[str, str]] = {"auto": "the backend chooses"}
    #: whether :meth:`Channel.write_with_imm` delivers immediates natively (else transports emulate them)
    immediates: ClassVar[bool] = False
    #: the benchmark programs :meth:`tool` can find, by the reference line they draw
    reference_tools: ClassVar[tuple[str, ...]] = ()
    #: carriers of the backend's library that the fabric never uses, each with why (``bench info`` says so)
    never_used: ClassVar[dict[str, str]] = {}

    @property
    def moves_device_memory(self) -> bool:
        """Whether this device registers GPU memory (:meth:`register` of a device array) and writes into a peer's
        with one-sided puts from a device array (CUDA IPC within a node, GPUDirect RDMA across): the transports
        then move device tensors without staging them through host memory. Default: no."""
        return False

    @classmethod
    @abstractmethod
    def availability(cls, fabric_transport: str = "auto") -> Availability:
        """Whether this backend can run here (its library loads, a device exists), over ``fabric_transport`` (one
        of :attr:`fabric_transports`: those that need hardware say whether it is here), and if not, why."""

    @classmethod
    def without_effect(cls, settings: RdmaSettings) -> dict[str, str]:
        """The RDMA_* variables set in ``settings`` that this backend cannot honour, each with the reason
        (default: every one set, until the backend says which it applies)."""
        return {name: f"the {cls.name} fabric does not read it" for name in settings.given()}

    @classmethod
    def links(cls) -> dict[str, list[str]]:
        """The links this backend offers here: carrier -> its devices (UCX: its transports, ``{"tcp": ["lo",
        "eth0"], "rc_verbs": ["rxe0:1"]}``; verbs: ``{"rc": ["rxe0:1"]}``); empty when it cannot tell."""
        return {}

    @classmethod
    def rdma_reach(cls, ports: list[str]) -> list[str]:
        """This backend's links that reach one of the RDMA ``ports`` (``device:port``, e.g. ``rxe0:1``), each as
        ``carrier/device:port`` (``rc_verbs/rxe0:1``); empty when none does, or when the backend cannot tell."""
        if not ports:
            return []
        return [f"{carrier}/{device}" for carrier, devices in cls.links().items() for device in devices
                if device in ports]

    @classmethod
    def tool(cls, name: str, fabric_transport: str = "auto") -> Tool:
        """Reference program ``name`` (one of :attr:`reference_tools`) set up for ``fabric_transport``.

        FabricError names what is missing and how to install it; ValueError an unknown ``fabric_transport``.
        """
        if name not in cls.reference_tools:
            raise FabricError(f"{cls.name}: no reference tool '{name}' "
                              f"(known: {', '.join(cls.reference_tools) or 'none'})")
        cls._check_transport(fabric_transport)
        return cls._tool(name, fabric_transport)

    @classmethod
    def _tool(cls, name: str, fabric_transport: str) -> Tool:
        """:meth:`tool` of a known ``name`` and ``fabric_transport`` (a backend with :attr:`reference_tools` writes
        it)."""
        raise FabricError(f"{cls.name}: reference tool '{name}' is listed but not set up")

    @classmethod
    def _check_transport(cls, fabric_transport: str) -> None:
        """ValueError unless ``fabric_transport`` is one of :attr:`fabric_transports`."""
        if fabric_transport not in cls.fabric_transports:
            raise ValueError(f"unknown fabric transport '{fabric_transport}' "
                             f"(known: {', '.join(cls.fabric_transports)})")

    def _check_open(self) -> None:
        """FabricError once the device is closed."""
        if self._closed:
            raise FabricError(f"{self.name}: the device is closed")

    # -- memory --------------------------------------------------------------------------------------

    @property
    def registrations_made(self) -> int:
        """Every memory registration this device made since it was opened (allocations and registrations)."""
        return self._registrations_made

    def registrations(self) -> int:
        """How many regions are registered now (those whose memory died are released first)."""
        return self._cache.count()

    def _count_region(self, region: MemRegion) -> None:
        """Count ``region`` (an allocation or a registration this device just made) and keep it until released
        (its ``release()`` ends with ``self._cache.forget(region)``)."""
        with self._lock:
            self._registrations_made += 1
        self._cache.track(region)

    @property
    @abstractmethod
    def address(self) -> list[bytes]:
        """What a peer needs to open channels to this device (sent over the control path)."""

    @abstractmethod
    def alloc(self, nbytes: int, shared: bool = True) -> MemRegion:
        """A new registered, 64-byte aligned region.

        ``shared``: memory that peers on the same host can map (a write there is the writer's own copy), where
        the backend has such memory and room for it; otherwise process memory (huge pages where possible).
        """

    def register(self, array: np.ndarray) -> MemRegion:
        """Register memory the device did not allocate, cached while the memory lives (``registrations.py``): the
        registration that covers it already (:meth:`_registered`), else a new one of its owner's whole buffer
        (:meth:`_register_span`), which evicts the least recently used beyond the cache's limit."""
        self._check_open()
        self._cache.release_expired()
        start = start_of(array)
        found = self._registered(array, start, start + array.nbytes)
        if found is not None:
            return found
        start, end = span_of(array)
        owner = owner_of(array)
        region = self._register_span(array, start, end, owner)
        self._count_region(region)
        for old in self._cache.add(start, end, region, owner, evictable=self._evictable):
            old.release()
        return region

    def _registered(self, array: np.ndarray, start: int, end: int) -> MemRegion | None:
        """The live registration that covers ``[start, end)`` of ``array``, or None (default: the cache's)."""
        return self._cache.find(start, end)

    @abstractmethod
    def _register_span(self, array: np.ndarray, start: int, end: int, owner: np.ndarray) -> MemRegion:
        """A new registration of ``[start, end)``, the memory ``owner`` holds and ``array`` lies in (for
        :meth:`register`, which counts and caches it)."""

    def _evictable(self, region: MemRegion) -> bool:
        """Whether the cache may release ``region`` to make room (default: any)."""
        del region
        return True

    def registered(self, array: np.ndarray) -> bool:
        """Whether ``array``'s bytes lie in memory registered with :meth:`register` that is still live."""
        self._cache.release_expired()
        start = data_pointer(array)
        return self._cache.find(start, start + array.nbytes) is not None

    @abstractmethod
    def channel(self, peer: list[bytes], lane: int = 0, exchange: Exchange | None = None) -> Channel:
        """The channel to ``peer`` (its :attr:`address`) over ``lane`` (cached).

        ``exchange`` reaches the peer's :meth:`accept` over the control path: backends that must
        agree on a connection with the peer (verbs' queue pairs) use it once per peer, for all lanes.
        """

    def flag_set(self, flags: list[np.ndarray]) -> FlagSet:
        """A set of one-byte flags in registered memory that peers raise, to wait on together (default: polled from
        Python, ``waits.py``)."""
        return PolledFlagSet(flags, self.interrupted, self.name, self.spin_s)

    def take_plan(self, trailers: list[np.ndarray], bells: list[np.ndarray] | None = None,
                  slots: list[np.ndarray] | None = None) -> TakePlan | None:
        """A static tensor's receive through one call (see :class:`TakePlan`): ``trailers`` are its slots'
        trailers in registered memory (9 bytes each: step, flag), written by the peer; ``bells`` a
        :data:`BELL_BYTES` record per slot there (uint8), used where the peer maps this memory
        (:meth:`TakePlan.use_bells`): a wait past its spin sleeps on its doorbell, and pulls into the slot's
        data (``slots``, registered memory; without them it pulls nothing) what the sender asks it to. None
        where the backend has no such path (the caller waits with :meth:`flag_set` and reads the trailer
        itself)."""
        return None

    def wait_counter(self, counter: np.ndarray, above: int, timeout: float) -> bool:
        """Wait until the uint64 ``counter[0]`` (registered memory a peer writes) exceeds ``above``.

        Spins for a moment, then naps in growing steps without holding the GIL: an idle waiter
        burns no core. False after ``timeout``; FabricInterrupted by :meth:`interrupt_waits`.
        (Default: polled from Python, ``waits.py``.)
        """
        return _polled_counter(counter, above, timeout, self.interrupted, self.name, self.spin_s)

    def write_flagged_lanes(self, channels: list[Channel], data: np.ndarray, remote: RemoteRegion,
                            trailer: np.ndarray, trailer_remote: RemoteRegion, timeout: float = 60.0) -> None:
        """:meth:`Channel.write_flagged` with the data spread over ``channels`` (lanes to one peer), the
        trailer over the first once all of them are flushed. One lane, or no data: the first's
        :meth:`~Channel.write_flagged`; else :meth:`_write_spread`."""
        if len(channels) == 1 or not data.nbytes:
            channels[0].write_flagged(data, remote, trailer, trailer_remote, timeout)
        else:
            self._write_spread(channels, data, remote, trailer, trailer_remote, timeout)

    def _write_spread(self, channels: list[Channel], data: np.ndarray, remote: RemoteRegion,
                      trailer: np.ndarray, trailer_remote: RemoteRegion, timeout: float) -> None:
        """:meth:`write_flagged_lanes` over two lanes or more, with data (default: the first lane carries it all)."""
        channels[0].write_flagged(data, remote, trailer, trailer_remote, timeout)

    def wait_counters(self, counters: list[np.ndarray], above: list[int], timeout: float) -> int | None:
        """The index of a counter (as in :meth:`wait_counter`) that exceeds its ``above``, or None after ``timeout``."""
        return _polled_counters(counters, above, timeout, self.interrupted, self.name, self.spin_s)

    def interrupt_waits(self) -> None:
        """Make every blocking wait and transfer of this device return at once (before closing): sets
        :attr:`interrupted`; a backend with transfers in flight of its own fails them too."""
        self.interrupted.set()

    @abstractmethod
    def wait_for_activity(self, timeout: float) -> None:
        """Sleep until the progress threads see incoming traffic, or ``timeout`` seconds pass."""

    def require_token(self, token: str) -> None:
        """Listeners of this device admit only connections that prove the run's ``token``; its channels prove it.
        Backends that listen nowhere (UCX over shared memory and RDMA, verbs) have nothing to check."""
        del token  # nothing of this backend listens

    def describe(self) -> dict[str, Any]:
        """For ``meta.json``: ``fabric`` (the backend's name), ``used`` (the links that carried data: UCX's
        transports, or verbs' device and port; default: none said), the progress threads and lanes, and the
        RDMA_* settings without effect; a backend adds its version and settings."""
        return {"fabric": self.name, "used": [], "progress_threads": self.progress_threads,
                "lanes_per_peer": self.lanes_per_peer,
                "rdma_settings_without_effect": self.without_effect(self.settings)}

    def close(self) -> None:
        """Close the device, once (a second call does nothing): the backend's threads stopped and its channels
        handed over (:meth:`_shut`), the channels closed, every registration released, then what the backend's
        library holds freed (:meth:`_free`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for channel in self._shut():
            channel.close()
        for region in self._cache.live():
            region.release()
        self._free()

    @abstractmethod
    def _shut(self) -> list[Channel]:
        """The first half of :meth:`close`: stop the backend's threads, fail what is in flight, and hand over
        every channel (forgotten here), for the base to close."""

    @abstractmethod
    def _free(self) -> None:
        """The second half of :meth:`close`, once channels and registrations are gone: free what the backend's
        library holds (queues, contexts)."""
