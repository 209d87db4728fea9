"""Figure 10, convergence (``bench converge`` runs): time to the target per transport and zero copy's speed-up
over gRPC.TCP (and gRPC.RDMA), beside the paper's.
"""

from __future__ import annotations

from bench.ground import paper
from bench.readers.report.notes import cores_note, fabric_notes, launch_notes, status_notes
from bench.readers.report.page import Section, Table
from bench.readers.report.text import (
    MISSING,
    ZERO_COPY,
    claim_cell,
    divide,
    line_name,
    listing,
    missing,
    num,
    percent,
    quote,
    times,
    unique,
)
from bench.results import Run
from bench.results import lines as catalogue


def figure10(run: Run, label: str) -> Section:
    """Figure 10: time to the target per transport and zero copy's speed-up over gRPC.TCP (and gRPC.RDMA)."""
    records = run.records
    settings = run.meta.get("settings") or {}
    task = str(settings.get("task") or (unique(records, "task") or ["?"])[0])
    claims = {other: paper.CONVERGE_SPEEDUP.get((task, other)) for other in (catalogue.GRPC_TCP, catalogue.GRPC_RDMA)}
    section = Section("figure10", f"Figure 10: convergence ({task})", run, label,
                      paper=[quote(c) for c in paper.CONVERGE_SPEEDUP.values()
                             if c in claims.values()] or [quote(c) for c in paper.CONVERGE_SPEEDUP.values()])
    summary = records[records["kind"] == "summary"] if "kind" in records else records.iloc[0:0]
    seconds = {r.transport: r.time_to_target_s for r in summary.itertuples(index=False)}
    rows = []
    for r in summary.itertuples(index=False):
        reached = not missing(r.time_to_target_s)
        over_tcp = r.speedup_vs_grpc_tcp if not missing(getattr(r, "speedup_vs_grpc_tcp", None)) else divide(
            seconds.get(catalogue.GRPC_TCP), r.time_to_target_s)
        rows.append([line_name(r.transport), str(r.target) if not missing(r.target) else MISSING,
                     num(r.steps_to_target) if reached else "not reached",
                     num(r.time_to_target_s) if reached else "not reached", times(over_tcp),
                     claim_cell(claims[catalogue.GRPC_TCP]) if r.transport == ZERO_COPY else ""])
    section.tables.append(Table("figure10-summary", "Time to the target per transport, and how many times sooner than "
                                "gRPC.TCP it got there", ["transport", "target", "steps", "seconds", "over gRPC.TCP",
                                                          "paper (RDMA.zerocp)"], rows))
    comparisons = []
    for other in (catalogue.GRPC_TCP, catalogue.GRPC_RDMA):
        if other not in seconds or ZERO_COPY not in seconds:
            continue
        ratio = divide(seconds[other], seconds[ZERO_COPY])
        claim = claims[other]
        show = percent if claim and claim.percent else times
        comparisons.append([f"RDMA.zerocp over {line_name(other)}", show(ratio) if ratio else "not reached by both",
                            claim_cell(claim), claim.verdict([ratio] if ratio else []) if claim else
                            "no paper number for this task"])
    if comparisons:
        section.tables.append(Table("figure10-paper", "Zero copy's speed-up to the target, beside the paper's (§5.2, "
                                    "Figure 10)", ["speed-up", "here", "paper", "here against the paper"], comparisons))
    if summary.empty:
        section.notes.append("The run has no summary records (kind summary): it ended before every transport was "
                             "evaluated, so no time to target is known.")
    elif summary["time_to_target_s"].isna().all():
        section.notes.append(f"No transport reached the target {listing(unique(summary, 'target'))} within the "
                             "run: train for longer (--steps, --time) or set an easier --target.")
    if task not in paper.CONVERGE_TASKS:
        sooner = listing(f"{paper.CONVERGE_SPEEDUP[(name, catalogue.GRPC_TCP)].text()} ({title})"
                          for name, title in paper.CONVERGE_TASKS.items())
        section.notes.append(f"The task '{task}' has no counterpart in the paper, whose Figure 10 trains "
                             f"{listing(paper.CONVERGE_TASKS.values())}: RDMA.zerocp reached the target {sooner} "
                             "sooner than gRPC.TCP.")
    servers, batch = settings.get("servers") or unique(records, "servers"), settings.get("batch_size")
    if servers:
        servers = servers if isinstance(servers, list) else [servers]
        section.notes.append(f"{listing(servers)} worker(s)" + (f" at batch {batch}" if batch else "")
                             + f"; the paper split each dataset over {paper.CONVERGE_WORKERS} workers.")
    section.notes += fabric_notes(records)
    section.notes += launch_notes(run, records)
    if note := cores_note(run, "Workers and parameter servers"):
        section.notes.append(note)
    section.notes += status_notes(run)
    return section
