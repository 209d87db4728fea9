"""What every reference line is to the harness: a :class:`ReferenceLine` measures each point in one rank itself
and reports a record; a :class:`PerftestLine` runs a perftest tool's server and client there, on private hosts.
:data:`REGISTRY` and :func:`reference_lines` give a run's lines."""

from __future__ import annotations

import functools
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from bench.experiments.micro import Measured, MicroLine, Point
from bench.experiments.references import running
from bench.experiments.references.running import LATENCY_MAX_SIZE, ReferenceUnavailable
from bench.launch import Launcher, RankContext, RankSpec
from bench.launch.private import PrivateHosts, hosts_for_open_listeners
from bench.results import MicroRecord
from bench.results import lines as catalogue
from transports import fabric
from transports.common import Availability, Registry


@dataclass
class ReferenceLine(MicroLine):
    """A reference line of ``bench micro``: one rank that measures every point itself and reports a record each.

    ``fabric_transport``: the UCX transports of the run (what its launcher makes of ``--fabric-transport``);
    ``timeout_s`` bounds one size.
    """

    fabric_transport: str = "auto"
    timeout_s: float = 120.0
    #: the fabric backend whose runs it belongs in (None: every run)
    fabric: ClassVar[str | None] = None

    def ranks(self, points: list[Point]) -> list[RankSpec]:
        return [RankSpec(functools.partial(_reference_job, self, points), self.name)]

    @abstractmethod
    def measure(self, point: Point, port: int) -> MicroRecord:
        """The record of ``point``, measured here; ``port`` is this rank's own to listen on."""


def _reference_job(line: ReferenceLine, points: list[Point], ctx: RankContext) -> None:
    port = int(ctx.cluster.addresses[ctx.rank].rsplit(":", 1)[1])
    for point in points:
        ctx.report(Measured(point.size_bytes, line.measure(point, port)))


@dataclass
class PerftestLine(ReferenceLine):
    """A perftest tool's line: server and client in the line's rank, on private hosts of the launch layer.

    Its tools listen on every interface (no bind option), so the rank runs where the network cannot reach
    it: in one private emulated host under the local launcher, on the emulated host under netns
    (:func:`bench.launch.private.private_hosts`), with the launch layer's reaper and stale sweep.
    """

    #: the perftest's tool, of the fabric backend
    tool: ClassVar[str]
    #: a latency test: the sizes up to LATENCY_MAX_SIZE, server and client pinned to a CPU each
    latency: ClassVar[bool] = False

    def points(self, points: list[Point]) -> list[Point]:
        return [p for p in points if p.size_bytes <= LATENCY_MAX_SIZE] if self.latency else points

    def availability(self) -> Availability:
        if self.fabric is not None and not (status := fabric.availability(self.fabric)).ok:
            return Availability(False, f"{self.name}: the {self.fabric} fabric is not available here: "
                                       f"{status.reason} (its lines need it; measure where it is, or pass "
                                       "--no-references)")
        try:
            running.tool(self.fabric, self.tool, self.fabric_transport)
        except ReferenceUnavailable as exc:
            return Availability(False, str(exc))
        return Availability(True)

    def hosts(self, launcher: Launcher) -> PrivateHosts:
        return hosts_for_open_listeners(launcher, self.tool, "--no-references")


#: the reference lines, in the order they are measured (before the transports: of_reference needs the
#: bandwidth reference of each size first); each entry's class says which fabric's runs it belongs in
REGISTRY = Registry("reference line", {line.name: (line.implementation, line.about)
                                        for line in catalogue.of_kind("reference") if not line.calibrates})


def reference_lines(fabric_name: str, fabric_transport: str = "auto",
                    timeout_s: float = 120.0) -> list[ReferenceLine]:
    """The reference lines of a ``bench micro`` run over fabric backend ``fabric_name`` (those of its fabric and
    those of every run), in order; ValueError for a fabric without lines of its own."""
    classes = [REGISTRY.load(name) for name in REGISTRY]
    if not any(cls.fabric == fabric_name for cls in classes):
        known = sorted({cls.fabric for cls in classes if cls.fabric})
        raise ValueError(f"no reference lines for fabric '{fabric_name}' (known: {', '.join(known)})")
    return [cls(fabric_transport=fabric_transport, timeout_s=timeout_s) for cls in classes
            if cls.fabric in (None, fabric_name)]
