"""Figure 11, scalability (``bench scale`` runs): total throughput against servers, over the Local line and over
the same transport on one server, beside the paper's speed-ups.
"""

from __future__ import annotations

from bench import LOCAL
from bench.ground import paper
from bench.ground.paper import model_name
from bench.readers.report.notes import compute_notes, cores_note, fabric_notes, launch_notes, status_notes
from bench.readers.report.page import Section, Table
from bench.readers.report.text import (
    ZERO_COPY,
    claim_cell,
    divide,
    line_name,
    listing,
    num,
    ordered,
    percent,
    quote,
    times,
)
from bench.results import Run
from bench.results.lines import GRPC_RDMA


def figure11(run: Run, label: str) -> Section:
    """Figure 11: throughput against servers, over the Local line and over the same transport's single server."""
    points = run.points()
    section = Section("figure11", "Figure 11: scalability", run, label,
                      paper=[quote(paper.SCALE_OVER_LOCAL[("lstm", GRPC_RDMA)]),
                             quote(paper.SCALE_OVER_LOCAL[("lstm", ZERO_COPY)]),
                             quote(paper.SCALE_OVER_ONE_SERVER[("lstm", ZERO_COPY)]),
                             quote(paper.SCALE_OVER_ONE_SERVER[("vgg16", ZERO_COPY)]),
                             quote(paper.SCALE_OVER_GRPC_RDMA["lstm"])])
    per_worker_sum = points["throughput_batches_per_s"] * points["servers"]
    points = points.assign(total_batches_per_s=points["total_batches_per_s"].fillna(per_worker_sum)
                           if "total_batches_per_s" in points else per_worker_sum)
    total = {(r.transport, r.model, int(r.batch_size), int(r.servers)): r.total_batches_per_s
             for r in points.itertuples(index=False)}
    comparisons = []
    for model, batch in dict.fromkeys((r.model, int(r.batch_size)) for r in points.itertuples(index=False)):
        subset = points[(points["model"] == model) & (points["batch_size"] == batch)]
        local_rows = subset[subset["transport"] == LOCAL]
        local = float(local_rows["total_batches_per_s"].median()) if len(local_rows) else None
        lines = [t for t in ordered(subset["transport"]) if t != LOCAL]
        servers = sorted({int(s) for s in subset[subset["transport"] != LOCAL]["servers"]})
        header = ["servers"]
        for line in lines:
            header += [f"{line_name(line)} (batches/s)", "over Local" if local else "", "over 1 server"]
        header = [h for h in header if h]
        rows = []
        for n in servers:
            row = [str(n)]
            for line in lines:
                value = total.get((line, model, batch, n))
                row.append(num(value))
                if local:
                    row.append(times(divide(value, local)))
                row.append(times(divide(value, total.get((line, model, batch, 1)))))
            rows.append(row)
        section.tables.append(Table(f"figure11-{model}-{batch}", f"{model_name(model)}, batch {batch} per worker: "
                                    "total mini-batches per second, and the speed-up over the Local line (one process, "
                                    "no communication) and over the same transport on one server", header, rows))
        most = max(servers) if servers else None
        if most is None:
            continue
        at = f"{most} servers"
        for line in lines:
            value = total.get((line, model, batch, most))
            claim = paper.SCALE_OVER_LOCAL.get((model, line))
            if local:
                ratio = divide(value, local)
                comparisons.append([model_name(model), line_name(line), f"over Local at {at}", times(ratio),
                                    claim_cell(claim), claim.verdict([ratio]) if claim else "no paper number"])
            claim = paper.SCALE_OVER_ONE_SERVER.get((model, line))
            ratio = divide(value, total.get((line, model, batch, 1)))
            comparisons.append([model_name(model), line_name(line), f"over 1 server at {at}", times(ratio),
                                claim_cell(claim), claim.verdict([ratio]) if claim else "no paper number"])
        if ZERO_COPY in lines and GRPC_RDMA in lines:
            claim = paper.SCALE_OVER_GRPC_RDMA.get(model)
            ratio = divide(total.get((ZERO_COPY, model, batch, most)), total.get((GRPC_RDMA, model, batch, most)))
            comparisons.append([model_name(model), "RDMA.zerocp", f"over gRPC.RDMA at {at}", percent(ratio),
                                claim_cell(claim), claim.verdict([ratio]) if claim else "no paper number"])
    if comparisons:
        section.tables.append(Table("figure11-paper", f"Speed-ups at the most servers run, beside the paper's at "
                                    f"{paper.SCALE_SERVERS} servers (§5.2, Figure 11)",
                                    ["model", "line", "speed-up", "here", "paper", "here against the paper"],
                                    comparisons))
    servers = sorted({int(s) for s in points["servers"]})
    batches = sorted({int(b) for b in points["batch_size"]})
    section.notes.append(f"The paper's speed-ups are on {paper.SCALE_SERVERS} servers at batch "
                         f"{paper.SCALE_BATCH_SIZE} per worker; this run has {listing(servers)} server(s) at batch "
                         f"{listing(batches)}: with {max(servers)} servers the most any line can reach is "
                         f"{max(servers)}x its single server.")
    if LOCAL not in set(points["transport"]):
        section.notes.append("The run has no Local line (transport local), so no speed-up over it is shown.")
    section.notes += fabric_notes(points)
    section.notes += compute_notes(run, points)
    section.notes += launch_notes(run, points)
    if note := cores_note(run, f"The {2 * max(servers)} processes of the {max(servers)}-server runs"):
        section.notes.append(note)
    section.notes += status_notes(run)
    return section
