"""Ranks out of the network's reach, for programs that listen on every interface whatever they are told.

TensorFlow's servers bind ``0.0.0.0`` and have no option to bind elsewhere; perftest's tools
(``ucx_perftest``, ``ib_write_*``) listen on every interface for their out-of-band connection. Run as
ranks of the local launcher, they would be open to the network while the run was asked to stay on
loopback (the default). :func:`private_hosts` gives the launcher to run such ranks on instead.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

from bench.launch.base import Launcher


class PrivateHosts(NamedTuple):
    """What :func:`private_hosts` chose."""

    launcher: Launcher
    #: made here: the caller closes it when done
    own: bool
    #: whether the ranks' listeners are out of the host network's reach
    isolated: bool
    #: how they run, in a sentence for the record
    note: str


def private_hosts(launcher: Launcher | None, what: str) -> PrivateHosts:
    """The launcher to run ``what`` (say, "TensorFlow's servers") on, so that its listeners stay private.

    - A launcher whose every host is private (``netns``: a network namespace each) as it is.
    - A launcher whose ranks someone else starts (``mpi``) as it is: they run where it runs them.
    - Otherwise (none, or ``local``) one private emulated host (a ``NetnsLauncher`` without a link rate,
      every rank of a run on host 0, no link to the host's interfaces), with the given launcher's log
      directory. Where network namespaces cannot be made: the given launcher when its bind address is not
      loopback (its ranks are meant to be reachable), else :class:`LauncherUnavailable` saying why and
      what to do.
    """
    from bench.launch import LauncherUnavailable

    if launcher is not None and launcher.private_hosts:
        return PrivateHosts(launcher, False, True,
                            f"--launcher {launcher.name}: each server's ranks on their own emulated host "
                            "(network namespace)")
    if launcher is not None and not launcher.starts_processes:
        return PrivateHosts(launcher, False, False, f"--launcher {launcher.name}")
    from bench.launch.netns import NetnsLauncher

    try:
        private = NetnsLauncher(log_dir=getattr(launcher, "log_dir", None))
    except LauncherUnavailable as exc:
        bind = launcher.bind if launcher is not None else "127.0.0.1"
        if ipaddress.ip_address(bind).is_loopback:
            raise LauncherUnavailable(
                f"no private network namespace here ({exc}), and {what} would listen on every interface of the "
                f"host, not on {bind}: run where network namespaces can be made (as root, or --launcher netns), "
                "or accept listening on the network with --bind ADDRESS|INTERFACE") from None
        return PrivateHosts(launcher, False, False, f"no private network namespace here ({exc}): {what} listens "
                                                    f"on every interface of the host (--bind {bind})")
    return PrivateHosts(private, True, True, f"one private emulated host (network namespace, no link to the "
                                             f"host's interfaces): {what} listens on every interface")


def hosts_for_open_listeners(launcher: Launcher, what: str, leave_out: str) -> PrivateHosts:
    """Where to run ranks of ``what`` (a program that listens on every interface): :func:`private_hosts`, refused
    when its ranks would still listen on the host's own network while the run was asked to stay on loopback.
    ``leave_out`` is the option that goes without it (``--no-references``), named in every refusal."""
    from bench.launch import LaunchError

    try:
        chosen = private_hosts(launcher, what)
    except LaunchError as exc:
        raise LaunchError(f"{exc}; or pass {leave_out}") from None
    bind = getattr(launcher, "bind", "") or "127.0.0.1"
    if not chosen.isolated and ipaddress.ip_address(bind).is_loopback:
        raise LaunchError(f"{what} listens on every interface (it has no bind option) and --launcher "
                          f"{launcher.name} runs it on the host's own network: pass --bind ADDRESS to accept "
                          f"that, or {leave_out}")
    return chosen
