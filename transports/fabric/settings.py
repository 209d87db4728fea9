"""The RDMA_* environment variables of TensorFlow's gRPC+verbs design note, read and validated once.

Every fabric backend gets the same :class:`RdmaSettings`: verbs applies them to its device, port,
GID and queue pairs; UCX maps each to the UCX setting that means the same where its build has one
(``transports/fabric/ucx/library.py``). A backend reports the variables it cannot honour
(``Device.without_effect``) instead of failing. A bad value is an error naming the variable and
what it accepts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

DEFAULT_QUEUE_DEPTH = 1024
#: the path MTUs verbs knows
MTUS = (256, 512, 1024, 2048, 4096)


class SettingsError(ValueError):
    """An RDMA_* variable with a value it cannot take."""


@dataclass(frozen=True)
class RdmaSettings:
    """What the RDMA_* variables ask for (None: not set, the backend's default)."""

    device: str | None = None  # RDMA_DEVICE: an RDMA device name (mlx5_0); UCX also takes a net device
    port: int | None = None  # RDMA_DEVICE_PORT
    gid_index: int | None = None  # RDMA_GID_INDEX
    pkey_index: int | None = None  # RDMA_QP_PKEY_INDEX
    mtu: int | None = None  # RDMA_QP_MTU, bytes
    timeout: int | None = None  # RDMA_QP_TIMEOUT: verbs' exponent, 4.096 us * 2**timeout
    retry_count: int | None = None  # RDMA_QP_RETRY_COUNT
    service_level: int | None = None  # RDMA_QP_SL
    traffic_class: int | None = None  # RDMA_TRAFFIC_CLASS
    queue_depth: int = DEFAULT_QUEUE_DEPTH  # RDMA_QP_QUEUE_DEPTH: work requests in flight per queue pair

    def given(self) -> dict[str, object]:
        """The variables that were set: RDMA_* name -> value."""
        default = RdmaSettings()
        return {VARIABLES[f.name]: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


#: field -> the variable that sets it
VARIABLES = {
    "device": "RDMA_DEVICE",
    "port": "RDMA_DEVICE_PORT",
    "gid_index": "RDMA_GID_INDEX",
    "pkey_index": "RDMA_QP_PKEY_INDEX",
    "mtu": "RDMA_QP_MTU",
    "timeout": "RDMA_QP_TIMEOUT",
    "retry_count": "RDMA_QP_RETRY_COUNT",
    "service_level": "RDMA_QP_SL",
    "traffic_class": "RDMA_TRAFFIC_CLASS",
    "queue_depth": "RDMA_QP_QUEUE_DEPTH",
}
#: field -> the whole numbers it takes
_RANGES = {
    "port": (1, 255),
    "gid_index": (0, 255),
    "pkey_index": (0, 65535),
    "mtu": (256, 4096),
    "timeout": (0, 31),
    "retry_count": (0, 7),
    "service_level": (0, 7),
    "traffic_class": (0, 255),
    "queue_depth": (4, 65536),
}


def _integer(env: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    text = env.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise SettingsError(f"{name}={text!r} is not a whole number (expected {low} to {high})") from None
    if not low <= value <= high:
        raise SettingsError(f"{name}={value} is out of range (expected {low} to {high})")
    return value


def read_settings(env: Mapping[str, str] | None = None) -> RdmaSettings:
    """The RDMA_* variables of ``env`` (default: the process environment); SettingsError names a bad one."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for field, (low, high) in _RANGES.items():
        value = _integer(env, VARIABLES[field], low, high)
        if value is not None:
            values[field] = value
    if "mtu" in values and values["mtu"] not in MTUS:
        raise SettingsError(f"RDMA_QP_MTU={values['mtu']} is not a verbs MTU "
                            f"(expected one of {', '.join(map(str, MTUS))})")
    device = env.get("RDMA_DEVICE", "").strip()
    if device:
        if not device.replace("_", "").replace("-", "").replace(".", "").isalnum() or len(device) > 64:
            raise SettingsError(f"RDMA_DEVICE={device!r} is not a device name (letters, digits, '_', '-', '.')")
        values["device"] = device
    return RdmaSettings(**values)
