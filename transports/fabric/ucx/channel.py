"""The ucx device's channels: a :class:`UcxChannel` per peer (an endpoint on one of the device's workers, its puts
and gets checked against the regions the peer exported), the send, counter and take plans and the flag sets built
on it, and the checks of where shared memory is mapped. ``library.py`` loads the library and hands it to this module
(:func:`bind`) before any channel is made; ``device.py`` owns the workers (``progress.py``) and registers memory."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from transports.common import data_pointer
from transports.fabric.base import (
    Channel,
    Device,
    FabricError,
    FabricInterrupted,
    RemoteRegion,
)
from transports.fabric.plans import BELL_BYTES, CounterPlan, FlagSet, SendPlan, TakePlan
from transports.fabric.ucx.shared_room import descriptors_short, shared_memory_short

#: the largest worker address or remote key a peer may send (ours are a few hundred bytes, rkeys under 100)
MAX_BLOB = 8192
#: remote targets a channel remembers as checked (static slots, counters: a few per tensor)
MAX_TARGETS = 4096
#: a waiter for a flag or counter spins (yielding its core) this long before it naps, unless its device shares
#: the cores with compute (``Device.share_cores``)
SPIN_S = 0.002

#: the memory type a remote key to host memory carries (UCX's ``UCS_MEMORY_TYPE_HOST``; CUDA's is 1)
HOST_MEMORY = 0


def key_memory_type(rkey: bytes) -> int:
    """The memory type a packed remote key says its memory has: UCX packs a key as its memory domains' map (64
    bits), the memory type (a byte), then each domain's key (``ucp_rkey_packed_copy``). A peer's key may lie about
    it; the check each kind of memory gets fails either way (a device check of host memory finds no device
    allocation, a host check of device memory no shared segment)."""
    return rkey[8] if len(rkey) > 8 else HOST_MEMORY


#: the loaded binding (cffi's ffi and lib): set by :func:`bind` when ``device.load`` has loaded it
_ffi = _lib = None


def bind(ffi: Any, lib: Any) -> None:
    """Use the binding ``device.load`` loaded (once, before the first channel)."""
    global _ffi, _lib
    _ffi, _lib = ffi, lib


def _reason(status: int) -> str:
    return _ffi.string(_lib.ucs_status_string(status)).decode()


def _check(status: int, what: str) -> None:
    if status != _lib.UCS_OK:
        raise FabricError(f"ucx: {what} failed: {_reason(status)}")


def _pointer(array: np.ndarray):
    """``array``'s first byte for UCX, host or device memory (the caller keeps ``array`` alive)."""
    return _ffi.cast("void *", data_pointer(array))


def _buffer(array: np.ndarray):
    """The bytes a put reads or a get writes, as cffi passes them: a NumPy array's buffer (cffi keeps it alive while
    the pointer lives), a device array's address (UCX finds its memory type; the caller keeps it alive)."""
    return _ffi.from_buffer(array) if type(array) is np.ndarray else _pointer(array)


def _pin(array: Any) -> weakref.ref | None:
    """A hold on the memory of NumPy array ``array`` for a pointer kept to it from one send to the next: a weak
    reference to the array that owns that memory (``array``, or the base it views), under which NumPy refuses to
    resize (move) that array, ``refcheck=False`` or not; its memory stays where it is, and allocated, while the
    hold lives. A strong reference is not one: ``resize(refcheck=False)`` ignores references. None for other
    arrays (a device array's memory is its owner's to keep)."""
    if type(array) is not np.ndarray:
        return None
    while isinstance(array.base, np.ndarray):
        array = array.base
    return weakref.ref(array)


_PROT_READ_WRITE = 0x3
_MAP_PRIVATE_ANONYMOUS = 0x02 | 0x20
_MAP_FIXED_NOREPLACE = 0x100000


