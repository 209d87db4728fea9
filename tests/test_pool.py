"""The registered memory pool (transports/fabric/pool.py) on a fake device: blocks, merging, bounded growth.

The fake device only allocates (numpy) and counts registrations and releases, so these tests need no fabric.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from transports.common import aligned_empty
from transports.fabric.base import MemRegion, RemoteRegion
from transports.fabric.pool import ALIGNMENT, RegisteredPool

KIB = 1 << 10
MIB = 1 << 20
SHARED = 4 * MIB  # the one segment of the shared tier (pool.SHARED_SEGMENT_BYTES), if any


class _Region(MemRegion):
    def __init__(self, device: _Device, nbytes: int) -> None:
        self.device = device
        self.array = aligned_empty((nbytes,), np.uint8)
        self.array[:] = 0
        self.released = False

    def export(self) -> RemoteRegion:
        return RemoteRegion(self.address, self.nbytes, b"key")

    def release(self) -> None:
        assert not self.released, "a segment released twice"
        self.released = True
        self.device.live.remove(self)


class _Device:
    """What the pool uses of a Device: ``alloc``; ``live`` holds the regions not released."""

    def __init__(self) -> None:
        self.live: list[_Region] = []
        self.allocations = 0

    def alloc(self, nbytes: int, shared: bool = True) -> _Region:
        self.allocations += 1
        region = _Region(self, nbytes)
        self.live.append(region)
        return region

    def live_bytes(self) -> int:
        return sum(region.nbytes for region in self.live)


@pytest.fixture
def device() -> _Device:
    return _Device()


def pool_of(device: _Device) -> RegisteredPool:
    # small segments and tiers, so that "large" blocks are a few MiB
    return RegisteredPool(device, segment_bytes=1 * MIB, large_bytes=64 * KIB)


def test_blocks_are_aligned_disjoint_and_reused(device):
    pool = pool_of(device)
    blocks = [pool.alloc(n) for n in (1, 100, 300 * KIB, 5, 200 * KIB)]
    for block in blocks:
        assert block.array.ctypes.data % ALIGNMENT == 0
    spans = sorted((b.array.ctypes.data, b.array.ctypes.data + b.nbytes) for b in blocks)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    allocations = device.allocations
    for block in blocks:
        pool.free(block)
    again = [pool.alloc(n) for n in (1, 100, 300 * KIB, 5, 200 * KIB)]
    assert device.allocations == allocations  # served from the same segments
    assert pool.in_use_bytes() == sum(-(-b.nbytes // ALIGNMENT) * ALIGNMENT for b in again)


def test_adjacent_free_blocks_of_a_segment_merge(device):
    pool = pool_of(device)
    pool.reserve([3 * MIB])  # one segment of 3 MiB
    assert len(device.live) == 1
    thirds = [pool.alloc(MIB) for _ in range(3)]
    assert len(device.live) == 1
    pool.free(thirds[0])
    pool.free(thirds[2])
    pool.free(thirds[1])  # the middle one last: all three ranges become one
    whole = pool.alloc(3 * MIB)
    assert len(device.live) == 1 and whole.segment is thirds[0].segment and whole.offset == 0


def test_a_pool_that_served_two_blocks_in_two_segments_serves_one_twice_as_large_without_holding_all_three(device):
    """Before, two 1 GiB blocks each got a segment, and once both were freed a 2 GiB block got a third: the
    pool held 4 GiB for a 2 GiB need. Wholly free segments that cannot serve a request are given back first."""
    pool = pool_of(device)
    a, b = pool.alloc(4 * MIB), pool.alloc(4 * MIB)
    assert device.live_bytes() == 8 * MIB
    pool.free(a)
    pool.free(b)
    big = pool.alloc(8 * MIB)
    assert device.live_bytes() == 8 * MIB
    assert pool.held_bytes("local") == 8 * MIB and pool.in_use_bytes() == 8 * MIB
    assert all(not region.released for region in device.live) and big.array.nbytes == 8 * MIB


def test_a_pool_holds_its_largest_need_not_the_sum_of_every_size_it_served(device):
    """Staging buffers of varying sizes, one at a time: the pool holds about the largest, and a size served
    again is served without a new registration."""
    pool = pool_of(device)
    sizes = [2 * MIB, 3 * MIB, 2 * MIB, 5 * MIB + 7, 8 * MIB, 3 * MIB, 8 * MIB, 8 * MIB, 1 * MIB]
    largest = 0
    for size in sizes:
        block = pool.alloc(size)
        block.array[:] = 1
        largest = max(largest, size)
        pool.free(block)
        assert device.live_bytes() <= -(-largest // ALIGNMENT) * ALIGNMENT + SHARED
    allocations = device.allocations
    for size in sizes:
        pool.free(pool.alloc(size))
    assert device.allocations == allocations  # every size fits the segment that is left


def test_segments_in_use_are_never_given_back(device):
    pool = pool_of(device)
    kept = pool.alloc(2 * MIB)
    kept.array[:] = 7
    small = pool.alloc(100)  # the shared tier: untouched by the local tier's growth
    for size in (3 * MIB, 4 * MIB, 6 * MIB):
        pool.free(pool.alloc(size))
    assert not kept.segment.region.released and not small.segment.region.released
    assert (kept.array == 7).all()
    assert pool.held_bytes("local") == 2 * MIB + 6 * MIB == device.live_bytes() - small.segment.region.nbytes
    assert pool.in_use_bytes() == 2 * MIB + 128  # 100 bytes take two 64-byte units
