"""The verbs fabric's discovery: pyverbs imported (only when a device is opened or asked whether it can run, so the
backend's modules import without it), the RDMA devices here described (ports, GIDs) for ``decide.py`` to choose
from, queue-pair attributes and completion statuses in pyverbs' terms."""

from __future__ import annotations

import importlib
import importlib.metadata
from types import SimpleNamespace

from transports.fabric.base import FabricError
from transports.fabric.verbs.decide import (
    GID_SCAN,
    MTU_BYTES,
    DeviceInfo,
    GidEntry,
    PortInfo,
    QpAttributes,
    gid_bytes,
    no_device_reason,
)

PYVERBS_MISSING = ("pyverbs is not installed: pip install -e '.[verbs]' (PyPI's pyverbs needs rdma-core 59 or newer), "
                   "or Debian's python3-pyverbs with tools/use-system-pyverbs")

_MODULES = ("addr", "cq", "device", "enums", "mr", "pd", "qp", "wr", "pyverbs_error")


def _pyverbs() -> SimpleNamespace:
    """pyverbs' modules by short name; ImportError if pyverbs is not installed."""
    return SimpleNamespace(**{name: importlib.import_module(f"pyverbs.{name}") for name in _MODULES})


def _pyverbs_version() -> str | None:
    try:
        return importlib.metadata.version("pyverbs")
    except importlib.metadata.PackageNotFoundError:
        return None


def _gid_entry(pv: SimpleNamespace, context, port: int, index: int) -> GidEntry | None:
    """GID ``index`` of ``port``, or None if the entry is empty or cannot be read."""
    try:
        gid = gid_bytes(context.query_gid(port, index).gid)
    except (pv.pyverbs_error.PyverbsError, ValueError):
        return None
    if not any(gid):
        return None
    try:
        roce_v2 = context.query_gid_type(port, index) == pv.enums.IBV_GID_TYPE_SYSFS_ROCE_V2
    except (pv.pyverbs_error.PyverbsError, AttributeError):
        roce_v2 = False
    return GidEntry(index, gid, roce_v2)


def _describe_device(pv: SimpleNamespace, context, name: str, gid_index: int | None) -> DeviceInfo:
    """What ``context`` reports of its ports: states, LIDs, link layers, MTUs, GID tables (in part)."""
    ports = []
    for number in range(1, context.query_device().phys_port_cnt + 1):
        attr = context.query_port(number)
        indexes = set(range(min(attr.gid_tbl_len, GID_SCAN)))
        if gid_index is not None and gid_index < attr.gid_tbl_len:
            indexes.add(gid_index)
        gids = tuple(entry for index in sorted(indexes) if (entry := _gid_entry(pv, context, number, index)))
        ports.append(PortInfo(number, attr.state, attr.lid, attr.link_layer, MTU_BYTES.get(attr.active_mtu, 1024),
                              gids, attr.pkey_tbl_len))
    return DeviceInfo(name, tuple(ports))


def _hardware(pv: SimpleNamespace, gid_index: int | None = None) -> list[DeviceInfo]:
    """Every RDMA device here, described; FabricError when there is none or one cannot be opened."""
    try:
        devices = pv.device.get_device_list()
    except pv.pyverbs_error.PyverbsError as exc:
        raise FabricError(no_device_reason(f"{exc}: no RDMA driver loaded? ibv_devices lists them")) from None
    if not devices:
        raise FabricError(no_device_reason("the device list is empty; ibv_devices lists them"))
    found = []
    for device in devices:
        name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
        try:
            with pv.device.Context(name=name) as context:
                found.append(_describe_device(pv, context, name, gid_index))
        except pv.pyverbs_error.PyverbsError as exc:
            raise FabricError(f"verbs: cannot open RDMA device {name}: {exc} "
                              f"(permission on /dev/infiniband?)") from None
    return found


def qp_attr(pv: SimpleNamespace, attributes: QpAttributes):
    """The pyverbs ``QPAttr`` of a transition that ``decide.py`` describes as plain data."""
    attr = pv.qp.QPAttr(qp_state=attributes.fields["qp_state"])
    for name, value in attributes.fields.items():
        setattr(attr, name, value)
    ah = attributes.ah
    if ah is not None:
        if ah.is_global:
            dgid = pv.addr.GID()
            dgid.gid = ah.dgid_text
            route = pv.addr.GlobalRoute(dgid=dgid, sgid_index=ah.sgid_index, hop_limit=ah.hop_limit,
                                        traffic_class=ah.traffic_class)
            attr.ah_attr = pv.addr.AHAttr(gr=route, is_global=1, port_num=ah.port_num, dlid=ah.dlid, sl=ah.sl)
        else:
            attr.ah_attr = pv.addr.AHAttr(is_global=0, port_num=ah.port_num, dlid=ah.dlid, sl=ah.sl)
    return attr


def _status_text(pv: SimpleNamespace, status: int, vendor_error: int) -> str:
    try:
        name = pv.enums.ibv_wc_status(status).name
    except ValueError:
        name = f"status {status}"
    return f"{pv.cq.cqe_status_to_str(status)} ({name}, vendor error {vendor_error:#x})"
