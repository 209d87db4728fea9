"""Which network interfaces carry a cluster's addresses: where the fabric may listen.

UCX's TCP transport opens a listener on every interface it is allowed, external ones
included, unless ``UCX_NET_DEVICES`` names the ones to use. The fabric transports pass a
device the interfaces that hold this host's addresses of the cluster (``lo`` for a loopback
cluster), and the UCX backend restricts itself to them. Written here, below both the fabric
and the launcher, so that either can ask.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface of this host that has one (name -> address)."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_for(host: str) -> str | None:
    """The interface of this host that holds ``host`` (an IPv4 address or a name), or None."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host.strip("[]")))
    except (OSError, ValueError):
        return None
    interfaces = interface_addresses()
    for name, own in interfaces.items():
        if ipaddress.ip_address(own) == address:
            return name
    if address.is_loopback:  # 127.0.0.2 and the like: the loopback interface holds the whole 127/8
        return next((name for name, own in interfaces.items() if ipaddress.ip_address(own).is_loopback), None)
    return None


def cluster_interfaces(hosts: list[str]) -> list[str]:
    """The interfaces of this host that hold any of ``hosts`` (a cluster's addresses), in order.

    Empty when none of them is on this host (the backend then chooses).
    """
    names: list[str] = []
    for host in dict.fromkeys(hosts):
        name = interface_for(host)
        if name is not None and name not in names:
            names.append(name)
    return names
