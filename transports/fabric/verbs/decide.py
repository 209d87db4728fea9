"""What the ``verbs`` fabric decides without hardware, as pure functions over plain data.

The device (``device.py``) queries pyverbs and describes what the hardware reported with
:class:`DeviceInfo`, :class:`PortInfo` and :class:`GidEntry`; everything it then decides is here,
unit-tested on a machine without an RDMA NIC:

* which device, port and GID index to use (:func:`choose`), from RDMA_DEVICE, RDMA_DEVICE_PORT
  and RDMA_GID_INDEX, with errors that name the variable and what exists;
* the queue-pair attributes of the INIT, RTR and RTS transitions (:func:`init_attributes`,
  :func:`rtr_attributes`, :func:`rts_attributes`) as plain :class:`QpAttributes`;
* the connection exchange: the device address (:func:`encode_address`, :func:`decode_address`)
  and the connect request and reply (:func:`connect_request`, :func:`parse_request`,
  :func:`connect_reply`, :func:`parse_reply`), parsed strictly: they come from another process;
* the paper's Table 1 mapping (section 3.1): each peer gets ``num_qps_per_peer`` (here
  ``lanes_per_peer``) RC queue pairs, spread round-robin over ``num_cqs`` (here
  ``progress_threads``) completion queues, each polled by its own progress thread
  (:func:`qp_index`, :func:`cq_index`), and a large write split over the lanes (:func:`spread`);
* the reasons the backend is unavailable (:func:`no_device_reason`, :func:`inactive_reason`).

Enum values (port states, MTUs, access flags, attribute masks) are those of ``<infiniband/verbs.h>``,
which pyverbs re-exports under the same names; the tests check that they agree.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass
from typing import Any

from transports.fabric.base import FabricError
from transports.fabric.settings import MTUS, RdmaSettings

# <infiniband/verbs.h> values (pyverbs.enums has the same names)
IBV_PORT_ACTIVE = 4
IBV_LINK_LAYER_INFINIBAND = 1
IBV_LINK_LAYER_ETHERNET = 2
IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS = 1, 2, 3
IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ = 1, 2, 4
IBV_QP_STATE = 1 << 0
IBV_QP_ACCESS_FLAGS = 1 << 3
IBV_QP_PKEY_INDEX = 1 << 4
IBV_QP_PORT = 1 << 5
IBV_QP_AV = 1 << 7
IBV_QP_PATH_MTU = 1 << 8
IBV_QP_TIMEOUT = 1 << 9
IBV_QP_RETRY_CNT = 1 << 10
IBV_QP_RNR_RETRY = 1 << 11
IBV_QP_RQ_PSN = 1 << 12
IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13
IBV_QP_MIN_RNR_TIMER = 1 << 15
IBV_QP_SQ_PSN = 1 << 16
IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17
IBV_QP_DEST_QPN = 1 << 20

#: enum ibv_mtu -> bytes
MTU_BYTES = dict(enumerate(MTUS, start=1))
#: link layer value -> the name ibv_devinfo prints
LINK_LAYERS = {IBV_LINK_LAYER_INFINIBAND: "InfiniBand", IBV_LINK_LAYER_ETHERNET: "Ethernet"}
#: path MTU in bytes -> enum ibv_mtu (IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5)
MTU_ENUM = {mtu: index for index, mtu in MTU_BYTES.items()}
#: what peers may do with registered memory: nothing beyond one-sided writes and reads (no atomics)
ACCESS_FLAGS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ

#: RDMA_QP_TIMEOUT when unset: 4.096 us * 2**14, about 67 ms before a retransmission
DEFAULT_TIMEOUT = 14
#: RDMA_QP_RETRY_COUNT when unset: the most verbs allows
DEFAULT_RETRY_COUNT = 7
#: retries after "receiver not ready" (no receive posted for an immediate): 6, the most short of forever (7), so a
#: receiver that stops posting receives fails the sender's transfer (IBV_WC_RNR_RETRY_EXC_ERR) instead of hanging it
RNR_RETRY = 6
#: how long a receiver without a posted receive tells the sender to wait (31: 491.52 ms): with RNR_RETRY, a
#: receiver gets about 3 s to post receives again before the transfer fails
MIN_RNR_TIMER = 31
#: hops a globally routed (RoCE, or InfiniBand with RDMA_GID_INDEX) packet may take
HOP_LIMIT = 64
#: outstanding RDMA reads per queue pair asked for (capped by what both devices allow)
RD_ATOMIC = 16
#: the GID table entries looked at when RDMA_GID_INDEX is unset (the RoCE ones come first)
GID_SCAN = 32

#: the device address: magic, 16-byte instance id, lid, port, link layer, mtu, rd_atomic, 16-byte gid
_ADDRESS = struct.Struct("<4s16sHBBHB16s")
_MAGIC = b"TTV1"
#: queue pair numbers and packet sequence numbers are 24-bit
QPN_LIMIT = PSN_LIMIT = 2**24


# -- what the hardware reported ---------------------------------------------------------------------


@dataclass(frozen=True)
class GidEntry:
    """One populated entry of a port's GID table: its index, the 16-byte GID, whether it is RoCE v2."""

    index: int
    gid: bytes
    roce_v2: bool = False

    @property
    def ipv4_mapped(self) -> bool:
        """Whether the GID is an IPv4 address (``::ffff:a.b.c.d``), what RoCE v2 routes best."""
        return self.gid[:12] == bytes(10) + b"\xff\xff"


