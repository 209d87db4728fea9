"""One page for any mix of runs: every figure, and beside it the measured ratios and the paper's numbers.

``bench report RESULTS_DIR...`` reads run directories (``meta.json`` and ``records.csv``; never writes into
them) of the experiments ``micro``, ``model``, ``scale``, ``converge``, ``models``, ``analysis`` (and
``soak``) and makes one section per figure of the paper each run reproduces:

==========================  ===========  ============================================================
section                     from         the ratio measured here
==========================  ===========  ============================================================
Figure 8, micro-benchmark   micro        other transport's median time / zero copy's, per size
Table 2, the models         models       model size, variables, compute ms/sample: here / the paper
                            model        model size moved per step / the paper's
Figure 7, tensor sizes      analysis     static/dynamic tensors, bytes, share above 10 KB and 1 MB
Figure 9, model throughput  model        zero copy's mini-batches/s / the other transport's
Figure 10, convergence      converge     time to target of grpc_tcp (and grpc_rdma) / zero copy's
Figure 11, scalability      scale        total throughput / the Local line's, / the 1-server one's
Figure 12, copy overhead    model        step time with the analysis off (or RDMA.cp) / on
==========================  ===========  ============================================================

Each section quotes the paper (:mod:`bench.paper`, the one place its numbers live), says where the ratios
fall against them, and explains the differences from the run's own data: the fabric that carried the
tensors (``ucx:cma,posix,sysv`` is shared memory on one host, not an RDMA NIC), the cores, replayed compute,
launcher and link rate, batch sizes and servers, against the paper's 8 servers with P100 GPUs and 100 Gbps
InfiniBand.

The page is self-contained (figures embedded as PNG ``data:`` URIs, no script, no network); the Markdown
form has the same tables and refers to the figures as PNG files written beside it. Figures come from
:func:`bench.readers.plot.plot_run`, drawn into a temporary directory; a run whose figures fail keeps its tables
and gets a one-line note. matplotlib is only imported when figures are drawn. Nothing is clipped: a table wider
than its column scrolls sideways in a box of its own (the scroll bar right under it), a figure is never shown at
less than half its pixels (:data:`MIN_FIGURE_SCALE`: 8-point text stays 8 CSS pixels high) and one too wide for the
column beside the tables gets the page's width below them.
"""

from __future__ import annotations

import base64
import html
import math
import re
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from bench import paper
from bench.paper import model_name
from bench.results import META_FILE, ResultsError, Run, default_run_dir, load_run, ratio, replace_file
from bench.sizes import format_size

#: short names of the lines, as the paper calls them (this suite's labels otherwise)
NAMES = {
    "grpc_tcp": "gRPC.TCP",
    "grpc_rdma": "gRPC.RDMA",
    "grpc_rdma:direct": "gRPC.RDMA direct",
    "rdma_cp": "RDMA.cp",
    "zerocopy": "RDMA.zerocp",
    "zerocopy:no_analysis": "RDMA.zerocp (analysis off)",
    "local": "Local",
    "tf_grpc": "TF gRPC (tf_grpc)",
}
#: the order lines appear in, in every table
ORDER = ("zerocopy", "zerocopy:no_analysis", "rdma_cp", "grpc_rdma", "grpc_rdma:direct", "grpc_tcp", "tf_grpc",
         "local")
#: micro lines that are no transport: the fabric library's limit and a copy in one process (never a ratio's base)
REFERENCE_LINES = ("ucx_perftest", "ucx_perftest_lat", "ib_write_bw", "ib_write_lat", "memcpy")
ZERO_COPY = "zerocopy"
NO_ANALYSIS = "zerocopy:no_analysis"
#: UCX transports that move data through memory shared between processes of one host
_SHARED_MEMORY = {"cma", "posix", "sysv", "xpmem", "knem", "self"}
_MISSING = "—"
#: section order on the page
_SECTION_ORDER = ("figure8", "table2", "figure7", "figure9", "figure10", "figure11", "figure12", "soak")


class ReportError(ValueError):
    """Nothing to report on: no run directory, or a path that is none; the message names the fix."""


# -- what a page is made of ----------------------------------------------------------------------------


@dataclass
class Table:
    """A table of formatted cells; ``name`` identifies it on the page (``data-table``)."""

    name: str
    caption: str
    header: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    """A figure drawn from a run: its PNG in the report's temporary directory."""

    stem: str
    png: Path


@dataclass
class Section:
    """One figure or table of the paper as one run reproduces it."""

    key: str
    title: str
    run: Run | None = None
    run_label: str = ""
    paper: list[tuple[str, str]] = field(default_factory=list)  # (quote, section of the paper)
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    #: why the numbers differ from the paper's, from the run's data
    notes: list[str] = field(default_factory=list)
    #: one line when the figures could not be drawn
    figure_note: str = ""


@dataclass
class Report:
    """Every section of a page, the runs behind it and what went wrong making it."""

    runs: list[tuple[str, Run]]
    sections: list[Section]
    created: str
    warnings: list[str] = field(default_factory=list)


# -- formatting ----------------------------------------------------------------------------------------


def _missing(value: Any) -> bool:
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def times(ratio: float | None) -> str:
    """A ratio as ``10.0x``, ``1.23x``, ``123x``; a dash when there is none."""
    if _missing(ratio) or not math.isfinite(ratio):
        return _MISSING
    if abs(ratio) >= 100:
        return f"{ratio:.0f}x"
    if abs(ratio) >= 10:
        return f"{ratio:.1f}x"
    return f"{ratio:.2f}x"


def percent(ratio: float | None) -> str:
    """A ratio as the improvement it is: 2.3 -> ``+130%``."""
    if _missing(ratio) or not math.isfinite(ratio):
        return _MISSING
    return f"{(ratio - 1) * 100:+.0f}%"


def _num(value: Any, spec: str = ".3g") -> str:
    if _missing(value):
        return _MISSING
    if isinstance(value, str):
        return value
    return format(float(value), spec)


def _ratio(numerator: Any, denominator: Any) -> float | None:
    if _missing(numerator) or _missing(denominator) or not float(denominator) > 0:
        return None
    return float(numerator) / float(denominator)


def _ratio_cell(numerator: Any, denominator: Any, column: str) -> str:
    """The ratio of ``column`` between two points (rows of ``Run.points()``), with the range their spreads give
    when they have one (rounds, or the samples' interval of the median): ``1.34x (0.97x to 1.79x)``."""
    if numerator is None or denominator is None:
        return _MISSING
    measured = ratio(numerator, denominator, column)
    if _missing(measured.value):
        return _MISSING
    if times(measured.low) == times(measured.value) == times(measured.high):
        return times(measured.value)
    return f"{times(measured.value)} ({times(measured.low)} to {times(measured.high)})"


def _name(line: str) -> str:
    return NAMES.get(line, line)


def _ordered(lines: Iterable[str]) -> list[str]:
    present = list(dict.fromkeys(lines))
    return sorted(present, key=lambda t: (ORDER.index(t) if t in ORDER else len(ORDER), t))


