"""Starts and watches the ranks of a run: local processes, network namespaces, MPI/Slurm.

Every multi-process experiment asks this package for a launcher by name and hands it runs
(lists of :class:`RankSpec`); see ``hub.py`` for how ranks and the coordinator talk.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from bench.launch.base import Launcher
from bench.launch.context import RankContext
from bench.launch.messages import LaunchError, RankFailed, RankResult, RankSpec
from transports.common import Registry

#: name -> the launcher class and what it does (for --help); the order is the order of --help. Each class says
#: which of the command line's launch options it takes (``options``) and why it refuses one (``refuses``).
REGISTRY = Registry("launcher", {
    "local": ("bench.launch.local:LocalLauncher", "processes on this machine (the default)"),
    "netns": ("bench.launch.netns:NetnsLauncher",
              "each server in its own network namespace, links shaped with tc (needs root, ip and tc)"),
    "mpi": ("bench.launch.mpi:MpiLauncher", "ranks started by mpirun, one process per rank (mpi4py)"),
    "slurm": ("bench.launch.slurm:SlurmLauncher",
              "ranks are the tasks of a Slurm step (srun -n N bench ...); outside a step, --nodes N submits a job"),
}, unknown=LaunchError)
#: the name that picks a launcher from where bench runs (:func:`detect`)
AUTO = "auto"
#: name -> what it does, for --help and errors; the order is the order of --help
LAUNCHERS = REGISTRY.descriptions()
#: the command line's launch options: keyword -> (its flag, what it does), said when a launcher does not take it
OPTIONS = {
    "bind": ("--bind", "sets where ranks listen"),
    "link_rate": ("--link-rate", "shapes the links between emulated hosts"),
}


class LauncherUnavailable(LaunchError):
    """A launcher that cannot run here; the message says what is missing and the fix."""


def detect(env: Mapping[str, str] = os.environ) -> str:
    """The launcher of the processes bench runs in: mpi under ``mpirun``, slurm in a task of a Slurm step
    (``srun``), local otherwise."""
    from bench.launch.mpi import PMI_VARIABLES
    from bench.launch.slurm_step import in_step

    if env.get("OMPI_COMM_WORLD_SIZE"):  # mpirun's, also when mpirun runs inside a step
        return "mpi"
    if in_step(env):
        return "slurm"
    if any(env.get(name) for name in PMI_VARIABLES):
        return "mpi"
    return "local"


def create(name: str, *, bind: str | None = None, link_rate: str | None = None,
           log_dir: Path | None = None) -> Launcher:
    """The launcher ``name`` (``auto``: :func:`detect`'s) with the command line's options; errors name the
    problem and the fix."""
    if name == AUTO:
        name = detect()
    cls = REGISTRY.load(name)
    given = {option: value for option, value in (("bind", bind), ("link_rate", link_rate)) if value}
    for option in given:
        if option not in cls.options:
            raise LaunchError(_not_taken(name, cls, option))
    return cls(log_dir=log_dir, **given)


def _not_taken(name: str, cls: type[Launcher], option: str) -> str:
    """Why launcher ``name`` refuses ``option``: its own reason, else what the option is for and who takes it."""
    flag, purpose = OPTIONS[option]
    if option in cls.refuses:
        return f"{flag} does not apply to --launcher {name}: {cls.refuses[option]}"
    takers = " or ".join(f"--launcher {other}" for other in REGISTRY if option in REGISTRY.load(other).options)
    return f"{flag} {purpose}: use it with {takers}"


__all__ = [
    "AUTO",
    "LAUNCHERS",
    "OPTIONS",
    "REGISTRY",
    "LaunchError",
    "Launcher",
    "LauncherUnavailable",
    "RankContext",
    "RankFailed",
    "RankResult",
    "RankSpec",
    "create",
    "detect",
]
