"""Figure 11 predicted (``bench predict`` runs, issue 62): total throughput and scaling efficiency against servers
per transport, what each line's step rests on at the most servers, and, for a prediction of the paper's cluster
(``--compute paper``: Table 2's P100 compute), the paper's Figure 11 ratios beside the predicted ones, each
difference explained from the predicted steps' parts.

Nothing here was trained: every number is a prediction from a micro run of the machine that made it (its costs)
and a simulation of the step. How far such a prediction is from a measured run is the section of
:mod:`bench.readers.report.sections.predict`.
"""

from __future__ import annotations

from bench.ground import paper
from bench.ground.paper import model_name
from bench.readers.report.notes import status_notes
from bench.readers.report.page import Section, Table
from bench.readers.report.text import (
    ZERO_COPY,
    claim_cell,
    divide,
    line_name,
    listing,
    num,
    ordered,
    quote,
    times,
)
from bench.results import Run
from bench.results import lines as catalogue
from bench.results.records import PredictRecord

#: the link rate of the paper's cluster (§5.1: 100 Gb/s RoCE), the one its Figure 11 ratios are compared at
PAPER_LINK_BPS = 100e9
#: a resource busy this share of a step or more is saturated (the step cannot shorten without relieving it)
SATURATED = 0.9


def figure11_predicted(run: Run, label: str) -> Section | None:
    """The predictions of one ``bench predict`` run, per model, batch size and link rate."""
    records = run.records
    if records.empty:
        return None
    section = Section("figure11-predicted", "Figure 11 predicted: scalability beyond this machine", run, label,
                      paper=_paper_quotes(records))
    panels = list(dict.fromkeys(zip(records["model"], records["batch_size"], records["link_rate"], strict=True)))
    for model, batch, rate in panels:
        rows = records[(records["model"] == model) & (records["batch_size"] == batch) & (records["link_rate"] == rate)]
        lines = ordered(rows["transport"])
        servers = sorted({int(n) for n in rows["servers"]})
        at = {(r.transport, int(r.servers)): r for r in rows.itertuples(index=False)}
        table = [[str(n), *(f"{num(at[(t, n)].total_batches_per_s)} ({at[(t, n)].scaling_efficiency:.2f})"
                            if (t, n) in at else "—" for t in lines)] for n in servers]
        tag = f"{model}-{int(batch)}-{rate}"
        section.tables.append(Table(f"predicted-{tag}", f"{model_name(model)}, batch {int(batch)} per worker, {rate} "
                                    "links: total mini-batches per second predicted (scaling efficiency)",
                                    ["servers", *map(line_name, lines)], table))
        most = servers[-1]
        parts = []
        for t in lines:
            if (t, most) not in at:
                continue
            r = at[(t, most)]
            first = next((n for n in servers if (t, n) in at and at[(t, n)].saturated_utilisation >= SATURATED), None)
            parts.append([line_name(t), f"{r.step_time_s:.4g}", f"{r.compute_fraction:.0%}", f"{r.host_fraction:.0%}",
                          f"{r.wire_fraction:.0%}", f"{r.wait_fraction:.0%}",
                          f"{PredictRecord.describe_resource(r.saturated)} ({r.saturated_utilisation:.0%})",
                          f"{first}: {PredictRecord.describe_resource(at[(t, first)].saturated)}" if first else "none"])
        section.tables.append(Table(f"predicted-parts-{tag}", f"{model_name(model)}, {rate} links, {most} servers: "
                                    "what a predicted step rests on (per worker, averaged)",
                                    ["line", "step (s)", "compute", "host", "wire", "waiting", "busiest resource",
                                     f"saturated (>= {SATURATED:.0%}) first at"], parts))
    comparisons, explained = paper_comparison(records)
    if comparisons:
        section.tables.append(Table("predicted-paper", "The paper's Figure 11 (and Figure 9) ratios beside the "
                                    "predicted ones on its cluster (Table 2's P100 compute, 100 Gb/s links)",
                                    ["model", "ratio", "servers", "predicted", "paper", "predicted / paper"],
                                    comparisons))
        section.notes += explained
    section.notes.append(f"Every number here is predicted (bench predict), none measured: transfer costs from the "
                         f"micro run {run.meta.get('settings', {}).get('micro_run', '?')} of the machine that made "
                         f"the run, compute {listing(sorted(set(records['compute'])))}; a server is one host running "
                         f"a worker and a parameter server, each host one NIC at the link rate.")
    section.notes.append(_how_to_check(records))
    section.notes += status_notes(run)
    return section


def _how_to_check(records) -> str:
    """How a user checks such predictions against real runs on one machine (issue 62's validation)."""
    model, rate = records["model"].iloc[0], records["link_rate"].iloc[0]
    return (f"To check predictions against real runs here: `bench scale {model} --launcher netns --compute replay "
            f"--link-rate {rate} --servers 1,2,4`, then `bench predict {model} --servers 1,2,4 --link-rate {rate} "
            f"--shared-cores <this machine's cores> --compute-from <that run>` (every emulated host on this "
            f"machine's cores, its measured compute); `bench report` of both runs sets each prediction beside its "
            f"measured point with the error, and Optimus's curve fit beside it.")


