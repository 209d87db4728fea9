"""The RDMA devices of this machine as sysfs shows them, read without pyverbs and without opening a device.

``/sys/class/infiniband/<device>`` holds what a person would look up by hand: ``node_desc``
(``rxe`` for Soft-RoCE), ``node_type``, ``parent`` (a software device's network interface) and per
port ``ports/<n>/``: ``state`` (``4: ACTIVE``), ``phys_state`` (``5: LinkUp``), ``link_layer``
(``Ethernet`` for RoCE, ``InfiniBand``), ``lid``, ``rate``, the GID table ``gids/<i>`` with each
entry's type ``gid_attrs/types/<i>`` (``RoCE v2``; empty entries refuse the read) and network
interface ``gid_attrs/ndevs/<i>``. A RoCE port's active MTU follows its interface's MTU
(``/sys/class/net/<netdev>/mtu``) the way the kernel derives it; an InfiniBand port's comes from
the subnet and is not in sysfs (pyverbs' ``query_port`` or ``ibv_devinfo`` show it).

Reading is a directory walk: cheap enough to run before every command that uses the fabric, and a
machine without ``/sys/class/infiniband`` costs one ``stat``. ``TENSOR_BENCH_RDMA_SYSFS`` points
it at another tree (the tests write fake ones); the network interfaces are read beside it
(``<root>/../net``). :meth:`RdmaDevice.device_info` turns a device into ``verbs/decide.py``'s
:class:`~transports.fabric.verbs.decide.DeviceInfo`, so :func:`gid_choice` picks the port and GID
index exactly as a ``--fabric verbs`` run would (:func:`~transports.fabric.verbs.decide.choose`).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from transports.fabric.base import FabricError
from transports.fabric.settings import MTUS, RdmaSettings
from transports.fabric.verbs.decide import (
    GID_SCAN,
    IBV_LINK_LAYER_ETHERNET,
    IBV_LINK_LAYER_INFINIBAND,
    IBV_PORT_ACTIVE,
    Choice,
    DeviceInfo,
    GidEntry,
    PortInfo,
    choose,
)

#: points the reader at another sysfs tree (its ``infiniband`` class directory)
SYSFS_VARIABLE = "TENSOR_BENCH_RDMA_SYSFS"
DEFAULT_ROOT = "/sys/class/infiniband"
#: what RoCE headers take from the interface's MTU before the IB MTU is chosen (the kernel's iboe_get_mtu:
#: GRH 40, UDP 8, BTH 12, XRC 4, atomic ETH 28, ICRC 4)
ROCE_HEADER_BYTES = 96
#: node_desc prefixes of software devices: Soft-RoCE and soft iWARP
SOFTWARE = {"rxe": "Soft-RoCE", "siw": "soft iWARP"}


@dataclass(frozen=True)
class Gid:
    """A populated entry of a port's GID table: index, the 16 bytes, type (``RoCE v2``, ``RoCE v1``, ``IB``, or
    ``""`` when unreadable) and the network interface it belongs to (RoCE)."""

    index: int
    gid: bytes
    type: str = ""
    netdev: str | None = None

    @property
    def text(self) -> str:
        """The GID as an IPv6 address, compressed (``fe80::5054:ff:fe12:3456``, ``::ffff:10.0.2.15``)."""
        address = ipaddress.IPv6Address(self.gid)
        return f"::ffff:{address.ipv4_mapped}" if address.ipv4_mapped else str(address)


@dataclass(frozen=True)
class Port:
    """One port of an RDMA device as sysfs shows it; ``active_mtu`` is None where sysfs cannot tell (InfiniBand)."""

    device: str
    number: int
    state: int
    state_name: str
    phys_state: str
    link_layer: str
    lid: int
    rate: str
    gids: tuple[Gid, ...] = ()
    netdev: str | None = None
    netdev_mtu: int | None = None
    active_mtu: int | None = None

    @property
    def name(self) -> str:
        """``device:port`` (``rxe0:1``), as UCX and perftest name it."""
        return f"{self.device}:{self.number}"

    @property
    def active(self) -> bool:
        return self.state == IBV_PORT_ACTIVE

    @property
    def ethernet(self) -> bool:
        return self.link_layer == "Ethernet"

    @property
    def kind(self) -> str:
        """``RoCE`` on an Ethernet link layer, else ``InfiniBand``."""
        return "RoCE" if self.ethernet else "InfiniBand"

    @property
    def mtu_text(self) -> str:
        """The active MTU, or why it is not known."""
        if self.active_mtu is not None:
            return f"active MTU {self.active_mtu}"
        if self.ethernet:
            return f"active MTU unknown (no MTU for {self.netdev or 'its interface'})"
        return "active MTU unknown (InfiniBand: the subnet sets it; ibv_devinfo shows it)"

    def port_info(self) -> PortInfo:
        """This port as ``verbs/decide.py`` describes what pyverbs reports."""
        link_layer = IBV_LINK_LAYER_ETHERNET if self.ethernet else IBV_LINK_LAYER_INFINIBAND
        gids = tuple(GidEntry(gid.index, gid.gid, gid.type == "RoCE v2") for gid in self.gids)
        return PortInfo(self.number, self.state, self.lid, link_layer, self.active_mtu or 1024, gids)


@dataclass(frozen=True)
class RdmaDevice:
    """An RDMA device: name, ``node_desc``, ``node_type``, whether it is software (``kind`` then says which) and
    its ports."""

    name: str
    node_desc: str
    node_type: str
    software: bool
    kind: str
    ports: tuple[Port, ...]

    def device_info(self) -> DeviceInfo:
        """This device as ``verbs/decide.py`` describes what pyverbs reports (for :func:`choose`)."""
        return DeviceInfo(self.name, tuple(port.port_info() for port in self.ports))


def sysfs_root(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the devices are read from: ``$TENSOR_BENCH_RDMA_SYSFS``, else ``/sys/class/infiniband``."""
    return Path(environ.get(SYSFS_VARIABLE) or DEFAULT_ROOT)