@dataclass(frozen=True)
class PortInfo:
    """A port as ``query_port`` reported it (``active_mtu`` in bytes) and its GID entries."""

    number: int
    state: int
    lid: int
    link_layer: int
    active_mtu: int
    gids: tuple[GidEntry, ...] = ()
    pkey_table_length: int = 1

    @property
    def active(self) -> bool:
        return self.state == IBV_PORT_ACTIVE



@dataclass(frozen=True)
class DeviceInfo:
    """An RDMA device by name, with its ports."""

    name: str
    ports: tuple[PortInfo, ...]


@dataclass(frozen=True)
class Choice:
    """The device, port and GID this process uses.

    ``gid_index`` is None for LID routing (InfiniBand without RDMA_GID_INDEX); ``gid`` is still the
    port's GID 0 then, sent to peers in the device address.
    """

    device: str
    port: int
    lid: int
    link_layer: int
    mtu: int
    gid_index: int | None
    gid: bytes
    pkey_index: int = 0

    @property
    def is_global(self) -> bool:
        """Whether packets carry a global routing header (always on RoCE)."""
        return self.gid_index is not None

    @property
    def link_layer_name(self) -> str:
        return LINK_LAYERS.get(self.link_layer, "InfiniBand")


def _names(items) -> str:
    return ", ".join(str(item) for item in items) or "none"


def choose(devices: list[DeviceInfo], settings: RdmaSettings) -> Choice:
    """The device, port and GID index to use; FabricError names the variable at fault and what exists.

    Device: RDMA_DEVICE, else the first device with an active port (the one RDMA_DEVICE_PORT
    names, if set). Port: RDMA_DEVICE_PORT, else the device's first active port. GID:
    RDMA_GID_INDEX, else on RoCE the first RoCE v2 entry holding an IPv4 address (else the first
    RoCE v2 entry, else the first entry), on InfiniBand none (LID routing).
    """
    if not devices:
        raise FabricError("verbs: no RDMA device found")
    if settings.device is not None:
        matching = [device for device in devices if device.name == settings.device]
        if not matching:
            raise FabricError(f"RDMA_DEVICE={settings.device} is not one of the RDMA devices here: "
                              f"{_names(device.name for device in devices)}")
        candidates = matching
    else:
        candidates = devices
    for device in candidates:
        ports = {port.number: port for port in device.ports}
        if settings.port is not None:
            port = ports.get(settings.port)
            if port is None or not port.active:
                if settings.device is None:
                    continue
                if port is None:
                    raise FabricError(f"RDMA_DEVICE_PORT={settings.port} is not a port of {device.name} "
                                      f"(its ports: {_names(ports)})")
                raise FabricError(f"RDMA_DEVICE_PORT={settings.port}: port {settings.port} of {device.name} is not "
                                  f"active (active ports: {_names(p.number for p in device.ports if p.active)})")
        else:
            active = [p for p in device.ports if p.active]
            if not active:
                if settings.device is None:
                    continue
                raise FabricError(f"RDMA_DEVICE={device.name} has no active port ({inactive_reason([device])})")
            port = active[0]
        return _with_gid(device, port, settings)
    if settings.port is not None:
        raise FabricError(f"RDMA_DEVICE_PORT={settings.port}: no RDMA device here has that port active "
                          f"({inactive_reason(devices) or 'devices: ' + _names(d.name for d in devices)})")
    raise FabricError(f"verbs: {inactive_reason(devices)}")


