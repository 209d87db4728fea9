"""The results store: one directory per run with ``meta.json``, a tidy ``records.csv`` and, for experiments
that time iterations, ``samples.csv``.

``meta.json`` says what ran, where and with what; ``records.csv`` has one row per measured point (one
record type per experiment, :mod:`bench.results.records`); ``samples.csv`` every timed iteration. Records
are appended as they are measured, so an interrupted run keeps what it finished. Plots, reports and
comparisons read only these files, so runs can be compared long after they were made.
"""

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
    REFERENCE_LINES,
    REQUIRED_COLUMNS,
    SAMPLES_FILE,
    SCHEMA_VERSION,
    Run,
    RunWriter,
    default_run_dir,
    environment,
    git_commit,
    load_run,
    now_iso,
    of_reference,
    package_versions,
    reference_throughputs,
    with_of_reference,
    writer_alive,
)

__all__ = [
    "AnalysisRecord", "COLUMNS", "ConvergeRecord", "META_FILE", "MicroRecord", "ModelRecord", "ModelsRecord",
    "READABLE_VERSIONS", "RECORDS_FILE", "RECORD_TYPES", "REFERENCE_LINES", "REQUIRED_COLUMNS", "Ratio", "Record",
    "ResultsError", "Run", "RunWriter", "SAMPLES_FILE", "SCHEMA_VERSION", "ScaleRecord", "SoakRecord",
    "default_run_dir", "environment", "git_commit", "latency_summary", "load_run", "median_interval", "now_iso",
    "of_reference", "package_versions", "points", "ratio", "record_type", "reference_throughputs",
    "with_of_reference", "writer_alive",
]
