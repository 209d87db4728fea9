"""What a ``bench micro`` run measures, planned before any rank starts: its lines in the order they are measured
(:func:`lines_of`), and the memory its largest point holds at once against what is free (:func:`memory_problem`)."""

from __future__ import annotations

import argparse
from typing import Any

from bench.experiments.micro import MicroLine, TransportLine
from bench.ground import memory
from bench.ground.sizes import format_size
from bench.results import lines as catalogue

#: launchers that start every rank on this host (a job's launchers, mpi and slurm, start one rank per process)
_ALL_RANKS_HERE = frozenset({"local", "netns"})


def memory_needed(size: int, labels: list[str], slowed: set[str], both_sides: bool = True) -> tuple[int, str]:
    """The bytes a point of ``size`` has allocated at once at its most (the line that holds the most), on this
    host: the sender's tensor and the receiver's (one side with ``both_sides`` False), a copy of each on a line
    that copies (the catalogue's ``copying``), the sender's scratch tensor on a line with ``--extra-copy``; and which
    line that is."""
    def held(label: str) -> int:
        per_side = 1 + (1 if catalogue.line(label).copying else 0)
        return per_side * (2 if both_sides else 1) + (1 if label in slowed else 0)

    worst = max(labels, key=held, default="memcpy")
    return max(held(worst), 2 if both_sides else 1) * size, worst


def memory_problem(sizes: list[int], labels: list[str], slowed: set[str], launcher: Any) -> str | None:
    """Why the largest size cannot be measured with the memory available now (``MemAvailable``), before any rank
    starts; None when it fits or the memory available cannot be read (read through the module at each call, so
    that a test can stand in for it)."""
    available = memory.available_memory_bytes()
    if available is None or not sizes:
        return None
    here = getattr(launcher, "name", "local") in _ALL_RANKS_HERE
    needed, line = memory_needed(max(sizes), labels, slowed, both_sides=here)
    if needed <= available:
        return None
    held = "the sender's and the receiver's tensor" if here else "this rank's tensor"
    if catalogue.line(line).copying:
        held += f" and {line}'s copy of {'each' if here else 'it'}"
    if line in slowed:
        held += " and the --extra-copy scratch tensor"
    return (f"--sizes: a {format_size(max(sizes))} transfer holds about {needed / 2**30:.1f} GB at once ({held}), "
            f"but {available / 2**30:.1f} GB of memory is available now (MemAvailable); choose smaller sizes or free "
            "memory")


def lines_of(args: argparse.Namespace, launcher: Any, chosen: list[Any], slowed: set[str]) -> list[MicroLine]:
    """The run's lines, in the order they are measured: the reference lines of its fabric (unless
    --no-references: of_reference needs each size's bandwidth reference first), the peer lines (unless
    --no-peers: of_peer needs each size's best peer first), then the transports."""
    from bench.experiments.peers import calibration_lines, peer_lines
    from bench.experiments.references import reference_lines

    lines: list[MicroLine] = []
    if not args.no_references:
        lines += reference_lines(args.fabric, launcher.fabric_transport(args.fabric_transport), args.timeout)
    if not args.no_peers:
        lines += peer_lines(args.peers, args.timeout)
        if args.calibrate:
            lines += calibration_lines(args.peers, args.timeout)
    for choice in chosen:
        lines.append(TransportLine(choice.label, choice.constructor_options(args, launcher),
                                   extra_copies=1 if choice.label in slowed else 0))
    return lines
