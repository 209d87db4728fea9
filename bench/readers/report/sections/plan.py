"""Figure 7, the tensors a step transfers (``bench analyze`` runs): the transfer plan's static and dynamic
tensors and their bytes, and the sizes of the variable tensors against the paper's shares.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from bench.ground import paper
from bench.readers.report.notes import status_notes
from bench.readers.report.page import Section, Table
from bench.readers.report.text import MISSING, listing, missing, num
from bench.results import Run


def figure7(run: Run, label: str) -> Section:
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
                                    f"{listing(dict.fromkeys(m for m, _ in variables))}, beside the paper's six "
                                    "models (§5, Figure 7)", ["share of", "here", "paper"],
                                    [[words[k][0], num(None if v is None else 100 * v) + "%",
                                      f"{words[k][1]}{100 * paper.TENSOR_SIZES[k]:.0f}%"]
                                     for k, v in measured.items()]))
    else:
        section.notes.append("The plan lists no weight tensor with a known size, so Figure 7's shares cannot be "
                             "computed.")
    if "analysis" in records and (records["analysis"].astype(str).str.lower() == "false").any():
        section.notes.append("Plans with analysis False are zerocopy:no_analysis's: every tensor dynamic.")
    section.notes += status_notes(run)
    return section


def _size_text(nbytes: Any) -> str:
    if missing(nbytes):
        return MISSING
    return f"{num(float(nbytes) / 2**20)} MB"


def _variable_sizes(records: pd.DataFrame) -> dict[tuple[str, str], float]:
    """``(model, variable) -> bytes`` of the weights a plan sends (each variable once, whatever its receivers)."""
    if "role" not in records or "bytes" not in records:
        return {}
    weights = records[(records["role"] == "weight") & records["bytes"].notna()]
    sizes = {}
    for r in weights.itertuples(index=False):
        name = r.variable if "variable" in weights and not missing(r.variable) else r.tensor
        sizes.setdefault((str(r.model), str(name)), float(r.bytes))
    return sizes