def _listing(values: Iterable[Any]) -> str:
    items = [str(v) for v in values]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def _range_text(values: Sequence[float], show: Callable[[float], str] = times) -> str:
    values = [v for v in values if not _missing(v)]
    if not values:
        return _MISSING
    low, high = min(values), max(values)
    return show(low) if show(low) == show(high) else f"{show(low)} to {show(high)}"


def _claim_cell(claim: paper.Claim | None) -> str:
    return claim.text() if claim else _MISSING


def _quote(claim: paper.Claim) -> tuple[str, str]:
    return (claim.quote, claim.section)


def _unique(frame: pd.DataFrame, column: str) -> list[Any]:
    if column not in frame:
        return []
    return list(dict.fromkeys(v for v in frame[column] if not _missing(v) and v != ""))


# -- why the numbers differ: sentences made from a run's data --------------------------------------------


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


def _fabric_notes(frame: pd.DataFrame) -> list[str]:
    if "fabric" not in frame or "transport" not in frame:
        return []
    carried: dict[str, list[str]] = {}
    for line, fabric in zip(frame["transport"], frame["fabric"], strict=True):
        if _missing(fabric) or fabric in ("", "none") or line in REFERENCE_LINES:
            continue
        carried.setdefault(str(fabric), [])
        if line not in carried[str(fabric)]:
            carried[str(fabric)].append(line)
    notes = [f"{_listing(_name(t) for t in _ordered(lines))} moved tensors over {describe_fabric(fabric)}; the "
             f"paper's crossed {paper.SETUP['network']} between servers."
             for fabric, lines in carried.items()]
    if any(p for fabric in carried for p in fabric.partition(":")[2].split(",") if p in _SHARED_MEMORY):
        notes.append("Over shared memory a one-sided write is a copy by the CPU (cma: process_vm_writev), so zero "
                     "copy saves copies but not the cost of moving the bytes, which an RDMA NIC takes off the CPU.")
    return notes


def _setting(run: Run, frame: pd.DataFrame, column: str) -> list[Any]:
    values = _unique(frame, column)
    if values:
        return values
    settings = run.meta.get("settings") or {}
    launcher = settings.get("launcher")
    value = launcher.get(column) if isinstance(launcher, dict) else (launcher if column == "launcher" else None)
    return [value] if value not in (None, "") else []


def _launch_notes(run: Run, frame: pd.DataFrame) -> list[str]:
    launchers = _setting(run, frame, "launcher")
    rates = [r for r in _setting(run, frame, "link_rate") if r != "unshaped"]
    notes = []
    if "local" in launchers:
        notes.append(f"All ranks ran on one host ({run.meta.get('host', '?')}, launcher local): no tensor crossed a "
                     "network link, where the paper's crossed InfiniBand between servers.")
    if "netns" in launchers:
        link = f"links shaped to {_listing(rates)}" if rates else "unshaped veth links"
        notes.append(f"Ranks ran in network namespaces of one host over {link} (the paper's links: 100 Gbps).")
    if "mpi" in launchers:
        settings = run.meta.get("settings") or {}
        hosts = (settings.get("launcher") or {}).get("hosts") if isinstance(settings.get("launcher"), dict) else None
        notes.append("Ranks were started by MPI" + (f" on {_listing(hosts)}" if hosts else "") + ".")
    return notes


def _cores_note(run: Run, processes: str) -> str:
    cores, cpu = run.meta.get("cpu_count"), run.meta.get("cpu", "an unknown CPU")
    if not cores:
        return ""
    few = " so they compete for the CPU with each other and with polling" if cores <= 4 else ""
    return (f"{processes} shared {cores} cores of one {cpu} ({run.meta.get('host', '?')}),{few}; each of the paper's "
            f"servers had {paper.SETUP['cores_per_server']} cores and {paper.SETUP['gpu'].replace(' per server', '')}.")


def _compute_notes(run: Run, frame: pd.DataFrame) -> list[str]:
    modes = _unique(frame, "compute") or _setting(run, frame, "compute")
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
                      if not _missing(c) and not _missing(s) and s > 0]
            whose = f"{_name(ZERO_COPY)}'s" if has_zero else "the"
            if shares:
                share = f"; compute was {_range_text(shares, lambda v: f'{v:.0f}%')} of {whose} step time"
        notes.append(f"Workers computed on this CPU ({run.meta.get('cpu', '?')}), not a Tesla P100{share}: the more "
                     "of a step compute takes, the less any transport can change it.")
    return notes


def _status_notes(run: Run) -> list[str]:
    notes = []
    status = run.meta.get("status")
    if status and status != "complete":
        notes.append(f"The run is marked '{status}': points it did not finish are missing.")
    if run.schema_version == 1:
        notes.append("Written by an earlier bench (results schema 1): every point measured once, without per-"
                     "iteration samples, so no spread is known.")
    return notes


def _rounds_note(points: pd.DataFrame) -> str:
    if "rounds" not in points or points.empty:
        return ""
    rounds = sorted({int(r) for r in points["rounds"] if not _missing(r)})
    if rounds and rounds[-1] > 1:
        return f"Each point is the median of {_listing(rounds)} rounds, interleaved with the other transports."
    return ""


# -- Figure 8: micro -------------------------------------------------------------------------------------


def micro_sections(run: Run, label: str) -> list[Section]:
    """Figure 8: per size, how many times faster zero copy moves a tensor than each other transport."""
    points = run.points()
    section = Section("figure8", "Figure 8: send/receive micro-benchmark", run, label,
                      paper=[_quote(c) for c in paper.MICRO_SPEEDUP.values()])
    lines = _ordered(t for t in points["transport"] if t not in REFERENCE_LINES)
    references = [t for t in dict.fromkeys(points["transport"]) if t in REFERENCE_LINES]
    sizes = sorted({int(s) for s in points["size_bytes"]})
    p50 = {(t, int(s)): v for t, s, v in zip(points["transport"], points["size_bytes"], points["p50_us"], strict=True)}
    point = {(r["transport"], int(r["size_bytes"])): r for _, r in points.iterrows()}
    if ZERO_COPY not in lines:
        section.tables.append(Table("figure8-times", "Median time per transfer (µs); no zero-copy line to compare with",
                                    ["size", *[_name(t) for t in lines]],
                                    [[format_size(s), *[_num(p50.get((t, s))) for t in lines]] for s in sizes]))
        section.notes.append("The run has no zerocopy (RDMA.zerocp) line, so no ratio can be set beside the paper's: "
                             "run bench micro with --transports zerocopy,... to get them.")
    else:
        others = [t for t in lines if t != ZERO_COPY]
        of_reference = {int(s): v for t, s, v in zip(points["transport"], points["size_bytes"],
                                                     points.get("of_reference", pd.Series([None] * len(points))),
                                                     strict=True) if t == ZERO_COPY}
        show_reference = any(not _missing(v) for v in of_reference.values())
        header = ["size", "RDMA.zerocp p50 (µs)", *(["of UCX's own (put bw)"] if show_reference else []),
                  *[f"over {_name(t)}" for t in others]]
        rows = []
        for size in sizes:
            row = [format_size(size), _num(p50.get((ZERO_COPY, size)))]
            if show_reference:
                row.append(_num(of_reference.get(size), ".2g"))
            row += [_ratio_cell(point.get((t, size)), point.get((ZERO_COPY, size)), "p50_us") for t in others]
            rows.append(row)
        section.tables.append(Table("figure8-ratios", "How many times faster RDMA.zerocp is: the other transport's "
                                    "median time per transfer / RDMA.zerocp's, per size (in brackets: the range the "
                                    "two points' spreads allow)", header, rows))
        summary = []
        for line in others:
            ratios = [_ratio(p50.get((line, s)), p50.get((ZERO_COPY, s))) for s in sizes]
            claim = paper.MICRO_SPEEDUP.get(line)
            summary.append([_name(line), _range_text(ratios), _claim_cell(claim),
                            claim.verdict(ratios) if claim else "no paper number"])
        section.tables.append(Table("figure8-paper", "RDMA.zerocp over each transport: here (over the sizes run) and "
                                    "in the paper (§5.1)", ["over", "here", "paper", "here against the paper"],
                                    summary))
    if references:
        section.notes.append(f"Reference lines {_listing(references)} are the machine's and the fabric library's own "
                             "limits, not transports: no ratio is taken against them.")
    if sizes:
        top = max(sizes)
        reach = "" if top >= paper.MICRO_MAX_SIZE else \
            f" (the paper's Figure 8 goes up to {format_size(paper.MICRO_MAX_SIZE)})"
        section.notes.append(f"Sizes {format_size(min(sizes))} to {format_size(top)}{reach}.")
    section.notes += _fabric_notes(points)
    section.notes += _launch_notes(run, points)
    if note := _cores_note(run, "Sender and receiver processes and their progress threads"):
        section.notes.append(note)
    if note := _rounds_note(points):
        section.notes.append(note)
    section.notes += _status_notes(run)
    return [section]


