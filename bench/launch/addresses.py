"""Where ranks listen: an address or an interface (``--bind``), and the UCX devices that go with it."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from bench.launch.messages import LaunchError
from transports.fabric.rdma_devices import active_ports, read_devices

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name``, or None when there is no such interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The name of the interface that has ``address``, or None."""
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def _here(address: str) -> str:
    """``address`` if a socket can listen on it here (probed: binding sends nothing), else a LaunchError."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as exc:
            raise LaunchError(f"--bind {address}: cannot listen there ({exc.strerror or exc}): it is not an "
                              f"address of this host (here: {_addresses_here()}); give one of these, or an "
                              "interface name") from None
    return address


def _addresses_here() -> str:
    """``lo 127.0.0.1, eth0 10.0.0.2``: this host's interfaces and their IPv4 addresses."""
    return ", ".join(f"{name} {found}" for _, name in socket.if_nameindex() if (found := interface_address(name)))


#: the advice for ranks on several hosts: where they listen must reach the other hosts
_SPAN_FIX = ("choose where ranks listen with --bind ADDRESS|INTERFACE, a non-loopback address (or interface) of this "
             "host that the other hosts reach")


def _spanning(address: str, hostnames: list[str], given: str | None) -> str:
    """``address``, unless the ranks span hosts and it is loopback, which the other hosts cannot reach: then a
    LaunchError saying so, with this host's addresses."""
    if len(set(hostnames)) > 1 and ipaddress.ip_address(address).is_loopback:
        how = f"--bind {given}" if given else f"this host's name ({socket.gethostname()}) resolves to {address}, which"
        raise LaunchError(f"the ranks span {len(set(hostnames))} hosts, and {how} is a loopback address the others "
                          f"cannot reach: {_SPAN_FIX} (here: {_addresses_here()})")
    return address


def resolve_bind(bind: str | None, hostnames: list[str]) -> str:
    """The address to listen on: ``bind`` (an address, or an interface), or the default for ranks on these hosts.
    Ranks on several hosts never listen on loopback: a LaunchError says so and names this host's addresses."""
    if bind:
        try:
            address = _here(str(ipaddress.ip_address(bind)))
        except ValueError:
            address = interface_address(bind)
            if address is None:
                raise LaunchError(f"--bind {bind}: no such address or network interface here "
                                  f"(interfaces: {', '.join(name for _, name in socket.if_nameindex())})") from None
        return _spanning(address, hostnames, bind)
    if len(set(hostnames)) <= 1:
        return "127.0.0.1"
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise LaunchError(f"the ranks span hosts, and this host's name does not resolve ({exc}); {_SPAN_FIX}") \
            from None
    return _spanning(address, hostnames, None)


def ucx_devices(address: str) -> dict[str, str]:
    """``UCX_NET_DEVICES`` for ranks listening on ``address`` (unless set already): UCX over tcp listens there
    too, and the RDMA ports here stay usable (naming only the interface would shut UCX off them)."""
    if "UCX_NET_DEVICES" in os.environ:
        return {"UCX_NET_DEVICES": os.environ["UCX_NET_DEVICES"]}
    device = "lo" if ipaddress.ip_address(address).is_loopback else interface_of(address)
    if not device:
        return {}
    return {"UCX_NET_DEVICES": ",".join([device, *rdma_ports()])}


def rdma_ports() -> list[str]:
    """The active RDMA ports here, as UCX names them (``mlx5_0:1``): a ``UCX_NET_DEVICES`` that names an interface
    must name them too, or UCX is shut off them."""
    return [port.name for port in active_ports(read_devices())]
