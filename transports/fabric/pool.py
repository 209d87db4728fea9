"""Registered memory pool: few large registrations, a first-fit allocator over them.

Registering memory costs kernel work (pinning, on a real NIC) and NICs bound the
number of registrations, so the paper registers one large buffer, sized by the
graph analyzer, and allocates tensors from it. Blocks are 64-byte aligned (what
TensorFlow needs for buffers it adopts) and reused after they are freed; a
segment's adjacent free ranges merge. When a request does not fit, the pool grows
by another segment rather than failing, and first gives back (deregisters and
frees) the tier's segments that are wholly free: they could not serve it, and
kept they would add up. So a pool holds what is in use plus at most one
segment's worth of what was, not the sum of every size it ever served: after a
1 GiB and a 2 GiB staging buffer it holds 2 GiB, not 3 (or, after two 1 GiB
blocks in two segments and then one 2 GiB block, 2 GiB, not 4). A size served
again finds its segment still registered.

Two tiers: blocks under ``LARGE_BYTES`` (flags, counters, receive slots of tensors up to GBs) come
from ``shared`` segments, which a peer on the same host maps so that a write there is the writer's own
memcpy (UCX over shared memory; ``tt_write_mapped``). Measured here (zerocopy, p50 per transfer, the
receiver's slot in either tier): 256KB 32 against 41 µs, 4MB 159 against 184 µs, 64MB 5.4 against
7.8 ms, 256MB 25.6 against 32.5 ms, 1GB 87 against 117 ms. A shared segment the shared-memory
filesystem (``/dev/shm``, often small in containers) has no room for is process memory instead (the
device decides: ``UcxDevice.alloc``). Larger blocks come from ``local`` segments of huge-page process
memory, moved by a single-copy kernel call (cma) or the NIC. So do tensors this process sends
(``source``) of ``SOURCE_LOCAL_BYTES`` or more: no peer maps them, and a copy reads huge pages faster.

Segments belong to one peer: a block asked for ``peer=p`` (memory exported to rank ``p``: its receive slots and
trailers, the credit table it writes, what it reads) comes from segments that hold blocks for ``p`` alone, so
the remote key ``p`` is given for one of them covers only ``p``'s memory. Over shared memory a key maps its
whole segment into the peer (UCX's posix transport), and bounds are checked only on the writer's side: with
one segment for all peers, rank 1's key for its own slot reached rank 2's slots and trailers a fixed distance
away. ``peer=None`` is memory exported to no peer (or to any: the segment is then shared as before). What the
OS allows anyway is not ours to close: a process of the same user may ``process_vm_writev`` (cma) or open
``/proc/PID/fd`` of any of this user's processes, so a peer rank run by the same user is kept to its own
memory by the fabric's checks, not by the kernel.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from transports.fabric.base import Device, MemRegion, RemoteRegion

ALIGNMENT = 64
DEFAULT_SEGMENT_BYTES = 64 << 20
SHARED_SEGMENT_BYTES = 4 << 20
LARGE_BYTES = 4 << 30
SOURCE_LOCAL_BYTES = 256 << 10


def aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT


@dataclass(eq=False)
class Block:
    """``nbytes`` of a registered segment starting at ``offset``."""

    segment: _Segment
    offset: int
    nbytes: int

    @property
    def peer(self) -> int | None:
        """The rank whose segments the block lies in (None: segments of no one peer)."""
        return self.segment.peer

    @property
    def array(self) -> np.ndarray:
        """The block's bytes (uint8), a view of registered memory."""
        return self.segment.region.array[self.offset : self.offset + self.nbytes]

    def view(self, dtype: np.dtype, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        """A typed view of the block's memory, starting ``offset`` bytes in."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        return self.array[offset : offset + nbytes].view(dtype).reshape(shape)

    def remote(self, offset: int = 0, length: int | None = None) -> RemoteRegion:
        """The descriptor a peer needs to reach ``[offset, offset + length)`` of this block."""
        length = self.nbytes - offset if length is None else length
        return self.segment.region.export().at(self.offset + offset, length)


class _Segment:
    def __init__(self, region: MemRegion, peer: int | None = None) -> None:
        self.region = region
        self.peer = peer
        self.free: list[tuple[int, int]] = [(0, region.nbytes)]  # (offset, size), sorted by offset

    def take(self, size: int) -> int | None:
        for i, (offset, free) in enumerate(self.free):
            if free >= size:
                if free == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, free - size)
                return offset
        return None

    def give_back(self, offset: int, size: int) -> None:
        self.free.append((offset, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.free = merged

    def contains(self, array: np.ndarray) -> bool:
        return self.region.contains(array)

    @property
    def unused(self) -> bool:
        """Whether no block of the segment is handed out."""
        return self.free == [(0, self.region.nbytes)]


class RegisteredPool:
    """Allocates 64-byte aligned blocks from registered segments of a device, in two tiers."""

    def __init__(self, device: Device, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 large_bytes: int = LARGE_BYTES) -> None:
        self.device = device
        self.segment_bytes = segment_bytes
        self.large_bytes = large_bytes
        self._tiers: dict[str, list[_Segment]] = {"shared": [], "local": []}
        self._lock = threading.Lock()

    @property
    def registrations(self) -> int:
        return sum(len(segments) for segments in self._tiers.values())

    def held_bytes(self, tier: str | None = None) -> int:
        """Bytes of registered memory the pool holds (of one tier, or of both), in use or not.

        Read only by tests, and kept for them: that a large tensor's memory is given back, not kept in the local
        tier (``test_large_tensors.py``, ``test_grpc_rdma.py``, ``test_pool.py``). Computing it there would
        reach into the pool's segments."""
        with self._lock:
            return sum(s.region.nbytes for name, segments in self._tiers.items() if tier in (None, name)
                       for s in segments)

    def in_use_bytes(self) -> int:
        """Bytes of the pool's segments handed out as blocks and not freed (64-byte aligned sizes).

        Read only by tests, and kept for them: that every block a transfer took is freed (``test_grpc_rdma.py``,
        ``test_pool.py``); as :meth:`held_bytes`."""
        with self._lock:
            return sum(s.region.nbytes - sum(size for _, size in s.free)
                       for segments in self._tiers.values() for s in segments)

    def tier(self, nbytes: int, source: bool = False) -> str:
        """Where a block of ``nbytes`` lives: a ``source`` (a tensor this process sends, which no peer maps) of
        ``SOURCE_LOCAL_BYTES`` or more in the local tier, whose huge pages a copy reads faster (16MB: about a
        third less time here); anything else by size."""
        return "local" if nbytes >= (SOURCE_LOCAL_BYTES if source else self.large_bytes) else "shared"

    def reserve(self, sizes: list[int], sources: list[int] = (), peers: list[int | None] | None = None,
                source_peers: list[int | None] | None = None) -> None:
        """Make room for blocks of ``sizes`` (and ``sources``: see :meth:`tier`) so that they need no new
        registration later (sized from the plan); ``peers`` and ``source_peers`` say whose each one is (see
        the module docstring; None: no one peer's)."""
        tiers = [self.tier(n) for n in sizes] + [self.tier(n, source=True) for n in sources]
        owners = [*(peers or [None] * len(sizes)), *(source_peers or [None] * len(sources))]
        sizes = [*sizes, *sources]
        for tier in self._tiers:
            for peer in dict.fromkeys(owners):
                need = sum(aligned(n) for n, t, p in zip(sizes, tiers, owners, strict=True)
                           if t == tier and p == peer)
                with self._lock:
                    largest = max((size for s in self._tiers[tier] if s.peer == peer for _, size in s.free),
                                  default=0)
                    if need and largest < need:
                        self._grow(tier, need, peer)

    def alloc(self, nbytes: int, source: bool = False, peer: int | None = None) -> Block:
        """A block of ``nbytes``; ``peer``: the rank it is exported to (it shares segments with no other rank's)."""
        size = aligned(nbytes)
        tier = self.tier(nbytes, source)
        with self._lock:
            for segment in self._tiers[tier]:
                if segment.peer != peer:
                    continue
                offset = segment.take(size)
                if offset is not None:
                    return Block(segment, offset, nbytes)
            segment = self._grow(tier, size, peer)
            return Block(segment, segment.take(size), nbytes)

    def free(self, block: Block) -> None:
        with self._lock:
            block.segment.give_back(block.offset, aligned(block.nbytes))

    def segment_of(self, array: np.ndarray) -> MemRegion | None:
        """The registered segment ``array`` lies in, if it lies in the pool."""
        found = self._segment_of(array)
        return None if found is None else found.region

    def peer_of(self, array: np.ndarray) -> int | None:
        """The rank whose segment ``array`` lies in (None: no one peer's, or not in the pool)."""
        found = self._segment_of(array)
        return None if found is None else found.peer

    def _segment_of(self, array: np.ndarray) -> _Segment | None:
        for segments in self._tiers.values():
            for segment in segments:
                if segment.contains(array):
                    return segment
        return None

    def _grow(self, tier: str, at_least: int, peer: int | None = None) -> _Segment:
        """A new segment of at least ``at_least`` bytes for ``peer`` (the caller holds the lock and found none
        that fits); the wholly free segments of the tier and peer go first (see the module docstring)."""
        segments = self._tiers[tier]
        for unused in [s for s in segments if s.unused and s.peer == peer]:
            segments.remove(unused)
            unused.region.release()
        default = self.segment_bytes if tier == "local" else SHARED_SEGMENT_BYTES
        segment = _Segment(self.device.alloc(max(default, aligned(at_least)), shared=tier == "shared"), peer)
        self._tiers[tier].append(segment)
        return segment