def _with_gid(device: DeviceInfo, port: PortInfo, settings: RdmaSettings) -> Choice:
    pkey_index = settings.pkey_index or 0
    if pkey_index >= port.pkey_table_length:
        raise FabricError(f"RDMA_QP_PKEY_INDEX={pkey_index} is beyond the partition key table of {device.name} "
                          f"port {port.number} ({port.pkey_table_length} entries)")
    gids = {entry.index: entry for entry in port.gids if any(entry.gid)}
    if settings.gid_index is not None:
        entry = gids.get(settings.gid_index)
        if entry is None:
            raise FabricError(f"RDMA_GID_INDEX={settings.gid_index} is not a valid GID of {device.name} port "
                              f"{port.number} (valid indexes: {_names(sorted(gids))})")
        gid_index: int | None = entry.index
    elif port.link_layer == IBV_LINK_LAYER_ETHERNET:
        entries = sorted(gids.values(), key=lambda e: e.index)
        ranked = ([e for e in entries if e.roce_v2 and e.ipv4_mapped] + [e for e in entries if e.roce_v2]
                  + entries)
        if not ranked:
            raise FabricError(f"verbs: {device.name} port {port.number} (RoCE) has no GID: give its interface an "
                              f"IP address, or set RDMA_GID_INDEX")
        entry, gid_index = ranked[0], ranked[0].index
    else:
        entry = gids.get(0) or GidEntry(0, bytes(16))
        gid_index = None
    return Choice(device.name, port.number, port.lid, port.link_layer, port.active_mtu, gid_index, entry.gid,
                  pkey_index)


def perftest_arguments(settings: RdmaSettings) -> tuple[str, ...]:
    """perftest's options (``ib_write_bw -d DEVICE -i PORT -x GID_INDEX``) for the RDMA_* variables that are set."""
    arguments: list[str] = []
    for option, value in (("-d", settings.device), ("-i", settings.port), ("-x", settings.gid_index)):
        if value is not None:
            arguments += [option, str(value)]
    return tuple(arguments)


def no_device_reason(detail: str) -> str:
    """Why verbs cannot run: no device at all (``detail``: what pyverbs said)."""
    return f"no RDMA device found ({detail})"


def inactive_reason(devices: list[DeviceInfo]) -> str | None:
    """None if some device has an active port, else a line naming each device and its ports' states."""
    if any(port.active for device in devices for port in device.ports):
        return None
    states = {1: "down", 2: "init", 3: "armed", 5: "active-defer"}
    parts = []
    for device in devices:
        ports = ", ".join(f"port {p.number} {states.get(p.state, f'state {p.state}')}" for p in device.ports)
        parts.append(f"{device.name} ({ports or 'no ports'})")
    return f"no RDMA device has an active port: {'; '.join(parts)}"


# -- queue-pair attributes ------------------------------------------------------------------------


@dataclass(frozen=True)
class AddressHandle:
    """The fields of pyverbs' ``AHAttr`` (and, when ``is_global``, of its ``GlobalRoute``)."""

    port_num: int
    dlid: int
    sl: int
    is_global: bool
    dgid: bytes = bytes(16)
    sgid_index: int = 0
    hop_limit: int = HOP_LIMIT
    traffic_class: int = 0

    @property
    def dgid_text(self) -> str:
        """The destination GID as pyverbs' ``GID.gid`` writes it (eight groups of four hex digits)."""
        return gid_text(self.dgid)