def loads_modules(modules: Path = Path("/proc/modules")) -> bool:
    """Whether this kernel can load modules (an RDMA driver, ``rdma_rxe``) at all."""
    return modules.exists()


def missing_reason(root: Path | None = None, modules: Path = Path("/proc/modules")) -> str | None:
    """Why there is no RDMA device to read at ``root``, or None when it holds devices."""
    root = sysfs_root() if root is None else root
    if not root.is_dir():
        if not loads_modules(modules):
            return (f"{root} does not exist: this kernel has no RDMA support built in and cannot load a driver "
                    f"(no {modules})")
        return f"{root} does not exist (no RDMA driver loaded)"
    if not any(root.iterdir()):
        return f"{root} is empty (an RDMA driver is loaded, but it found no device)"
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):  # empty GID entries refuse reads of their type (EINVAL)
        return None


def _numbered(text: str | None) -> tuple[int, str]:
    """``4: ACTIVE`` -> (4, ``ACTIVE``); (0, ``unknown``) when unreadable."""
    number, _, name = (text or "").partition(":")
    try:
        return int(number), name.strip() or number.strip()
    except ValueError:
        return 0, text or "unknown"


def _indexes(directory: Path) -> list[int]:
    try:
        return sorted(int(entry.name) for entry in directory.iterdir() if entry.name.isdigit())
    except OSError:
        return []


def active_mtu(netdev_mtu: int) -> int:
    """The IB MTU a RoCE port gets on an interface of ``netdev_mtu`` bytes: the largest of 256 ... 4096 that fits
    beside the RoCE headers (1500 -> 1024, 9000 -> 4096); 256 below that."""
    payload = netdev_mtu - ROCE_HEADER_BYTES
    return max((mtu for mtu in MTUS if mtu <= payload), default=MTUS[0])


def _gids(port_dir: Path, link_layer: str, gid_index: int | None) -> tuple[Gid, ...]:
    """The populated GID entries among the first :data:`GID_SCAN` (and ``gid_index``): what a verbs run looks at."""
    wanted = [index for index in _indexes(port_dir / "gids") if index < GID_SCAN or index == gid_index]
    found = []
    for index in wanted:
        text = _read(port_dir / "gids" / str(index))
        try:
            gid = bytes.fromhex((text or "").replace(":", ""))
        except ValueError:
            continue
        if len(gid) != 16 or not any(gid):
            continue
        kind = _read(port_dir / "gid_attrs" / "types" / str(index)) or ""
        if kind == "IB/RoCE v1":  # the kernel's one name for both
            kind = "RoCE v1" if link_layer == "Ethernet" else "IB"
        netdev = _read(port_dir / "gid_attrs" / "ndevs" / str(index)) or None
        found.append(Gid(index, gid, kind, netdev))
    return tuple(found)


