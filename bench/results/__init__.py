"""The results store: one directory per run with ``meta.json``, a tidy ``records.csv`` and, for experiments
that time iterations, ``samples.csv``.

``meta.json`` says what ran, where and with what; ``records.csv`` has one row per measured point (one
record type per experiment, :mod:`bench.results.records`); ``samples.csv`` every timed iteration. Records
are appended as they are measured, whole or not at all, so an interrupted run, or one whose disk filled up, keeps
what it finished; every file is written by :mod:`bench.results.files` (write, then rename; or a whole append).
Plots, reports and comparisons read only these files, so runs can be compared long after they were made.
"""

from bench.results import lines
from bench.results.files import DiskError, LinkError, append_whole, disk_failed, is_disk_error, make_dir, replace_file
from bench.results.provenance import environment, git_commit, package_versions
from bench.results.reading import look_at
from bench.results.records import (
    RECORD_TYPES,
    AnalysisRecord,
    ConvergeRecord,
    MicroRecord,
    ModelRecord,
    ModelsRecord,
    Ratio,
    Record,
    ResultsError,
    ScaleRecord,
    SoakRecord,
    latency_summary,
    median_interval,
    points,
    ratio,
    record_type,
)
from bench.results.store import (
    COLUMNS,
    META_FILE,
    READABLE_VERSIONS,
    RECORDS_FILE,
    REQUIRED_COLUMNS,
    RESERVE_FILE,
    SAMPLES_FILE,
    SCHEMA_VERSION,
    Run,
    RunWriter,
    default_run_dir,
    load_run,
    now_iso,
    of_peer,
    of_reference,
    reference_throughputs,
    with_line_kinds,
    with_of_reference,
    with_rounds,
    writer_alive,
)
from bench.results.text import NAME_LIMIT, printable, shown

__all__ = [
    "AnalysisRecord", "COLUMNS", "ConvergeRecord", "DiskError", "META_FILE", "MicroRecord", "ModelRecord",
    "ModelsRecord", "READABLE_VERSIONS", "RECORDS_FILE", "RECORD_TYPES", "REQUIRED_COLUMNS", "RESERVE_FILE", "Ratio",
    "Record", "ResultsError", "Run", "RunWriter",
    "SAMPLES_FILE", "SCHEMA_VERSION", "ScaleRecord", "SoakRecord", "append_whole", "default_run_dir", "disk_failed",
    "LinkError", "NAME_LIMIT", "environment", "git_commit", "is_disk_error", "latency_summary", "load_run",
    "look_at", "lines", "make_dir", "median_interval", "now_iso", "printable", "shown",
    "of_peer", "of_reference", "package_versions", "points", "ratio", "record_type", "reference_throughputs",
    "replace_file", "with_line_kinds", "with_of_reference", "with_rounds", "writer_alive",
]
