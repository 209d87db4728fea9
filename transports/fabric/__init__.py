"""The fabric: the paper's "RDMA device" (its Table 1), one interface over backends opened by name.

- ``ucx``: UCX's UCP through cffi (``transports/fabric/ucx``): shared memory and TCP where there
  is no RDMA NIC; real RDMA with a UCX built with verbs.
- ``verbs``: rdma-core's pyverbs (``transports/fabric/verbs``): RC queue pairs on an RDMA NIC
  (InfiniBand, RoCE).

Everything above the fabric opens a device with :func:`open_device` and uses the
:class:`~transports.fabric.base.Device` interface; nothing outside ``transports/fabric/`` imports a
backend module. Backends are imported only when asked for, so one whose library is missing
reports itself unavailable (:func:`availability`, ``bench info``) instead of breaking imports.
"""

from __future__ import annotations

import contextlib
from typing import Any

from transports.common import Availability, Registry
from transports.fabric.base import Device, FabricError
from transports.fabric.settings import RdmaSettings


class UnknownFabric(ValueError):
    """A fabric backend name that is not registered."""


#: name -> the Device class of each backend, ``module:class``; the first is the default
BACKENDS = Registry("fabric", {
    "ucx": "transports.fabric.ucx.device:UcxDevice",
    "verbs": "transports.fabric.verbs.device:VerbsDevice",
}, unknown=UnknownFabric)
DEFAULT = "ucx"


def names() -> list[str]:
    """Every registered backend name."""
    return BACKENDS.names()


def backend(name: str) -> type[Device]:
    """The Device class of backend ``name``; the error lists the known names."""
    return BACKENDS.load(name)


def availability(name: str, fabric_transport: str = "auto") -> Availability:
    """Whether backend ``name`` can run here over ``fabric_transport``, and if not, why; an import failure is
    reported, not raised."""
    return BACKENDS.availability(name, lambda cls: cls.availability(fabric_transport))


def open_device(name: str = DEFAULT, fabric_transport: str = "auto", progress_threads: int = 1,
                lanes_per_peer: int = 1, interfaces: list[str] | tuple[str, ...] = (),
                settings: RdmaSettings | None = None) -> Device:
    """A device of backend ``name`` (the paper's ``CreateRdmaDevice``).

    ``fabric_transport``: one of the backend's ``fabric_transports``; ``progress_threads``: threads
    polling completions (the paper's CQs); ``lanes_per_peer``: connections per peer (its QPs per
    peer); ``interfaces``: the network interfaces that hold the cluster's addresses (where a backend
    that listens may listen); ``settings``: the RDMA_* variables. FabricError says why it cannot open.
    """
    status = availability(name)
    if not status.ok:
        raise FabricError(f"the {name} fabric is not available here: {status.reason}")
    cls = backend(name)
    if fabric_transport not in cls.fabric_transports:
        raise ValueError(f"the {name} fabric has no fabric transport '{fabric_transport}' "
                         f"(known: {', '.join(cls.fabric_transports)})")
    return cls(fabric_transport=fabric_transport, progress_threads=progress_threads, lanes_per_peer=lanes_per_peer,
               interfaces=interfaces, settings=settings)


def preload(name: str = DEFAULT) -> None:
    """Load backend ``name``'s native libraries now, if they are here (quietly nothing otherwise).

    Call it before starting another library that brings its own copy of them: MPI (Open MPI's
    wheel bundles an older UCX) must find ours already loaded, or UCX's symbols clash.
    """
    with contextlib.suppress(ImportError):
        backend(name).availability()


def label(description: dict[str, Any] | None) -> str:
    """``ucx:cma,posix,sysv`` (the backend and what carried the data) from a device's description; ``none``
    for a transport that uses no fabric."""
    if not description or description.get("fabric", "none") == "none":
        return "none"
    used = description.get("used") or [description.get("fabric_transport", "?")]
    return f"{description['fabric']}:{','.join(used)}"