# -- Table 2: models, and model sizes of model runs ------------------------------------------------------


def _paper_model(model: str) -> paper.PaperModel | None:
    return paper.TABLE2.get(model)


def models_sections(run: Run, label: str) -> list[Section]:
    """Table 2: each model's size, variables and local compute time per sample, here against the paper's."""
    records = run.records
    section = Section("table2", "Table 2: the benchmark models", run, label,
                      paper=[(paper.TABLE2_QUOTE, paper.TABLE2_SECTION)])
    rows, slow = [], []
    for _, r in records.iterrows():
        known = _paper_model(str(r["model"]))
        paper_mb = r.get("paper_model_mb") if not _missing(r.get("paper_model_mb")) else (known and known.model_mb)
        paper_vars = r.get("paper_variables") if not _missing(r.get("paper_variables")) else (
            known and known.variables)
        paper_ms = r.get("paper_compute_ms_per_sample") if not _missing(r.get("paper_compute_ms_per_sample")) else (
            known and known.compute_ms_per_sample)
        ratio_ms = _ratio(r["compute_ms_per_sample"], paper_ms)
        if ratio_ms:
            slow.append(ratio_ms)
        rows.append([known.name if known else str(r["model"]), _num(r.get("batch_size"), "g"),
                     _num(r["variables"], "g"), _num(paper_vars, "g"),
                     _num(r["model_mb"], ".2f"), _num(paper_mb, ".2f"), times(_ratio(r["model_mb"], paper_mb)),
                     _num(r["compute_ms_per_sample"], ".3g"), _num(paper_ms, ".3g"), times(ratio_ms)])
    section.tables.append(Table("table2", "Here against the paper's Table 2 (here / paper as a ratio)",
                                ["model", "batch", "variables", "paper", "size (MB)", "paper (MB)", "here / paper",
                                 "compute (ms/sample)", "paper (ms/sample)", "here / paper"], rows))
    if slow:
        section.notes.append(f"Compute per sample here is {_range_text(slow)} the paper's: this CPU "
                             f"({run.meta.get('cpu', '?')}, {run.meta.get('cpu_count', '?')} cores) against one "
                             "Tesla P100 GPU.")
    section.notes.append("Sizes are of float32 variables in MB of 2**20 bytes; bench/models.py explains the layouts "
                         "(10 output classes, Keras' Inception-v3 without its auxiliary head, TensorFlow 1's RNN cells "
                         "splitting their variables differently).")
    section.notes += _status_notes(run)
    return [section]


def _model_size_section(run: Run, label: str, points: pd.DataFrame) -> Section | None:
    if "model_mb" not in points or points["model_mb"].isna().all():
        return None
    sizes = points.dropna(subset=["model_mb"]).groupby("model", sort=False)["model_mb"].median()
    rows = []
    for model, mb in sizes.items():
        known = _paper_model(str(model))
        rows.append([known.name if known else str(model), _num(mb, ".2f"), _num(known and known.model_mb, ".2f"),
                     times(_ratio(mb, known and known.model_mb))])
    return Section("table2", "Table 2: model size moved per step", run, label,
                   paper=[(paper.TABLE2_QUOTE, paper.TABLE2_SECTION)],
                   tables=[Table("table2-model-size", "Model size of the model runs against Table 2's",
                                 ["model", "size here (MB)", "paper (MB)", "here / paper"], rows)])


# -- Figure 9 and Figure 12: model -----------------------------------------------------------------------


def _model_context_notes(run: Run, points: pd.DataFrame, batch_claim: str) -> list[str]:
    notes = []
    batches = sorted({int(b) for b in points["batch_size"]})
    servers = sorted({int(s) for s in points["servers"]})
    notes.append(f"Batch sizes {_listing(batches)} per worker (the paper's: {batch_claim}); {_listing(servers)} "
                 f"server(s), each a worker and a parameter server (the paper's cluster: {paper.SETUP['servers']} "
                 "servers).")
    notes += _fabric_notes(points)
    notes += _compute_notes(run, points)
    notes += _launch_notes(run, points)
    most = max(servers) if servers else 1
    if note := _cores_note(run, f"The {2 * most} processes of a {most}-server run (a worker and a parameter server "
                                "per server)"):
        notes.append(note)
    if note := _rounds_note(points):
        notes.append(note)
    notes += _status_notes(run)
    return notes


def model_sections(run: Run, label: str) -> list[Section]:
    """Figure 9 (zero copy's throughput over each other line), Table 2's model size, and Figure 12 when the run has
    zero copy with the analysis off or RDMA.cp."""
    points = run.points()
    sections = [_throughput_section(run, label, points)]
    if size := _model_size_section(run, label, points):
        sections.append(size)
    lines = set(points["transport"])
    if ZERO_COPY in lines and lines & {NO_ANALYSIS, "rdma_cp"}:
        sections.append(_copy_overhead_section(run, label, points))
    return sections


