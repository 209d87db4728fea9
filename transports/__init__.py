"""Tensor transports behind one rendezvous interface, looked up by name.

Backends are imported only when asked for, so a backend whose libraries are
missing reports itself unavailable instead of breaking every import.
"""

from __future__ import annotations

from typing import Any

from transports.base import (
    Cluster,
    Inbound,
    Key,
    Outbound,
    PeerError,
    Transport,
    TransportClosed,
    TransportError,
    TransportStats,
    TransportTimeout,
)
from transports.common import Availability, Registry
from transports.placement import TensorSpec


class UnknownTransport(ValueError):
    """A transport name that is not registered."""


class TransportUnavailable(RuntimeError):
    """A registered transport that cannot run on this machine."""


#: name -> the Transport class, ``module:TRANSPORT``, in the order ``bench info`` lists them and ``bench micro`` runs
#: them by default. Figures and tables order lines by the catalogue (``bench/results/lines.py``), which gives each
#: its paper name, label and look; transports/ imports nothing from bench/, so the names are written here and
#: tests/test_catalogue_names.py checks that every one is a line of the catalogue and the reverse.
REGISTRY = Registry("transport", {
    "grpc_tcp": "transports.grpc_tcp:TRANSPORT",
    "grpc_rdma": "transports.grpc_rdma:TRANSPORT",
    "rdma_cp": "transports.rdma_cp:TRANSPORT",
    "zerocopy": "transports.zerocopy:TRANSPORT",
    "local": "transports.local:TRANSPORT",
}, unknown=UnknownTransport)


def names() -> list[str]:
    """Every registered transport name."""
    return REGISTRY.names()


def transport_class(name: str) -> type[Transport]:
    """The class registered under ``name``; the error lists the known names."""
    return REGISTRY.load(name)


def availability(name: str) -> Availability:
    """Whether ``name`` can run here; a backend that fails to import is reported, not raised."""
    return REGISTRY.availability(name, lambda cls: cls.availability())


def available_names() -> list[str]:
    """The registered transports that can run on this machine."""
    return [name for name in REGISTRY if availability(name).ok]


def resolve(label: str) -> tuple[str, dict[str, Any]]:
    """``grpc_rdma:direct`` -> (``grpc_rdma``, its options for mode ``direct``); a plain name has none."""
    name, _, mode = label.partition(":")
    cls = transport_class(name)
    if not mode:
        return name, {}
    modes = cls.modes()
    if mode not in modes:
        known = ", ".join(f"{name}:{m}" for m in modes) or "none"
        raise UnknownTransport(f"transport '{name}' has no mode '{mode}' (known: {known})")
    return name, dict(modes[mode])


def load_fabric() -> None:
    """Load the default fabric's native libraries now, if they are here (see ``transports.fabric.preload``)."""
    from transports import fabric

    fabric.preload()


def create(name: str, **options: object) -> Transport:
    """A new, not yet started transport ``name``; raises if it is unknown or cannot run here."""
    status = availability(name)
    if not status.ok:
        raise TransportUnavailable(f"transport '{name}' is not available here: {status.reason}")
    return transport_class(name)(**options)


__all__ = [
    "Availability",
    "Cluster",
    "Inbound",
    "Key",
    "Outbound",
    "PeerError",
    "REGISTRY",
    "TensorSpec",
    "Transport",
    "TransportClosed",
    "TransportError",
    "TransportStats",
    "TransportTimeout",
    "TransportUnavailable",
    "UnknownTransport",
    "availability",
    "available_names",
    "create",
    "load_fabric",
    "names",
    "resolve",
    "transport_class",
]
