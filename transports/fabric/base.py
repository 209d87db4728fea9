"""The "RDMA device" of the paper (its Table 1), independent of the backend.

| paper                                     | here                                      |
|-------------------------------------------|-------------------------------------------|
| CreateRdmaDevice(num_cqs, num_qps, ep)    | ``Device(progress_threads, lanes_per_peer)`` |
| AllocateMemRegion(size)                   | ``device.alloc(nbytes) -> MemRegion``      |
| (register foreign memory)                 | ``device.register(array) -> MemRegion``    |
| GetChannel(remote_endpoint, qp_idx)       | ``device.channel(peer, lane) -> Channel``  |
| Memcpy(local, remote, size, dir, cb)      | ``channel.write/read(...) -> Future``, ``flush`` |
| address distribution over a vanilla RPC   | ``region.export() -> RemoteRegion``        |
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

#: the longest remote key a peer may send (UCX's are under 100 bytes here)
MAX_RKEY_BYTES = 1024


class FabricError(RuntimeError):
    """A fabric operation failed; the message names the operation and the backend's reason."""


class FabricTimeout(FabricError):
    """A blocking fabric operation or wait did not finish in time."""


class FabricInterrupted(FabricError):
    """A blocking wait was cut short by :meth:`Device.interrupt_waits` (the owner is closing)."""


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
    """Registered memory: a numpy byte view plus what peers need to reach it."""

    array: np.ndarray  # uint8, C-contiguous

    @property
    def address(self) -> int:
        return self.array.ctypes.data

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
        start = array.__array_interface__["data"][0]
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

    @abstractmethod
    def notify(self) -> Future:
        """Wake the peer's progress threads (and whoever waits on them) with an empty message.

        One-sided writes into mapped memory raise no event at the target; a verbs write with
        immediate would. Writers that a sleeping peer must notice ring this doorbell after them.
        """

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

    @abstractmethod
    def write_flagged(self, data: np.ndarray, remote: RemoteRegion, trailer: np.ndarray | None = None,
                      trailer_remote: RemoteRegion | None = None, timeout: float = 60.0) -> None:
        """Write ``data`` to ``remote``, flush, then ``trailer`` (its last byte a flag) to ``trailer_remote``, flush.

        Returns once both are at the peer: a peer that sees the flag sees the data. ``data`` may be
        empty. Raises FabricTimeout after ``timeout`` seconds, FabricInterrupted when the device's
        waits are interrupted, FabricError when the transfer fails.
        """

    @abstractmethod
    def read_now(self, local: np.ndarray, remote: RemoteRegion, timeout: float = 60.0) -> None:
        """Read ``remote`` into ``local`` and return once it is there (errors as :meth:`write_flagged`)."""


class FlagSet(ABC):
    """Flag bytes (each a one-byte view of registered memory) waited on together; see :meth:`Device.flag_set`."""

    @abstractmethod
    def wait_any(self, timeout: float) -> int | None:
        """The index of a raised flag not yet :meth:`done`, or None after ``timeout`` seconds.

        FabricInterrupted when the device's waits are interrupted.
        """

    @abstractmethod
    def done(self, index: int) -> None:
        """Stop watching flag ``index``."""

    @abstractmethod
    def reset(self) -> None:
        """Watch every flag again."""


class Device(ABC):
    """One process's endpoint on the fabric."""

    @property
    @abstractmethod
    def address(self) -> list[bytes]:
        """What a peer needs to open channels to this device (sent over the control path)."""

    @abstractmethod
    def alloc(self, nbytes: int, shared: bool = True) -> MemRegion:
        """A new registered, 64-byte aligned region.

        ``shared``: memory that peers on the same host can map, best for small writes;
        otherwise process memory (huge pages where possible), best for large transfers.
        """

    @abstractmethod
    def register(self, array: np.ndarray) -> MemRegion:
        """Register memory the device did not allocate (cached by address range)."""

    @abstractmethod
    def channel(self, peer: list[bytes], lane: int = 0) -> Channel:
        """The channel to ``peer`` (its :attr:`address`) over ``lane`` (cached)."""

    @abstractmethod
    def flag_set(self, flags: list[np.ndarray]) -> FlagSet:
        """A set of one-byte flags in registered memory that peers raise, to wait on together."""

    @abstractmethod
    def wait_counter(self, counter: np.ndarray, above: int, timeout: float) -> bool:
        """Wait until the uint64 ``counter[0]`` (registered memory a peer writes) exceeds ``above``.

        Spins for a moment, then naps in growing steps without holding the GIL: an idle waiter
        burns no core. False after ``timeout``; FabricInterrupted by :meth:`interrupt_waits`.
        """

    def write_flagged_lanes(self, channels: list[Channel], data: np.ndarray, remote: RemoteRegion,
                            trailer: np.ndarray, trailer_remote: RemoteRegion, timeout: float = 60.0) -> None:
        """:meth:`Channel.write_flagged` with the data spread over ``channels`` (lanes to one peer), the
        trailer over the first once all of them are flushed. Backends that cannot spread use the first."""
        channels[0].write_flagged(data, remote, trailer, trailer_remote, timeout)

    @abstractmethod
    def wait_counters(self, counters: list[np.ndarray], above: list[int], timeout: float) -> int | None:
        """The index of a counter (as in :meth:`wait_counter`) that exceeds its ``above``, or None after ``timeout``."""

    @abstractmethod
    def interrupt_waits(self) -> None:
        """Make every blocking wait and transfer of this device return at once (before closing)."""

    @abstractmethod
    def wait_for_activity(self, timeout: float) -> None:
        """Sleep until the progress threads see incoming traffic, or ``timeout`` seconds pass."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The backend, its version and the fabric transports actually in use, for ``meta.json``."""

    @abstractmethod
    def close(self) -> None:
        """Close channels, release registrations, stop progress threads."""
