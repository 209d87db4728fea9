"""Figure 8, the send/receive micro-benchmark (``bench micro`` runs): per size, how many times faster zero copy
moves a tensor than each other transport, beside the paper's speed-ups.
"""

from __future__ import annotations

import pandas as pd

from bench.ground import paper
from bench.ground.sizes import format_size
from bench.readers.report.notes import (
    cores_note,
    fabric_notes,
    launch_notes,
    rounds_note,
    source_note,
    status_notes,
)
from bench.readers.report.page import Section, Table
from bench.readers.report.text import (
    ZERO_COPY,
    claim_cell,
    column_cell,
    divide,
    line_name,
    lines_of,
    listing,
    missing,
    num,
    quote,
    range_text,
    ratio_cell,
)
from bench.results import Run
from bench.results.lines import COMPARED_KINDS


def figure8(run: Run, label: str) -> Section:
    """Figure 8: per size, how many times faster zero copy moves a tensor than each other transport."""
    points = run.points(also=("of_reference", "of_peer"))
    section = Section("figure8", "Figure 8: send/receive micro-benchmark", run, label,
                      paper=[quote(c) for c in paper.MICRO_SPEEDUP.values()])
    lines = lines_of(points, *COMPARED_KINDS)
    peers = lines_of(points, "peer")
    references = lines_of(points, "reference")
    sizes = sorted({int(s) for s in points["size_bytes"]})
    p50 = {(t, int(s)): v for t, s, v in zip(points["transport"], points["size_bytes"], points["p50_us"], strict=True)}
    point = {(r["transport"], int(r["size_bytes"])): r for _, r in points.iterrows()}
    others = [t for t in lines if t != ZERO_COPY]
    if ZERO_COPY not in lines or not others:  # no ratio to take: the times alone, and why
        lacking = "no zero-copy line" if ZERO_COPY not in lines else "no other transport"
        section.tables.append(Table("figure8-times", f"Median time per transfer (µs); {lacking} to compare with",
                                    ["size", *[line_name(t) for t in lines]],
                                    [[format_size(s), *[num(p50.get((t, s))) for t in lines]] for s in sizes]))
        section.notes.append(f"The run has {lacking} ({listing(map(line_name, lines)) or 'no transport'} only), so "
                             "no ratio can be set beside the paper's: run bench micro with --transports "
                             "zerocopy,grpc_tcp,... to get them.")
    else:
        show_reference = "of_reference" in points and any(
            not missing(v) for t, v in zip(points["transport"], points["of_reference"], strict=True) if t == ZERO_COPY)
        header = ["size", "RDMA.zerocp p50 (µs)", *(["of UCX's own (put bw)"] if show_reference else []),
                  *[f"over {line_name(t)}" for t in others]]
        rows = []
        for size in sizes:
            row = [format_size(size), num(p50.get((ZERO_COPY, size)))]
            if show_reference:
                row.append(column_cell(point.get((ZERO_COPY, size)), "of_reference", num))
            row += [ratio_cell(point.get((t, size)), point.get((ZERO_COPY, size)), "p50_us") for t in others]
            rows.append(row)
        section.tables.append(Table("figure8-ratios", "How many times faster RDMA.zerocp is: the other transport's "
                                    "median time per transfer / RDMA.zerocp's, per size (in brackets: the range the "
                                    "two points' spreads allow)", header, rows))
        summary = []
        for line in others:
            ratios = [divide(p50.get((line, s)), p50.get((ZERO_COPY, s))) for s in sizes]
            claim = paper.MICRO_SPEEDUP.get(line)
            summary.append([line_name(line), range_text(ratios), claim_cell(claim),
                            claim.verdict(ratios) if claim else "no paper number"])
        section.tables.append(Table("figure8-paper", "RDMA.zerocp over each transport: here (over the sizes run) and "
                                    "in the paper (§5.1)", ["over", "here", "paper", "here against the paper"],
                                    summary))
    if peers:
        section.tables.append(_peer_table(point, lines, peers, sizes, p50))
    if references:
        section.notes.append(f"Reference lines {listing(references)} are the machine's and the fabric library's own "
                             "limits, not transports: no ratio is taken against them.")
    if sizes:
        top = max(sizes)
        reach = "" if top >= paper.MICRO_MAX_SIZE else \
            f" (the paper's Figure 8 goes up to {format_size(paper.MICRO_MAX_SIZE)})"
        section.notes.append(f"Sizes {format_size(min(sizes))} to {format_size(top)}{reach}.")
    section.notes += fabric_notes(points)
    section.notes += launch_notes(run, points)
    if note := cores_note(run, "Sender and receiver processes and their progress threads"):
        section.notes.append(note)
    if note := rounds_note(points):
        section.notes.append(note)
    section.notes.append(source_note(run, points))
    section.notes += status_notes(run)
    return section


def _peer_table(point: dict[tuple[str, int], pd.Series], lines: list[str], peers: list[str], sizes: list[int],
                p50: dict[tuple[str, int], float]) -> Table:
    """Per size: each peer's median time, and each transport's over the best peer's (its ``of_peer``, with its range
    across rounds)."""
    header = ["size", *[f"{line_name(t)} p50 (µs)" for t in peers], *[f"{line_name(t)} / best" for t in lines]]
    rows = [[format_size(s), *[num(p50.get((t, s))) for t in peers],
             *[column_cell(point.get((t, s)), "of_peer") for t in lines]] for s in sizes]
    return Table("figure8-peers", "Against the libraries a user could pick instead (peer lines, timed as the "
                 "transports are): each peer's median time per transfer, and each transport's median over the best "
                 "peer's at that size (below 1.00x: faster than every peer; in brackets: the range across rounds)",
                 header, rows)
