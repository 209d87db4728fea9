"""Figure 12, the cost of the sender's copy (``bench model`` runs with zero copy and its analysis off or
RDMA.cp): the mini-batch time without the zero-copy analysis over with it.
"""

from __future__ import annotations

from bench.ground import paper
from bench.ground.paper import model_name
from bench.readers.report.notes import compute_notes, fabric_notes, status_notes
from bench.readers.report.page import Section, Table
from bench.readers.report.text import (
    MISSING,
    NO_ANALYSIS,
    ZERO_COPY,
    divide,
    line_name,
    listing,
    num,
    percent,
    quote,
    spread_cell,
)
from bench.results import Run
from bench.results import ratio as ratio_of
from bench.results.lines import RDMA_CP


def figure12(run: Run, label: str) -> Section | None:
    """The step time with the analysis off (or RDMA.cp) over with it; None for a run without zero copy and one of
    them."""
    points = run.points()
    present = set(points["transport"])
    if ZERO_COPY not in present or not present & {NO_ANALYSIS, RDMA_CP}:
        return None
    claim = paper.COPY_OVERHEAD
    section = Section("figure12", "Figure 12: the cost of the sender's copy", run, label, paper=[quote(claim)])
    point = {(r["transport"], r["model"], int(r["batch_size"]), int(r["servers"])): r for _, r in points.iterrows()}
    step = {key: row["step_time_s"] for key, row in point.items()}
    lines = [t for t in (NO_ANALYSIS, RDMA_CP) if t in present]
    cases = list(dict.fromkeys((r.model, int(r.batch_size), int(r.servers)) for r in points.itertuples(index=False)
                               if r.transport == ZERO_COPY))
    header = ["model", "batch", "servers", "RDMA.zerocp step (s)"]
    for line in lines:
        header += [f"{line_name(line)} step (s)", f"{line_name(line)} against RDMA.zerocp"]
    rows, gains = [], []
    for model, batch, servers in cases:
        on = step.get((ZERO_COPY, model, batch, servers))
        row = [model_name(model), str(batch), str(servers), num(on)]
        for line in lines:
            off = step.get((line, model, batch, servers))
            ratio = divide(off, on)
            if ratio is not None:
                gains.append(ratio)
            between = (ratio_of(point[(line, model, batch, servers)], point[(ZERO_COPY, model, batch, servers)],
                                "step_time_s") if ratio is not None else None)
            row += [num(off), spread_cell(between.value, between.low, between.high, percent) if between else MISSING]
        rows.append(row)
    section.tables.append(Table("figure12-ratios", "Mini-batch time without the zero-copy analysis over with it "
                                "(+21% = 21% longer without it; in brackets: the range the two points' spreads "
                                "allow)", header, rows))
    section.tables.append(Table("figure12-paper", "The largest gain of the analysis: here and in the paper (§5.2)",
                                ["here (largest)", "paper", "here against the paper"],
                                [[percent(max(gains)) if gains else MISSING, claim.text() + " at batch "
                                  f"{paper.COPY_OVERHEAD_BATCH_SIZE}", claim.verdict(gains)]]))
    batches = sorted({b for _, b, _ in cases})
    if paper.COPY_OVERHEAD_BATCH_SIZE not in batches:
        section.notes.append(f"The paper's {claim.text()} is at batch {paper.COPY_OVERHEAD_BATCH_SIZE}; this run has "
                             f"batch size(s) {listing(batches)}.")
    if NO_ANALYSIS in lines:
        section.notes.append("RDMA.zerocp with the analysis off sends from memory it has to register or copy first "
                             "(dynamic allocation); RDMA.cp always copies into registered memory, the paper's "
                             "'analysis off' case.")
    section.notes += fabric_notes(points)
    section.notes += compute_notes(run, points)
    section.notes += status_notes(run)
    return section