def _keep_mapped(array: np.ndarray, address: int, length: int, content: bytes) -> None:
    """Map private memory holding ``content`` at ``address`` (just unmapped) while ``array`` lives.

    MAP_FIXED_NOREPLACE: should another mapping have taken the range meanwhile, it is left alone
    (the views then read whatever is there, as freed memory would, but never crash on it).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    got = libc.mmap(address, length, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0)
    if got != address:
        if got not in (None, ctypes.c_void_p(-1).value):
            libc.munmap(got, length)  # an old kernel that took the flag as a hint
        return
    ctypes.memmove(address, content, len(content))
    weakref.finalize(array, libc.munmap, address, length)


_SHARED_PREFIXES = ("/SYSV", "/dev/shm/", "/memfd:")
#: unpacking remote keys one at a time, so that the segments each one maps are told apart
_unpacking = threading.Lock()


def _shared_mappings() -> set[tuple[int, int]]:
    """The ``[start, end)`` of every mapping of a shared segment in this process (SysV, POSIX, memfd)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) > 5 and fields[5].strip().startswith(_SHARED_PREFIXES):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                found.add((lo, hi))
    return found


def _merged(ranges: set[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo == out[-1][1]:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


class UcxChannel(Channel):
    """A UCP endpoint from one of our workers to one of the peer's.

    The peer's address is checked by :meth:`UcxDevice.address_problem` before UCX sees it,
    remote keys are bounded in size, and every one-sided operation on memory UCX maps into
    this process (shared-memory transports) must lie inside that mapping: a peer's bad
    descriptor is an error, not a crash.
    """

    def __init__(self, worker: Any, peer_address: bytes, peer_errors: bool) -> None:
        self.worker = worker
        self._error = _ffi.new("int *")  # written by UCX's error callback
        self._peer_address = _ffi.new("char[]", peer_address)
        ep = _ffi.new("ucp_ep_h *")
        status = _lib.tt_ep_create(worker.handle, self._peer_address, int(peer_errors), self._error, ep)
        if status != _lib.UCS_OK and (short := descriptors_short()) is not None:
            # the cause is the descriptor limit: said as the OSError it is, which names the limit where it is shown
            raise OSError(errno.EMFILE, f"{os.strerror(errno.EMFILE)}: ucx: connecting to a peer failed "
                                        f"({_reason(status)}): {short}")
        if status != _lib.UCS_OK and (short := shared_memory_short()) is not None:
            raise FabricError(f"ucx: connecting to a peer failed ({_reason(status)}): {short}")
        _check(status, "connecting to a peer")
        self.ep = ep[0]
        self._rkeys: dict[bytes, Any] = {}
        #: per remote key: the shared segments unpacking it mapped into this process (shared-memory
        #: transports), where every operation with that key must land; None if it mapped none
        self._segments: dict[bytes, list[tuple[int, int]] | None] = {}
        #: (rkey, address, bytes) of remote targets already checked -> the unpacked key
        self._targets: dict[tuple[bytes, int, int], Any] = {}
        self._lock = threading.Lock()

    def _rkey(self, rkey: bytes):
        with self._lock:
            if rkey not in self._rkeys:
                if not rkey or len(rkey) > MAX_BLOB:
                    raise FabricError(f"ucx: a remote key of {len(rkey)} bytes is malformed")
                handle = _ffi.new("ucp_rkey_h *")
                _lib.tt_cuda_enter()  # (a key to device memory opens the peer's IPC handle through the driver)
                with _unpacking:
                    before = _shared_mappings()
                    _check(_lib.ucp_ep_rkey_unpack(self.ep, rkey, handle), "unpacking a remote key")
                    mapped = _shared_mappings() - before
                self._rkeys[rkey] = handle[0]
                self._segments[rkey] = _merged(mapped) or None
            return self._rkeys[rkey]

    def _check_mapped(self, rkey: bytes, handle, remote: RemoteRegion, nbytes: int) -> int:
        """Refuse an operation on peer memory mapped here (shared memory) that leaves the peer's segment;
        where it lies in this process (0: not mapped here).

        With shared-memory transports UCX turns the remote address into a pointer into its
        mapping of the peer's segment and copies, unchecked: an address outside the segment
        would read or write this process's own memory. The segment is what unpacking the key
        mapped; should UCX have reused an earlier mapping, the target must at least lie in one
        shared segment and not in memory this device allocated. That is the writer's own check, and
        the pool keeps what one peer's key maps to that peer's blocks (``transports/fabric/pool.py``).
        Nothing else checks: cma lets any process of the same user write anywhere in the peer (the
        OS's boundary), and over tcp UCX's target copies a put to whatever address the request names,
        with an empty key (``uct_tcp_ep_handle_put_req``; ``UCX_TCP_PUT_ENABLE=n`` only stops this side
        offering put), so any process that reaches the worker's tcp port can write the process's memory.
        """
        if nbytes == 0:
            return 0
        local = _ffi.new("void **")
        _lib.tt_cuda_enter()  # (cuda_ipc maps a key to device memory through the driver, on this thread's context)
        if _lib.ucp_rkey_ptr(handle, remote.addr, local) != _lib.UCS_OK:
            return 0  # not mapped into this process
        start = int(_ffi.cast("uintptr_t", local[0]))
        end = start + nbytes
        if key_memory_type(rkey) != HOST_MEMORY:
            self._check_device_target(start, end, remote)
            return 0  # device memory: UCX's CUDA transports copy, never this process's CPU
        segments = self._segments.get(rkey)
        if segments is None:
            own = self.worker.device.own_mappings()
            segments = [(lo, hi) for lo, hi in _merged(_shared_mappings())
                        if not any(lo < o_hi and o_lo < hi for o_lo, o_hi in own)]
        if not any(lo <= start and end <= hi for lo, hi in segments):
            raise FabricError(
                f"ucx: the peer's region [{remote.addr:#x}, +{nbytes}) lies outside the memory its remote key covers"
            )
        return start

    def _check_device_target(self, start: int, end: int, remote: RemoteRegion) -> None:
        """Refuse an operation on a peer's device memory, mapped here by CUDA IPC at ``[start, end)``, that leaves
        the peer's allocation. UCX's cuda_ipc finds the target as its mapping of the allocation the key names plus
        the address's offset from that allocation's start, bounded only by an assertion of its debug builds: an
        address outside the key would have this process's GPU copy land beside the mapping, in device memory of
        its own. The driver says which allocation ``start`` lies in (the mapping of a peer's block is all of it:
        ``DeviceBlock``); the operation must end inside it, and it must not be device memory this device
        registered (the writer's own tensors and slots)."""
        base, size = _ffi.new("uintptr_t *"), _ffi.new("size_t *")
        status = _lib.tt_cuda_range(start, base, size)
        lo = int(base[0])
        hi = lo + int(size[0])
        if status != 0:  # the driver knows no allocation there: said with its error, not as a peer's fault alone
            raise FabricError(f"ucx: the peer's region [{remote.addr:#x}, +{end - start}), mapped here at "
                              f"{start:#x}, lies in no device allocation the CUDA driver knows (cuMemGetAddressRange: "
                              f"CUresult {status}; -1: no CUDA context held): outside the device memory its remote "
                              f"key covers, or a mapping the driver cannot place")
        ours = any(o_lo < hi and lo < o_hi for o_lo, o_hi in self.worker.device.own_device_memory())
        if not lo <= start < end <= hi or ours:
            raise FabricError(f"ucx: the peer's region [{remote.addr:#x}, +{end - start}) lies outside the device "
                              f"memory its remote key covers (mapped here at {start:#x}, in the allocation "
                              f"[{lo:#x}, {hi:#x}){', memory of this device' if ours else ''})")

    def _rma(self, op, name: str, local: np.ndarray, remote: RemoteRegion) -> Future:
        if local.nbytes > remote.length:
            raise remote.too_small(local.nbytes, name)
        try:  # what the peer is to blame for fails the operation's future, as a failed transfer would
            if (reason := self.failed()) is not None:
                raise FabricError(f"ucx: {name} on a failed connection: {reason}")
            rkey = self._rkey(remote.rkey)
            self._check_mapped(remote.rkey, rkey, remote, local.nbytes)
        except FabricError as exc:
            failed: Future = Future()
            failed.set_exception(exc)
            return failed
        request = op(self.ep, _pointer(local), local.nbytes, remote.addr, rkey)
        return self.worker.complete(request, name, keep_alive=local)

    def write(self, local: np.ndarray, remote: RemoteRegion) -> Future:
        return self._rma(_lib.tt_put, "put", local, remote)

    def _checked(self, remote: RemoteRegion, nbytes: int, name: str) -> tuple[Any, int]:
        """The unpacked remote key for an operation of ``nbytes`` on ``remote`` and where the target lies in
        this process (0: not mapped here), checked once per target."""
        if nbytes > remote.length:
            raise remote.too_small(nbytes, name)
        target = (remote.rkey, remote.addr, nbytes)
        checked = self._targets.get(target)
        if checked is None:
            if (reason := self.failed()) is not None:
                raise FabricError(f"ucx: {name} on a failed connection: {reason}")
            handle = self._rkey(remote.rkey)
            checked = handle, self._check_mapped(remote.rkey, handle, remote, nbytes)
            if len(self._targets) >= MAX_TARGETS:
                self._targets.clear()
            self._targets[target] = checked
        return checked

    def write_flagged(self, data: np.ndarray, remote: RemoteRegion, trailer: np.ndarray | None = None,
                      trailer_remote: RemoteRegion | None = None, timeout: float = 60.0) -> None:
        rkey, mapped = self._checked(remote, data.nbytes, "put") if data.nbytes else (_ffi.NULL, 0)
        if trailer is not None:
            trailer_rkey, trailer_mapped = self._checked(trailer_remote, trailer.nbytes, "put")
            trailer_pointer, trailer_bytes = _ffi.from_buffer(trailer), trailer.nbytes
            trailer_addr = trailer_remote.addr
        else:
            trailer_rkey, trailer_mapped, trailer_pointer, trailer_bytes, trailer_addr = _ffi.NULL, 0, _ffi.NULL, 0, 0
        device = self.worker.device
        if (mapped or not data.nbytes) and (trailer_mapped or not trailer_bytes) and type(data) is np.ndarray:
            # the peer's memory is mapped here (shared memory): the transfer is this thread's own copy (never from
            # device memory, which UCX copies)
            if (reason := self.failed()) is not None:
                raise FabricError(f"ucx: put on a failed connection: {reason}")
            _lib.tt_write_mapped(_ffi.cast("void *", mapped), _buffer(data), data.nbytes,
                                 _ffi.cast("uint8_t *", trailer_mapped), trailer_pointer, trailer_bytes)
            device._mapped_elsewhere += 1
            return
        status = _lib.tt_put_flagged(self.worker.handle, self.ep, _buffer(data), data.nbytes, remote.addr,
                                     rkey, trailer_pointer, trailer_bytes, trailer_addr, trailer_rkey,
                                     device.flush_between, int(timeout * 1e9), device._stop, self._error)
        if status != _lib.UCS_OK:
            device._outcome(status, "put", keep_alive=(data, trailer))

    def send_plan(self, slots: list[RemoteRegion], trailers: list[RemoteRegion], trailer: np.ndarray,
                  credits: np.ndarray, bells: list[RemoteRegion] | None = None) -> UcxSendPlan:
        return UcxSendPlan(self, slots, trailers, trailer, credits, bells)

    def counter_plan(self, local: np.ndarray, remote: RemoteRegion) -> UcxCounterPlan:
        return UcxCounterPlan(self, local, remote)

    def read_now(self, local: np.ndarray, remote: RemoteRegion, timeout: float = 60.0) -> None:
        if not local.nbytes:
            return
        rkey, _ = self._checked(remote, local.nbytes, "get")
        device = self.worker.device
        status = _lib.tt_get_sync(self.worker.handle, self.ep, _buffer(local), local.nbytes, remote.addr,
                                  rkey, int(timeout * 1e9), device._stop, self._error)
        if status != _lib.UCS_OK:
            device._outcome(status, "get", keep_alive=local)

    def read(self, local: np.ndarray, remote: RemoteRegion) -> Future:
        return self._rma(_lib.tt_get, "get", local, remote)

    def flush(self) -> Future:
        return self.worker.complete(_lib.tt_ep_flush(self.ep), "flush")

    def notify(self) -> Future:
        return self.worker.complete(_lib.tt_doorbell(self.ep), "ringing the doorbell")

    def wait(self, future: Future, timeout: float | None = None):
        return self.worker.wait(future, timeout)

    def failed(self) -> str | None:
        status = self._error[0]
        return None if status == 0 else _reason(status)

    def fail(self) -> None:
        if not self._error[0]:
            self._error[0] = _lib.UCS_ERR_CONNECTION_RESET

    def info(self) -> str:
        text = _lib.tt_ep_info(self.ep)
        if text == _ffi.NULL:
            return ""
        try:
            return _ffi.string(text).decode(errors="replace")
        finally:
            _lib.free(text)

    def close(self) -> None:
        for rkey in self._rkeys.values():
            _lib.ucp_rkey_destroy(rkey)
        self._rkeys.clear()
        closing = self.worker.complete(_lib.tt_ep_close(self.ep, 1), "closing an endpoint")
        self.worker.drain(closing)


class UcxSendPlan(SendPlan):
    """``tt_send_planned``'s plan (shim.c): each target checked and its key unpacked once, here."""

    def __init__(self, channel: UcxChannel, slots: list[RemoteRegion], trailers: list[RemoteRegion],
                 trailer: np.ndarray, credits: np.ndarray, bells: list[RemoteRegion] | None = None) -> None:
        if not 1 <= len(slots) == len(trailers) <= _lib.TT_MAX_SLOTS or trailer.nbytes != 9 or credits.nbytes != 8:
            raise ValueError("a send plan takes 1 or 2 slots with a trailer each, a 9-byte trailer and one counter")
        if bells is not None and (len(bells) != len(slots) or any(b.length != BELL_BYTES for b in bells)):
            raise ValueError(f"a send plan takes a {BELL_BYTES}-byte bell per slot, or none")
        plan = _ffi.new("tt_send_plan *")
        plan.worker, plan.ep, plan.slots, plan.length = channel.worker.handle, channel.ep, len(slots), slots[0].length
        mapped = True
        for k, (slot, flag) in enumerate(zip(slots, trailers, strict=True)):
            rkey, at = channel._checked(slot, slot.length, "put") if slot.length else (_ffi.NULL, 0)
            plan.remote[k], plan.rkey[k], plan.mapped[k] = slot.addr, rkey, _ffi.cast("void *", at)
            rkey, at_flag = channel._checked(flag, trailer.nbytes, "put")
            plan.trailer_remote[k], plan.trailer_rkey[k] = flag.addr, rkey
            plan.trailer_mapped[k] = _ffi.cast("uint8_t *", at_flag)
            mapped = mapped and bool(at or not slot.length) and bool(at_flag)
            if at:  # the slot's pages mapped writable here now, not by the first transfers into it
                _lib.tt_populate(plan.mapped[k], slot.length)
            if bells is not None:  # in memory mapped here only, 8-byte aligned (its words are atomics)
                _, at_bell = channel._checked(bells[k], BELL_BYTES, "put")
                plan.bell[k] = _ffi.cast("tt_bell *", at_bell if at_bell % 8 == 0 else 0)
        plan.pid = os.getpid()
        plan.trailer = _ffi.cast("uint8_t *", trailer.ctypes.data)
        plan.posted = _ffi.cast("uint64_t *", credits.ctypes.data)
        device = channel.worker.device
        plan.spin_ns, plan.stop, plan.failed = int(device.spin_s * 1e9), device._stop, channel._error
        plan.workers, plan.nworkers = device._worker_handles, len(device._workers)
        plan.mapped_writes, plan.flush_between = device._mapped_by_plans, device.flush_between
        self._plan, self._channel, self._device = plan, channel, device
        # what the plan points into stays alive with it
        self._memory = (trailer, credits, device._stop, channel._error, device._worker_handles,
                        device._mapped_by_plans)
        #: the waits (seconds) the plan holds in nanoseconds (mostly the same every time)
        self._waits: tuple[float, float] = (-1.0, -1.0)
        #: every transfer is this process's own copy into peer memory mapped here (shared memory)
        self.mapped = mapped

    @property
    def rung(self) -> int:
        """The times a send found the peer asleep on its doorbell and woke it."""
        return int(self._plan.rung)

    @property
    def pulled(self) -> int:
        """The transfers the peer pulled itself."""
        return int(self._plan.pulled)

    def _set_waits(self, credit_wait: float, timeout: float) -> None:
        """The waits every send through the plan makes (its sends and persistent calls share them)."""
        if (credit_wait, timeout) != self._waits:
            self._plan.credit_wait_ns, self._plan.timeout_ns = int(credit_wait * 1e9), int(timeout * 1e9)
            self._waits = credit_wait, timeout

    def send(self, data: np.ndarray, seq: int, step: int, credit_wait: float, timeout: float = 60.0) -> bool:
        # (the buffer is looked up anew each call and nothing keeps it after: a caller that sends the same array
        # every time takes the plan's fast call, which holds it)
        if self.mapped and type(data) is not np.ndarray:
            raise ValueError("a plan into memory mapped here copies host memory only; device memory is put")
        self._set_waits(credit_wait, timeout)
        status = _lib.tt_send_planned(self._plan, _buffer(data), seq, step)
        if status == 0:  # UCS_OK
            return True
        device = self._device
        if status == _lib.TT_NO_CREDIT:
            return False
        if status == _lib.TT_SEND_STOPPED:
            raise FabricInterrupted("ucx: the wait was interrupted (the device is closing)")
        device._outcome(status, "put", keep_alive=data)
        return False

    def fast(self, data: np.ndarray, credit_wait: float, timeout: float = 60.0) -> Callable[[int, int], int]:
        """``tt_send_planned`` itself, bound to the plan and ``data``'s buffer (see :meth:`SendPlan.fast`): its
        status is 0 once written. The call holds ``data``'s memory where it is for its life (:func:`_pin`)."""
        if self.mapped and type(data) is not np.ndarray:
            raise ValueError("a plan into memory mapped here copies host memory only; device memory is put")
        self._set_waits(credit_wait, timeout)
        call = functools.partial(_lib.tt_send_planned, self._plan, _buffer(data))
        call.pin = _pin(data)  # (a partial keeps attributes: the hold lives and goes with the call)
        return call


class UcxCounterPlan(CounterPlan):
    """``tt_set_counter``'s plan (shim.c): the peer's word checked and its key unpacked once, here."""

    def __init__(self, channel: UcxChannel, local: np.ndarray, remote: RemoteRegion) -> None:
        if local.dtype != np.uint64 or local.size != 1 or remote.length != 8 or remote.addr % 8:
            raise ValueError("a counter plan takes one uint64 here and 8 aligned bytes at the peer")
        rkey, at = channel._checked(remote, 8, "put")
        plan = _ffi.new("tt_counter_plan *")
        plan.worker, plan.ep, plan.remote, plan.rkey = channel.worker.handle, channel.ep, remote.addr, rkey
        plan.local = _ffi.cast("uint64_t *", local.ctypes.data)
        plan.mapped = _ffi.cast("uint64_t *", at if at % 8 == 0 else 0)
        device = channel.worker.device
        plan.stop, plan.failed, plan.mapped_writes = device._stop, channel._error, device._mapped_by_plans
        self._plan, self._channel, self._device, self._local = plan, channel, device, local
        self._memory = (device._stop, channel._error, device._mapped_by_plans)  # what the plan points into
        self.mapped = bool(at) and at % 8 == 0

    def set(self, value: int, timeout: float = 60.0) -> None:
        device = self._device
        status = _lib.tt_set_counter(self._plan, value, int(timeout * 1e9), device._stop, self._channel._error)
        if status != _lib.UCS_OK:
            device._outcome(status, "put", keep_alive=self._local)

    def fast(self, timeout: float = 60.0) -> Callable[[int], int]:
        """``tt_set_counter_planned`` itself, bound to the plan (see :meth:`CounterPlan.fast`)."""
        self._plan.timeout_ns = int(timeout * 1e9)
        return functools.partial(_lib.tt_set_counter_planned, self._plan)


class UcxTakePlan(TakePlan):
    """``tt_take_planned``'s plan (shim.c): the slots' trailers, found once."""

    def __init__(self, device: Device, trailers: list[np.ndarray], bells: list[np.ndarray] | None = None,
                 slots: list[np.ndarray] | None = None) -> None:
        if not 1 <= len(trailers) <= _lib.TT_MAX_SLOTS or any(t.nbytes != 9 for t in trailers):
            raise ValueError("a take plan takes 1 or 2 trailers of 9 bytes")
        if bells is not None and (len(bells) != len(trailers) or any(
                b.dtype != np.uint8 or b.nbytes != BELL_BYTES or b.ctypes.data % 8 for b in bells)):
            raise ValueError(f"a take plan takes an 8-byte aligned bell ({BELL_BYTES} bytes) per trailer, or none")
        if slots is not None and (len(slots) != len(trailers) or len({s.nbytes for s in slots}) != 1
                                  or not all(s.flags.c_contiguous and s.flags.writeable for s in slots)):
            raise ValueError("a take plan takes a writable slot of one size per trailer, or none")
        plan = _ffi.new("tt_take_plan *")
        plan.slots = len(trailers)
        for k, trailer in enumerate(trailers):
            plan.trailer[k] = _ffi.cast("uint8_t *", trailer.ctypes.data)
            if bells is not None:
                plan.bell[k] = _ffi.cast("tt_bell *", bells[k].ctypes.data)
            if bells is not None and slots is not None and slots[k].nbytes >= _lib.TT_PULL_FROM:  # asked of these
                plan.slot[k] = _ffi.cast("void *", slots[k].ctypes.data)
                plan.length = slots[k].nbytes
        plan.pid, plan.spin_ns, plan.stop = os.getpid(), int(device.spin_s * 1e9), device._stop
        plan.workers, plan.nworkers = device._worker_handles, len(device._workers)
        # what the plan points into stays alive with it
        self._plan, self._memory = plan, (trailers, bells, slots, device._stop, device._worker_handles)
        self._taken = _lib.TT_TAKEN

    def use_bells(self, on: bool) -> None:
        self._plan.bells = int(on and self._plan.bell[0] != _ffi.NULL)

    @property
    def pulls(self) -> int:
        """The transfers this plan pulled itself, asked by the sender."""
        return int(self._plan.pulls)

    def take(self, seq: int, step: int, timeout: float) -> bool | None:
        found = _lib.tt_take_planned(self._plan, seq, step, int(timeout * 1e9))
        if found >= 0:  # TT_TAKEN or TT_TAKEN_OTHER (a wait's TT_WAIT_* are negative)
            return found == self._taken
        if found == _lib.TT_WAIT_STOPPED:
            raise FabricInterrupted("ucx: the wait was interrupted (the device is closing)")
        return None

    def fast(self) -> Callable[[int, int, int], int]:
        """``tt_take_planned`` itself, bound to the plan (see :meth:`TakePlan.fast`): its answers are the same."""
        return functools.partial(_lib.tt_take_planned, self._plan)

    @property
    def last(self) -> tuple[int, int]:
        return self._plan.flag, self._plan.step


class UcxFlagSet(FlagSet):
    """Flag bytes polled together in C (``tt_wait_flags``), without the GIL."""

    def __init__(self, device: Device, flags: list[np.ndarray]) -> None:
        self._device = device
        self._flags = flags  # keeps the memory the pointers point into alive
        self._pointers = _ffi.new("uint8_t *[]", [_ffi.cast("uint8_t *", f.ctypes.data) for f in flags])
        self._done = _ffi.new("uint8_t[]", len(flags))
        self._count = len(flags)

    def wait_any(self, timeout: float) -> int | None:
        device = self._device
        found = _lib.tt_wait_flags(self._pointers, self._done, self._count, int(device.spin_s * 1e9),
                                   int(timeout * 1e9),
                                   device._stop, device._worker_handles, len(device._workers))
        if found == _lib.TT_WAIT_STOPPED:
            raise FabricInterrupted("ucx: the wait was interrupted (the device is closing)")
        return None if found == _lib.TT_WAIT_TIMED_OUT else found

    def done(self, index: int) -> None:
        self._done[index] = 1

    def reset(self) -> None:
        _ffi.memmove(self._done, bytes(self._count), self._count)
