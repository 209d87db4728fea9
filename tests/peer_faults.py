"""Peer lines with a fault built in, for tests/test_peers.py: importable by the ranks (and by the MPI processes,
which import the link class their relay names: the run's channels carry a class by its ``module:qualname``,
never a pickle; see ``bench/launch/wire.py``).

- ``Corrupting*``: the receiver flips one bit in the middle of every tensor it gets, after the library delivered it
  (the data check must catch it);
- ``Dying*``: the receiver kills its own process with SIGKILL at transfer ``DIE_AT`` (a peer that dies
  mid-run: the run must end with an error naming the line, and leave no process behind).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from bench.experiments.peers import PeerLink
from bench.experiments.peers.mooncake import MooncakeLine, MooncakeLink
from bench.experiments.peers.mpi import MpiLine
from bench.experiments.peers.mpi_links import MpiLink, MpiRmaLink
from bench.experiments.peers.nixl import NixlLine, NixlLink
from bench.experiments.peers.plain_socket import SocketLine, SocketLink
from transports import Cluster, Key

DIE_AT = 3


def _flip(tensor: np.ndarray) -> np.ndarray:
    tensor.reshape(-1).view(np.uint8)[tensor.nbytes // 2] ^= 0x10
    return tensor


def corrupting(cls: type[PeerLink]) -> type[PeerLink]:
    class Corrupting(cls):  # type: ignore[valid-type, misc]
        def recv(self, key: Key) -> np.ndarray:
            return _flip(super().recv(key))

    Corrupting.__name__ = Corrupting.__qualname__ = f"Corrupting{cls.__name__}"
    return Corrupting


def dying(cls: type[PeerLink]) -> type[PeerLink]:
    class Dying(cls):  # type: ignore[valid-type, misc]
        def recv(self, key: Key) -> np.ndarray:
            if key.step == DIE_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().recv(key)

    Dying.__name__ = Dying.__qualname__ = f"Dying{cls.__name__}"
    return Dying


CorruptingSocketLink = corrupting(SocketLink)
CorruptingNixlLink = corrupting(NixlLink)
CorruptingMooncakeLink = corrupting(MooncakeLink)
CorruptingMpiLink = corrupting(MpiLink)
CorruptingMpiRmaLink = corrupting(MpiRmaLink)
DyingMpiLink = dying(MpiLink)


@dataclass
class CorruptingSocketLine(SocketLine):
    def link(self, cluster: Cluster, rank: int) -> PeerLink:
        return CorruptingSocketLink(cluster, rank, self.timeout_s)


@dataclass
class CorruptingNixlLine(NixlLine):
    def link(self, cluster: Cluster, rank: int) -> PeerLink:
        return CorruptingNixlLink(cluster, rank, self.timeout_s)


@dataclass
class CorruptingMooncakeLine(MooncakeLine):
    def link(self, cluster: Cluster, rank: int) -> PeerLink:
        return CorruptingMooncakeLink(cluster, rank, self.timeout_s)


@dataclass
class CorruptingMpiLine(MpiLine):
    link_class: ClassVar[type[MpiLink]] = CorruptingMpiLink


@dataclass
class CorruptingMpiRmaLine(MpiLine):
    link_class: ClassVar[type[MpiLink]] = CorruptingMpiRmaLink


@dataclass
class DyingMpiLine(MpiLine):
    link_class: ClassVar[type[MpiLink]] = DyingMpiLink
