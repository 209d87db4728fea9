"""The RDMA_* environment variables of TensorFlow's gRPC+verbs, read, validated and mapped to UCX.

Each variable is checked (a bad value is an error naming the variable and what it
accepts) and mapped to the UCX setting that means the same where there is one. A
setting the UCX build does not know (the InfiniBand ones, on a UCX without IB
transports, as the PyPI wheel here) is reported as having no effect instead of
failing: the README lists which those are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_QUEUE_DEPTH = 1024
_MTUS = (256, 512, 1024, 2048, 4096)


class ConfigError(ValueError):
    """An RDMA_* variable with a value it cannot take."""


@dataclass(frozen=True)
class RdmaConfig:
    """What the variables ask for: UCX settings, and the queue depth the transport honours itself."""

    queue_depth: int = DEFAULT_QUEUE_DEPTH
    ucx: dict[str, str] = field(default_factory=dict)
    #: variables that were set but mean nothing to this fabric, with the reason
    no_effect: dict[str, str] = field(default_factory=dict)


def _integer(env: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    text = env.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number (expected {low} to {high})") from None
    if not low <= value <= high:
        raise ConfigError(f"{name}={value} is out of range (expected {low} to {high})")
    return value


def read_config(env: Mapping[str, str] | None = None, accepts=None) -> RdmaConfig:
    """Read the RDMA_* variables from ``env`` (default: the process environment).

    ``accepts(name, value)`` says whether the UCX in use takes a setting; settings it does not
    take are listed in ``no_effect``.
    """
    env = os.environ if env is None else env
    wanted: dict[str, tuple[str, str, str]] = {}  # UCX name -> (value, variable, what it means)

    device = env.get("RDMA_DEVICE", "").strip()
    port = _integer(env, "RDMA_DEVICE_PORT", 1, 255)
    if device:
        wanted["NET_DEVICES"] = (f"{device}:{port}" if port else device, "RDMA_DEVICE", "device (and port)")
    if (gid := _integer(env, "RDMA_GID_INDEX", 0, 255)) is not None:
        wanted["IB_GID_INDEX"] = (str(gid), "RDMA_GID_INDEX", "GID index")
    if (timeout := _integer(env, "RDMA_QP_TIMEOUT", 0, 31)) is not None:
        # verbs' timeout is an exponent: 4.096 us * 2^timeout
        wanted["RC_TIMEOUT"] = (f"{4.096 * 2**timeout:.3f}us", "RDMA_QP_TIMEOUT", "retransmission timeout")
    if (retries := _integer(env, "RDMA_QP_RETRY_COUNT", 0, 7)) is not None:
        wanted["RC_RETRY_COUNT"] = (str(retries), "RDMA_QP_RETRY_COUNT", "retry count")
    if (sl := _integer(env, "RDMA_QP_SL", 0, 7)) is not None:
        wanted["IB_SL"] = (str(sl), "RDMA_QP_SL", "service level")
    if (tclass := _integer(env, "RDMA_TRAFFIC_CLASS", 0, 255)) is not None:
        wanted["IB_TRAFFIC_CLASS"] = (str(tclass), "RDMA_TRAFFIC_CLASS", "traffic class")
    if (mtu := _integer(env, "RDMA_QP_MTU", 256, 4096)) is not None:
        if mtu not in _MTUS:
            raise ConfigError(f"RDMA_QP_MTU={mtu} is not a verbs MTU (expected one of {', '.join(map(str, _MTUS))})")
        wanted["IB_PATH_MTU"] = (str(mtu), "RDMA_QP_MTU", "path MTU")
    queue_depth = _integer(env, "RDMA_QP_QUEUE_DEPTH", 4, 65536) or DEFAULT_QUEUE_DEPTH

    no_effect: dict[str, str] = {}
    if _integer(env, "RDMA_QP_PKEY_INDEX", 0, 65535) is not None:
        no_effect["RDMA_QP_PKEY_INDEX"] = "UCX selects partition keys by value, not by index"
    if port is not None and not device:
        no_effect["RDMA_DEVICE_PORT"] = "it applies only together with RDMA_DEVICE"
    ucx = {}
    for name, (value, variable, meaning) in wanted.items():
        if accepts is None or accepts(name, value):
            ucx[name] = value
        else:
            no_effect[variable] = f"this UCX has no setting UCX_{name} ({meaning}; it needs InfiniBand transports)"
    return RdmaConfig(queue_depth, ucx, no_effect)
