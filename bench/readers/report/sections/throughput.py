"""Figure 9, training throughput (``bench model`` runs): zero copy's mini-batches per second over each other
line's, per model, batch size and servers, beside the paper's speed-ups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pandas as pd

from bench import TF_GRPC
from bench.ground import paper
from bench.ground.paper import model_name
from bench.readers.report.notes import compute_notes, cores_note, fabric_notes, launch_notes, rounds_note, status_notes
from bench.readers.report.page import Section, Table
from bench.readers.report.text import (
    MISSING,
    NO_ANALYSIS,
    ZERO_COPY,
    claim_cell,
    divide,
    line_name,
    listing,
    missing,
    num,
    ordered,
    percent,
    range_text,
    ratio_cell,
    times,
)
from bench.results import Run
from bench.results import lines as catalogue


def figure9(run: Run, label: str) -> Section:
    """Zero copy's throughput over each other line's, and where the speed-ups fall against the paper's."""
    points = run.points()
    section = Section("figure9", "Figure 9: training throughput", run, label,
                      paper=[(paper.MODEL_SPEEDUP_QUOTE, paper.MODEL_SPEEDUP[("vgg16", catalogue.GRPC_RDMA)].section)])
    lines = ordered(t for t in points["transport"] if t != NO_ANALYSIS)
    tput = {(r.transport, r.model, int(r.batch_size), int(r.servers)): r.throughput_batches_per_s
            for r in points.itertuples(index=False)}
    point = {(r["transport"], r["model"], int(r["batch_size"]), int(r["servers"])): r for _, r in points.iterrows()}
    cases = list(dict.fromkeys((r.model, int(r.batch_size), int(r.servers)) for r in points.itertuples(index=False)))
    others = [t for t in lines if t != ZERO_COPY]
    if ZERO_COPY not in lines or not others:  # no ratio to take: the throughputs alone, and why
        lacking = "no zero-copy line" if ZERO_COPY not in lines else "no other line"
        section.tables.append(Table("figure9-throughput", f"Mini-batches per second per worker ({lacking} to "
                                    "compare with)", ["model", "batch", "servers", *[line_name(t) for t in lines]],
                                    [[model_name(m), str(b), str(s), *[num(tput.get((t, m, b, s))) for t in lines]]
                                     for m, b, s in cases]))
        section.notes.append(f"The run has {lacking} ({listing(map(line_name, lines)) or 'no line'} only), so no "
                             "ratio can be set beside the paper's: run bench model --transport zerocopy,grpc_tcp,... "
                             "to get them.")
    else:
        rows = [[model_name(m), str(b), str(s), num(tput.get((ZERO_COPY, m, b, s))),
                 *[ratio_cell(point.get((t, m, b, s)), point.get((ZERO_COPY, m, b, s)), "step_time_s")
                   for t in others]]
                for m, b, s in cases]
        section.tables.append(Table("figure9-ratios", "RDMA.zerocp's mini-batches per second over each other line's, "
                                    "per model, batch size and servers",
                                    ["model", "batch", "servers", "RDMA.zerocp (batches/s)",
                                     *[f"over {line_name(t)}" for t in others]], rows))
        summary = []
        for model in dict.fromkeys(m for m, _, _ in cases):
            for line in others:
                ratios = [divide(tput.get((ZERO_COPY, m, b, s)), tput.get((line, m, b, s)))
                          for m, b, s in cases if m == model]
                if all(missing(r) for r in ratios):
                    continue
                claim = paper.MODEL_SPEEDUP.get((model, catalogue.line(line).paper_line or line))
                show = percent if claim and claim.percent else times
                summary.append([model_name(model), line_name(line), range_text(ratios, show) + _also(ratios, show),
                                claim_cell(claim), claim.verdict(ratios) if claim else "no paper number"])
        if summary:
            section.tables.append(Table("figure9-paper", "RDMA.zerocp over each line: here (over the batch sizes run) "
                                        "and in the paper (§5.2, Figure 9)",
                                        ["model", "over", "here", "paper", "here against the paper"], summary))
        if TF_GRPC in others:
            section.notes.append("TF gRPC (tf_grpc) is TensorFlow's own parameter-server training over its gRPC "
                                 "runtime, what the paper calls gRPC.TCP: the paper's gRPC.TCP numbers are set beside "
                                 "it too.")
    section.notes += _model_context_notes(run, points, paper.MODEL_BATCH_SIZES)
    return section


def _also(ratios: Sequence[float | None], show: Callable[[float], str]) -> str:
    """The other spelling of a ratio range: ``+130%`` beside ``2.30x`` and the other way round."""
    other = times if show is percent else percent
    text = range_text([r for r in ratios if not missing(r)], other)
    return "" if text == MISSING else f" ({text})"

def _model_context_notes(run: Run, points: pd.DataFrame, batch_claim: str) -> list[str]:
    notes = []
    batches = sorted({int(b) for b in points["batch_size"]})
    servers = sorted({int(s) for s in points["servers"]})
    notes.append(f"Batch sizes {listing(batches)} per worker (the paper's: {batch_claim}); {listing(servers)} "
                 f"server(s), each a worker and a parameter server (the paper's cluster: {paper.SETUP['servers']} "
                 "servers).")
    notes += fabric_notes(points)
    notes += compute_notes(run, points)
    notes += launch_notes(run, points)
    most = max(servers) if servers else 1
    if note := cores_note(run, f"The {2 * most} processes of a {most}-server run (a worker and a parameter server "
                                "per server)"):
        notes.append(note)
    if note := rounds_note(points):
        notes.append(note)
    notes += status_notes(run)
    return notes