def _throughput_section(run: Run, label: str, points: pd.DataFrame) -> Section:
    section = Section("figure9", "Figure 9: training throughput", run, label,
                      paper=[(paper.MODEL_SPEEDUP_QUOTE, paper.MODEL_SPEEDUP[("vgg16", "grpc_rdma")].section)])
    lines = _ordered(t for t in points["transport"] if t != NO_ANALYSIS)
    tput = {(r.transport, r.model, int(r.batch_size), int(r.servers)): r.throughput_batches_per_s
            for r in points.itertuples(index=False)}
    point = {(r["transport"], r["model"], int(r["batch_size"]), int(r["servers"])): r for _, r in points.iterrows()}
    cases = list(dict.fromkeys((r.model, int(r.batch_size), int(r.servers)) for r in points.itertuples(index=False)))
    if ZERO_COPY not in lines:
        section.tables.append(Table("figure9-throughput", "Mini-batches per second per worker (no zero-copy line)",
                                    ["model", "batch", "servers", *[_name(t) for t in lines]],
                                    [[model_name(m), str(b), str(s), *[_num(tput.get((t, m, b, s))) for t in lines]]
                                     for m, b, s in cases]))
        section.notes.append("The run has no zerocopy (RDMA.zerocp) line, so no ratio can be set beside the paper's: "
                             "run bench model --transport zerocopy,... to get them.")
    else:
        others = [t for t in lines if t != ZERO_COPY]
        rows = [[model_name(m), str(b), str(s), _num(tput.get((ZERO_COPY, m, b, s))),
                 *[_ratio_cell(point.get((t, m, b, s)), point.get((ZERO_COPY, m, b, s)), "step_time_s")
                   for t in others]]
                for m, b, s in cases]
        section.tables.append(Table("figure9-ratios", "RDMA.zerocp's mini-batches per second over each other line's, "
                                    "per model, batch size and servers",
                                    ["model", "batch", "servers", "RDMA.zerocp (batches/s)",
                                     *[f"over {_name(t)}" for t in others]], rows))
        summary = []
        for model in dict.fromkeys(m for m, _, _ in cases):
            for line in others:
                ratios = [_ratio(tput.get((ZERO_COPY, m, b, s)), tput.get((line, m, b, s)))
                          for m, b, s in cases if m == model]
                if all(_missing(r) for r in ratios):
                    continue
                claim = paper.MODEL_SPEEDUP.get((model, paper.PAPER_LINE_OF.get(line, line)))
                show = percent if claim and claim.percent else times
                summary.append([model_name(model), _name(line), _range_text(ratios, show) + _also(ratios, show),
                                _claim_cell(claim), claim.verdict(ratios) if claim else "no paper number"])
        section.tables.append(Table("figure9-paper", "RDMA.zerocp over each line: here (over the batch sizes run) and "
                                    "in the paper (§5.2, Figure 9)",
                                    ["model", "over", "here", "paper", "here against the paper"], summary))
        if "tf_grpc" in others:
            section.notes.append("TF gRPC (tf_grpc) is TensorFlow's own parameter-server training over its gRPC "
                                 "runtime, what the paper calls gRPC.TCP: the paper's gRPC.TCP numbers are set beside "
                                 "it too.")
    section.notes += _model_context_notes(run, points, paper.MODEL_BATCH_SIZES)
    return section


def _also(ratios: Sequence[float | None], show: Callable[[float], str]) -> str:
    """The other spelling of a ratio range: ``+130%`` beside ``2.30x`` and the other way round."""
    other = times if show is percent else percent
    text = _range_text([r for r in ratios if not _missing(r)], other)
    return "" if text == _MISSING else f" ({text})"


def _copy_overhead_section(run: Run, label: str, points: pd.DataFrame) -> Section:
    claim = paper.COPY_OVERHEAD
    section = Section("figure12", "Figure 12: the cost of the sender's copy", run, label, paper=[_quote(claim)])
    step = {(r.transport, r.model, int(r.batch_size), int(r.servers)): r.step_time_s
            for r in points.itertuples(index=False)}
    lines = [t for t in (NO_ANALYSIS, "rdma_cp") if t in set(points["transport"])]
    cases = list(dict.fromkeys((r.model, int(r.batch_size), int(r.servers)) for r in points.itertuples(index=False)
                               if r.transport == ZERO_COPY))
    header = ["model", "batch", "servers", "RDMA.zerocp step (s)"]
    for line in lines:
        header += [f"{_name(line)} step (s)", f"{_name(line)} against RDMA.zerocp"]
    rows, gains = [], []
    for model, batch, servers in cases:
        on = step.get((ZERO_COPY, model, batch, servers))
        row = [model_name(model), str(batch), str(servers), _num(on)]
        for line in lines:
            off = step.get((line, model, batch, servers))
            ratio = _ratio(off, on)
            if ratio is not None:
                gains.append(ratio)
            row += [_num(off), percent(ratio)]
        rows.append(row)
    section.tables.append(Table("figure12-ratios", "Mini-batch time without the zero-copy analysis over with it "
                                "(+21% = 21% longer without it)", header, rows))
    section.tables.append(Table("figure12-paper", "The largest gain of the analysis: here and in the paper (§5.2)",
                                ["here (largest)", "paper", "here against the paper"],
                                [[percent(max(gains)) if gains else _MISSING, claim.text() + " at batch "
                                  f"{paper.COPY_OVERHEAD_BATCH_SIZE}", claim.verdict(gains)]]))
    batches = sorted({b for _, b, _ in cases})
    if paper.COPY_OVERHEAD_BATCH_SIZE not in batches:
        section.notes.append(f"The paper's {claim.text()} is at batch {paper.COPY_OVERHEAD_BATCH_SIZE}; this run has "
                             f"batch size(s) {_listing(batches)}.")
    if NO_ANALYSIS in lines:
        section.notes.append("RDMA.zerocp with the analysis off sends from memory it has to register or copy first "
                             "(dynamic allocation); RDMA.cp always copies into registered memory, the paper's "
                             "'analysis off' case.")
    section.notes += _fabric_notes(points)
    section.notes += _compute_notes(run, points)
    section.notes += _status_notes(run)
    return section


# -- Figure 11: scale ------------------------------------------------------------------------------------


