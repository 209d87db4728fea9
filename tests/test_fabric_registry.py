"""The fabric registry, the RDMA_* settings every backend gets, and the layering rule around the fabric."""

from __future__ import annotations

import ctypes
import re
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

import transports
from transports import fabric
from transports.common import Availability, done_future
from transports.fabric.base import Channel, Device, FabricError, FabricInterrupted, MemRegion, RemoteRegion
from transports.fabric.settings import RdmaSettings, SettingsError, read_settings

ROOT = Path(__file__).resolve().parent.parent


# -- the registry ------------------------------------------------------------------------------------------


def test_both_backends_are_registered_with_ucx_the_default():
    assert fabric.names() == ["ucx", "verbs"] and fabric.DEFAULT == "ucx"
    assert fabric.backend("ucx").name == "ucx" and fabric.backend("verbs").name == "verbs"


def test_an_unknown_backend_is_named_with_the_known_ones():
    with pytest.raises(fabric.UnknownFabric, match="unknown fabric 'ib' \\(known: ucx, verbs\\)"):
        fabric.backend("ib")


def test_verbs_says_why_it_cannot_run_here():
    status = fabric.availability("verbs")
    if status.ok:
        pytest.skip("this machine has an RDMA device")
    assert status.reason.startswith(("no RDMA device found", "pyverbs is not installed")), status.reason
    with pytest.raises(FabricError, match="the verbs fabric is not available here"):
        fabric.open_device("verbs")


def test_a_backend_refuses_a_fabric_transport_it_does_not_have():
    with pytest.raises(ValueError, match=r"no fabric transport 'ib' \(known: auto, shm, tcp, rdma\)"):
        fabric.open_device("ucx", "ib")


def test_a_transport_on_an_unknown_fabric_is_refused_at_construction():
    with pytest.raises(ValueError, match="unknown fabric 'ib'"):
        transports.create("zerocopy", fabric="ib")
    with pytest.raises(ValueError, match="fabric transport 'shm' for the verbs fabric"):
        transports.create("zerocopy", fabric="verbs", fabric_transport="shm")


def test_the_label_names_the_backend_and_its_carriers():
    assert fabric.label({"fabric": "ucx", "used": ["cma", "posix"]}) == "ucx:cma,posix"
    assert fabric.label({"fabric": "verbs", "used": ["rc/mlx5_0:1"]}) == "verbs:rc/mlx5_0:1"
    assert fabric.label(None) == "none" and fabric.label({"fabric": "none"}) == "none"


def test_nothing_above_the_fabric_imports_a_backend_module():
    """bench/ and transports/ outside transports/fabric/ go through the registry and the Device interface."""
    pattern = re.compile(r"^\s*(from|import)\s+transports\.fabric\.(ucx|verbs)\b", re.MULTILINE)
    offenders = [str(path.relative_to(ROOT)) for top in ("bench", "transports") for path in (ROOT / top).rglob("*.py")
                 if "fabric" not in path.relative_to(ROOT / top).parts[:1] and pattern.search(path.read_text())]
    assert offenders == []


def test_the_fabric_imports_nothing_from_the_layers_above():
    above = r"bench|transports\.(base|fabric_transport|control|zerocopy|rdma_cp|grpc_\w+)"
    pattern = re.compile(rf"^\s*(from|import)\s+({above})\b", re.MULTILINE)
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "transports" / "fabric").rglob("*.py")
                 if pattern.search(path.read_text())]
    assert offenders == []


# -- RDMA_* settings ---------------------------------------------------------------------------------------


def test_rdma_variables_are_read_into_settings():
    settings = read_settings({"RDMA_DEVICE": "mlx5_0", "RDMA_DEVICE_PORT": "1", "RDMA_GID_INDEX": "3",
                              "RDMA_QP_MTU": "1024", "RDMA_QP_QUEUE_DEPTH": "64", "RDMA_QP_SL": "2", "HOME": "/"})
    assert settings == RdmaSettings(device="mlx5_0", port=1, gid_index=3, mtu=1024, queue_depth=64, service_level=2)
    assert settings.given() == {"RDMA_DEVICE": "mlx5_0", "RDMA_DEVICE_PORT": 1, "RDMA_GID_INDEX": 3,
                                "RDMA_QP_MTU": 1024, "RDMA_QP_SL": 2, "RDMA_QP_QUEUE_DEPTH": 64}
    assert read_settings({}) == RdmaSettings() and RdmaSettings().given() == {}


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("RDMA_QP_SL", "9", "RDMA_QP_SL=9 is out of range"),
        ("RDMA_QP_MTU", "1500", "RDMA_QP_MTU=1500 is not a verbs MTU"),
        ("RDMA_QP_TIMEOUT", "soon", "is not a whole number"),
        ("RDMA_QP_QUEUE_DEPTH", "0", "out of range"),
        ("RDMA_TRAFFIC_CLASS", "256", "out of range"),
        ("RDMA_DEVICE", "mlx5_0; rm", "is not a device name"),
    ],
)
def test_bad_values_name_the_variable(variable, value, fragment):
    with pytest.raises(SettingsError, match=fragment):
        read_settings({variable: value})