@dataclass(frozen=True)
class QpAttributes:
    """One state transition of a queue pair: pyverbs ``QPAttr`` field name -> value, the address
    handle (RTR only) and the ``ibv_qp_attr_mask`` of the fields set (``QP.modify(attr, mask)``)."""

    fields: dict[str, int]
    mask: int
    ah: AddressHandle | None = None


def gid_text(gid: bytes) -> str:
    """``fe80:0000:...`` from 16 GID bytes, the form pyverbs' ``GID.gid`` takes and gives."""
    return ":".join(gid[i : i + 2].hex() for i in range(0, 16, 2))


def gid_bytes(text: str) -> bytes:
    """The 16 bytes of a GID in pyverbs' text form; ValueError if it is not one."""
    digits = text.replace(":", "")
    if len(digits) != 32:
        raise ValueError(f"'{text}' is not a GID (eight groups of four hex digits)")
    return bytes.fromhex(digits)


def init_attributes(choice: Choice) -> QpAttributes:
    """RESET -> INIT: the port, the partition key index and what the peer may do (write and read)."""
    fields = {"qp_state": IBV_QPS_INIT, "pkey_index": choice.pkey_index, "port_num": choice.port,
              "qp_access_flags": ACCESS_FLAGS}
    return QpAttributes(fields, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)


def path_mtu(choice: Choice, remote: DeviceAddress, settings: RdmaSettings) -> int:
    """The path MTU in bytes: the smallest of RDMA_QP_MTU and both ports' active MTUs."""
    return min(settings.mtu or max(MTUS), choice.mtu, remote.mtu)


def rtr_attributes(choice: Choice, remote: DeviceAddress, remote_lane: LaneEndpoint, rd_atomic: int,
                   settings: RdmaSettings) -> QpAttributes:
    """INIT -> RTR (ready to receive): the peer's queue pair, its first PSN and how to reach it.

    ``rd_atomic``: the RDMA reads this device serves at once per queue pair (``max_dest_rd_atomic``).
    The address handle routes by LID on InfiniBand; with a global header (RoCE, or RDMA_GID_INDEX
    given) it carries the peer's GID, our GID index, RDMA_TRAFFIC_CLASS and a hop limit.
    """
    if remote.link_layer != choice.link_layer:
        raise FabricError(f"verbs: cannot connect {choice.link_layer_name} port {choice.device}:{choice.port} "
                          f"to a peer on {LINK_LAYERS[remote.link_layer]}")
    ah = AddressHandle(port_num=choice.port, dlid=remote.lid, sl=settings.service_level or 0,
                       is_global=choice.is_global, dgid=remote.gid if choice.is_global else bytes(16),
                       sgid_index=choice.gid_index or 0, hop_limit=HOP_LIMIT if choice.is_global else 0,
                       traffic_class=(settings.traffic_class or 0) if choice.is_global else 0)
    fields = {"qp_state": IBV_QPS_RTR, "path_mtu": MTU_ENUM[path_mtu(choice, remote, settings)],
              "dest_qp_num": remote_lane.qp_num, "rq_psn": remote_lane.psn, "max_dest_rd_atomic": rd_atomic,
              "min_rnr_timer": MIN_RNR_TIMER}
    mask = (IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)
    return QpAttributes(fields, mask, ah)



def rts_attributes(local_psn: int, remote: DeviceAddress, rd_atomic: int, settings: RdmaSettings) -> QpAttributes:
    """RTR -> RTS (ready to send): our first PSN, retransmission timeout and retries, and the RDMA
    reads in flight at once (``max_rd_atomic``: at most what the peer serves, ``remote.rd_atomic``)."""
    fields = {"qp_state": IBV_QPS_RTS, "sq_psn": local_psn,
              "timeout": DEFAULT_TIMEOUT if settings.timeout is None else settings.timeout,
              "retry_cnt": DEFAULT_RETRY_COUNT if settings.retry_count is None else settings.retry_count,
              "rnr_retry": RNR_RETRY, "max_rd_atomic": min(rd_atomic, remote.rd_atomic)}
    mask = (IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY
            | IBV_QP_MAX_QP_RD_ATOMIC)
    return QpAttributes(fields, mask)