def scale_sections(run: Run, label: str) -> list[Section]:
    """Figure 11: throughput against servers, over the Local line and over the same transport's single server."""
    points = run.points()
    section = Section("figure11", "Figure 11: scalability", run, label,
                      paper=[_quote(paper.SCALE_OVER_LOCAL[("lstm", "grpc_rdma")]),
                             _quote(paper.SCALE_OVER_LOCAL[("lstm", "zerocopy")]),
                             _quote(paper.SCALE_OVER_ONE_SERVER[("lstm", "zerocopy")]),
                             _quote(paper.SCALE_OVER_ONE_SERVER[("vgg16", "zerocopy")]),
                             _quote(paper.SCALE_OVER_GRPC_RDMA["lstm"])])
    per_worker_sum = points["throughput_batches_per_s"] * points["servers"]
    points = points.assign(total_batches_per_s=points["total_batches_per_s"].fillna(per_worker_sum)
                           if "total_batches_per_s" in points else per_worker_sum)
    total = {(r.transport, r.model, int(r.batch_size), int(r.servers)): r.total_batches_per_s
             for r in points.itertuples(index=False)}
    comparisons = []
    for model, batch in dict.fromkeys((r.model, int(r.batch_size)) for r in points.itertuples(index=False)):
        subset = points[(points["model"] == model) & (points["batch_size"] == batch)]
        local_rows = subset[subset["transport"] == "local"]
        local = float(local_rows["total_batches_per_s"].median()) if len(local_rows) else None
        lines = [t for t in _ordered(subset["transport"]) if t != "local"]
        servers = sorted({int(s) for s in subset[subset["transport"] != "local"]["servers"]})
        header = ["servers"]
        for line in lines:
            header += [f"{_name(line)} (batches/s)", "over Local" if local else "", "over 1 server"]
        header = [h for h in header if h]
        rows = []
        for n in servers:
            row = [str(n)]
            for line in lines:
                value = total.get((line, model, batch, n))
                row.append(_num(value))
                if local:
                    row.append(times(_ratio(value, local)))
                row.append(times(_ratio(value, total.get((line, model, batch, 1)))))
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
                ratio = _ratio(value, local)
                comparisons.append([model_name(model), _name(line), f"over Local at {at}", times(ratio),
                                    _claim_cell(claim), claim.verdict([ratio]) if claim else "no paper number"])
            claim = paper.SCALE_OVER_ONE_SERVER.get((model, line))
            ratio = _ratio(value, total.get((line, model, batch, 1)))
            comparisons.append([model_name(model), _name(line), f"over 1 server at {at}", times(ratio),
                                _claim_cell(claim), claim.verdict([ratio]) if claim else "no paper number"])
        if ZERO_COPY in lines and "grpc_rdma" in lines:
            claim = paper.SCALE_OVER_GRPC_RDMA.get(model)
            ratio = _ratio(total.get((ZERO_COPY, model, batch, most)), total.get(("grpc_rdma", model, batch, most)))
            comparisons.append([model_name(model), "RDMA.zerocp", f"over gRPC.RDMA at {at}", percent(ratio),
                                _claim_cell(claim), claim.verdict([ratio]) if claim else "no paper number"])
    section.tables.append(Table("figure11-paper", f"Speed-ups at the most servers run, beside the paper's at "
                                f"{paper.SCALE_SERVERS} servers (§5.2, Figure 11)",
                                ["model", "line", "speed-up", "here", "paper", "here against the paper"], comparisons))
    servers = sorted({int(s) for s in points["servers"]})
    batches = sorted({int(b) for b in points["batch_size"]})
    section.notes.append(f"The paper's speed-ups are on {paper.SCALE_SERVERS} servers at batch "
                         f"{paper.SCALE_BATCH_SIZE} per worker; this run has {_listing(servers)} server(s) at batch "
                         f"{_listing(batches)}: with {max(servers)} servers the most any line can reach is "
                         f"{max(servers)}x its single server.")
    if "local" not in set(points["transport"]):
        section.notes.append("The run has no Local line (transport local), so no speed-up over it is shown.")
    section.notes += _fabric_notes(points)
    section.notes += _compute_notes(run, points)
    section.notes += _launch_notes(run, points)
    if note := _cores_note(run, f"The {2 * max(servers)} processes of the {max(servers)}-server runs"):
        section.notes.append(note)
    section.notes += _status_notes(run)
    return [section]


# -- Figure 10: converge ---------------------------------------------------------------------------------


def converge_sections(run: Run, label: str) -> list[Section]:
    """Figure 10: time to the target per transport and zero copy's speed-up over gRPC.TCP (and gRPC.RDMA)."""
    records = run.records
    settings = run.meta.get("settings") or {}
    task = str(settings.get("task") or (_unique(records, "task") or ["?"])[0])
    claims = {other: paper.CONVERGE_SPEEDUP.get((task, other)) for other in ("grpc_tcp", "grpc_rdma")}
    section = Section("figure10", f"Figure 10: convergence ({task})", run, label,
                      paper=[_quote(c) for c in paper.CONVERGE_SPEEDUP.values()
                             if c in claims.values()] or [_quote(c) for c in paper.CONVERGE_SPEEDUP.values()])
    summary = records[records["kind"] == "summary"] if "kind" in records else records.iloc[0:0]
    seconds = {r.transport: r.time_to_target_s for r in summary.itertuples(index=False)}
    rows = []
    for r in summary.itertuples(index=False):
        reached = not _missing(r.time_to_target_s)
        over_tcp = r.speedup_vs_grpc_tcp if not _missing(getattr(r, "speedup_vs_grpc_tcp", None)) else _ratio(
            seconds.get("grpc_tcp"), r.time_to_target_s)
        rows.append([_name(r.transport), str(r.target) if not _missing(r.target) else _MISSING,
                     _num(r.steps_to_target, "g") if reached else "not reached",
                     _num(r.time_to_target_s) if reached else "not reached", times(over_tcp),
                     _claim_cell(claims["grpc_tcp"]) if r.transport == ZERO_COPY else ""])
    section.tables.append(Table("figure10-summary", "Time to the target per transport, and how many times sooner than "
                                "gRPC.TCP it got there", ["transport", "target", "steps", "seconds", "over gRPC.TCP",
                                                          "paper (RDMA.zerocp)"], rows))
    comparisons = []
    for other in ("grpc_tcp", "grpc_rdma"):
        if other not in seconds or ZERO_COPY not in seconds:
            continue
        ratio = _ratio(seconds[other], seconds[ZERO_COPY])
        claim = claims[other]
        show = percent if claim and claim.percent else times
        comparisons.append([f"RDMA.zerocp over {_name(other)}", show(ratio) if ratio else "not reached by both",
                            _claim_cell(claim), claim.verdict([ratio] if ratio else []) if claim else
                            "no paper number for this task"])
    if comparisons:
        section.tables.append(Table("figure10-paper", "Zero copy's speed-up to the target, beside the paper's (§5.2, "
                                    "Figure 10)", ["speed-up", "here", "paper", "here against the paper"], comparisons))
    if summary.empty:
        section.notes.append("The run has no summary records (kind summary): it ended before every transport was "
                             "evaluated, so no time to target is known.")
    elif summary["time_to_target_s"].isna().all():
        section.notes.append(f"No transport reached the target {_listing(_unique(summary, 'target'))} within the "
                             "run: train for longer (--steps, --time) or set an easier --target.")
    if task not in paper.CONVERGE_TASKS:
        sooner = _listing(f"{paper.CONVERGE_SPEEDUP[(name, 'grpc_tcp')].text()} ({title})"
                          for name, title in paper.CONVERGE_TASKS.items())
        section.notes.append(f"The task '{task}' has no counterpart in the paper, whose Figure 10 trains "
                             f"{_listing(paper.CONVERGE_TASKS.values())}: RDMA.zerocp reached the target {sooner} "
                             "sooner than gRPC.TCP.")
    servers, batch = settings.get("servers") or _unique(records, "servers"), settings.get("batch_size")
    if servers:
        servers = servers if isinstance(servers, list) else [servers]
        section.notes.append(f"{_listing(servers)} worker(s)" + (f" at batch {batch}" if batch else "")
                             + f"; the paper split each dataset over {paper.CONVERGE_WORKERS} workers.")
    section.notes += _fabric_notes(records)
    section.notes += _launch_notes(run, records)
    if note := _cores_note(run, "Workers and parameter servers"):
        section.notes.append(note)
    section.notes += _status_notes(run)
    return [section]


# -- Figure 7: analysis ----------------------------------------------------------------------------------