def _netdev_of(device_dir: Path, gids: tuple[Gid, ...]) -> str | None:
    """The network interface under a RoCE port: its GIDs', else the device's ``parent`` (Soft-RoCE), else the one
    interface of its PCI function."""
    named = next((gid.netdev for gid in gids if gid.netdev), None)
    if named:
        return named
    if parent := _read(device_dir / "parent"):
        return parent
    try:
        interfaces = sorted(entry.name for entry in (device_dir / "device" / "net").iterdir())
    except OSError:
        return None
    return interfaces[0] if len(interfaces) == 1 else None


def read_port(device_dir: Path, number: int, net: Path, gid_index: int | None = None) -> Port:
    """Port ``number`` of the device at ``device_dir``; ``net`` holds the network interfaces (``/sys/class/net``)."""
    port_dir = device_dir / "ports" / str(number)
    state, state_name = _numbered(_read(port_dir / "state"))
    phys = _numbered(_read(port_dir / "phys_state"))[1]
    link_layer = _read(port_dir / "link_layer") or "InfiniBand"
    try:
        lid = int(_read(port_dir / "lid") or "0", 16)
    except ValueError:
        lid = 0
    gids = _gids(port_dir, link_layer, gid_index)
    netdev = netdev_mtu = mtu = None
    if link_layer == "Ethernet":
        netdev = _netdev_of(device_dir, gids)
        if netdev is not None:
            try:
                netdev_mtu = int(_read(net / netdev / "mtu") or "")
            except ValueError:
                netdev_mtu = None
        mtu = None if netdev_mtu is None else active_mtu(netdev_mtu)
    return Port(device_dir.name, number, state, state_name, phys, link_layer, lid, _read(port_dir / "rate") or "",
                gids, netdev, netdev_mtu, mtu)


def _software(device_dir: Path, node_desc: str, node_type: str) -> tuple[bool, str]:
    prefix = node_desc.split()[0].lower() if node_desc.split() else ""
    if prefix in SOFTWARE:
        return True, SOFTWARE[prefix]
    if "/devices/virtual/" in str(device_dir.resolve()):  # no PCI function under it
        return True, "software"
    return False, "iWARP" if node_type.startswith("4") else "hardware"


def read_devices(root: Path | str | None = None, net: Path | str | None = None,
                 gid_index: int | None = None) -> list[RdmaDevice]:
    """Every RDMA device under ``root`` (default :func:`sysfs_root`), in name order; none when it does not exist.

    ``net``: the network interfaces' class directory (default ``<root>/../net``); ``gid_index``: a GID entry to
    read beyond the first :data:`GID_SCAN` (RDMA_GID_INDEX).
    """
    root = sysfs_root() if root is None else Path(root)
    net = root.parent / "net" if net is None else Path(net)
    try:
        names = sorted(entry.name for entry in root.iterdir())
    except OSError:
        return []
    devices = []
    for name in names:
        device_dir = root / name
        node_desc = _read(device_dir / "node_desc") or ""
        node_type = _read(device_dir / "node_type") or ""
        software, kind = _software(device_dir, node_desc, node_type)
        ports = tuple(read_port(device_dir, number, net, gid_index) for number in _indexes(device_dir / "ports"))
        devices.append(RdmaDevice(name, node_desc, node_type, software, kind, ports))
    return devices


def active_ports(devices: list[RdmaDevice]) -> list[Port]:
    """The ports in state ACTIVE, in device and port order."""
    return [port for device in devices for port in device.ports if port.active]


def gid_choice(devices: list[RdmaDevice], settings: RdmaSettings | None = None,
               port: Port | None = None) -> Choice | str:
    """What a ``--fabric verbs`` run would use (device, port, GID index), or the run's error as a line.

    ``port``: decide for that port, as if RDMA_DEVICE and RDMA_DEVICE_PORT named it (the other RDMA_*
    variables in ``settings`` still apply: RDMA_GID_INDEX picks the GID).
    """
    settings = settings or RdmaSettings()
    if port is not None:
        settings = replace(settings, device=port.device, port=port.number)
    try:
        return choose([device.device_info() for device in devices], settings)
    except FabricError as exc:
        return str(exc)
