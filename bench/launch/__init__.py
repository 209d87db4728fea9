"""Starts and watches the ranks of a run: local processes, network namespaces, MPI/Slurm.

Every multi-process experiment asks this package for a launcher by name and hands it runs
(lists of :class:`RankSpec`); see ``base.py`` for how ranks and the coordinator talk.
"""

from __future__ import annotations

from pathlib import Path

from bench.launch.base import (
    Launcher,
    LaunchError,
    RankContext,
    RankFailed,
    RankResult,
    RankSpec,
)

#: name -> what it does, for --help and errors; the order is the order of --help
LAUNCHERS = {
    "local": "processes on this machine (the default)",
    "netns": "each server in its own network namespace, links shaped with tc (needs root, ip and tc)",
    "mpi": "ranks started by mpirun or srun, one process per rank (mpi4py)",
}


class LauncherUnavailable(LaunchError):
    """A launcher that cannot run here; the message says what is missing and the fix."""


def create(name: str, *, bind: str | None = None, link_rate: str | None = None,
           log_dir: Path | None = None) -> Launcher:
    """The launcher ``name`` with the command line's options; errors name the problem and the fix."""
    if name == "local":
        from bench.launch.local import LocalLauncher

        if link_rate:
            raise LaunchError("--link-rate shapes the links between emulated hosts: use it with --launcher netns")
        return LocalLauncher(bind=bind, log_dir=log_dir)
    if name == "netns":
        from bench.launch.netns import NetnsLauncher

        if bind:
            raise LaunchError("--bind does not apply to --launcher netns: every host has its own address")
        return NetnsLauncher(link_rate=link_rate, log_dir=log_dir)
    if name == "mpi":
        from bench.launch.mpi import MpiLauncher

        if link_rate:
            raise LaunchError("--link-rate shapes emulated links: use it with --launcher netns")
        return MpiLauncher(bind=bind, log_dir=log_dir)
    raise LaunchError(f"unknown launcher '{name}' (known: {', '.join(LAUNCHERS)})")


__all__ = [
    "LAUNCHERS",
    "LaunchError",
    "Launcher",
    "LauncherUnavailable",
    "RankContext",
    "RankFailed",
    "RankResult",
    "RankSpec",
    "create",
]