def _paper_quotes(records) -> list[tuple[str, str]]:
    if "vgg16" not in set(records["model"]):
        return []
    return [quote(paper.SCALE_OVER_GRPC_RDMA["vgg16"]), quote(paper.SCALE_OVER_ONE_SERVER[("vgg16", ZERO_COPY)]),
            quote(paper.SCALE_OVER_LOCAL[("vgg16", ZERO_COPY)])]


def paper_comparison(records) -> tuple[list[list[str]], list[str]]:
    """Rows setting the predicted ratios of the paper's cluster (``compute`` paper, 100 Gb/s) beside the paper's
    Figure 11 (and Figure 9's over gRPC.TCP, which Figure 11 does not state), and a note per ratio explaining the
    difference from the predicted steps' parts."""
    rows_out: list[list[str]] = []
    notes: list[str] = []
    ours = records[(records["compute"] == "paper") & (records["link_rate_bps"] == PAPER_LINK_BPS)]
    for model in dict.fromkeys(ours["model"]):
        rows = ours[ours["model"] == model]
        at = {(r.transport, int(r.servers)): r for r in rows.itertuples(index=False)}
        servers = sorted(n for n in {int(n) for n in rows["servers"]} if n <= paper.SCALE_SERVERS)
        claims = [(catalogue.GRPC_RDMA, paper.SCALE_OVER_GRPC_RDMA.get(model), "Figure 11"),
                  (catalogue.GRPC_TCP, paper.MODEL_SPEEDUP.get((model, catalogue.GRPC_TCP)), "Figure 9")]
        for other, claim, figure in claims:
            if claim is None or (ZERO_COPY, paper.SCALE_SERVERS) not in at:
                continue
            for n in servers:
                ratio = divide(_total(at, ZERO_COPY, n), _total(at, other, n))
                rows_out.append([model_name(model), f"{line_name(ZERO_COPY)} over {line_name(other)}", str(n),
                                 times(ratio), f"{claim_cell(claim)} ({figure})",
                                 times(divide(ratio, claim.low))])
            notes.append(_why(model, at, other, claim.low))
        for claim, what, base in ((paper.SCALE_OVER_ONE_SERVER.get((model, ZERO_COPY)), "over 1 server",
                                   _total(at, ZERO_COPY, 1)),
                                  (paper.SCALE_OVER_LOCAL.get((model, ZERO_COPY)), "over Local",
                                   _local(rows))):
            ratio = divide(_total(at, ZERO_COPY, paper.SCALE_SERVERS), base)
            if claim is None or ratio is None:
                continue
            rows_out.append([model_name(model), f"{line_name(ZERO_COPY)} {what}", str(paper.SCALE_SERVERS),
                             times(ratio), f"{claim_cell(claim)} (Figure 11)",
                             times(divide(ratio, claim.low))])
    return rows_out, notes


def _total(at: dict, line: str, servers: int) -> float | None:
    record = at.get((line, servers))
    return None if record is None else record.total_batches_per_s


def _local(rows) -> float | None:
    """The Local line on one server: one process computing without communication, a batch per compute time."""
    compute = rows["compute_s"].median()
    return 1 / compute if compute and compute > 0 else None


def _why(model: str, at: dict, other: str, claimed: float) -> str:
    """Why the predicted ratio of zero copy over ``other`` at the paper's most servers differs from the paper's:
    both lines' predicted step split into compute, host work, wire and waiting."""
    n = paper.SCALE_SERVERS
    ours, theirs = at.get((ZERO_COPY, n)), at.get((other, n))
    if ours is None or theirs is None:
        return f"{model_name(model)}: no {n}-server prediction of {line_name(other)} to compare."
    ratio = theirs.step_time_s / ours.step_time_s

    def split(r) -> str:
        return (f"{r.step_time_s * 1e3:.0f} ms: {r.compute_fraction:.0%} compute, {r.host_fraction:.0%} host work, "
                f"{r.wire_fraction:.0%} wire, {r.wait_fraction:.0%} waiting")

    bound = theirs.compute_fraction * theirs.step_time_s
    most = theirs.step_time_s / bound if bound > 0 else float("inf")
    return (f"{model_name(model)} at {n} servers, {line_name(ZERO_COPY)} over {line_name(other)}: predicted "
            f"{times(ratio)}, the paper {times(claimed)}. {line_name(other)}'s step {split(theirs)}; "
            f"{line_name(ZERO_COPY)}'s {split(ours)}. With the same compute, no transport can be more than "
            f"{times(most)} faster than {line_name(other)} here (its step over the compute): the paper's ratio needs "
            f"{line_name(other)}'s communication to cost more than this machine's measured host time and the wire "
            "say it does.")