def rd_atomic_limit(max_qp_rd_atom: int, max_qp_init_rd_atom: int) -> int:
    """The outstanding RDMA reads per queue pair this device asks for: :data:`RD_ATOMIC`, within its limits."""
    return max(1, min(RD_ATOMIC, max_qp_rd_atom, max_qp_init_rd_atom))


# -- the connection exchange -------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceAddress:
    """What a peer needs to reach this device (sent over the control path as :func:`encode_address`).

    ``instance``: 16 random bytes, so that two devices (two processes, or a reopened one) are told
    apart even on the same port; ``rd_atomic``: the RDMA reads it serves at once per queue pair.
    """

    instance: bytes
    lid: int
    port: int
    link_layer: int
    mtu: int
    rd_atomic: int
    gid: bytes


def new_address(choice: Choice, rd_atomic: int) -> DeviceAddress:
    """The address of a device just opened on ``choice``, with a fresh instance id."""
    return DeviceAddress(secrets.token_bytes(16), choice.lid, choice.port, choice.link_layer, choice.mtu, rd_atomic,
                         choice.gid)


def encode_address(address: DeviceAddress) -> bytes:
    return _ADDRESS.pack(_MAGIC, address.instance, address.lid, address.port, address.link_layer, address.mtu,
                         address.rd_atomic, address.gid)


def decode_address(data: Any) -> DeviceAddress:
    """The address a peer sent (:func:`encode_address`); ValueError says what is wrong with it."""
    if not isinstance(data, bytes | bytearray):
        raise ValueError(f"a verbs device address must be bytes, not {type(data).__name__}")
    if len(data) != _ADDRESS.size:
        raise ValueError(f"a verbs device address has {_ADDRESS.size} bytes, not {len(data)} "
                         f"(is the peer on another fabric?)")
    magic, instance, lid, port, link_layer, mtu, rd_atomic, gid = _ADDRESS.unpack(bytes(data))
    if magic != _MAGIC:
        raise ValueError(f"a verbs device address starts with {_MAGIC!r}, not {magic!r}")
    if link_layer not in LINK_LAYERS:
        raise ValueError(f"a verbs device address has an unknown link layer {link_layer}")
    if mtu not in MTUS:
        raise ValueError(f"a verbs device address has MTU {mtu}, not one of {_names(MTUS)}")
    if port < 1:
        raise ValueError("a verbs device address has port 0 (ports count from 1)")
    if rd_atomic < 1:
        raise ValueError("a verbs device address serves no RDMA reads (rd_atomic 0)")
    return DeviceAddress(instance, lid, port, link_layer, mtu, rd_atomic, gid)


@dataclass(frozen=True)
class LaneEndpoint:
    """One side of one lane's queue-pair connection: the queue pair number and its first PSN."""

    qp_num: int
    psn: int

    def to_json(self) -> dict[str, int]:
        return {"qp_num": self.qp_num, "psn": self.psn}


def new_psn() -> int:
    """A random first packet sequence number (24 bits)."""
    return secrets.randbelow(PSN_LIMIT)


def connect_request(address: bytes, lanes: list[LaneEndpoint]) -> dict[str, Any]:
    """What :meth:`Device.channel` sends to the peer's ``accept``: our address (hex) and our queue pairs."""
    return {"verbs": 1, "address": address.hex(), "lanes": [lane.to_json() for lane in lanes]}


def connect_reply(lanes: list[LaneEndpoint]) -> dict[str, Any]:
    """What ``accept`` answers: its queue pairs, lane by lane."""
    return {"verbs": 1, "lanes": [lane.to_json() for lane in lanes]}


def connect_deferral() -> dict[str, Any]:
    """What ``accept`` answers a peer it is connected to, or connecting to itself and :func:`wins`: "drop your
    queue pairs, mine are on their way" (the requester then takes the connection the other side makes)."""
    return {"verbs": 1, "defer": True}


def wins(ours: bytes, theirs: bytes) -> bool:
    """Whether this device's connection stands when two devices connect to each other at once: the smaller
    address's (both sides compare the same two addresses, so exactly one wins)."""
    return ours < theirs