def analysis_sections(run: Run, label: str) -> list[Section]:
    """The transfer plan: static and dynamic tensors and their bytes, and the sizes of variable tensors (Figure 7)."""
    records = run.records
    section = Section("figure7", "Figure 7: the tensors a step transfers", run, label,
                      paper=[(paper.TENSOR_SIZES_QUOTE, paper.TENSOR_SIZES_SECTION)])
    group = [c for c in ("model", "servers", "batch_size", "analysis") if c in records]
    rows = []
    for key, plan in records.groupby(group, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        placement = plan["placement"].astype(str)
        static_bytes = plan.loc[placement == "static", "bytes"].sum(min_count=1) if "bytes" in plan else None
        rows.append([*[str(v) for v in key], str(len(plan)), str(int((placement == "static").sum())),
                     str(int((placement == "dynamic").sum())), _size_text(static_bytes)])
    section.tables.append(Table("figure7-plan", "Cross-process tensors of one step, by placement (static: "
                                "preallocated, one-sided write; dynamic: meta-data then a read)",
                                [*group, "tensors", "static", "dynamic", "static bytes"], rows))
    variables = _variable_sizes(records)
    if variables:
        sizes = list(variables.values())
        total = sum(sizes)
        measured = {"count_above_10KB": sum(s > 10 * 1024 for s in sizes) / len(sizes),
                    "count_above_1MB": sum(s > 1 << 20 for s in sizes) / len(sizes),
                    "bytes_above_1MB": sum(s for s in sizes if s > 1 << 20) / total if total else None}
        words = {"count_above_10KB": ("variable tensors above 10 KB", "more than "),
                 "count_above_1MB": ("variable tensors above 1 MB", "more than "),
                 "bytes_above_1MB": ("bytes in tensors above 1 MB", "")}
        section.tables.append(Table("figure7-paper", f"Sizes of the {len(sizes)} variable tensors (weights) of "
                                    f"{_listing(dict.fromkeys(m for m, _ in variables))}, beside the paper's six "
                                    "models (§5, Figure 7)", ["share of", "here", "paper"],
                                    [[words[k][0], _num(None if v is None else 100 * v, ".0f") + "%",
                                      f"{words[k][1]}{100 * paper.TENSOR_SIZES[k]:.0f}%"]
                                     for k, v in measured.items()]))
    else:
        section.notes.append("The plan lists no weight tensor with a known size, so Figure 7's shares cannot be "
                             "computed.")
    if "analysis" in records and (records["analysis"].astype(str).str.lower() == "false").any():
        section.notes.append("Plans with analysis False are zerocopy:no_analysis's: every tensor dynamic.")
    section.notes += _status_notes(run)
    return [section]


def _size_text(nbytes: Any) -> str:
    if _missing(nbytes):
        return _MISSING
    return f"{float(nbytes) / 2**20:.2f} MB"


def _variable_sizes(records: pd.DataFrame) -> dict[tuple[str, str], float]:
    """``(model, variable) -> bytes`` of the weights a plan sends (each variable once, whatever its receivers)."""
    if "role" not in records or "bytes" not in records:
        return {}
    weights = records[(records["role"] == "weight") & records["bytes"].notna()]
    sizes = {}
    for r in weights.itertuples(index=False):
        name = r.variable if "variable" in weights and not _missing(r.variable) else r.tensor
        sizes.setdefault((str(r.model), str(name)), float(r.bytes))
    return sizes


# -- soak ------------------------------------------------------------------------------------------------


def soak_sections(run: Run, label: str) -> list[Section]:
    """The soak test: no paper counterpart; whether every tensor arrived intact and memory stayed flat."""
    records = run.records
    section = Section("soak", "Soak: every tensor checked, memory watched", run, label)
    group = [c for c in ("phase", "transport", "size_bytes", "model") if c in records]
    rows = []
    for key, part in records.groupby(group, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        cells = [format_size(int(v)) if name == "size_bytes" and not _missing(v) else
                 (_MISSING if _missing(v) else str(v)) for name, v in zip(group, key, strict=True)]
        growth = part["rss_growth_mb"] if "rss_growth_mb" in part else part["rss_end_mb"] - part["rss_start_mb"]
        rows.append([*cells, str(int(part["tensors_received"].sum())), str(int(part["corrupted"].sum())),
                     str(int(part["lost"].sum())), _num(growth.max(), ".1f")])
    section.tables.append(Table("soak", "Per point: tensors received, corrupted and lost, and the largest memory "
                                "growth of a process", [*group, "received", "corrupted", "lost", "RSS growth (MB)"],
                                rows))
    section.notes.append("The paper has no soak test: this is the suite's own safety check.")
    section.notes += _status_notes(run)
    return [section]


BUILDERS: dict[str, Callable[[Run, str], list[Section]]] = {
    "micro": micro_sections, "model": model_sections, "scale": scale_sections, "converge": converge_sections,
    "models": models_sections, "analysis": analysis_sections, "soak": soak_sections,
}


# -- putting it together ---------------------------------------------------------------------------------


def find_runs(paths: Sequence[Path]) -> list[Path]:
    """The run directories named: each path itself, or, for a directory without ``meta.json``, the run
    directories directly inside it (``bench report results/``). A ReportError names a path that is neither."""
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ReportError(f"'{path}' does not exist; give a run directory such as results/micro-<time>/")
        if not path.is_dir():
            raise ReportError(f"'{path}' is a file, not a run directory; give the directory holding its meta.json and "
                              "records.csv")
        if (path / META_FILE).is_file():
            found.append(path)
            continue
        inside = sorted(p for p in path.iterdir() if p.is_dir() and (p / META_FILE).is_file())
        if not inside:
            raise ReportError(f"'{path}' is not a run directory (it has no {META_FILE}) and holds none; give "
                              "directories written by bench micro, model, scale, converge, models or analyze")
        found += inside
    return list(dict.fromkeys(found))


def run_labels(paths: Sequence[Path]) -> list[str]:
    """A short, unique label per run: its directory's name, with the parent's when two share a name."""
    names = [p.name or str(p) for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(n) > 1 else n for p, n in zip(paths, names, strict=True)]


def draw_figures(run: Run, out_dir: Path) -> tuple[list[Figure], str]:
    """The run's figures (PNG) drawn into ``out_dir``, or none and a one-line reason."""
    try:
        from bench.readers.plot import plot_run

        out_dir.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            written = plot_run(run.path, out_dir=out_dir)
    except Exception as exc:  # a figure that fails must not cost the run its tables
        text = str(exc).strip().splitlines()
        return [], f"Figures could not be drawn: {text[0] if text else type(exc).__name__}"
    pngs = [Path(p) for p in written if Path(p).suffix.lower() == ".png" and Path(p).is_file()]
    return [Figure(p.stem, p) for p in pngs], ""


def build_report(paths: Sequence[Path], figure_dir: Path, figures: bool = True) -> Report:
    """Read the runs, make their sections and draw their figures into ``figure_dir`` (ResultsError for a path
    that is not a readable run)."""
    runs = [load_run(p) for p in find_runs(paths)]
    labels = run_labels([r.path for r in runs])
    report = Report(list(zip(labels, runs, strict=True)), [], datetime.now().astimezone().isoformat(timespec="seconds"))
    for index, (label, run) in enumerate(report.runs, start=1):
        try:
            sections = BUILDERS[run.experiment](run, label)
        except Exception as exc:  # a run whose records defy the tables still shows up, saying why
            first = (str(exc).strip().splitlines() or [""])[0]
            problem = f"{label}: its tables could not be made ({type(exc).__name__}: {first})"
            report.warnings.append(problem)
            sections = [Section("other", f"{run.experiment} run", run, label,
                                notes=[problem + "; were its records edited by hand?"])]
        if figures:
            drawn, note = draw_figures(run, figure_dir / f"{index:02d}")
            _place_figures(sections, drawn, note)
        report.sections += sections
    report.sections.sort(key=lambda s: _SECTION_ORDER.index(s.key) if s.key in _SECTION_ORDER else len(_SECTION_ORDER))
    return report


def _place_figures(sections: list[Section], figures: list[Figure], note: str) -> None:
    """Each figure to the section it belongs to: Figure 12's to that section, the rest to the run's first."""
    if not sections:
        return
    by_key = {s.key: s for s in sections}
    for figure in figures:
        target = by_key.get("figure12") if figure.stem.startswith("copy_overhead") else None
        (target or sections[0]).figures.append(figure)
    if note:
        sections[0].figure_note = note


# -- HTML ----------------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 1.5rem 2rem; color: #1d1d1f;
       background: #ffffff; line-height: 1.4; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.25rem; border-bottom: 2px solid #1f77b4; padding-bottom: 0.2rem; margin-top: 2.2rem; }
h3 { font-size: 1rem; margin: 1rem 0 0.4rem; }
.run { color: #555; font-size: 0.9rem; margin-top: 0; }
.pair { display: flex; flex-wrap: wrap; gap: 1.5rem; align-items: flex-start; }
.figures { flex: 1 1 560px; min-width: 320px; }
.numbers { flex: 1 1 480px; min-width: 320px; }
.run, li, blockquote, figcaption, caption { overflow-wrap: anywhere; }
figure { margin: 0 0 1rem; overflow-x: auto; }
figure img { max-width: 100%; height: auto; border: 1px solid #ddd; box-sizing: border-box; }
figure.wide { margin-top: 0.5rem; }
figcaption { font-size: 0.8rem; color: #666; }
.scroll { overflow-x: auto; max-width: 100%; margin: 0.3rem 0 1rem; }
table { border-collapse: collapse; font-size: 0.85rem; }
caption { text-align: left; font-size: 0.85rem; color: #333; padding-bottom: 0.3rem; caption-side: top; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f0f4f8; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
blockquote { margin: 0.3rem 0 0.6rem; padding: 0.3rem 0.8rem; border-left: 3px solid #ff7f0e; background: #fff8f0;
             font-size: 0.85rem; }
blockquote cite { display: block; color: #666; font-style: normal; font-size: 0.8rem; }
ul.notes { font-size: 0.85rem; padding-left: 1.2rem; }
p.figure-note { color: #a33; font-size: 0.85rem; }
nav ul { columns: 2; font-size: 0.9rem; }
"""


#: cells right-aligned on the page: numbers, ratios, percentages, sizes and ranges of them
_NUMERIC = re.compile(r"^[-+]?[\d.,]+(e[-+]?\d+)?(x|%| ?[KMG]?B| MB)?( to [-+]?[\d.,]+(x|%)?)?( \(.*\))?$|^—$")


def _h(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _html_table(table: Table) -> str:
    """The table in a box of its own that scrolls sideways when the table is wider than the page gives it (the
    scroll bar right under the table, not under the whole column)."""
    head = "".join(f"<th>{_h(c)}</th>" for c in table.header)
    body = "".join("<tr>" + "".join(f'<td class="n">{_h(c)}</td>' if _NUMERIC.match(str(c)) else f"<td>{_h(c)}</td>"
                                    for c in row) + "</tr>" for row in table.rows)
    return (f'<div class="scroll"><table data-table="{_h(table.name)}"><caption>{_h(table.caption)}</caption>'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


#: figures are drawn at 150 dots per inch; shown at their drawn size a dot is this many CSS pixels (96 per inch)
_PIXELS_PER_DOT = 96 / 150
#: never shown smaller than this share of their dots: 8-point text (legends) stays 8 CSS pixels high; a figure that
#: would have to shrink more scrolls sideways instead
MIN_FIGURE_SCALE = 0.5
#: a figure wider than this (in dots) cannot be shown at MIN_FIGURE_SCALE beside the tables: it gets the page's width
WIDE_FIGURE_DOTS = 1300


def _png_width(data: bytes) -> int | None:
    """The width in pixels of a PNG (from its IHDR chunk), or None when ``data`` is not one."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big")


def _html_figure(figure: Figure) -> tuple[str, bool]:
    """The figure embedded as a PNG ``data:`` URI, sized to be readable; whether it is wide."""
    png = figure.png.read_bytes()
    data = base64.b64encode(png).decode("ascii")
    width = _png_width(png)
    wide = width is not None and width > WIDE_FIGURE_DOTS
    size = (f' style="width: {round(width * _PIXELS_PER_DOT)}px; min-width: {round(width * MIN_FIGURE_SCALE)}px"'
            if width else "")
    kind = ' class="wide"' if wide else ""
    return (f'<figure{kind}><img src="data:image/png;base64,{data}" '
            f'alt="{_h(figure.stem)}" data-figure="{_h(figure.stem)}"{size}>'
            f"<figcaption>{_h(figure.stem)}</figcaption></figure>"), wide


def _anchor(index: int, section: Section) -> str:
    return f"s{index}-{section.key}"


def render_html(report: Report) -> str:
    """The page: an overview of the runs and the paper's setup, then one block per section, figures on the left
    (PNG as data: URIs) and the paper's words, the ratio tables and the notes on the right."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             "<title>bench report: measured against Xue et al., EuroSys '19</title>",
             f"<style>{_CSS}</style></head><body>",
             "<h1>Measured here against <i>Fast Distributed Deep Learning over RDMA</i></h1>",
             f'<p class="run">{_h(paper.CITATION)}<br>Report made {_h(report.created)} from {len(report.runs)} '
             "run(s). Ratios are speed-ups: how many times faster (or higher in throughput) RDMA.zerocp is.</p>"]
    parts.append("<h2 id=\"overview\">Runs and setup</h2>")
    for table in overview_tables(report):
        parts.append(_html_table(table))
    parts.append("<nav><ul>" + "".join(
        f'<li><a href="#{_anchor(i, s)}">{_h(s.title)}</a> <span class="run">({_h(s.run_label)})</span></li>'
        for i, s in enumerate(report.sections)) + "</ul></nav>")
    for index, section in enumerate(report.sections):
        parts.append(f'<section id="{_anchor(index, section)}" data-section="{_h(section.key)}">')
        parts.append(f"<h2>{_h(section.title)}</h2>")
        if section.run is not None:
            parts.append(f'<p class="run">run {_h(section.run_label)}: {_h(section.run.path)} · '
                         f"{_h(section.run.experiment)} · {_h(section.run.meta.get('status', '?'))} · started "
                         f"{_h(section.run.meta.get('start_time', '?'))}</p>")
        parts.append('<div class="pair">')
        drawn = [_html_figure(figure) for figure in section.figures]
        beside = [html_ for html_, wide in drawn if not wide]
        if beside or section.figure_note:
            parts.append('<div class="figures">')
        parts += beside
        if section.figure_note:
            parts.append(f'<p class="figure-note">{_h(section.figure_note)}</p>')
        if beside or section.figure_note:
            parts.append("</div>")
        parts.append('<div class="numbers">')
        if section.paper:
            parts.append("<h3>The paper</h3>")
            parts += [f"<blockquote>“{_h(quote)}”<cite>{_h(where)}</cite></blockquote>"
                      for quote, where in section.paper]
        parts.append("<h3>Measured here</h3>")
        parts += [_html_table(t) for t in section.tables]
        if section.notes:
            parts.append("<h3>Why the numbers differ</h3><ul class=\"notes\">"
                         + "".join(f"<li>{_h(n)}</li>" for n in section.notes) + "</ul>")
        parts.append("</div></div>")
        parts += [html_ for html_, wide in drawn if wide]  # below the pair, the page's width: readable
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def overview_tables(report: Report) -> list[Table]:
    """The runs (directory, experiment, status, where) and the paper's setup against this machine's."""
    runs = Table("runs", "The runs of this report", ["run", "experiment", "status", "started", "host", "cores",
                                                     "CPU", "schema", "commit"],
                 [[label, run.experiment, str(run.meta.get("status", "?")), str(run.meta.get("start_time", "?")),
                   str(run.meta.get("host", "?")), str(run.meta.get("cpu_count", "?")), str(run.meta.get("cpu", "?")),
                   str(run.schema_version), str(run.meta.get("git_commit", "?"))[:12]]
                  for label, run in report.runs])
    metas = [run.meta for _, run in report.runs]
    names: list[str] = []
    emulated = False
    for meta in metas:
        names.append(str(meta.get("host", "?")))
        launcher = (meta.get("settings") or {}).get("launcher")
        if isinstance(launcher, dict) and launcher.get("launcher") == "mpi":
            names += [str(h) for h in launcher.get("hosts") or []]
        emulated = emulated or (isinstance(launcher, dict) and launcher.get("launcher") == "netns")
    unique = list(dict.fromkeys(names))
    hosts = f"{len(unique)} host(s): {_listing(unique)}" + (
        "; netns runs emulate hosts as network namespaces of one" if emulated else "")
    cpus = _listing(dict.fromkeys(f"{m.get('cpu_count', '?')} cores of {m.get('cpu', '?')}" for m in metas))
    fabrics = []
    for _, run in report.runs:
        records = run.records
        if "transport" in records:
            records = records[~records["transport"].isin(REFERENCE_LINES)]
        fabrics += [f for f in _unique(records, "fabric") if f != "none"]
    tf = _listing(dict.fromkeys(str((m.get("packages") or {}).get("tensorflow", "?")) for m in metas))
    python = _listing(dict.fromkeys(str((m.get("packages") or {}).get("python", "?")) for m in metas))
    setup = Table("setup", f"The paper's cluster ({paper.SETUP_SECTION}) and this one", ["", "paper", "here"], [
        ["servers", str(paper.SETUP["servers"]), hosts],
        ["CPU", paper.SETUP["cpu"], cpus],
        ["GPU", paper.SETUP["gpu"], "none: models compute on the CPU (or replay compute times)"],
        ["network", paper.SETUP["network"],
         _listing(describe_fabric(f) for f in dict.fromkeys(fabrics)) or "no fabric line in these runs"],
        ["software", paper.SETUP["software"], f"TensorFlow {tf}, Python {python}"],
    ])
    return [runs, setup]


# -- Markdown ------------------------------------------------------------------------------------------


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _md_table(table: Table) -> list[str]:
    lines = [f"*{_md(table.caption)}*", "", "| " + " | ".join(_md(c) for c in table.header) + " |",
             "|" + "|".join("---" for _ in table.header) + "|"]
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in table.rows]
    return [*lines, ""]


def render_markdown(report: Report, figure_names: dict[Path, str]) -> str:
    """The same page in Markdown; each figure refers to ``figure_names[png]``, a file beside the document."""
    lines = ["# Measured here against *Fast Distributed Deep Learning over RDMA*", "", paper.CITATION, "",
             f"Report made {report.created} from {len(report.runs)} run(s). Ratios are speed-ups: how many times "
             "faster (or higher in throughput) RDMA.zerocp is.", "", "## Runs and setup", ""]
    for table in overview_tables(report):
        lines += _md_table(table)
    for section in report.sections:
        lines += [f"## {section.title}", ""]
        if section.run is not None:
            lines += [f"Run {section.run_label}: `{section.run.path}` ({section.run.experiment}, "
                      f"{section.run.meta.get('status', '?')}).", ""]
        for figure in section.figures:
            lines += [f"![{figure.stem}]({figure_names[figure.png]})", ""]
        if section.figure_note:
            lines += [f"*{section.figure_note}*", ""]
        for quote, where in section.paper:
            lines += [f"> “{quote}” ({where})", ""]
        for table in section.tables:
            lines += _md_table(table)
        if section.notes:
            lines += ["Why the numbers differ:", ""] + [f"- {_md(n)}" for n in section.notes] + [""]
    return "\n".join(lines)


# -- writing -------------------------------------------------------------------------------------------


def default_report_path(root: Path = Path("results"), suffix: str = ".html") -> Path:
    """``results/report-<YYYYmmdd-HHMMSS><suffix>``, made unique if the name is taken."""
    return default_run_dir("report", root, suffix)


def write_report(paths: Sequence[Path], html_path: Path | None = None, markdown_path: Path | None = None,
                 on_warning: Callable[[str], None] | None = None) -> list[Path]:
    """Write the report of the runs at ``paths`` as HTML and/or Markdown (its PNGs beside it); the files written.

    ReportError or ResultsError for a path that is not a run; OSError when a file cannot be written.
    """
    if html_path is None and markdown_path is None:
        raise ReportError("no output asked for; give an HTML or a Markdown path")
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        report = build_report(paths, Path(tmp))
        for warning in report.warnings:
            if on_warning:
                on_warning(warning)
        if html_path is not None:
            html_path.parent.mkdir(parents=True, exist_ok=True)
            # written whole, then renamed over the old page: a full disk keeps the old page, not half a new one
            replace_file(html_path, render_html(report))
            written.append(html_path)
        if markdown_path is not None:
            markdown_path.parent.mkdir(parents=True, exist_ok=True)
            names: dict[Path, str] = {}
            for section in report.sections:
                for figure in section.figures:
                    if figure.png in names:
                        continue
                    run_dir = figure.png.parent.name  # the run's number
                    name = f"{markdown_path.stem}-{run_dir}-{_safe(figure.stem)}.png"
                    replace_file(markdown_path.parent / name, figure.png.read_bytes())
                    names[figure.png] = name
                    written.append(markdown_path.parent / name)
            replace_file(markdown_path, render_markdown(report, names))
            written.insert(1 if html_path is not None else 0, markdown_path)
    return written


def _safe(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem)


__all__ = ["BUILDERS", "Figure", "Report", "ReportError", "ResultsError", "Section", "Table", "build_report",
           "default_report_path", "describe_fabric", "find_runs", "percent", "render_html", "render_markdown",
           "times", "write_report"]
