"""The verbs fabric without an RDMA NIC: its pure setup (device, port and GID choice, queue-pair
attributes, the connection exchange, lane mapping), the generic memory waits, availability and tool().

Real queue pairs need hardware. The device code still runs here over a simulated NIC (a stand-in
for pyverbs that performs each work request with memmove): connection through accept(), writes,
reads, flushes, flags, immediates, failures and the registration cache. When pyverbs is importable,
the plain queue-pair attributes are also turned into real ``pyverbs.qp.QPAttr`` objects (no device
needed) and decide.py's enum values are checked against pyverbs'.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from transports import fabric, peer_input
from transports.fabric import waits
from transports.fabric.base import FabricError, FabricInterrupted, RemoteRegion
from transports.fabric.settings import RdmaSettings, read_settings
from transports.fabric.verbs import decide
from transports.fabric.verbs import device as verbs_device
from transports.fabric.verbs.decide import (
    IBV_LINK_LAYER_ETHERNET,
    IBV_LINK_LAYER_INFINIBAND,
    IBV_PORT_ACTIVE,
    Choice,
    DeviceInfo,
    GidEntry,
    LaneEndpoint,
    PortInfo,
)
from transports.fabric.verbs.device import PYVERBS_MISSING, VerbsDevice

HAVE_PYVERBS = importlib.util.find_spec("pyverbs") is not None
needs_pyverbs = pytest.mark.skipif(
    not HAVE_PYVERBS, reason="pyverbs is not installed (apt install python3-pyverbs, then tools/use-system-pyverbs)")

IB_GID = bytes.fromhex("fe800000000000009a039bfffe00e4bf")
LINK_LOCAL = bytes.fromhex("fe800000000000009a039bfffe00aaaa")
IPV4_GID = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 7])
PORT_DOWN = 1
IB_GIDS = (GidEntry(0, IB_GID),)


def ib_port(number=1, state=IBV_PORT_ACTIVE, lid=7, mtu=4096, gids=IB_GIDS, pkeys=16):
    return PortInfo(number, state, lid, IBV_LINK_LAYER_INFINIBAND, mtu, tuple(gids), pkeys)


def roce_port(number=1, state=IBV_PORT_ACTIVE, mtu=1024, gids=()):
    return PortInfo(number, state, 0, IBV_LINK_LAYER_ETHERNET, mtu, tuple(gids), 1)


def choice_for(devices, **settings) -> Choice:
    return decide.choose(devices, RdmaSettings(**settings))


# -- device, port and GID choice --------------------------------------------------------------------


def test_the_first_device_with_an_active_port_is_chosen():
    devices = [DeviceInfo("mlx5_0", (ib_port(state=PORT_DOWN),)),
               DeviceInfo("mlx5_1", (ib_port(1, state=PORT_DOWN), ib_port(2, lid=9)))]
    chosen = choice_for(devices)
    assert (chosen.device, chosen.port, chosen.lid, chosen.mtu) == ("mlx5_1", 2, 9, 4096)
    assert chosen.gid_index is None and not chosen.is_global  # InfiniBand: LID routing
    assert chosen.gid == IB_GID


def test_rdma_device_and_port_pick_them():
    devices = [DeviceInfo("mlx5_0", (ib_port(1), ib_port(2, lid=3))), DeviceInfo("mlx5_1", (ib_port(1, lid=5),))]
    assert (choice_for(devices, device="mlx5_1").device, choice_for(devices, device="mlx5_1").lid) == ("mlx5_1", 5)
    assert choice_for(devices, port=2).lid == 3
    # RDMA_DEVICE_PORT alone: the first device that has that port active
    assert choice_for([DeviceInfo("a", (ib_port(1),)), DeviceInfo("b", (ib_port(1), ib_port(2)))], port=2).device == "b"


def test_an_unknown_rdma_device_names_the_devices_here():
    devices = [DeviceInfo("mlx5_0", (ib_port(),)), DeviceInfo("mlx5_1", (ib_port(),))]
    with pytest.raises(FabricError) as caught:
        choice_for(devices, device="mlx9")
    assert str(caught.value) == "RDMA_DEVICE=mlx9 is not one of the RDMA devices here: mlx5_0, mlx5_1"


def test_port_errors_name_the_variable_and_the_ports():
    devices = [DeviceInfo("mlx5_0", (ib_port(1), ib_port(2, state=PORT_DOWN)))]
    with pytest.raises(FabricError, match=r"RDMA_DEVICE_PORT=3 is not a port of mlx5_0 \(its ports: 1, 2\)"):
        choice_for(devices, device="mlx5_0", port=3)
    with pytest.raises(FabricError, match=r"RDMA_DEVICE_PORT=2: port 2 of mlx5_0 is not active \(active ports: 1\)"):
        choice_for(devices, device="mlx5_0", port=2)
    with pytest.raises(FabricError, match="RDMA_DEVICE_PORT=2: no RDMA device here has that port active"):
        choice_for(devices, port=2)


def test_a_device_without_an_active_port_is_named():
    devices = [DeviceInfo("mlx5_0", (ib_port(1, state=PORT_DOWN),)), DeviceInfo("mlx5_1", (ib_port(1, state=2),))]
    with pytest.raises(FabricError, match=r"RDMA_DEVICE=mlx5_0 has no active port .*mlx5_0 \(port 1 down\)"):
        choice_for(devices, device="mlx5_0")
    with pytest.raises(FabricError, match=r"no RDMA device has an active port: mlx5_0 \(port 1 down\); "
                                          r"mlx5_1 \(port 1 init\)"):
        choice_for(devices)
    assert decide.inactive_reason(devices) == ("no RDMA device has an active port: mlx5_0 (port 1 down); "
                                               "mlx5_1 (port 1 init)")
    assert decide.inactive_reason([*devices, DeviceInfo("mlx5_2", (ib_port(),))]) is None
    with pytest.raises(FabricError, match="no RDMA device found"):
        choice_for([])


def test_roce_prefers_a_roce_v2_ipv4_gid():
    gids = [GidEntry(0, LINK_LOCAL, False), GidEntry(1, LINK_LOCAL, True), GidEntry(2, IPV4_GID, False),
            GidEntry(3, IPV4_GID, True)]
    chosen = choice_for([DeviceInfo("rocep1s0", (roce_port(gids=gids),))])
    assert (chosen.gid_index, chosen.gid, chosen.is_global) == (3, IPV4_GID, True)
    # without an IPv4 one: the first RoCE v2 entry; without RoCE v2: the first entry
    assert choice_for([DeviceInfo("r", (roce_port(gids=gids[:3]),))]).gid_index == 1
    assert choice_for([DeviceInfo("r", (roce_port(gids=[gids[0], gids[2]]),))]).gid_index == 0
    # empty entries do not count
    assert choice_for([DeviceInfo("r", (roce_port(gids=[GidEntry(0, bytes(16)), gids[2]]),))]).gid_index == 2
    with pytest.raises(FabricError, match="has no GID: give its interface an IP address, or set RDMA_GID_INDEX"):
        choice_for([DeviceInfo("r", (roce_port(gids=[GidEntry(0, bytes(16))]),))])


def test_rdma_gid_index_picks_the_gid_and_global_routing():
    gids = [GidEntry(0, IB_GID), GidEntry(1, LINK_LOCAL)]
    chosen = choice_for([DeviceInfo("mlx5_0", (ib_port(gids=gids),))], gid_index=1)
    assert (chosen.gid_index, chosen.gid, chosen.is_global) == (1, LINK_LOCAL, True)
    with pytest.raises(FabricError, match=r"RDMA_GID_INDEX=5 is not a valid GID of mlx5_0 port 1 "
                                          r"\(valid indexes: 0, 1\)"):
        choice_for([DeviceInfo("mlx5_0", (ib_port(gids=gids),))], gid_index=5)


def test_pkey_index_must_be_in_the_port_table():
    devices = [DeviceInfo("mlx5_0", (ib_port(pkeys=2),))]
    assert choice_for(devices, pkey_index=1).pkey_index == 1
    with pytest.raises(FabricError, match="RDMA_QP_PKEY_INDEX=2 is beyond the partition key table of mlx5_0 port 1"):
        choice_for(devices, pkey_index=2)


# -- queue-pair attributes ----------------------------------------------------------------------------

IB = Choice("mlx5_0", 1, 7, IBV_LINK_LAYER_INFINIBAND, 4096, None, IB_GID, 0)
ROCE = Choice("rocep1s0", 2, 0, IBV_LINK_LAYER_ETHERNET, 1024, 3, IPV4_GID, 0)


def peer_of(choice: Choice, mtu=None, rd_atomic=16, lid=11) -> decide.DeviceAddress:
    return decide.DeviceAddress(bytes(range(16)), lid, 1, choice.link_layer, mtu or choice.mtu, rd_atomic,
                                LINK_LOCAL)


def test_init_attributes():
    attrs = decide.init_attributes(replace(IB, pkey_index=3))
    assert attrs.fields == {"qp_state": decide.IBV_QPS_INIT, "pkey_index": 3, "port_num": 1,
                            "qp_access_flags": decide.IBV_ACCESS_LOCAL_WRITE | decide.IBV_ACCESS_REMOTE_WRITE
                            | decide.IBV_ACCESS_REMOTE_READ}
    assert attrs.fields["qp_access_flags"] == 7  # local write, remote write, remote read: no atomics
    assert attrs.mask == (decide.IBV_QP_STATE | decide.IBV_QP_PKEY_INDEX | decide.IBV_QP_PORT
                          | decide.IBV_QP_ACCESS_FLAGS)
    assert attrs.ah is None


def test_rtr_on_infiniband_routes_by_lid():
    settings = RdmaSettings(service_level=3, traffic_class=40)
    attrs = decide.rtr_attributes(IB, peer_of(IB, lid=11), LaneEndpoint(0x12345, 777), 8, settings)
    assert attrs.fields == {"qp_state": decide.IBV_QPS_RTR, "path_mtu": 5, "dest_qp_num": 0x12345, "rq_psn": 777,
                            "max_dest_rd_atomic": 8, "min_rnr_timer": decide.MIN_RNR_TIMER}
    ah = attrs.ah
    assert (ah.port_num, ah.dlid, ah.sl, ah.is_global) == (1, 11, 3, False)
    assert ah.dgid == bytes(16) and ah.traffic_class == 0  # no global header: no GID, no traffic class
    assert attrs.mask == (decide.IBV_QP_STATE | decide.IBV_QP_AV | decide.IBV_QP_PATH_MTU | decide.IBV_QP_DEST_QPN
                          | decide.IBV_QP_RQ_PSN | decide.IBV_QP_MAX_DEST_RD_ATOMIC | decide.IBV_QP_MIN_RNR_TIMER)


def test_rtr_on_roce_carries_a_global_header():
    settings = RdmaSettings(service_level=2, traffic_class=106)
    attrs = decide.rtr_attributes(ROCE, peer_of(ROCE, lid=0), LaneEndpoint(5, 6), 16, settings)
    ah = attrs.ah
    assert (ah.port_num, ah.is_global, ah.dgid, ah.sgid_index, ah.traffic_class, ah.sl) == (
        2, True, LINK_LOCAL, 3, 106, 2)
    assert ah.hop_limit == decide.HOP_LIMIT
    assert ah.dgid_text == "fe80:0000:0000:0000:9a03:9bff:fe00:aaaa"
    assert attrs.fields["path_mtu"] == 3  # IBV_MTU_1024


@pytest.mark.parametrize(("setting", "local", "remote", "expected"), [
    (None, 4096, 4096, 4096), (None, 4096, 2048, 2048), (None, 1024, 4096, 1024), (512, 4096, 4096, 512),
    (4096, 2048, 4096, 2048)])
def test_path_mtu_is_the_smallest(setting, local, remote, expected):
    choice = replace(IB, mtu=local)
    attrs = decide.rtr_attributes(choice, peer_of(choice, mtu=remote), LaneEndpoint(1, 1), 16,
                                  RdmaSettings(mtu=setting))
    assert decide.MTU_BYTES[attrs.fields["path_mtu"]] == expected


def test_rtr_refuses_another_link_layer():
    with pytest.raises(FabricError, match="cannot connect InfiniBand port mlx5_0:1 to a peer on Ethernet"):
        decide.rtr_attributes(IB, peer_of(ROCE), LaneEndpoint(1, 1), 16, RdmaSettings())


def test_rts_attributes_defaults_and_settings():
    attrs = decide.rts_attributes(4242, peer_of(IB, rd_atomic=4), 16, RdmaSettings())
    assert attrs.fields == {"qp_state": decide.IBV_QPS_RTS, "sq_psn": 4242, "timeout": 14, "retry_cnt": 7,
                            "rnr_retry": 6, "max_rd_atomic": 4}  # a finite RNR retry
    assert attrs.mask == (decide.IBV_QP_STATE | decide.IBV_QP_SQ_PSN | decide.IBV_QP_TIMEOUT | decide.IBV_QP_RETRY_CNT
                          | decide.IBV_QP_RNR_RETRY | decide.IBV_QP_MAX_QP_RD_ATOMIC)
    tuned = decide.rts_attributes(1, peer_of(IB), 2, RdmaSettings(timeout=20, retry_count=0))
    assert (tuned.fields["timeout"], tuned.fields["retry_cnt"], tuned.fields["max_rd_atomic"]) == (20, 0, 2)


def test_rd_atomic_limit():
    assert decide.rd_atomic_limit(16, 16) == 16
    assert decide.rd_atomic_limit(64, 4) == 4
    assert decide.rd_atomic_limit(0, 0) == 1


def test_gid_text_round_trip():
    assert decide.gid_bytes(decide.gid_text(IB_GID)) == IB_GID
    with pytest.raises(ValueError, match="is not a GID"):
        decide.gid_bytes("fe80::1")


# -- the connection exchange ----------------------------------------------------------------------------


def test_address_round_trip_and_instances_differ():
    first, second = decide.new_address(ROCE, 8), decide.new_address(ROCE, 8)
    assert first.instance != second.instance and len(first.instance) == 16
    encoded = decide.encode_address(first)
    assert isinstance(encoded, bytes) and len(encoded) <= peer_input.MAX_ADDRESS_BYTES  # what peers take
    assert decide.decode_address(encoded) == first
    assert (first.lid, first.port, first.link_layer, first.mtu, first.rd_atomic, first.gid) == (
        0, 2, IBV_LINK_LAYER_ETHERNET, 1024, 8, IPV4_GID)


def _address_with(**changes) -> bytes:
    fields = {"magic": b"TTV1", "instance": bytes(16), "lid": 1, "port": 1, "link_layer": 1, "mtu": 4096,
              "rd_atomic": 16, "gid": IB_GID, **changes}
    return decide._ADDRESS.pack(*fields.values())


@pytest.mark.parametrize(("data", "message"), [
    ("00ff", "must be bytes, not str"),
    (b"\x00" * 10, f"has {decide._ADDRESS.size} bytes, not 10"),
    (_address_with(magic=b"UCX!"), "starts with"),
    (_address_with(link_layer=9), "unknown link layer 9"),
    (_address_with(mtu=1500), "MTU 1500"),
    (_address_with(port=0), "port 0"),
    (_address_with(rd_atomic=0), "serves no RDMA reads"),
])
def test_malformed_addresses_are_refused(data, message):
    with pytest.raises(ValueError, match=message):
        decide.decode_address(data)


def test_request_and_reply_round_trip():
    address = decide.encode_address(decide.new_address(IB, 16))
    lanes = [LaneEndpoint(0xFFFFFF, 0), LaneEndpoint(17, 0xABCDE)]
    request = decide.connect_request(address, lanes)
    import json

    raw, decoded, parsed = decide.parse_request(json.loads(json.dumps(request)), 2)
    assert raw == address and decoded == decide.decode_address(address) and parsed == lanes
    reply = decide.connect_reply(lanes[::-1])
    assert decide.parse_reply(json.loads(json.dumps(reply)), 2) == lanes[::-1]


def _request(**changes):
    request = decide.connect_request(decide.encode_address(decide.new_address(IB, 16)), [LaneEndpoint(1, 2)])
    request.update(changes)
    return request


def _lane(**changes):
    return _request(lanes=[{"qp_num": 1, "psn": 2, **changes}])


@pytest.mark.parametrize(("request_", "message"), [
    ([], "must be an object with exactly"),
    ({"address": "00", "lanes": []}, "must be an object with exactly"),
    (_request(extra=1), "must be an object with exactly"),
    (_request(verbs=2), "version 2"),
    (_request(verbs=True), "version True"),
    (_request(address=5), "'address' must be a hex string"),
    (_request(address=""), "'address' must be a hex string"),
    (_request(address="ab" * 8193), "'address' must be a hex string"),
    (_request(address="zz"), "is not hex"),
    (_request(address="00" * decide._ADDRESS.size), "starts with"),
    (_request(lanes={"qp_num": 1}), "'lanes' must be a list"),
    (_request(lanes=[]), "has 0 lanes, this device 1"),
    (_request(lanes=[{"qp_num": 1, "psn": 2}] * 2), "has 2 lanes, this device 1"),
    (_request(lanes=[[1, 2]]), "exactly 'qp_num' and 'psn'"),
    (_lane(extra=3), "exactly 'qp_num' and 'psn'"),
    (_lane(qp_num=2**24), "'qp_num' must be an integer in"),
    (_lane(qp_num=-1), "'qp_num' must be an integer in"),
    (_lane(qp_num=True), "'qp_num' must be an integer in"),
    (_lane(qp_num="7"), "'qp_num' must be an integer in"),
    (_lane(psn=2**24), "'psn' must be an integer in"),
    (_lane(psn=1.0), "'psn' must be an integer in"),
])
def test_malformed_requests_are_refused(request_, message):
    with pytest.raises(ValueError, match=message):
        decide.parse_request(request_, 1)


@pytest.mark.parametrize(("reply", "message"), [
    (None, "must be an object with exactly"),
    ({"verbs": 1, "lanes": [], "address": "00"}, "must be an object with exactly"),
    ({"verbs": 1, "lanes": [{"qp_num": 1, "psn": 1}]}, "has 1 lanes, this device 2"),
    ({"verbs": 1, "lanes": [{"qp_num": 1, "psn": 1}, {"qp_num": None, "psn": 1}]}, "lane 1 .*'qp_num'"),
])
def test_malformed_replies_are_refused(reply, message):
    with pytest.raises(ValueError, match=message):
        decide.parse_reply(reply, 2)


def test_new_psns_are_24_bit_and_vary():
    psns = {decide.new_psn() for _ in range(64)}
    assert all(0 <= psn < 2**24 for psn in psns) and len(psns) > 1


# -- lanes, queue pairs, completion queues ---------------------------------------------------------------


def test_lanes_map_to_queue_pairs_and_queue_pairs_to_cqs_round_robin():
    assert [decide.qp_index(lane, 3) for lane in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [decide.cq_index(qp, 2) for qp in range(5)] == [0, 1, 0, 1, 0]
    assert [decide.cq_index(qp, 4) for qp in range(2)] == [0, 1]  # more CQs than queue pairs: some idle
    with pytest.raises(ValueError, match="negative"):
        decide.qp_index(-1, 2)


@pytest.mark.parametrize(("nbytes", "parts"), [(1, 4), (64, 4), (1000, 3), (1 << 20, 4), (1 << 20 | 5, 3),
                                               (4096, 1), (130, 2)])
def test_spread_covers_the_data_in_aligned_pieces(nbytes, parts):
    pieces = decide.spread(nbytes, parts)
    assert 1 <= len(pieces) <= parts
    assert sum(length for _, length in pieces) == nbytes
    assert all(length > 0 for _, length in pieces)
    assert [offset for offset, _ in pieces] == list(np.cumsum([0] + [length for _, length in pieces[:-1]]))
    assert all(offset % 64 == 0 for offset, _ in pieces)
    assert decide.spread(0, 4) == []
    assert len(decide.spread(1 << 20, 4)) == 4


def test_perftest_arguments_come_from_the_settings():
    assert decide.perftest_arguments(RdmaSettings()) == ()
    assert decide.perftest_arguments(RdmaSettings(device="mlx5_1", port=2, gid_index=3)) == (
        "-d", "mlx5_1", "-i", "2", "-x", "3")
    assert decide.perftest_arguments(RdmaSettings(gid_index=0)) == ("-x", "0")


def test_no_device_reason():
    assert decide.no_device_reason("x") == "no RDMA device found (x)"


# -- memory waits ----------------------------------------------------------------------------------------


def _later(delay, action):
    thread = threading.Thread(target=lambda: (time.sleep(delay), action()), daemon=True)
    thread.start()
    return thread


def test_a_flag_raised_from_another_thread_is_seen():
    memory = np.zeros(3, np.uint8)
    flags = [memory[i : i + 1] for i in range(3)]
    flag_set = waits.PolledFlagSet(flags, threading.Event(), "test")
    assert flag_set.wait_any(0.01) is None
    _later(0.05, lambda: memory.__setitem__(2, 1))
    assert flag_set.wait_any(5.0) == 2
    flag_set.done(2)
    assert flag_set.wait_any(0.01) is None  # done: no longer watched
    memory[0] = 1
    assert flag_set.wait_any(0.01) == 0
    flag_set.done(0)
    flag_set.reset()
    assert flag_set.wait_any(0.01) == 0


def test_counters():
    counter = np.zeros(1, np.uint64)
    assert not waits.wait_counter(counter, 0, 0.01, threading.Event(), "test")
    _later(0.05, lambda: counter.__setitem__(0, 3))
    assert waits.wait_counter(counter, 2, 5.0, threading.Event(), "test")
    assert not waits.wait_counter(counter, 3, 0.01, threading.Event(), "test")
    counters = [np.zeros(1, np.uint64) for _ in range(3)]
    assert waits.wait_counters(counters, [0, 0, 0], 0.01, threading.Event(), "test") is None
    _later(0.05, lambda: counters[1].__setitem__(0, 5))
    assert waits.wait_counters(counters, [0, 4, 0], 5.0, threading.Event(), "test") == 1
    with pytest.raises(ValueError, match="2 counters but 1 thresholds"):
        waits.wait_counters(counters[:2], [0], 0.01, threading.Event(), "test")


def test_interrupt_ends_waits():
    stop = threading.Event()
    counter = np.zeros(1, np.uint64)
    flag_set = waits.PolledFlagSet([np.zeros(1, np.uint8)], stop, "verbs")
    _later(0.05, stop.set)
    start = time.monotonic()
    with pytest.raises(FabricInterrupted, match="verbs: the wait was interrupted"):
        waits.wait_counter(counter, 0, 30.0, stop, "verbs")
    assert time.monotonic() - start < 5
    with pytest.raises(FabricInterrupted):
        flag_set.wait_any(30.0)
    with pytest.raises(FabricInterrupted):
        waits.wait_counters([counter], [0], 30.0, stop, "verbs")


def test_idle_waits_nap():
    """An idle waiter sleeps (naps grow to MAX_NAP_S): over 0.2 s it polls far fewer times than a spin would."""
    calls = []
    waits.poll_until(lambda: calls.append(1), 0.2, threading.Event(), "test")
    assert 10 < len(calls) < 0.2 / waits.MAX_NAP_S + 200


# -- the backend's class-level behaviour ---------------------------------------------------------------


def test_the_registry_opens_verbs_by_name():
    assert fabric.backend("verbs") is VerbsDevice
    assert VerbsDevice.name == "verbs" and VerbsDevice.immediates
    assert VerbsDevice.reference_tools == ("ib_write_bw", "ib_write_lat")
    assert list(VerbsDevice.fabric_transports) == ["auto"]
    assert VerbsDevice.without_effect(read_settings({"RDMA_QP_MTU": "1024", "RDMA_QP_SL": "1"})) == {}


def test_availability_without_pyverbs_gives_the_install_hint(monkeypatch):
    for name in [name for name in sys.modules if name == "pyverbs" or name.startswith("pyverbs.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "pyverbs", None)
    status = VerbsDevice.availability()
    assert (status.ok, status.reason) == (False, PYVERBS_MISSING)
    assert "\n" not in status.reason and "pip install -e '.[verbs]'" in status.reason
    assert fabric.availability("verbs") == status
    with pytest.raises(FabricError, match="pyverbs is not installed"):
        VerbsDevice()


@needs_pyverbs
def test_availability_without_a_device_says_so():
    status = VerbsDevice.availability()
    assert not status.ok
    assert status.reason.startswith("no RDMA device found"), status.reason
    with pytest.raises(FabricError, match="the verbs fabric is not available here: no RDMA device found"):
        fabric.open_device("verbs")


def test_hardware_is_described_from_what_pyverbs_reports():
    """``_hardware`` over a stand-in for pyverbs: ports, MTU enums, GID entries and their RoCE v2 type."""

    class Error(Exception):
        pass

    class Context:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def query_device(self):
            return SimpleNamespace(phys_port_cnt=2)

        def query_port(self, number):
            return SimpleNamespace(state=IBV_PORT_ACTIVE if number == 2 else PORT_DOWN, lid=0, link_layer=2,
                                   active_mtu=3, gid_tbl_len=4, pkey_tbl_len=1)

        def query_gid(self, port, index):
            if index == 3:
                raise Error("no such entry")
            return SimpleNamespace(gid=decide.gid_text(IPV4_GID if index == 1 else bytes(16) if index == 2
                                                       else LINK_LOCAL))

        def query_gid_type(self, port, index):
            return 1 if index == 1 else 0

    pv = SimpleNamespace(
        device=SimpleNamespace(get_device_list=lambda: [SimpleNamespace(name=b"rocep1s0")], Context=Context),
        pyverbs_error=SimpleNamespace(PyverbsError=Error),
        enums=SimpleNamespace(IBV_GID_TYPE_SYSFS_ROCE_V2=1))
    (info,) = verbs_device._hardware(pv)
    assert info.name == "rocep1s0" and [port.number for port in info.ports] == [1, 2]
    port = info.ports[1]
    assert (port.active, port.active_mtu, port.link_layer) == (True, 1024, IBV_LINK_LAYER_ETHERNET)
    assert port.gids == (GidEntry(0, LINK_LOCAL, False), GidEntry(1, IPV4_GID, True))  # 2 empty, 3 unreadable
    chosen = decide.choose([info], RdmaSettings())
    assert (chosen.port, chosen.gid_index) == (2, 1)

    def no_list():
        raise Error("Failed to get devices list")

    pv.device.get_device_list = no_list
    with pytest.raises(FabricError, match=r"^no RDMA device found \(Failed to get devices list"):
        verbs_device._hardware(pv)
    pv.device.get_device_list = list
    with pytest.raises(FabricError, match=r"^no RDMA device found \(the device list is empty"):
        verbs_device._hardware(pv)


def test_tool_finds_perftest_on_path(monkeypatch):
    monkeypatch.setattr(verbs_device.shutil, "which", lambda name: f"/usr/bin/{name}")
    for name in ("RDMA_DEVICE", "RDMA_DEVICE_PORT", "RDMA_GID_INDEX"):
        monkeypatch.delenv(name, raising=False)
    tool = VerbsDevice.tool("ib_write_bw")
    assert (tool.name, str(tool.path), tool.arguments) == ("ib_write_bw", "/usr/bin/ib_write_bw", ())
    monkeypatch.setenv("RDMA_DEVICE", "mlx5_1")
    monkeypatch.setenv("RDMA_GID_INDEX", "3")
    tool = VerbsDevice.tool("ib_write_lat")
    assert tool.arguments == ("-d", "mlx5_1", "-x", "3")
    assert tool.environment["RDMA_DEVICE"] == "mlx5_1"
    with pytest.raises(ValueError, match="unknown fabric transport 'tcp'"):
        VerbsDevice.tool("ib_write_bw", "tcp")
    with pytest.raises(FabricError, match="no reference tool 'ucx_perftest'"):
        VerbsDevice.tool("ucx_perftest")


def test_tool_without_perftest_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(verbs_device.shutil, "which", lambda name: None)
    with pytest.raises(FabricError, match=r"ib_write_bw is not installed .*apt install perftest"):
        VerbsDevice.tool("ib_write_bw")


# -- against the real pyverbs (no device needed) ---------------------------------------------------------


@needs_pyverbs
def test_constants_agree_with_pyverbs():
    import pyverbs.enums as e

    for name in ("IBV_PORT_ACTIVE", "IBV_LINK_LAYER_INFINIBAND", "IBV_LINK_LAYER_ETHERNET", "IBV_QPS_INIT",
                 "IBV_QPS_RTR", "IBV_QPS_RTS", "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE",
                 "IBV_ACCESS_REMOTE_READ", "IBV_QP_STATE", "IBV_QP_ACCESS_FLAGS", "IBV_QP_PKEY_INDEX", "IBV_QP_PORT",
                 "IBV_QP_AV", "IBV_QP_PATH_MTU", "IBV_QP_TIMEOUT", "IBV_QP_RETRY_CNT", "IBV_QP_RNR_RETRY",
                 "IBV_QP_RQ_PSN", "IBV_QP_MAX_QP_RD_ATOMIC", "IBV_QP_MIN_RNR_TIMER", "IBV_QP_SQ_PSN",
                 "IBV_QP_MAX_DEST_RD_ATOMIC", "IBV_QP_DEST_QPN"):
        assert getattr(decide, name) == int(getattr(e, name)), name
    for mtu, enum in decide.MTU_ENUM.items():
        assert int(getattr(e, f"IBV_MTU_{mtu}")) == enum


@needs_pyverbs
def test_plain_attributes_become_pyverbs_qp_attrs():
    pv = verbs_device._pyverbs()
    settings = RdmaSettings(service_level=4, traffic_class=32, timeout=18, retry_count=5)
    init = verbs_device.qp_attr(pv, decide.init_attributes(replace(ROCE, pkey_index=0)))
    assert (init.qp_state, init.port_num, init.pkey_index, init.qp_access_flags) == (1, 2, 0, 7)

    rtr = verbs_device.qp_attr(pv, decide.rtr_attributes(ROCE, peer_of(ROCE), LaneEndpoint(0xABC, 99), 16, settings))
    assert (rtr.qp_state, rtr.path_mtu, rtr.dest_qp_num, rtr.rq_psn, rtr.max_dest_rd_atomic, rtr.min_rnr_timer) == (
        2, 3, 0xABC, 99, 16, decide.MIN_RNR_TIMER)
    ah = rtr.ah_attr
    assert (ah.is_global, ah.port_num, ah.sl, ah.sgid_index, ah.hop_limit, ah.traffic_class) == (1, 2, 4, 3, 64, 32)
    assert ah.dgid == "fe80:0000:0000:0000:9a03:9bff:fe00:aaaa"

    ib = verbs_device.qp_attr(pv, decide.rtr_attributes(IB, peer_of(IB, lid=23), LaneEndpoint(1, 2), 16, settings))
    assert (ib.ah_attr.is_global, ib.ah_attr.dlid, ib.ah_attr.sl, ib.path_mtu) == (0, 23, 4, 5)

    rts = verbs_device.qp_attr(pv, decide.rts_attributes(1234, peer_of(IB, rd_atomic=8), 16, settings))
    assert (rts.qp_state, rts.sq_psn, rts.timeout, rts.retry_cnt, rts.rnr_retry, rts.max_rd_atomic) == (
        3, 1234, 18, 5, decide.RNR_RETRY, 8)


# -- the device over a simulated NIC ---------------------------------------------------------------------


class _FakeNic:
    """A stand-in for pyverbs whose "NIC" performs each work request at once with memmove: two devices in one
    process connect through accept(), and their transfers, completions and immediates run through device.py."""

    IBV_WC_SUCCESS, IBV_WC_REM_ACCESS_ERR, IBV_WC_RECV_RDMA_WITH_IMM = 0, 10, 129

    def __init__(self):
        import ctypes
        import enum
        import itertools

        nic = self
        self.memmove = ctypes.memmove
        self.qps, self.mrs, self.posted = {}, {}, []
        qp_numbers, keys = itertools.count(100), itertools.count(0x1000)

        class Error(Exception):
            pass

        class Context:
            def __init__(self, name):
                self.closed = False

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def query_device(self):
                return SimpleNamespace(phys_port_cnt=1, max_qp_wr=4096, max_qp_rd_atom=16, max_qp_init_rd_atom=16,
                                       max_cqe=1 << 20)

            def query_port(self, number):
                return SimpleNamespace(state=IBV_PORT_ACTIVE, lid=1, link_layer=IBV_LINK_LAYER_INFINIBAND,
                                       active_mtu=5, gid_tbl_len=1, pkey_tbl_len=1)

            def query_gid(self, port, index):
                return SimpleNamespace(gid=decide.gid_text(IB_GID))

            def query_gid_type(self, port, index):
                return 0

            def close(self):
                self.closed = True

        class MR:
            def __init__(self, pd, length, access, address):
                self.lkey = self.rkey = next(keys)
                self.range, self.access = (address, address + length), access
                nic.mrs[self.rkey] = self

            def close(self):
                nic.mrs.pop(self.rkey, None)

        class CompChannel:  # opens no descriptor: the progress threads nap instead of sleeping on events
            def __init__(self, context):
                pass

            def get_cq_event(self, cq):
                raise AssertionError("no descriptor was ready, so no event may be taken")

            def close(self):
                pass

        class CQ:
            def __init__(self, context, cqe, cq_context, channel, vector):
                self.cqe, self.entries, self.lock = cqe, [], threading.Lock()

            def req_notify(self):
                pass

            def ack_events(self, count):
                pass

            def poll(self, count):
                with self.lock:
                    taken, self.entries = self.entries[:count], self.entries[count:]
                return len(taken), taken

            def push(self, **fields):
                with self.lock:
                    self.entries.append(SimpleNamespace(**{"vendor_err": 0, "opcode": 0, "imm_data": 0, **fields}))

            def resize(self, cqe):
                self.cqe = cqe

            def close(self):
                pass

        class QP:
            def __init__(self, pd, init):
                self.qp_num, self.cq, self.recvs, self.state, self.peer = next(qp_numbers), init.scq, 0, 0, None
                nic.qps[self.qp_num] = self

            def modify(self, attr, mask):
                self.state = attr.qp_state
                if attr.qp_state == 2:
                    self.peer = attr.dest_qp_num

            def post_recv(self, wr):
                self.recvs += 1

            def post_send(self, wr):
                target = nic.qps[self.peer]
                status = nic.IBV_WC_SUCCESS if self.state == 3 else 5
                local, remote = wr.sg[0], nic.mrs.get(wr.rkey)
                if wr.sg[0].length and (remote is None or not remote.range[0] <= wr.addr
                                        or wr.addr + local.length > remote.range[1]):
                    status = nic.IBV_WC_REM_ACCESS_ERR
                elif status == nic.IBV_WC_SUCCESS and local.length:
                    pair = (local.addr, wr.addr) if wr.opcode == 4 else (wr.addr, local.addr)
                    nic.memmove(*pair, local.length)
                if wr.send_flags & 2 or status != nic.IBV_WC_SUCCESS:  # unsignaled: a completion only on error
                    self.cq.push(wr_id=wr.wr_id, status=status, qp_num=self.qp_num)
                nic.posted.append(wr)
                if wr.opcode == 1 and status == nic.IBV_WC_SUCCESS:  # IBV_WR_RDMA_WRITE_WITH_IMM
                    target.recvs -= 1
                    target.cq.push(wr_id=0, status=0, qp_num=target.qp_num, opcode=nic.IBV_WC_RECV_RDMA_WITH_IMM,
                                   imm_data=wr.imm_data)

            def close(self):
                nic.qps.pop(self.qp_num, None)

        class SendWR:
            def __init__(self, wr_id, opcode, num_sge, sg, send_flags, imm_data):
                self.wr_id, self.opcode, self.sg, self.imm_data = wr_id, opcode, sg, imm_data
                self.send_flags = send_flags

            def set_wr_rdma(self, rkey, addr):
                self.rkey, self.addr = rkey, addr

        status = enum.IntEnum("ibv_wc_status", {"IBV_WC_SUCCESS": 0, "IBV_WC_LOC_QP_OP_ERR": 5,
                                                "IBV_WC_REM_ACCESS_ERR": 10})
        self.pv = SimpleNamespace(
            device=SimpleNamespace(get_device_list=lambda: [SimpleNamespace(name=b"mlx5_0")], Context=Context),
            pyverbs_error=SimpleNamespace(PyverbsError=Error),
            pd=SimpleNamespace(PD=lambda context: SimpleNamespace(close=lambda: None)),
            mr=SimpleNamespace(MR=MR),
            cq=SimpleNamespace(CQ=CQ, CompChannel=CompChannel, cqe_status_to_str=lambda s: status(s).name.lower()),
            qp=SimpleNamespace(QP=QP, QPCap=SimpleNamespace, QPInitAttr=SimpleNamespace, QPAttr=SimpleNamespace),
            addr=SimpleNamespace(GID=SimpleNamespace, GlobalRoute=SimpleNamespace, AHAttr=SimpleNamespace),
            wr=SimpleNamespace(SGE=lambda addr, length, lkey: SimpleNamespace(addr=addr, length=length, lkey=lkey),
                               SendWR=SendWR, RecvWR=SimpleNamespace),
            enums=SimpleNamespace(IBV_QPT_RC=2, IBV_SEND_SIGNALED=2, IBV_WR_RDMA_WRITE=0,
                                  IBV_WR_RDMA_WRITE_WITH_IMM=1, IBV_WR_RDMA_READ=4, IBV_WC_SUCCESS=0,
                                  IBV_WC_RECV_RDMA_WITH_IMM=self.IBV_WC_RECV_RDMA_WITH_IMM, IBV_QPS_ERR=6,
                                  IBV_QP_STATE=1, IBV_GID_TYPE_SYSFS_ROCE_V2=1, ibv_wc_status=status))


@pytest.fixture
def simulated(monkeypatch):
    """Two verbs devices (two lanes per peer, two progress threads) on the simulated NIC."""
    nic = _FakeNic()
    monkeypatch.setattr(verbs_device, "_pyverbs", lambda: nic.pv)
    devices = [VerbsDevice(progress_threads=2, lanes_per_peer=2, settings=RdmaSettings(queue_depth=8))
               for _ in range(2)]
    yield nic, devices
    for device in devices:
        device.close()


def _connected(devices, lane=0):
    a, b = devices
    exchanges = []

    def exchange(request):
        exchanges.append(request)
        return b.accept(request, a.address)

    return a.channel(b.address, lane, exchange), exchanges


def test_simulated_devices_connect_once_per_peer_and_both_ways(simulated):
    nic, (a, b) = simulated
    assert a.address != b.address  # instance ids differ on the same port
    assert VerbsDevice.availability().ok
    with pytest.raises(FabricError, match="needs the exchange"):
        a.channel(b.address, 0)
    channel, exchanges = _connected((a, b))
    assert len(exchanges) == 1 and len(exchanges[0]["lanes"]) == 2
    second = a.channel(b.address, 3, lambda request: pytest.fail("a second exchange"))
    assert second is a.channel(b.address, 1) and second is not channel  # lane 3 is queue pair 1
    assert channel.poller is not second.poller  # lanes spread over the progress threads' CQs
    back = b.channel(a.address, 0)  # accept() made the requester's lanes: no exchange
    assert back.failed() is None
    assert all(qp.state == 3 for qp in nic.qps.values())  # every queue pair reached RTS
    with pytest.raises(ValueError, match="has 1 lanes, this device 2"):
        b.accept({**exchanges[0], "lanes": exchanges[0]["lanes"][:1]}, a.address)
    described = a.describe()
    assert described["used"] == ["rc/mlx5_0:1"] and described["lanes_per_peer"] == 2
    assert fabric.label(described) == "verbs:rc/mlx5_0:1"


def test_simulated_write_read_flush_and_flags(simulated):
    _, (a, b) = simulated
    channel, _ = _connected((a, b))
    target = b.alloc(256)
    target.array[:] = 0
    source = np.arange(256, dtype=np.uint8)
    assert channel.wait(channel.write(source[:128], target.export()), 5.0) is None
    assert channel.wait(channel.flush(), 5.0) is None
    assert bytes(target.array[:128]) == bytes(source[:128])
    back = np.zeros(64, np.uint8)
    channel.read_now(back, target.export().at(64, 64))
    assert bytes(back) == bytes(source[64:128])
    flag = np.ones(1, np.uint8)
    channel.write_flagged(source[128:192], target.export().at(128, 64), flag, target.export().at(255, 1))
    assert bytes(target.array[128:192]) == bytes(source[128:192]) and target.array[255] == 1
    assert b.flag_set([target.array[255:256]]).wait_any(1.0) == 0
    assert channel.notify().done()
    with pytest.raises(ValueError, match="does not fit"):
        channel.write(source, target.export().at(0, 16))
    bad_key = RemoteRegion(target.address, 16, b"\x01\x02")
    with pytest.raises(FabricError, match="a remote key of 2 bytes is malformed"):
        channel.wait(channel.write(source[:16], bad_key), 5.0)


def test_simulated_lanes_spread_a_large_write(simulated):
    _, (a, b) = simulated
    lanes = [_connected((a, b), lane)[0] for lane in range(2)]
    target = b.alloc(1 << 16)
    data = np.random.default_rng(1).integers(0, 255, 1 << 16, dtype=np.uint8)
    flag = np.ones(1, np.uint8)
    flag_region = b.alloc(1)
    flag_region.array[:] = 0
    a.write_flagged_lanes(lanes, data, target.export(), flag, flag_region.export())
    assert bytes(target.array) == bytes(data) and flag_region.array[0] == 1


def test_simulated_immediates_arrive_with_the_peer_address(simulated):
    nic, (a, b) = simulated
    channel, _ = _connected((a, b))
    target = b.alloc(64)
    channel.write_with_imm(np.full(8, 7, np.uint8), target.export(), 0xDEADBEEF)
    channel.write_with_imm(np.zeros(0, np.uint8), target.export(), 5)
    deadline = time.monotonic() + 5
    got = []
    while len(got) < 2 and time.monotonic() < deadline:
        b.wait_for_activity(0.1)
        got += b.take_immediates()
    assert got == [((a.address[0],), 0xDEADBEEF), ((a.address[0],), 5)]
    assert bytes(target.array[:8]) == bytes([7] * 8)
    assert b.take_immediates() == []
    receiving = b.channel(a.address, 0)
    assert nic.qps[receiving.qp_num].recvs == 8  # each receive used was posted again
    with pytest.raises(ValueError, match="32-bit"):
        channel.write_with_imm(np.zeros(0, np.uint8), target.export(), 2**32)


def test_simulated_failures_and_interrupts(simulated):
    _, (a, b) = simulated
    channel, _ = _connected((a, b))
    target = b.alloc(64)
    wrong = RemoteRegion(target.address, 64, (target.export().rkey[0] + 99).to_bytes(4, "little"))
    with pytest.raises(FabricError, match="RDMA write failed: ibv_wc_rem_access_err"):
        channel.write_flagged(np.ones(8, np.uint8), wrong)
    assert "rem_access_err" in channel.failed()
    with pytest.raises(FabricError, match="on a failed connection"):
        channel.read_now(np.zeros(8, np.uint8), target.export())
    other, _ = _connected((a, b), 1)
    other.fail()
    assert other.failed() is not None
    a.interrupt_waits()
    with pytest.raises(FabricInterrupted):
        a.wait_counter(np.zeros(1, np.uint64), 0, 5.0)


def test_simulated_registrations_are_cached_per_owner_and_released(simulated):
    _, (a, b) = simulated
    channel, _ = _connected((a, b))
    target = b.alloc(1024)
    made = a.registrations_made
    buffer = np.zeros(1024, np.uint8)
    for offset in (0, 256, 512):
        channel.write_flagged(buffer[offset : offset + 256], target.export().at(offset, 256))
    assert a.registrations_made == made + 1  # one registration for the whole owner buffer
    assert a.register(buffer[10:20]) is a.register(buffer)
    region = a.alloc(100)
    assert region.address % 64 == 0 and region.nbytes == 100 and a.register(region.array[5:50]) is region
    count = a.registrations()
    del buffer
    import gc

    gc.collect()
    assert a.registrations() == count - 1  # deregistered once its owner died
    a.close()
    assert a.registrations() == 0
    with pytest.raises(FabricError, match="the device is closed"):
        a.alloc(8)
    a.close()  # idempotent


# -- the fabric transports on the verbs backend (simulated NIC): the plumbing above the device ---------------


@pytest.mark.parametrize(("name", "options"), [("zerocopy", {}), ("rdma_cp", {}), ("grpc_rdma", {"mode": "buffered"}),
                                               ("grpc_rdma", {"mode": "direct"})],
                         ids=["zerocopy", "rdma_cp", "grpc_rdma-buffered", "grpc_rdma-direct"])
def test_every_fabric_transport_runs_on_the_verbs_backend_of_the_simulated_nic(monkeypatch, name, options):
    """Queue pairs agreed over the control path ('fabric' calls), sources registered through the cache,
    grpc_rdma's immediates delivered natively (no ring): what runs above the device, checked here without
    hardware. The NIC is simulated; that the device works on a real one, this does not show."""
    from transports import Key, TensorSpec

    from .conftest import start_pair

    nic = _FakeNic()
    monkeypatch.setattr(verbs_device, "_pyverbs", lambda: nic.pv)
    pair = start_pair(name, fabric="verbs", **options)
    try:
        sender, receiver = pair
        assert sender.device.name == "verbs" and sender.describe()["used"] == ["rc/mlx5_0:1"]
        spec = TensorSpec("w", (64, 32), np.dtype(np.float32), src=0, dst=1)
        for transport in pair:
            transport.placement.plan([spec])
        for step in range(3):
            tensor = np.full((64, 32), step, np.float32)
            sent = sender.send_async(Key("w", step, 0, 1), tensor)
            np.testing.assert_array_equal(receiver.recv(Key("w", step, 0, 1), timeout=20), tensor)
            sent.result(20)
        if name == "grpc_rdma":
            assert sender.describe()["immediates"] == "native"
        # the queue pairs were agreed over the control path, and every one reached RTS
        assert nic.qps and all(qp.state == 3 for qp in nic.qps.values())
    finally:
        for transport in pair:
            transport.close()
    assert all(transport.device.registrations() == 0 for transport in pair)


def test_simulated_data_and_flag_are_one_completion(simulated):
    nic, (a, b) = simulated
    channel, _ = _connected((a, b))
    target, flag = b.alloc(256), b.alloc(64)
    nic.posted.clear()
    channel.write_flagged(np.full(256, 3, np.uint8), target.export(), np.ones(1, np.uint8), flag.export().at(0, 1))
    data, trailer = nic.posted
    assert not data.send_flags & 2 and trailer.send_flags & 2  # the data unsignaled, the flag's completion waited for
    assert (target.array == 3).all() and flag.array[0] == 1
    assert channel._slots._value == 8  # both send queue entries were freed by the one completion


def test_simulated_accept_takes_a_request_only_from_the_device_it_names(simulated, monkeypatch):
    nic, (a, b) = simulated
    c = VerbsDevice(settings=RdmaSettings(queue_depth=8), lanes_per_peer=2)
    try:
        forged = []

        def exchange(request):  # a's request, but b is told it comes from c's rank
            forged.append(request)
            return b.accept(request, c.address)

        with pytest.raises(FabricError, match="names another device"):
            a.channel(b.address, 0, exchange)
        assert forged and b.registrations() == 0 and len(nic.qps) == 0  # nothing made for it
    finally:
        c.close()


def test_simulated_devices_connecting_to_each_other_at_once_keep_one_connection(simulated):
    nic, (a, b) = simulated
    both_asked = threading.Barrier(2, timeout=10)
    requests = {}

    def exchange_to(target, source):
        def exchange(request):
            requests[source] = request
            both_asked.wait()  # each side has sent its request before either is served
            return target.accept(request, source.address)
        return exchange

    results = {}
    threads = [threading.Thread(target=lambda d=d, t=t: results.__setitem__(d, d.channel(t.address, 0,
                                                                                           exchange_to(t, d))))
               for d, t in ((a, b), (b, a))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    ab, ba = results[a], results[b]
    assert nic.qps[ab.qp_num].peer == ba.qp_num and nic.qps[ba.qp_num].peer == ab.qp_num  # one connection
    assert len(nic.qps) == 4  # two lanes each side, the deferred side's own dropped
    target = b.alloc(64)
    ab.write_flagged(np.full(64, 5, np.uint8), target.export())
    assert (target.array == 5).all()
