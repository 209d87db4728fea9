"""What a launcher is: :class:`Launcher`, which starts the ranks of runs its own way (processes here, in network
namespaces, under ``mpirun`` or ``srun``) and hands every rank the run's ``Cluster``. Every launcher then uses the
same hub (``bench.launch.hub``, whose docstring says how ranks and the coordinator talk), the same messages
(``bench.launch.messages``) and the same wire (``bench.launch.wire``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from bench.launch.messages import RankResult, RankSpec
from transports.common import Availability

# -- launchers ------------------------------------------------------------------------------------


class Launcher(ABC):
    """Starts the ranks of runs, one run at a time, and tells how it went."""

    name: ClassVar[str]
    #: whether this process coordinates (writes results); under MPI only rank 0 does
    is_coordinator: ClassVar[bool] = True
    #: whether every host of a run is private: its ranks' listeners out of the host network's reach (netns)
    private_hosts: ClassVar[bool] = False
    #: whether it starts the ranks' processes itself (local, netns), rather than finding them started (mpi)
    starts_processes: ClassVar[bool] = True

    @abstractmethod
    def run(self, ranks: list[RankSpec], timeout_s: float, on_report: Callable[[int, Any], None] | None = None,
            label: str = "run", startup_s: float = 0.0) -> list[RankResult]:
        """Run ``ranks`` to the end: every rank's result (in rank order) on the coordinator, [] elsewhere.

        ``timeout_s``: the longest the ranks may all stay silent, ``startup_s`` more until the run's
        first report. ``label`` names the run's logs.
        Raises :class:`RankFailed` naming the rank when one fails or dies; no process of the run is
        left behind either way.
        """

    @classmethod
    def availability(cls) -> Availability:
        """Whether it can run here, and if not, why, found without starting anything."""
        return Availability(True)

    def fabric_transport(self, requested: str) -> str:
        """The UCX transports the fabric must use under this launcher (netns: tcp, whatever was asked)."""
        return requested

    def describe(self) -> dict[str, Any]:
        """How ranks run, for ``meta.json``."""
        return {"launcher": self.name}

    def ranks_problem(self, needed: int, names: str) -> str | None:
        """Why a run of ``needed`` ranks (``names``, said in the line) cannot run under this launcher, in one line
        naming the fix; None when it can. A launcher that starts its ranks starts as many as asked."""
        return None

    def close(self) -> None:  # noqa: B027 (most launchers hold nothing across runs)
        """Release what the launcher holds across runs."""

    def end_process(self, status: int) -> None:  # noqa: B027 (a launcher that starts its ranks leaves it be)
        """Called once the command is over and the launcher closed: a launcher whose processes are a job's ends
        this one here with ``status``; the others return."""

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
