"""The soak test (``bench soak`` runs), which has no paper counterpart: whether every tensor arrived intact and
memory stayed flat.
"""

from __future__ import annotations

from bench.ground.sizes import format_size
from bench.readers.report.notes import status_notes
from bench.readers.report.page import Section, Table
from bench.readers.report.text import MISSING, missing, num
from bench.results import Run


def soak(run: Run, label: str) -> Section:
    """The soak test: no paper counterpart; whether every tensor arrived intact and memory stayed flat."""
    records = run.records
    section = Section("soak", "Soak: every tensor checked, memory watched", run, label)
    group = [c for c in ("phase", "transport", "size_bytes", "model") if c in records]
    rows = []
    for key, part in records.groupby(group, sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        cells = [format_size(int(v)) if name == "size_bytes" and not missing(v) else
                 (MISSING if missing(v) else str(v)) for name, v in zip(group, key, strict=True)]
        growth = part["rss_growth_mb"] if "rss_growth_mb" in part else part["rss_end_mb"] - part["rss_start_mb"]
        rows.append([*cells, str(int(part["tensors_received"].sum())), str(int(part["corrupted"].sum())),
                     str(int(part["lost"].sum())), num(growth.max())])
    section.tables.append(Table("soak", "Per point: tensors received, corrupted and lost, and the largest memory "
                                "growth of a process", [*group, "received", "corrupted", "lost", "RSS growth (MB)"],
                                rows))
    section.notes.append("The paper has no soak test: this is the suite's own safety check.")
    section.notes += status_notes(run)
    return section
