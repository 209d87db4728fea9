"""What ranks and the coordinator say to each other, and what a run is made of: the errors a run ends with, a
rank's :class:`RankSpec` and :class:`RankResult`, the run's token, the typed messages on the hub (see
``bench.launch.hub`` for who sends which, and ``bench.launch.wire`` for how they travel), and the helpers both
sides use to describe a failure."""

from __future__ import annotations

import os
import secrets
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transports import Cluster

#: overrides the token a run generates (every rank of a run must use the same one)
TOKEN_VARIABLE = "TENSOR_BENCH_TOKEN"
#: seconds a connecting peer gets to prove it knows the token and say who it is
HANDSHAKE_S = 20.0
#: seconds between a rank process's heartbeats
HEARTBEAT_S = 1.0


class LaunchError(RuntimeError):
    """A run could not start or did not end well; the message names the rank and what to do."""


class RankFailed(LaunchError):
    """A rank failed (its job raised), died (its process ended first) or the run fell silent."""

    def __init__(self, rank: int, name: str, message: str, kind: str = "failed") -> None:
        super().__init__(f"rank {rank} ({name}) {message}")
        self.rank = rank
        self.name = name
        self.kind = kind
        self.waited = False  # a failure that followed from another rank's (see Failed)

    def with_log(self, tail: str) -> RankFailed:
        """The same failure, ending with the end of the rank's log."""
        if not tail:
            return self
        failed = RankFailed(self.rank, self.name, "", self.kind)
        failed.args = (f"{self}\n--- the end of rank {self.rank}'s log ---\n{tail}",)
        return failed


def run_token() -> str:
    """The run's token: ``TENSOR_BENCH_TOKEN`` when set, else a fresh random one."""
    return os.environ.get(TOKEN_VARIABLE) or secrets.token_hex(16)


@dataclass(frozen=True)
class RankSpec:
    """What one rank runs: ``job(ctx)`` in the rank's process (``ctx``: its ``bench.launch.context.RankContext``);
    its result goes to the coordinator."""

    job: Callable[[Any], Any]
    name: str
    #: the server this rank belongs to: ranks of one server share an emulated host (netns)
    host: int = 0
    #: runs until stopped; the run ends when every other rank has finished
    service: bool = False


@dataclass(frozen=True)
class RankResult:
    """What one rank returned, and its process's peak resident memory over the run."""

    rank: int
    name: str
    result: Any
    peak_rss_mb: float


# -- messages on the hub --------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """rank -> coordinator, first: which rank is calling."""

    rank: int


@dataclass(frozen=True)
class Assignment:
    """coordinator -> rank: what to run, and the cluster it runs in."""

    rank: int
    spec: RankSpec
    cluster: Cluster
    #: the rank's network interface whose byte counters tell the traffic on its link (netns), if any
    link_interface: str | None = None


@dataclass(frozen=True)
class Report:
    """rank -> coordinator: a typed payload of the experiment's (progress, a measurement)."""

    payload: Any


@dataclass(frozen=True)
class Relay:
    """rank -> coordinator -> rank ``dst``: a payload for another rank (a ready signal)."""

    src: int
    dst: int
    payload: Any


@dataclass(frozen=True)
class Confirm:
    """A relayed payload whose arrival the receiving rank's hub thread confirms at once (:class:`Confirmed`),
    whatever its job is doing (:meth:`RankContext.tell`)."""

    payload: Any
    ticket: int


@dataclass(frozen=True)
class Confirmed:
    """The answer to :class:`Confirm`: ``ticket``'s payload is in this rank's inbox."""

    ticket: int


@dataclass(frozen=True)
class Finished:
    """rank -> coordinator, last: the job's result and the process's peak memory."""

    result: Any
    peak_rss_mb: float


@dataclass(frozen=True)
class Failed:
    """rank -> coordinator, last: the job raised.

    ``waited``: the error is a consequence of another rank (a peer that vanished or refused, a wait that ran
    out), so another rank's own failure, if there is one, is the cause.
    """

    error: str
    waited: bool = False


@dataclass(frozen=True)
class Alive:
    """rank -> coordinator, every HEARTBEAT_S: the rank's process is running (not progress)."""


@dataclass(frozen=True)
class Stop:
    """coordinator -> service rank: report your peak memory and exit."""



# -- process helpers --------------------------------------------------------------------------


def waited_on_others(exc: BaseException) -> bool:
    """Whether a job's error is a consequence of another rank: a peer that failed, vanished or timed out."""
    from transports import PeerError, TransportClosed, TransportTimeout

    return isinstance(exc, PeerError | TransportTimeout | TransportClosed | TimeoutError) or (
        isinstance(exc, LaunchError) and not isinstance(exc, RankFailed))


def describe_error(exc: BaseException) -> str:
    """``Type: message (at file:line)`` of the innermost frame."""
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"
