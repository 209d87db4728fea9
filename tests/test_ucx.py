"""The ucx fabric backend: one-sided put/get, registration, and release of what it holds."""

from __future__ import annotations

import os

import numpy as np
import pytest

from transports.fabric.base import FabricError
from transports.fabric.ucx.device import UcxDevice, load

try:
    load()
except FabricError as exc:  # pragma: no cover - only where the binding is missing
    pytest.skip(f"ucx fabric not available: {exc}", allow_module_level=True)

FABRICS = ["shm", "tcp"]


@pytest.fixture(params=FABRICS)
def devices(request):
    pair = UcxDevice(request.param), UcxDevice(request.param)
    yield pair
    for device in pair:
        device.close()


def test_write_then_flush_lands_in_the_peer_region(devices):
    a, b = devices
    src, dst = a.alloc(4096), b.alloc(4096)
    src.array[:] = np.arange(4096) % 251
    dst.array[:] = 0
    channel = a.channel(b.address)
    channel.wait(channel.write(src.array[:3000], dst.export().at(100, 3000)))
    channel.wait(channel.flush())
    np.testing.assert_array_equal(dst.array[100:3100], src.array[:3000])
    assert not dst.array[:100].any() and not dst.array[3100:].any()


def test_read_pulls_the_peer_region(devices):
    a, b = devices
    local, remote = a.alloc(1 << 20), b.alloc(1 << 20)
    remote.array[:] = 7
    channel = a.channel(b.address)
    channel.wait(channel.read(local.array, remote.export()), timeout=10)
    assert (local.array == 7).all()


def test_foreign_memory_registers_once_and_is_readable_remotely(devices):
    a, b = devices
    tensor = np.arange(1000, dtype=np.float64)
    region = b.register(tensor)
    assert b.register(tensor[10:20]) is region  # inside a registered range: cached
    local = a.alloc(tensor.nbytes)
    channel = a.channel(b.address)
    channel.wait(channel.read(local.array, region.export()), timeout=10)
    np.testing.assert_array_equal(local.array.view(np.float64), tensor)


def test_allocations_are_64_byte_aligned():
    device = UcxDevice("shm")
    try:
        assert all(device.alloc(n).address % 64 == 0 for n in (1, 63, 4096, 1 << 20))
    finally:
        device.close()


def test_a_write_larger_than_the_remote_region_is_refused(devices):
    a, b = devices
    channel = a.channel(b.address)
    with pytest.raises(ValueError, match="does not fit"):
        channel.write(a.alloc(128).array, b.alloc(64).export())


def test_unknown_fabric_transport_is_named():
    with pytest.raises(ValueError, match="unknown fabric transport 'ib'"):
        UcxDevice("ib")


def test_describe_names_the_ucx_transports_in_use(devices):
    a, b = devices
    channel = a.channel(b.address)
    channel.wait(channel.write(a.alloc(8).array, b.alloc(8).export()))
    described = a.describe()
    assert described["fabric"] == "ucx" and described["ucx_transports_used"]


def _held_resources() -> tuple[int, int, int]:
    """What this process holds: mappings of shared files (/dev/shm, memfd), of SysV segments, and fds.

    Only this process's own resources count (its /proc/self/maps and fds): system-wide totals of
    /dev/shm or /proc/sysvipc change whenever another process on the machine makes some.
    """
    shm_maps, sysv_maps = set(), set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) > 5 else ""
            if path.startswith("/SYSV"):
                sysv_maps.add((fields[4], path))  # one per attached segment, however many areas
            elif path.startswith(("/dev/shm/", "/memfd:")):
                shm_maps.add((fields[4], path))
    fds = len(os.listdir("/proc/self/fd"))
    return len(shm_maps), len(sysv_maps), fds


@pytest.mark.parametrize("fabric", FABRICS)
def test_registrations_and_shared_segments_are_released_on_close(fabric):
    def cycle():
        a, b = UcxDevice(fabric), UcxDevice(fabric)
        src, dst = a.alloc(1 << 16), b.alloc(1 << 16)
        kept = np.ones(1000)  # a registration lives as long as its memory
        a.register(kept)
        channel = a.channel(b.address)
        channel.wait(channel.write(src.array, dst.export()))
        channel.wait(channel.flush())
        assert a.registrations() == 2
        a.close()
        b.close()
        assert a.registrations() == 0 and b.registrations() == 0

    cycle()  # let UCX load its modules once
    before = _held_resources()
    for _ in range(100):
        cycle()
    after = _held_resources()
    # no growth (other tests' leftovers may be released meanwhile, so fewer is fine)
    assert all(now <= then for now, then in zip(after, before, strict=True)), (before, after)
