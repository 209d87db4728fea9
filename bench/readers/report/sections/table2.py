"""Table 2, the benchmark models: each model's size, variables and compute time per sample
(``bench models`` runs), and the model size a ``bench model`` run moved per step, here against the paper's.
"""

from __future__ import annotations

from bench.ground import paper
from bench.readers.report.notes import status_notes
from bench.readers.report.page import Section, Table
from bench.readers.report.text import divide, missing, num, range_text, times
from bench.results import Run


def _paper_model(model: str) -> paper.PaperModel | None:
    return paper.TABLE2.get(model)


def table2(run: Run, label: str) -> Section:
    """Table 2: each model's size, variables and local compute time per sample, here against the paper's."""
    records = run.records
    section = Section("table2", "Table 2: the benchmark models", run, label,
                      paper=[(paper.TABLE2_QUOTE, paper.TABLE2_SECTION)])
    rows, slow = [], []
    for _, r in records.iterrows():
        known = _paper_model(str(r["model"]))
        paper_mb = r.get("paper_model_mb") if not missing(r.get("paper_model_mb")) else (known and known.model_mb)
        paper_vars = r.get("paper_variables") if not missing(r.get("paper_variables")) else (
            known and known.variables)
        paper_ms = r.get("paper_compute_ms_per_sample") if not missing(r.get("paper_compute_ms_per_sample")) else (
            known and known.compute_ms_per_sample)
        ratio_ms = divide(r["compute_ms_per_sample"], paper_ms)
        if ratio_ms:
            slow.append(ratio_ms)
        rows.append([known.name if known else str(r["model"]), num(r.get("batch_size")),
                     num(r["variables"]), num(paper_vars),
                     num(r["model_mb"]), num(paper_mb), times(divide(r["model_mb"], paper_mb)),
                     num(r["compute_ms_per_sample"]), num(paper_ms), times(ratio_ms)])
    section.tables.append(Table("table2", f"Measured by run {label}, against the paper's Table 2 (here / paper as a "
                                "ratio)",
                                ["model", "batch", "variables", "paper", "size (MB)", "paper (MB)", "here / paper",
                                 "compute (ms/sample)", "paper (ms/sample)", "here / paper"], rows))
    if slow:
        section.notes.append(f"Compute per sample here is {range_text(slow)} the paper's: this CPU "
                             f"({run.meta.get('cpu', '?')}, {run.meta.get('cpu_count', '?')} cores) against one "
                             "Tesla P100 GPU.")
    if run.framework == "torch":
        section.notes.append("Sizes are of float32 variables in MB of 2**20 bytes, PyTorch's parameters and "
                             "buffers; bench/experiments/torch_models.py explains the layouts (where one differs "
                             "from Keras', as Inception-v3's batch norm keeping a scale).")
    else:
        section.notes.append("Sizes are of float32 variables in MB of 2**20 bytes; "
                             "bench/experiments/models.py explains the layouts "
                             "(10 output classes, Keras' Inception-v3 without its auxiliary head, TensorFlow 1's RNN "
                             "cells splitting their variables differently).")
    section.notes += status_notes(run)
    return section


def model_size(run: Run, label: str) -> Section | None:
    """The model size a ``bench model`` run moved per step, against Table 2's (None when it recorded none)."""
    points = run.points()
    if "model_mb" not in points or points["model_mb"].isna().all():
        return None
    sizes = points.dropna(subset=["model_mb"]).groupby("model", sort=False)["model_mb"].median()
    rows = []
    for model, mb in sizes.items():
        known = _paper_model(str(model))
        rows.append([known.name if known else str(model), num(mb), num(known and known.model_mb),
                     times(divide(mb, known and known.model_mb))])
    return Section("table2", "Table 2: model size moved per step", run, label,
                   paper=[(paper.TABLE2_QUOTE, paper.TABLE2_SECTION)],
                   tables=[Table("table2-model-size", f"Model size moved per step by run {label}, against Table 2's",
                                 ["model", "size here (MB)", "paper (MB)", "here / paper"], rows)])