def test_a_bad_rdma_variable_stops_a_fabric_transport_at_construction(monkeypatch):
    monkeypatch.setenv("RDMA_QP_MTU", "1500")
    with pytest.raises(ValueError, match="zerocopy: RDMA_QP_MTU=1500"):
        transports.create("zerocopy")


def test_ucx_maps_the_variables_it_has_and_reports_the_others():
    from transports.fabric.ucx.device import ucx_settings

    settings = read_settings({"RDMA_DEVICE": "lo", "RDMA_QP_SL": "3", "RDMA_QP_QUEUE_DEPTH": "64",
                              "RDMA_QP_PKEY_INDEX": "0"})
    config, no_effect = ucx_settings(settings, accepts=lambda name, value: not name.startswith("IB_"))
    assert config == {"NET_DEVICES": "lo"}
    assert "RDMA_QP_SL" in no_effect and "InfiniBand" in no_effect["RDMA_QP_SL"]
    assert "RDMA_QP_PKEY_INDEX" in no_effect
    config, _ = ucx_settings(read_settings({"RDMA_DEVICE": "mlx5_0", "RDMA_DEVICE_PORT": "1"}),
                             accepts=lambda name, value: True)
    assert config["NET_DEVICES"] == "mlx5_0:1"


def test_the_ucx_device_describes_the_variables_without_effect_here():
    if not fabric.availability("ucx").ok:
        pytest.skip("no ucx here")
    device = fabric.open_device("ucx", "shm", settings=read_settings({"RDMA_QP_PKEY_INDEX": "0"}))
    try:
        assert "RDMA_QP_PKEY_INDEX" in device.describe()["rdma_settings_without_effect"]
    finally:
        device.close()



@pytest.mark.parametrize("users", [None, "n"])
def test_ucx_workers_lock_with_a_mutex_unless_the_user_says_otherwise(monkeypatch, users):
    """A progress thread and the waiting threads share each worker: UCX's default spinlock lets a preempted
    holder stall the others for whole time slices (multi-millisecond tails over tcp on a loaded host)."""
    if not fabric.availability("ucx").ok:
        pytest.skip("no ucx here")
    if users is None:
        monkeypatch.delenv("UCX_USE_MT_MUTEX", raising=False)
    else:
        monkeypatch.setenv("UCX_USE_MT_MUTEX", users)
    device = fabric.open_device("ucx", "tcp")
    try:
        assert device.describe()["ucx_config"].get("USE_MT_MUTEX") == ("y" if users is None else None)
    finally:
        device.close()

# -- the registration cache every backend keeps ------------------------------------------------------------


class _Region:
    def __init__(self, cache, busy=False):
        self.cache, self.busy, self.released = cache, busy, False

    def release(self):
        self.released = True
        self.cache.forget(self)


def test_the_registration_cache_evicts_the_least_recently_used_it_may_and_expires_with_the_owner():
    import gc

    import numpy as np

    from transports.fabric.registrations import RegistrationCache, span_of, start_of

    cache = RegistrationCache(limit=2)
    owners = [np.zeros(64, np.uint8) for _ in range(3)]
    busy, idle, newest = _Region(cache, busy=True), _Region(cache), _Region(cache)
    for region, owner in ((busy, owners[0]), (idle, owners[1])):
        cache.track(region)
        assert cache.add(*span_of(owner), region, owner, evictable=lambda r: not r.busy) == []
    cache.track(newest)
    assert cache.add(*span_of(owners[2]), newest, owners[2], evictable=lambda r: not r.busy) == [idle]
    assert cache.find(start_of(owners[0]) + 8, start_of(owners[0]) + 16) is busy  # a view finds its buffer's entry
    assert span_of(owners[2][10:20]) == span_of(owners[2])
    idle.release()
    assert cache.count() == 2
    del owners[2]
    gc.collect()
    assert cache.count() == 1 and newest.released  # expired with its owner, released at the next call


def test_a_registration_being_withdrawn_is_never_found_for_new_memory():
    """While one thread releases a registration whose owner died, another thread's lookup of the same addresses
    (new memory there) must miss: a hit handed a peer a key being withdrawn (an RDMA read's remote access error)."""
    import threading

    import numpy as np

    from transports.fabric.registrations import RegistrationCache, span_of

    cache = RegistrationCache()
    withdrawing, finish = threading.Event(), threading.Event()

    class Slow(_Region):
        def release(self):  # the key's withdrawal takes a while (ibv_dereg_mr); the entry must be gone before it
            withdrawing.set()
            assert finish.wait(10)
            super().release()

    owner = np.zeros(64, np.uint8)
    span = span_of(owner)
    region = Slow(cache)
    cache.track(region)
    cache.add(*span, region, owner)
    del owner  # the owner dies: its registration expires
    releasing = threading.Thread(target=cache.release_expired)
    releasing.start()
    assert withdrawing.wait(10)
    try:
        assert cache.find(*span) is None
    finally:
        finish.set()
        releasing.join(10)
    assert region.released and cache.count() == 0