def _lanes(data: Any, lanes_per_peer: int, what: str) -> list[LaneEndpoint]:
    lanes = data.get("lanes")
    if not isinstance(lanes, list):
        raise ValueError(f"a verbs {what}'s 'lanes' must be a list")
    if len(lanes) != lanes_per_peer:
        raise ValueError(f"a verbs {what} has {len(lanes)} lanes, this device {lanes_per_peer} "
                         f"(both ends must use the same lanes per peer)")
    parsed = []
    for index, lane in enumerate(lanes):
        if not isinstance(lane, dict) or set(lane) != {"qp_num", "psn"}:
            raise ValueError(f"lane {index} of a verbs {what} must be an object with exactly 'qp_num' and 'psn'")
        for name, limit in (("qp_num", QPN_LIMIT), ("psn", PSN_LIMIT)):
            value = lane[name]
            if type(value) is not int or not 0 <= value < limit:
                raise ValueError(f"lane {index} of a verbs {what}: '{name}' must be an integer in [0, 2**24), "
                                 f"not {value!r:.40}")
        parsed.append(LaneEndpoint(lane["qp_num"], lane["psn"]))
    return parsed


def _envelope(data: Any, keys: set[str], what: str) -> None:
    if not isinstance(data, dict) or set(data) != keys:
        raise ValueError(f"a verbs {what} must be an object with exactly {_names(sorted(repr(k) for k in keys))}")
    if data["verbs"] != 1 or type(data["verbs"]) is not int:
        raise ValueError(f"a verbs {what} of version {data['verbs']!r:.20} (this side speaks version 1)")


def parse_request(data: Any, lanes_per_peer: int) -> tuple[bytes, DeviceAddress, list[LaneEndpoint]]:
    """The requester's address (raw and decoded) and queue pairs; ValueError says what is wrong."""
    _envelope(data, {"verbs", "address", "lanes"}, "connect request")
    # the address the requester's control server gave (checked there: transports/peer_input.py) and the
    # device compares: bounded here by a verbs address's own fixed size, no limit of its own
    text = data["address"]
    if not isinstance(text, str) or not 0 < len(text) <= 2 * _ADDRESS.size:
        raise ValueError(f"a verbs connect request's 'address' must be a hex string of 1 to {_ADDRESS.size} bytes")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise ValueError("a verbs connect request's 'address' is not hex") from None
    return raw, decode_address(raw), _lanes(data, lanes_per_peer, "connect request")


def parse_reply(data: Any, lanes_per_peer: int) -> list[LaneEndpoint] | None:
    """The accepting peer's queue pairs, lane by lane, or None when it deferred (:func:`connect_deferral`);
    ValueError says what is wrong."""
    if isinstance(data, dict) and "defer" in data:
        _envelope(data, {"verbs", "defer"}, "connect reply")
        if data["defer"] is not True:
            raise ValueError(f"a verbs connect reply's 'defer' must be true, not {data['defer']!r:.20}")
        return None
    _envelope(data, {"verbs", "lanes"}, "connect reply")
    return _lanes(data, lanes_per_peer, "connect reply")


# -- lanes, queue pairs and completion queues -----------------------------------------------------------


def qp_index(lane: int, lanes_per_peer: int) -> int:
    """The queue pair (of a peer's ``num_qps_per_peer``) that carries ``lane``."""
    if lane < 0:
        raise ValueError(f"lane {lane} is negative")
    return lane % lanes_per_peer


def cq_index(qp: int, progress_threads: int) -> int:
    """The completion queue (of ``num_cqs``, one per progress thread) of a peer's queue pair ``qp``: round-robin."""
    return qp % progress_threads


def spread(nbytes: int, parts: int, alignment: int = 64) -> list[tuple[int, int]]:
    """``nbytes`` cut into at most ``parts`` (offset, length) pieces of ``alignment``-multiple size, in order.

    Each lane writes one piece; the last piece takes the remainder, and no piece is empty.
    """
    if nbytes <= 0 or parts <= 1:
        return [(0, nbytes)] if nbytes > 0 else []
    size = -(-nbytes // parts)
    size = -(-size // alignment) * alignment
    return [(offset, min(size, nbytes - offset)) for offset in range(0, nbytes, size)]

