"""Why the numbers differ from the paper's: sentences made from a run's own data.

The fabric that carried the tensors, the launcher and links, the cores, replayed compute, rounds, a micro run's
source and the run's status; every section adds the ones that apply to it.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from bench.ground import paper
from bench.readers.report.text import (
    ZERO_COPY,
    line_kinds,
    line_name,
    listing,
    missing,
    ordered,
    range_text,
    unique,
)
from bench.results import Run
from bench.results import lines as catalogue
from bench.results.records import MICRO_SOURCES

#: UCX transports that move data through memory shared between processes of one host
_SHARED_MEMORY = {"cma", "posix", "sysv", "xpmem", "knem", "self"}


def describe_fabric(fabric: str) -> str:
    """What a records' ``fabric`` value means for the comparison with the paper's InfiniBand."""
    backend, _, carriers = str(fabric).partition(":")
    parts = [p for p in carriers.split(",") if p]
    if backend == "ucx":
        if parts and set(parts) <= _SHARED_MEMORY:
            return f"UCX shared memory ({', '.join(parts)}) between processes on one host, not an RDMA NIC"
        if "tcp" in parts:
            return (f"UCX over TCP sockets ({', '.join(parts)}), not an RDMA NIC: the target's progress thread lands "
                    "every put")
        if carriers in ("", "auto"):
            return "UCX with the transports it picked itself (auto)"
        if any(p.startswith(("rc", "dc", "ud", "ib")) or "mlx" in p for p in parts):
            return f"UCX over an RDMA NIC ({', '.join(parts)})"
        return f"UCX ({', '.join(parts)})"
    if backend == "verbs":
        return f"verbs on {carriers or 'an RDMA device'}: a real RDMA NIC, as in the paper"
    return str(fabric)


def fabric_notes(frame: pd.DataFrame) -> list[str]:
    if "fabric" not in frame or "transport" not in frame:
        return []
    carried: dict[str, list[str]] = {}
    kinds = line_kinds(frame)
    for line, fabric in zip(frame["transport"], frame["fabric"], strict=True):
        if missing(fabric) or fabric in ("", "none") or kinds[str(line)] in catalogue.OTHERS_KINDS:
            continue
        carried.setdefault(str(fabric), [])
        if line not in carried[str(fabric)]:
            carried[str(fabric)].append(line)
    notes = [f"{listing(line_name(t) for t in ordered(lines))} moved tensors over {describe_fabric(fabric)}; the "
             f"paper's crossed {paper.SETUP['network']} between servers."
             for fabric, lines in carried.items()]
    if any(p for fabric in carried for p in fabric.partition(":")[2].split(",") if p in _SHARED_MEMORY):
        notes.append("Over shared memory a one-sided write is a copy by the CPU (cma: process_vm_writev), so zero "
                     "copy saves copies but not the cost of moving the bytes, which an RDMA NIC takes off the CPU.")
    return notes


def _setting(run: Run, frame: pd.DataFrame, column: str) -> list[Any]:
    values = unique(frame, column)
    if values:
        return values
    settings = run.meta.get("settings") or {}
    launcher = settings.get("launcher")
    value = launcher.get(column) if isinstance(launcher, dict) else (launcher if column == "launcher" else None)
    return [value] if value not in (None, "") else []


def launch_notes(run: Run, frame: pd.DataFrame) -> list[str]:
    launchers = _setting(run, frame, "launcher")
    rates = [r for r in _setting(run, frame, "link_rate") if r != "unshaped"]
    notes = []
    if "local" in launchers:
        notes.append(f"All ranks ran on one host ({run.meta.get('host', '?')}, launcher local): no tensor crossed a "
                     "network link, where the paper's crossed InfiniBand between servers.")
    if "netns" in launchers:
        link = f"links shaped to {listing(rates)}" if rates else "unshaped veth links"
        notes.append(f"Ranks ran in network namespaces of one host over {link} (the paper's links: 100 Gbps).")
    if "mpi" in launchers:
        settings = run.meta.get("settings") or {}
        hosts = (settings.get("launcher") or {}).get("hosts") if isinstance(settings.get("launcher"), dict) else None
        notes.append("Ranks were started by MPI" + (f" on {listing(hosts)}" if hosts else "") + ".")
    return notes


def cores_note(run: Run, processes: str) -> str:
    cores, cpu = run.meta.get("cpu_count"), run.meta.get("cpu", "an unknown CPU")
    if not cores:
        return ""
    few = " so they compete for the CPU with each other and with polling" if cores <= 4 else ""
    return (f"{processes} shared {cores} cores of one {cpu} ({run.meta.get('host', '?')}),{few}; each of the paper's "
            f"servers had {paper.SETUP['cores_per_server']} cores and {paper.SETUP['gpu'].replace(' per server', '')}.")


def compute_notes(run: Run, frame: pd.DataFrame) -> list[str]:
    modes = unique(frame, "compute") or _setting(run, frame, "compute")
    notes = []
    if "replay" in modes:
        notes.append("Compute was REPLAYED: workers waited the compute time measured here instead of computing, "
                     "leaving the cores to communication.")
    if "paper" in modes:
        notes.append("Compute was REPLAYED at the paper's P100 times (Table 2): workers waited instead of computing.")
    if "real" in modes or not modes:
        share = ""
        if {"compute_s", "step_time_s", "transport"} <= set(frame.columns):
            has_zero = ZERO_COPY in set(frame["transport"])
            rows = frame[frame["transport"] == ZERO_COPY] if has_zero else frame
            shares = [100 * c / s for c, s in zip(rows["compute_s"], rows["step_time_s"], strict=True)
                      if not missing(c) and not missing(s) and s > 0]
            whose = f"{line_name(ZERO_COPY)}'s" if has_zero else "the"
            if shares:
                share = f"; compute was {range_text(shares, lambda v: f'{v:.0f}%')} of {whose} step time"
        notes.append(f"Workers computed on this CPU ({run.meta.get('cpu', '?')}), not a Tesla P100{share}: the more "
                     "of a step compute takes, the less any transport can change it.")
    return notes


def status_notes(run: Run) -> list[str]:
    notes = []
    status = run.meta.get("status")
    if status and status != "complete":
        notes.append(f"The run is marked '{status}': points it did not finish are missing.")
    if run.schema_version == 1:
        notes.append("Written by an earlier bench (results schema 1): every point measured once, without per-"
                     "iteration samples, so no spread is known.")
    return notes


def rounds_note(points: pd.DataFrame) -> str:
    if "rounds" not in points or points.empty:
        return ""
    rounds = sorted({int(r) for r in points["rounds"] if not missing(r)})
    if rounds and rounds[-1] > 1:
        return f"Each point is the median of {listing(rounds)} rounds, interleaved with the other transports."
    return ""


#: what each of ``bench micro --source``'s sources means, as a note says it
_SOURCE_WORDS = {
    "fresh": "before each transfer the sender wrote its whole tensor, outside the timed interval, as a backward pass "
             "writes a gradient every step",
    "reused": "the sender sent the same tensor again, written only where the harness marks it, as OSU and "
              "nccl-tests measure (the receiver's cache may still hold it from the last transfer)",
}


def source_note(run: Run, points: pd.DataFrame) -> str:
    """Which source a micro run's senders used (``--source``), and the lines that used another (the tools with loops
    of their own); a run from before the setting says it was not recorded."""
    setting = (run.meta.get("settings") or {}).get("source")
    if setting not in MICRO_SOURCES:
        return ("Source not recorded (a run from before bench micro --source, whose senders sent the same tensor "
                "again: reused).")
    others = {} if "source" not in points else {
        line: source for line, source in zip(points["transport"], points["source"], strict=True)
        if source in MICRO_SOURCES and source != setting}
    note = f"Source {setting} (bench micro --source): {_SOURCE_WORDS[setting]}."
    if others:
        note += (f" {listing(line_name(t) for t in ordered(others))}: {listing(sorted(set(others.values())))}, "
                 "their tools' own loops.")
    return note
