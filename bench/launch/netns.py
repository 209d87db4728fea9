"""``--launcher netns``: each server in a network namespace of its own, joined by shaped links.

The ranks of server ``i`` (its worker and parameter server; the micro-benchmark's sender is host
0, its receiver host 1) run in emulated host ``i``: a network namespace with one veth link to a
bridge, every link shaped with ``tc`` when ``--link-rate`` is given (``bench.launch.hosts``).
Ranks listen on their host's address. Shared memory between processes would bypass the links, so
the fabric runs UCX over tcp on the host's link interface, whatever ``--fabric-transport`` says,
and ``meta.json`` says so. The namespaces are made for each run and removed after it, also after a
crash or Ctrl-C (the hosts' reaper sees the coordinator go).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from bench.ground.sizes import parse_rate
from bench.launch.addresses import rdma_ports
from bench.launch.hosts import EmulatedHosts, NetnsUnavailable, check_support, sweep_stale
from bench.launch.local import LocalLauncher
from bench.launch.messages import LaunchError, RankSpec
from transports.common import Availability

#: rank r listens on this port plus r of its host's address (every host is a fresh namespace); below the
#: ephemeral range, so that no listener UCX opens on port 0 can have taken it first
BASE_PORT = 29000


class NetnsLauncher(LocalLauncher):
    """Ranks as processes in emulated hosts (network namespaces and shaped veth links)."""

    name = "netns"
    options: ClassVar[tuple[str, ...]] = ("link_rate",)
    refuses: ClassVar[dict[str, str]] = {"bind": "every host has its own address"}
    private_hosts = True

    @classmethod
    def availability(cls) -> Availability:
        try:
            check_support()
        except NetnsUnavailable as exc:
            return Availability(False, str(exc))
        return Availability(True)

    def __init__(self, link_rate: str | None = None, log_dir: Path | None = None) -> None:
        try:
            check_support()
        except NetnsUnavailable as exc:
            from bench.launch import LauncherUnavailable

            raise LauncherUnavailable(f"--launcher netns cannot run here: {exc}") from None
        try:
            self.link_rate_bps = parse_rate(link_rate) if link_rate else None
        except ValueError as exc:
            raise LaunchError(f"--link-rate: {exc}") from None
        super().__init__(log_dir=log_dir)
        self.bind = ""  # every host has an address of its own
        self.link_rate = link_rate
        self._hosts: EmulatedHosts | None = None
        self._described: dict[str, Any] = {}
        self._host_counts: set[int] = set()
        sweep_stale()  # namespaces a crashed run left behind

    def fabric_transport(self, requested: str) -> str:
        return "tcp"

    def describe(self) -> dict[str, Any]:
        return {"launcher": self.name, "link_rate": self.link_rate or "unshaped",
                "fabric_transport": "tcp: shared memory between processes would bypass the links",
                **self._described, "hosts": sorted(self._host_counts)}

    def _open_hosts(self, ranks: list[RankSpec]) -> None:
        self._hosts = EmulatedHosts(max(spec.host for spec in ranks) + 1, self.link_rate_bps).create()
        described = self._hosts.describe()
        self._described = {k: v for k, v in described.items() if k not in ("addresses", "namespace_prefix")}
        self._host_counts.add(self._hosts.hosts)

    def _close_hosts(self) -> None:
        if self._hosts is not None:
            self._hosts.close()
            self._hosts = None

    def _addresses(self, ranks: list[RankSpec]) -> list[str]:
        return [f"{self._hosts.address(spec.host)}:{BASE_PORT + rank}" for rank, spec in enumerate(ranks)]

    def _command(self, spec: RankSpec, argv: list[str]) -> list[str]:
        return self._hosts.command(spec.host, argv)

    def _environment(self) -> dict[str, str]:
        # the emulated host's link for UCX over tcp, and the RDMA ports (shared across namespaces): a private host
        # of a run over rdma (perftest's, under the local launcher) keeps its device
        return {"UCX_NET_DEVICES": ",".join([EmulatedHosts.INTERFACE, *rdma_ports()])}

    def _link_interface(self, spec: RankSpec) -> str | None:
        return EmulatedHosts.INTERFACE
