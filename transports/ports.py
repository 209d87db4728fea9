"""Ports for the ranks' listeners: reserved where the addresses are handed out, released once a listener is up.

The launch layer calls :func:`free_port` when it gives each rank its address (``host:port``), so that nothing
else takes the port before the rank's listener binds it; a transport calls :func:`release_port` once its
listener (or a peer's, which answered) is up, and :func:`release_cluster_ports` when it closes.
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterable

#: free_port() picks among this many ports just below the kernel's ephemeral range
_PORTS_BELOW_EPHEMERAL = 8000
#: free_port() holds at most this many reservations; beyond, the oldest (whose listeners are long up) go
MAX_RESERVATIONS = 256

_reservations: OrderedDict[tuple[str, int], socket.socket] = OrderedDict()
_reservations_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that stays reserved for this run's listener until it binds it.

    The port is bound (not listening) without ``SO_REUSEADDR``, so that no other process can bind
    it, another ``free_port`` included, then ``SO_REUSEADDR`` is set: Linux then lets a listener that
    sets it too (gRPC's do, whatever ``grpc.so_reuseport`` says) bind and listen on the port while
    the reservation holds it. The reservation lasts until :func:`release_port` (a listener calls it
    once it is up) or until :data:`MAX_RESERVATIONS` newer ones exist; a listener in another process
    (the launcher's children) binds while its parent still holds the reservation.

    What remains: a process that binds with ``SO_REUSEADDR`` and without checking first (another
    gRPC server given this very port) can still bind it before our listener does; the first of the
    two to listen wins, and the other's start fails with "cannot listen on ...; is the port in use?".

    It comes from below the kernel's ephemeral range: a port from inside it could be handed to
    another process's ``bind(port 0)`` or outgoing connection (UCX's tcp listeners, for one).
    """
    low = _ephemeral_low()
    for _ in range(100):
        port = low - 1 - secrets.randbelow(min(_PORTS_BELOW_EPHEMERAL, low - 1025))
        reservation = _reserve(host, port)
        if reservation is not None:
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: any free port
        s.bind((host, 0))
        return s.getsockname()[1]


def _reserve(host: str, port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))  # exclusive: fails while anyone else holds or reserves the port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # now let our listener bind beside it
    except OSError:
        s.close()
        return None
    with _reservations_lock:
        old = _reservations.pop((host, port), None)
        _reservations[(host, port)] = s
        evicted = [_reservations.popitem(last=False)[1] for _ in range(len(_reservations) - MAX_RESERVATIONS)]
    for stale in [old, *evicted]:
        if stale is not None:
            stale.close()
    return s


def release_port(address: str) -> None:
    """Drop the reservation :func:`free_port` holds for ``address`` (``host:port``): its listener is up."""
    host, _, port = address.rpartition(":")
    try:
        key = (host.strip("[]"), int(port))
    except ValueError:
        return
    with _reservations_lock:
        reservation = _reservations.pop(key, None)
    if reservation is not None:
        reservation.close()


def release_cluster_ports(addresses: Iterable[str]) -> None:
    """A rank or a coordinator is done with a cluster: the reservations this process still holds for the
    ports of its ``addresses`` (peers never reached, started in other processes) protect nothing any more."""
    for address in addresses:
        release_port(address)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return low if low > 2048 else 32768
