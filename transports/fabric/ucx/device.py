"""The ``ucx`` fabric: UCX's UCP API (put, get, flush, mem_map, rkeys) through cffi.

Each progress thread owns one UCP worker and stands in for one of the paper's
CQ-polling threads; lanes to a peer are spread round-robin over them. A
progress thread progresses its worker while operations are outstanding, then
arms the worker and sleeps on its event file descriptor, so an idle device
burns no core.

UCX's tcp transport is never opened (its target writes any address a peer names, see
``transports/fabric/stream.py``): ``--fabric-transport tcp`` carries one-sided operations over the fabric's own
checked stream, and ``auto`` chooses among the rest.

The binding, its settings and what this UCX offers are ``library.py``; the progress threads ``progress.py``; the
channels, their plans and flag sets ``channel.py``. This module holds the device and its memory regions.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import weakref
from typing import Any, ClassVar

import numpy as np

from transports.common import Availability, aligned_empty
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
from transports.fabric.rdma_devices import active_ports, read_devices
from transports.fabric.registrations import owner_of
from transports.fabric.settings import RdmaSettings
from transports.fabric.stream import Grants, StreamChannel, StreamListener, parse_stream_address
from transports.fabric.ucx import library
from transports.fabric.ucx.channel import (
    MAX_BLOB,
    SPIN_S,
    UcxChannel,
    UcxFlagSet,
    UcxTakePlan,
    _buffer,
    _check,
    _keep_mapped,
    _pointer,
    _reason,
)
from transports.fabric.ucx.library import (
    FABRIC_TRANSPORTS,
    GROUP_SHARED_TRANSPORT,
    TOOL_TRANSPORTS,
    UCX_HOME_VARIABLE,
    UNCHECKED_TRANSPORT,
    WORKER_LOCK,
    accepts_setting,
    listen_host,
    moves_device_memory,
    no_rdma_reason,
    owner_only_tls,
    parse_ucx_info,
    ucx_home,
    ucx_settings,
    with_device_transports,
)
from transports.fabric.ucx.progress import Worker
from transports.fabric.ucx.shared_room import shared_room

ALIGNMENT = 64

_ffi = _lib = None


def load() -> tuple[Any, Any]:
    """The cffi module (:func:`library.load`), bound to this module too; FabricError says why it cannot load."""
    global _ffi, _lib
    if _lib is None:
        _ffi, _lib = library.load()
    return _ffi, _lib


class UcxRegion(MemRegion):
    """Memory registered with ``ucp_mem_map``; ``owner`` keeps the underlying buffer alive. Device memory
    (``span``: its ``[start, end)``) is registered by address, UCX finding its memory type; it has no host view
    (``array`` is None)."""

    def __init__(self, device: UcxDevice, array: np.ndarray | None, owner: object, allocate: int = 0,
                 span: tuple[int, int] | None = None) -> None:
        self.device = device
        self._owner = owner
        self._span = span
        memh = _ffi.new("ucp_mem_h *")
        if span is not None:
            self._mapped = None
            _check(_lib.tt_mem_map(device.context, _ffi.cast("void *", span[0]), max(span[1] - span[0], 1), memh),
                   "registering device memory")
        elif allocate:
            _check(_lib.tt_mem_map(device.context, _ffi.NULL, allocate, memh), f"allocating {allocate} bytes")
            length = _ffi.new("size_t *")
            address = _lib.tt_mem_address(memh[0], length)
            array = np.frombuffer(_ffi.buffer(address, allocate), dtype=np.uint8)
            self._mapped = (int(_ffi.cast("uintptr_t", address)), int(length[0]))
        else:
            self._mapped = None
            _check(_lib.tt_mem_map(device.context, _pointer(array), max(array.nbytes, 1), memh),
                   "registering memory")
        self.array = array
        self.memh = memh[0]
        #: the array a registration (not an allocation) was made for; its death releases the registration
        self._owner_ref: weakref.ref | None = None
        self._exported: RemoteRegion | None = None
        self._released = False

    @property
    def address(self) -> int:
        return self._span[0] if self._span is not None else self.array.ctypes.data

    @property
    def nbytes(self) -> int:
        return self._span[1] - self._span[0] if self._span is not None else self.array.nbytes

    def export(self) -> RemoteRegion:
        """The region's one descriptor: made once, under the device's lock (two first exports at once, each
        granting a key of its own over TCP, gave one table two keys, and the receiver one mirror per key, whose
        span writes then set each other's entries back to zero)."""
        exported = self._exported
        if exported is not None:
            return exported
        with self.device._lock:
            if self._exported is None and self.device.grants is not None:
                # over TCP the key is a capability the device's listener checks (transports/fabric/stream.py)
                self._exported = RemoteRegion(self.address, self.nbytes, self.device.grants.grant(self.array))
            if self._exported is None:
                _lib.tt_cuda_enter()  # (packing a key of device memory asks the driver for its IPC handle)
                buffer, size = _ffi.new("void **"), _ffi.new("size_t *")
                _check(_lib.ucp_rkey_pack(self.device.context, self.memh, buffer, size), "packing a remote key")
                rkey = bytes(_ffi.buffer(buffer[0], size[0]))
                _lib.ucp_rkey_buffer_release(buffer[0])
                self._exported = RemoteRegion(self.address, self.nbytes, rkey)
            return self._exported

    def release(self) -> None:
        """Unregister: the remote key is revoked (a peer's mapping of UCX's segment ends with it).

        Memory UCX allocated goes with its registration; if views of it are still referenced (a
        received tensor read after ``close()``), its bytes move to private memory at the same
        address first, so that those views stay valid until they are dropped.
        """
        if not self._released:
            self._released = True
            if self._exported is not None and self.device.grants is not None:
                self.device.grants.revoke(self._exported.rkey)
            # references: self.array and getrefcount's argument; any other one is a view
            keep = self._mapped is not None and sys.getrefcount(self.array) > 2
            saved = bytes(_ffi.buffer(_ffi.cast("void *", self._mapped[0]), self._mapped[1])) if keep else b""
            _lib.tt_cuda_enter()  # (cuda_copy pins host memory it registers: unpinning needs a context here too)
            _lib.ucp_mem_unmap(self.device.context, self.memh)
            if keep:
                _keep_mapped(self.array, *self._mapped, saved)
            self.device._cache.forget(self)


class UcxDevice(Device):
    """A UCP context with ``progress_threads`` workers; see the module docstring.

    ``interfaces``: the network interfaces UCX's network transports may use (``UCX_NET_DEVICES``,
    unless the user set that variable); ``settings``: the RDMA_* variables, mapped to UCX settings
    where this build has them (:func:`ucx_settings`); ``config``: further UCX settings (name
    without ``UCX_`` -> value), which win.
    """

    name = "ucx"
    spin_s = SPIN_S  # (its waits are in C: a latency run's receiver sees a transfer landing within 2 ms at once)
    fabric_transports: ClassVar[dict[str, str]] = {
        "auto": "UCX chooses among all it offers but sysv", "shm": "shared memory only (posix, cma; never sysv)",
        "tcp": "TCP only, over the fabric's own stream that checks every access (never UCX's tcp)",
        "rdma": "RDMA only (UCX's rc transports on an RDMA device); an error where this UCX reaches none"}
    reference_tools = ("ucx_perftest", "ucx_info")
    never_used: ClassVar[dict[str, str]] = {
        GROUP_SHARED_TRANSPORT: "its segments are open to the owner's group",
        UNCHECKED_TRANSPORT: "its target writes any address a peer names; --fabric-transport tcp is the fabric's "
                             "own checked stream"}

    def __init__(self, fabric_transport: str = "auto", progress_threads: int = 1, lanes_per_peer: int = 1,
                 interfaces: list[str] | tuple[str, ...] = (), settings: RdmaSettings | None = None,
                 config: dict[str, str] | None = None) -> None:
        super().__init__(progress_threads, lanes_per_peer, settings, fabric_transport)
        load()
        #: ask UCX to report a failed peer on each endpoint (UCP_ERR_HANDLING_MODE_PEER). Off: over tcp it
        #: makes UCX emulate every put with active messages (a fifth of the bandwidth of its zero-copy put,
        #: measured here), and the transports find a dead peer through the control path and deadlines
        self.peer_errors = False
        mapped, self.settings_without_effect = ucx_settings(self.settings)
        lock = {} if "UCX_USE_MT_MUTEX" in os.environ else WORKER_LOCK
        self.config = {**lock, **self._network_config(fabric_transport, interfaces), **mapped, **(config or {})}
        #: UCX_TLS as given to UCX: ``config``'s TLS, else the fabric transport's (auto: the user's UCX_TLS, else
        #: all), never with sysv (see GROUP_SHARED_TRANSPORT)
        chosen = FABRIC_TRANSPORTS[fabric_transport] if "TLS" not in self.config else ""
        self.tls = owner_only_tls(self.config.pop("TLS", None) or chosen or os.environ.get("UCX_TLS", ""))
        if chosen and fabric_transport != "tcp":  # a list the fabric chose: GPU memory too, where a GPU is
            self.tls = with_device_transports(self.tls)
        #: a flagged put orders its data before its flag with a bounded flush of the endpoint, not a fence (shim.c:
        #: tt_put_flagged): where UCX moves GPU memory, whose puts are GPU copies UCX completes later
        self.flush_between = 0
        if fabric_transport != "tcp" and moves_device_memory(self.tls):
            # UCX's CUDA transports call the driver from every thread that calls UCX: device 0's primary context
            # (CUDA_VISIBLE_DEVICES chooses it) is made current on each that has none (shim.c: tt_cuda_enter)
            status = _lib.tt_cuda_use(0)
            if status != 0:
                raise FabricError(f"ucx: UCX offers its CUDA transports, but CUDA device 0's context cannot be held "
                                  f"(CUresult {status}; -1: libcuda.so.1 or one of its functions is missing); "
                                  f"leave cuda_copy out of UCX_TLS to move host memory only")
            self.flush_between = 1
        names = [_ffi.new("char[]", name.encode()) for name in self.config]
        values = [_ffi.new("char[]", str(value).encode()) for value in self.config.values()]
        context = _ffi.new("ucp_context_h *")
        status = _lib.tt_init(self.tls.encode(), _ffi.new("char *[]", names),
                              _ffi.new("char *[]", values), len(names), context)
        if status != _lib.UCS_OK and fabric_transport == "rdma":
            raise FabricError(f"ucx: --fabric-transport rdma: {no_rdma_reason(_reason(status))}")
        _check(status, f"initialising UCX with transports '{fabric_transport}' and settings {self.config}")
        self.context = context[0]
        self._activity = threading.Condition()
        self._channels: dict[tuple[bytes, int], UcxChannel] = {}
        #: set by interrupt_waits(): every blocking wait and transfer in C returns
        self._stop = _ffi.new("int *")
        #: buffers of transfers given up on (timed out): UCX may still read or write them until close
        self._abandoned: list[object] = []
        #: transfers written by this process's own copy into peer memory mapped here (shared memory): those of
        #: plans (counted in C) and the others (``_mapped_elsewhere``): :attr:`mapped_writes`
        self._mapped_by_plans = _ffi.new("uint64_t *")
        self._mapped_elsewhere = 0
        self._workers = [Worker(self, i) for i in range(progress_threads)]
        #: the workers' handles, for the waits in C to progress them (see tt_progress_all)
        self._worker_handles = _ffi.new("ucp_worker_h[]", [worker.handle for worker in self._workers])
        #: over TCP: what this device exported (remote keys are capabilities) and the listener that checks each
        #: access against them (transports/fabric/stream.py); None otherwise
        self.grants: Grants | None = None
        self.stream: StreamListener | None = None
        #: why this device moves no device memory, None when it does; False until asked (device_memory_problem)
        self._device_memory_problem: str | bool | None = False
        self._token: str | None = None
        if fabric_transport == "tcp":
            self.grants = Grants()
            try:
                self.stream = StreamListener(listen_host(interfaces), self.grants, self._wake_waiters)
            except OSError as exc:
                self.close()
                raise FabricError(f"tcp: cannot listen on {listen_host(interfaces)}: {exc}") from None

    @property
    def moves_device_memory(self) -> bool:
        return self.device_memory_problem() is None

    def device_memory_problem(self) -> str | None:
        """Why this device does not register GPU memory and put into it (None: it does); found once (a transport asks
        on every send of a device tensor)."""
        if self._device_memory_problem is False:
            if self.stream is not None:
                self._device_memory_problem = ("over --fabric-transport tcp the fabric's own stream carries host "
                                               "memory only")
            elif not moves_device_memory(self.tls):
                self._device_memory_problem = (f"UCX offers no CUDA transport under UCX_TLS={self.tls} here (it "
                                               "needs a GPU, and cuda_copy in UCX_TLS)")
            else:
                self._device_memory_problem = None
        return self._device_memory_problem

    @property
    def mapped_writes(self) -> int:
        """Transfers written by this process's own copy into peer memory mapped here (shared memory)."""
        return self._mapped_elsewhere + int(self._mapped_by_plans[0])

    @classmethod
    def availability(cls, fabric_transport: str = "auto") -> Availability:
        """Whether the binding loads; for ``rdma``, also whether this UCX has an RC transport on an active RDMA port."""
        try:
            load()
        except FabricError as exc:
            return Availability(False, str(exc))
        if fabric_transport != "rdma":
            return Availability(True)
        if not active_ports(read_devices()):
            return Availability(False, "no RDMA device with an active port here (bench doctor says more)")
        config = cls._network_config(fabric_transport, ())
        context = _ffi.new("ucp_context_h *")
        status = _lib.tt_init(owner_only_tls(FABRIC_TRANSPORTS["rdma"]).encode(),
                              _ffi.new("char *[]", [_ffi.new("char[]", k.encode()) for k in config]),
                              _ffi.new("char *[]", [_ffi.new("char[]", v.encode()) for v in config.values()]),
                              len(config), context)
        if status != _lib.UCS_OK:
            return Availability(False, no_rdma_reason(_reason(status)))
        _lib.ucp_cleanup(context[0])
        return Availability(True)

    @staticmethod
    def _network_config(fabric_transport: str, interfaces: list[str] | tuple[str, ...]) -> dict[str, str]:
        """UCX settings for the network devices: TCP restricted to ``interfaces`` (where the cluster's addresses
        are), RDMA ports left usable beside them; Soft-RoCE's quirk of UD wire-up worked around."""
        config: dict[str, str] = {}
        devices = read_devices()
        ports = [port.name for port in active_ports(devices)]
        if interfaces and not os.environ.get("UCX_NET_DEVICES") and fabric_transport not in ("rdma", "tcp"):
            # without the RDMA ports in the list, naming the interfaces would shut UCX off RDMA
            config["NET_DEVICES"] = ",".join([*interfaces, *ports])
        soft_roce = any(device.kind == "Soft-RoCE" and any(port.active for port in device.ports) for device in devices)
        uses_ud = fabric_transport in ("auto", "rdma")  # shm and tcp have no UD (UCX warns of a setting unused)
        if soft_roce and uses_ud and "UCX_UD_ETH_DGID_CHECK" not in os.environ \
                and accepts_setting("UD_ETH_DGID_CHECK", "n"):
            # rxe (Soft-RoCE) fails UD's destination-GID check on its IPv4-mapped GIDs, so RC connections,
            # which UD sets up, never come up (UCX's "UD endpoint ... unhandled timeout error")
            config["UD_ETH_DGID_CHECK"] = "n"
        return config

    @classmethod
    def without_effect(cls, settings: RdmaSettings) -> dict[str, str]:
        return ucx_settings(settings)[1]

    @classmethod
    def links(cls) -> dict[str, list[str]]:
        """The transports of this UCX and their devices, from its ``ucx_info -d``; empty when that cannot run."""
        try:
            tool = cls.tool("ucx_info")
            listed = subprocess.run([str(tool.path), "-d"], capture_output=True, text=True, timeout=60,
                                    env=tool.environment)
        except (OSError, subprocess.SubprocessError, FabricError):
            return {}
        return parse_ucx_info(listed.stdout)

    @classmethod
    def _tool(cls, name: str, fabric_transport: str) -> Tool:
        """``ucx_perftest`` or ``ucx_info`` of the fabric's UCX, on the UCX transports of ``fabric_transport``."""
        path = ucx_home() / "bin" / name
        if not path.is_file():
            raise FabricError(f"{name} not found at {path}: it ships with the libucx-cu12 wheel; reinstall it with "
                              f"'pip install --force-reinstall libucx-cu12' (or point {UCX_HOME_VARIABLE} at a UCX "
                              f"install that has bin/{name})")
        if not os.access(path, os.X_OK):
            raise FabricError(f"{name} at {path} is not executable; fix with 'chmod +x {path}'")
        env = dict(os.environ)
        # The wheel's binaries carry no RPATH to its lib/: without this they fail to load libucp.so.0.
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(path.parent.parent / "lib"),
                                                             env.get("LD_LIBRARY_PATH")) if p)
        if TOOL_TRANSPORTS[fabric_transport]:  # "auto" leaves UCX_TLS alone (unset, or the user's own)
            env["UCX_TLS"] = TOOL_TRANSPORTS[fabric_transport]
        for setting, value in cls._network_config(fabric_transport, ()).items():  # as the fabric's own devices
            env.setdefault(f"UCX_{setting}", value)
        return Tool(name, path, env)

    @property
    def address(self) -> list[bytes]:
        if self.stream is not None:
            return [self.stream.address]
        return [worker.address for worker in self._workers]

    def take_plan(self, trailers: list[np.ndarray], bells: list[np.ndarray] | None = None,
                  slots: list[np.ndarray] | None = None) -> UcxTakePlan:
        return UcxTakePlan(self, trailers, bells, slots)

    def flag_set(self, flags: list[np.ndarray]) -> UcxFlagSet:
        return UcxFlagSet(self, flags)

    def wait_counter(self, counter: np.ndarray, above: int, timeout: float) -> bool:
        found = _lib.tt_wait_counter(_ffi.cast("uint64_t *", counter.ctypes.data), above, int(self.spin_s * 1e9),
                                     int(timeout * 1e9), self._stop, self._worker_handles, len(self._workers))
        if found == _lib.TT_WAIT_STOPPED:
            raise FabricInterrupted("ucx: the wait was interrupted (the device is closing)")
        return found == 1

    def wait_counters(self, counters: list[np.ndarray], above: list[int], timeout: float) -> int | None:
        words = _ffi.new("uint64_t *[]", [_ffi.cast("uint64_t *", counter.ctypes.data) for counter in counters])
        found = _lib.tt_wait_counters(words, _ffi.new("uint64_t[]", above), len(counters), int(self.spin_s * 1e9),
                                      int(timeout * 1e9), self._stop, self._worker_handles, len(self._workers))
        if found == _lib.TT_WAIT_STOPPED:
            raise FabricInterrupted("ucx: the wait was interrupted (the device is closing)")
        return None if found == _lib.TT_WAIT_TIMED_OUT else found

    def interrupt_waits(self) -> None:
        self._stop[0] = 1

    def _write_spread(self, channels: list[Channel], data: np.ndarray, remote: RemoteRegion,
                      trailer: np.ndarray, trailer_remote: RemoteRegion, timeout: float) -> None:
        channels = channels[: _lib.TT_MAX_LANES]
        if self.stream is not None:
            channels[0].write_flagged(data, remote, trailer, trailer_remote, timeout)
            return
        checked = [channel._checked(remote, data.nbytes, "put") for channel in channels]
        if (checked[0][1] and channels[0]._checked(trailer_remote, trailer.nbytes, "put")[1]
                and type(data) is np.ndarray):
            # mapped here (shared memory): one copy by this thread; lanes would only split it
            channels[0].write_flagged(data, remote, trailer, trailer_remote, timeout)
            return
        rkeys = [rkey for rkey, _ in checked]
        trailer_rkey, _ = channels[0]._checked(trailer_remote, trailer.nbytes, "put")
        status = _lib.tt_put_flagged_lanes(
            _ffi.new("ucp_worker_h[]", [channel.worker.handle for channel in channels]),
            _ffi.new("ucp_ep_h[]", [channel.ep for channel in channels]), _ffi.new("ucp_rkey_h[]", rkeys),
            len(channels), _buffer(data), data.nbytes, remote.addr, _ffi.from_buffer(trailer),
            trailer.nbytes, trailer_remote.addr, trailer_rkey, int(timeout * 1e9), self._stop, channels[0]._error)
        if status != _lib.UCS_OK:
            self._outcome(status, "put", keep_alive=(data, trailer))

    def _outcome(self, status: int, what: str, keep_alive: object) -> None:
        """Raise for a failed blocking transfer; its buffers stay alive (UCX may still use them)."""
        self._abandoned.append(keep_alive)
        if status == _lib.UCS_ERR_TIMED_OUT:
            if self._stop[0]:
                raise FabricInterrupted(f"ucx: {what} was interrupted (the device is closing)")
            raise FabricTimeout(f"ucx: {what} did not complete in time")
        raise FabricError(f"ucx: {what} failed: {_reason(status)}")

    def own_mappings(self) -> list[tuple[int, int]]:
        """``[start, end)`` of the memory UCX allocated for this device's regions."""
        with self._lock:
            return [(region._mapped[0], region._mapped[0] + region._mapped[1]) for region in self._cache.live()
                    if region._mapped is not None]

    def own_device_memory(self) -> list[tuple[int, int]]:
        """``[start, end)`` of the device memory this device registered (its own allocations and tensors)."""
        with self._lock:
            return [region._span for region in self._cache.live() if region._span is not None]

    def address_problem(self, address: bytes) -> str | None:
        """None when ``address`` (a peer's, from the control path) is a worker address UCX can use, else why not.

        Checked in this process, before UCX sees it: the size, and the header byte, which carries the
        address format's version and flags and so is the same for every worker of the run's UCX (an
        address of another format, or garbage such as 0xff bytes, is what made ``ucp_ep_create``
        abort). UCX offers no call that validates the rest of a packed address (its layout is
        internal and carries no length): the control path only takes an address from the rank it
        belongs to, at that rank's own control server (see ``transports.fabric_transport``).
        """
        if self.stream is not None:
            try:
                parse_stream_address(address)
            except FabricError as exc:
                return str(exc)
            return None
        if not isinstance(address, bytes) or not 9 <= len(address) <= MAX_BLOB:
            return f"a worker address of {len(address) if isinstance(address, bytes) else '?'} bytes is malformed"
        if address[0] != self._workers[0].address[0]:
            return (f"a worker address with header {address[0]:#04x} is malformed (this UCX writes "
                    f"{self._workers[0].address[0]:#04x}: another UCX version or settings?)")
        return None

    def alloc(self, nbytes: int, shared: bool = True) -> MemRegion:
        if shared and nbytes > shared_room():
            shared = False  # the shared-memory filesystem has not that much to spare: process memory (cma reaches it)
        if shared:
            # UCX allocates it: with shared-memory transports it comes from a shared segment that
            # a peer maps when it unpacks the remote key, so a put there is the sender's own
            # memcpy and never waits for this process to progress.
            region = UcxRegion(self, None, None, allocate=max(nbytes, 1))
        else:
            # numpy backs large arrays with transparent huge pages, which single-copy (cma)
            # transfers move markedly faster than the 4 KiB pages of a shared segment
            array = aligned_empty((nbytes,), np.uint8, ALIGNMENT)
            region = UcxRegion(self, array, array)
        if region.address % ALIGNMENT:
            region.release()
            raise FabricError(f"ucx: allocated memory at {region.address:#x} is not {ALIGNMENT}-byte aligned")
        self._count_region(region)
        return region

    def register(self, array: np.ndarray) -> MemRegion:
        """Host memory, or a device array's GPU memory where this device moves it (:attr:`moves_device_memory`)."""
        if type(array) is not np.ndarray and (problem := self.device_memory_problem()) is not None:
            raise FabricError(f"ucx: cannot register device memory here: {problem}")
        return super().register(array)

    def _registered(self, array: np.ndarray, start: int, end: int) -> MemRegion | None:
        found = self._cache.find(start, end)
        # a registration lives as long as the array it was made for: one of another array that shares the pages
        # is released when that array dies, maybe while a peer still reads this one with its key
        if found is not None and found._owner_ref is not None and found._owner_ref() is owner_of(array):
            return found
        return None

    def _register_span(self, array: np.ndarray, start: int, end: int, owner: np.ndarray) -> MemRegion:
        if type(array) is np.ndarray:
            view = np.frombuffer(_ffi.buffer(_ffi.cast("char *", start), max(end - start, 1)), dtype=np.uint8)
            region = UcxRegion(self, view, None)
        else:
            region = UcxRegion(self, None, None, span=(start, end))
        region._owner_ref = weakref.ref(owner)
        return region

    def _evictable(self, region: MemRegion) -> bool:
        # device memory is never evicted: a receiver's slots are registered once, for a peer that writes into them
        # all along (with GPUDirect a released key fails its writes); it dies with the memory, or at close
        return region._span is None

    def channel(self, peer: list[bytes], lane: int = 0, exchange: Exchange | None = None) -> Channel:
        lane %= self.lanes_per_peer  # UCX connects from the address alone: no exchange
        worker = self._workers[lane % len(self._workers)]
        target = peer[lane % len(peer)]
        with self._lock:
            self._check_open()
            key = (target, lane)
            channel = self._channels.get(key)
        if channel is not None:
            return channel
        if (problem := self.address_problem(target)) is not None:
            raise FabricError(f"ucx: {problem}")
        with self._lock:
            self._check_open()
            if key in self._channels:
                return self._channels[key]
            if self.stream is not None:
                channel = StreamChannel(target, stopped=lambda: bool(self._stop[0]), wait_counter=self.wait_counter,
                                        token=self._token)
            else:
                channel = UcxChannel(worker, target, peer_errors=self.peer_errors)
            self._channels[key] = channel
            return channel

    def require_token(self, token: str) -> None:
        """Over tcp: the stream's listener admits only connections that prove ``token``; channels prove it."""
        self._token = token
        if self.stream is not None:
            self.stream.require_token(token)

    def _wake_waiters(self) -> None:
        """After the tcp stream landed a write: a waiter asleep on the workers' event descriptors wakes at once."""
        for worker in self._workers:
            _lib.ucp_worker_signal(worker.handle)
        self._notify_activity()

    def _notify_activity(self) -> None:
        with self._activity:
            self._activity.notify_all()

    def wait_for_activity(self, timeout: float) -> None:
        with self._activity:
            self._activity.wait(timeout)

    def describe(self) -> dict[str, Any]:
        used = set()
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            if isinstance(channel, StreamChannel):
                used.add("tcp")  # the fabric's own stream
                continue
            # the lanes of the endpoint ("lane[0]:  0:rc_verbs/rxe0:1.0 md[0] ..."): the transports that carry data
            used.update(re.findall(r"lane\[\d+\]:\s+\d+:(\w+)/", channel.info()))
        stream = {"tcp_data_path": "the fabric's own stream: every access checked against the keys it granted "
                                   "(UCX's tcp transport is never used)"} if self.stream is not None else {}
        return {
            **super().describe(),
            "used": sorted(used),
            "ucx_version": _ffi.string(_lib.ucp_get_version_string()).decode(),
            "fabric_transport": self.fabric_transport,
            "ucx_tls": self.tls,
            "moves_device_memory": self.moves_device_memory,
            "ucx_config": self.config,
            **stream,
        }

    def _shut(self) -> list[Channel]:
        with self._lock:
            channels: list[Channel] = list(self._channels.values())
            self._channels.clear()
        if self.stream is not None:
            self.stream.close()
        for worker in self._workers:
            worker.stop()
        _lib.tt_cuda_enter()  # (UCX's CUDA transports release their streams and events through the driver)
        return channels

    def _free(self) -> None:
        for worker in self._workers:
            worker.destroy()
        _lib.ucp_cleanup(self.context)