# -- the contract a backend writes ------------------------------------------------------------------------------


class _InProcessRegion(MemRegion):
    """Process memory, reachable by its address: all a backend in one process needs."""

    def __init__(self, device: Device, nbytes: int) -> None:
        self.device = device
        self.array = np.zeros(nbytes, np.uint8)

    def export(self) -> RemoteRegion:
        return RemoteRegion(self.address, self.nbytes, b"\x01")

    def release(self) -> None:
        self.array = np.zeros(0, np.uint8)
        self.device._cache.forget(self)


class _InProcessChannel(Channel):
    """One-sided writes and reads as copies within this process: only the abstract methods."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _copy(self, to: int, frm: int, nbytes: int, what: str) -> Future:
        ctypes.memmove(to, frm, nbytes)
        self.calls.append(what)
        return done_future()

    def write(self, local, remote):
        return self._copy(remote.addr, local.ctypes.data, local.nbytes, "write")

    def read(self, local, remote):
        return self._copy(local.ctypes.data, remote.addr, local.nbytes, "read")

    def flush(self):
        self.calls.append("flush")
        return done_future()

    def failed(self):
        return None

    def fail(self) -> None:
        pass


class _InProcessDevice(Device):
    """The smallest backend: the abstract methods and nothing else (docs/fabric-backend.md shows it)."""

    name = "in_process"

    @classmethod
    def availability(cls, fabric_transport="auto"):
        return Availability(True)

    @property
    def address(self):
        return [b"here"]

    def alloc(self, nbytes, shared=True):
        region = _InProcessRegion(self, nbytes)
        self._count_region(region)
        return region

    def _register_span(self, array, start, end, owner):
        raise FabricError("in_process registers nothing it did not allocate")

    def channel(self, peer, lane=0, exchange=None):
        return _InProcessChannel()

    def wait_for_activity(self, timeout):
        self.interrupted.wait(timeout)

    def _shut(self):
        self.interrupt_waits()
        return []

    def _free(self) -> None:
        pass


def test_a_backend_writes_the_paper_s_table_1_and_the_rest_has_defaults():
    """A fabric backend writes fifteen methods (tensorpipe's transport: 6); the waits (polled, fabric/waits.py),
    the registration cache and its counts, closing, the per-transfer calls, plans and descriptions have defaults in
    fabric/base.py, which a backend may replace with a faster path."""
    abstract = sorted(f"{cls.__name__}.{name}" for cls in (Device, Channel, MemRegion)
                      for name in cls.__abstractmethods__)
    assert abstract == ["Channel.fail", "Channel.failed", "Channel.flush", "Channel.read", "Channel.write",
                        "Device._free", "Device._register_span", "Device._shut", "Device.address", "Device.alloc",
                        "Device.availability", "Device.channel", "Device.wait_for_activity", "MemRegion.export",
                        "MemRegion.release"]
    for optional in ("Device.interrupt_waits", "Device.describe", "Device.without_effect", "Channel.write_flagged",
                     "Channel.read_now", "Channel.notify", "Device.flag_set", "Device.wait_counter",
                     "Device.wait_counters", "Device.close", "Device.register", "Device.registrations"):
        assert optional not in abstract

    device = _InProcessDevice()
    data, trailer = device.alloc(64), device.alloc(16)
    channel = device.channel([b"peer"])
    payload, flag = np.arange(64, dtype=np.uint8), np.full(16, 7, np.uint8)
    channel.write_flagged(payload, data.export(), flag, trailer.export())
    assert channel.calls == ["write", "flush", "write", "flush"]  # the data at the peer before its flag
    np.testing.assert_array_equal(data.array, payload)
    back = np.zeros(64, np.uint8)
    channel.read_now(back, data.export())
    np.testing.assert_array_equal(back, payload)

    flags = device.flag_set([trailer.array[15:16], data.array[0:1]])
    assert flags.wait_any(1.0) == 0  # the trailer's flag is up; data[0] is 0
    counter = np.zeros(1, np.uint64)
    assert device.wait_counter(counter, 0, 0.01) is False
    counter[0] = 3
    assert device.wait_counters([np.zeros(1, np.uint64), counter], [0, 2], 1.0) == 1
    assert device.describe() == {"fabric": "in_process", "used": [], "progress_threads": 1, "lanes_per_peer": 1,
                                 "rdma_settings_without_effect": {}}
    assert device.registrations_made == device.registrations() == 2
    settings = read_settings({"RDMA_QP_QUEUE_DEPTH": "64", "RDMA_QP_SL": "1"})
    assert list(_InProcessDevice.without_effect(settings)) == list(settings.given())
    assert list(settings.given()) == ["RDMA_QP_SL", "RDMA_QP_QUEUE_DEPTH"]
    device.close()
    device.close()  # once: a second close does nothing
    assert device.registrations() == 0  # the base released every region
    with pytest.raises(FabricError, match="in_process: the device is closed"):
        device.register(np.zeros(8, np.uint8))
    with pytest.raises(FabricInterrupted):
        device.wait_counter(np.zeros(1, np.uint64), 0, 5.0)
