"""Run directories written and read back: ``meta.json``, ``records.csv`` and ``samples.csv``.

The columns are the record types' (:mod:`bench.results.records`); this module writes them as they are
measured (a signal waits until a row is whole), reads them back, checks their schema version and
upgrades older versions' records to the current meaning.

A full or failing disk costs a run no point it has measured (:mod:`bench.results.files`): rows are appended
whole or not at all, ``meta.json`` is replaced by rename, and a room kept free beside it
(:data:`RESERVE_FILE`) is given up when a row is refused, so ``meta.json`` can still say ``failed`` and why; a disk
too full to keep that room at the start still takes the last ``meta.json`` into the blocks of the first, which is
written with room to spare (at least :data:`META_ROOM_BYTES` of trailing white space, to the end of a block).
A reader skips (and warns about) a last row cut short by a writer that could not finish it, and counts it
(:attr:`Run.unread_rows`: ``bench compare`` calls it lost). A results file that is there but cannot be read
(no permission, a directory or a named pipe at its name, binary data) is named as such, never as missing
(:mod:`bench.results.reading`).

What a reader takes from a run directory is bounded, as input from anyone who could write there: ``meta.json`` is
read up to :data:`META_LIMIT_BYTES` and :data:`META_DEPTH_LIMIT` levels deep, the fields readers use must have
their types (a one-line :class:`ResultsError` names the file and the field otherwise), the columns of the records
and samples must hold numbers where their record type says so, and every string is shown escaped and cut
(:mod:`bench.results.text`: names to :data:`~bench.results.text.NAME_LIMIT` characters, free text and paths,
such as the micro run a prediction rests on, to :data:`~bench.results.text.TEXT_LIMIT`).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.results.files import DiskError, append_whole, make_dir, overwrite_in_place, replace_file
from bench.results.lines import bandwidth_references, kind_of
from bench.results.provenance import environment
from bench.results.reading import a_file, first_line, look_at, read_csv
from bench.results.records import (
    OLD_FRAMEWORK,
    RECORD_TYPES,
    SAMPLE_INDEX,
    Record,
    ResultsError,
    points,
    record_type,
)
from bench.results.text import NAME_LIMIT, TEXT_LIMIT, printable, shown

if TYPE_CHECKING:  # pandas is imported where runs are read: a rank that only writes records never loads it
    import pandas as pd

#: 2: micro and model records have a ``round`` column (several rows per point with ``--rounds``), and runs
#: that time iterations keep them in ``samples.csv``; 3: records of lines (micro, model, scale) have ``line_kind``.
#: 4: records of training and of models (model, scale, converge, models, analysis) have ``framework`` and
#: ``framework_version``, the framework part of their key (a bench that reads 3 at most would take a PyTorch point
#: for a TensorFlow one). Older directories still load, upgraded on the way in (:data:`UPGRADES`)
SCHEMA_VERSION = 4
#: the versions :func:`load_run` reads
READABLE_VERSIONS = (1, 2, 3, 4)
META_FILE = "meta.json"
RECORDS_FILE = "records.csv"
SAMPLES_FILE = "samples.csv"
#: space a running writer holds in its directory and gives up when the disk refuses a row, so that ``meta.json``
#: can still be rewritten to say the run failed and why (removed when the run ends)
RESERVE_FILE = ".meta.json.reserve"
RESERVE_BYTES = 16 * 1024
#: white space after the first meta.json's JSON: blocks its last version is written into, in place, when the disk
#: was too full at the start to keep :data:`RESERVE_FILE` (bench's last meta.json is a few KB longer than its first)
META_ROOM_BYTES = 2 * 1024
#: the block the first meta.json's length is rounded up to (a disk's block: its last bytes cost nothing)
META_BLOCK = 4096
#: the largest meta.json a reader parses (bench writes a few KB), and the deepest it may be nested (bench: 4 levels)
META_LIMIT_BYTES = 4 * 2**20
META_DEPTH_LIMIT = 32

#: columns every record of an experiment carries (more are allowed): the record types' required fields
REQUIRED_COLUMNS: dict[str, list[str]] = {name: cls.required() for name, cls in RECORD_TYPES.items()}
#: every column an experiment's records may carry, in the order of records.csv
COLUMNS: dict[str, list[str]] = {name: cls.columns() for name, cls in RECORD_TYPES.items()}



def of_peer(p50_us: float | None, best_peer_p50_us: float | None) -> float | None:
    """A micro record's ``of_peer``: its p50 over the best (lowest) p50 of the same run's peer lines at the same
    size in the same round; below 1.0 is faster than every peer. None (an empty cell) without peers
    (``--no-peers``, none installed) or without a time."""
    if best_peer_p50_us is None or not best_peer_p50_us > 0 or p50_us is None:
        return None
    value = float(p50_us)
    return None if math.isnan(value) else value / float(best_peer_p50_us)


def of_reference(throughput_MBps: float, reference_MBps: float | None) -> float | None:
    """A micro record's ``of_reference``: its throughput as a fraction of the same run's bandwidth reference
    at the same size (:func:`bench.results.lines.bandwidth_reference`: ``ucx_perftest``, UCX's put bandwidth
    ``ucp_put_bw`` over the run's ``--fabric-transport``; ``ib_write_bw`` on the verbs fabric).

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
    :func:`bench.results.lines.bandwidth_references` it has); a size measured more than once (never by ``bench
    micro``) has no reference, as which one is meant cannot be told."""
    if "transport" not in records or "throughput_MBps" not in records or "size_bytes" not in records:
        return {}
    lines = records[records["transport"].isin(bandwidth_references())]
    lines = lines[lines["size_bytes"].map(lambda size: _size_key(size) is not None).astype(bool)]
    counts = lines["size_bytes"].value_counts()
    return {int(size): float(mbps) for size, mbps in zip(lines["size_bytes"], lines["throughput_MBps"], strict=True)
            if counts[size] == 1}


def _size_key(size: Any) -> int | None:
    """A record's size as a key: None where the file holds no finite number there (empty, inf)."""
    return int(size) if isinstance(size, (int, float)) and math.isfinite(size) else None


def with_of_reference(records: pd.DataFrame) -> pd.DataFrame:
    """Micro records with an ``of_reference`` column: as recorded, or computed from the run's own
    reference records for a run written before the column existed (empty where it has none)."""
    if "of_reference" in records.columns:
        return records
    references = reference_throughputs(records)
    records = records.copy()
    records["of_reference"] = [
        of_reference(mbps, references.get(_size_key(size)))
        for size, mbps in zip(records["size_bytes"], records["throughput_MBps"], strict=True)
    ]
    records["of_reference"] = records["of_reference"].astype(float)
    return records



def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def default_run_dir(experiment: str, root: Path = Path("results"), suffix: str = "") -> Path:
    """``results/<experiment>-<YYYYmmdd-HHMMSS><suffix>``, made unique if that name is taken (a report's file
    takes a ``suffix``, a run's directory none)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = root / f"{experiment}-{stamp}{suffix}"
    n = 2
    while path.exists():
        path = root / f"{experiment}-{stamp}-{n}{suffix}"
        n += 1
    return path


class RunWriter:
    """Writes one run directory: ``meta.json`` at the start and end, records (and samples) as they come."""

    def __init__(self, path: Path, experiment: str, settings: dict[str, Any]) -> None:
        self.record_type = record_type(experiment)
        self.path = path
        #: the disk error that stopped a write, once one did
        self.disk_error: DiskError | None = None
        make_dir(path, parents=True)  # a link planted at the name is refused, never written through
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
        try:
            self._write_meta(room=META_ROOM_BYTES)  # blocks the last meta.json can be written into, disk full or not
        except BaseException:
            with contextlib.suppress(OSError):  # no run began: leave no empty directory behind
                path.rmdir()
            raise
        self._hold_reserve()

    def add(self, record: Record | dict[str, Any]) -> None:
        """Append one measured point to ``records.csv`` (a mapping is checked against the record type first)."""
        if not isinstance(record, Record):
            record = self.record_type.from_row(record)
        elif not isinstance(record, self.record_type):
            raise ResultsError(f"a {type(record).__name__} cannot go into a {self.meta['experiment']} run "
                               f"(it takes {self.record_type.__name__})")
        self._append(RECORDS_FILE, self.record_type.columns(), [record.row()])

    def add_samples(self, record: Record, values: dict[str, Any]) -> None:
        """Append the timed iterations of ``record``'s point to ``samples.csv``: ``values`` maps each of the
        record type's sample columns to a sequence, one entry per iteration (numbered from 0)."""
        columns = self.record_type.sample_columns()
        lengths = {len(values[name]) for name in self.record_type.samples}
        if len(lengths) != 1:
            raise ResultsError(f"samples of {record.point()} differ in length: "
                               f"{ {name: len(values[name]) for name in self.record_type.samples} }")
        point = dict(zip(self.record_type.key, record.point(), strict=True), round=getattr(record, "round", 1))
        rows = [{**point, "iteration": i, **{name: values[name][i] for name in self.record_type.samples}}
                for i in range(lengths.pop())]
        self._append(SAMPLES_FILE, columns, rows)

    def _append(self, name: str, columns: list[str], rows: list[dict[str, Any]]) -> None:
        # the rows go to the file in one write, whole or not at all (see bench.results.files.append_whole)
        if self.disk_error is not None:
            raise self.disk_error  # the disk refused a row already: no later row may land after the gap
        header, body = io.StringIO(), io.StringIO()
        csv.DictWriter(header, fieldnames=columns).writeheader()
        # optional columns a record lacks (a reference line has no CPU split, say) stay empty
        csv.DictWriter(body, fieldnames=columns).writerows(rows)
        with _signals_held():
            try:
                append_whole(self.path / name, body.getvalue(), header=header.getvalue())
            except DiskError as exc:
                self.disk_error = exc
                self._release_reserve()  # room for meta.json to say so
                raise

    def finish(self, status: str = "complete", **extra: Any) -> None:
        """Record the end time, the outcome and anything learnt during the run.

        After a disk error the run is ``failed`` with the error as its ``reason``; should ``meta.json`` still
        not be rewritable then, the old one stays as it was (and this does not raise again).
        """
        if self.disk_error is not None:
            status = "failed"
            extra.setdefault("reason", str(self.disk_error))
        self.meta.update(end_time=now_iso(), status=status, **extra)
        self._release_reserve()  # what it was kept for: this last meta.json
        try:
            self._write_meta()
        except DiskError as exc:
            try:  # no block for a new file even so (the room could not be kept): into the first one's blocks
                with _signals_held():
                    overwrite_in_place(self.path / META_FILE, self._meta_text())
            except OSError:
                if self.disk_error is None:
                    self.disk_error = exc
                    raise

    def _meta_text(self, room: int = 0) -> str:
        """meta.json's text; with ``room``, white space after the JSON (which JSON allows) up to the end of a
        :data:`META_BLOCK` at least ``room`` bytes on: blocks a disk block holds anyway."""
        text = json.dumps(self.meta, indent=2, default=str) + "\n"
        if not room:
            return text
        size = len(text.encode("utf-8"))
        return text + " " * (-(size + room) % META_BLOCK + room - 1) + "\n"

    def _write_meta(self, room: int = 0) -> None:
        with _signals_held():
            replace_file(self.path / META_FILE, self._meta_text(room))

    def _hold_reserve(self) -> None:
        with contextlib.suppress(OSError):  # best effort: a disk this full fails the first row instead
            replace_file(self.path / RESERVE_FILE, bytes(RESERVE_BYTES), durable=False)

    def _release_reserve(self) -> None:
        with contextlib.suppress(OSError):
            (self.path / RESERVE_FILE).unlink(missing_ok=True)


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
    """A run read back: its meta-data and its records (upgraded to the current schema)."""

    path: Path
    meta: dict[str, Any]
    records: pd.DataFrame
    #: rows of ``records.csv`` that could not be read and are left out of ``records`` (a last row cut short)
    unread_rows: int = 0
    #: the framework whose records alone this holds (:meth:`by_framework`), to be named wherever they are shown;
    #: None for a run read whole
    framework: str | None = None

    @property
    def frameworks(self) -> list[str]:
        """The frameworks the run's records name, in the order they first appear; empty for an experiment whose
        records name none (micro, soak)."""
        if "framework" not in self.records:
            return []
        return [str(name) for name in dict.fromkeys(self.records["framework"].dropna())]

    def by_framework(self) -> list[Run]:
        """The run as readers show it, one framework's points never drawn or tabled with another's: this run alone
        when its records name none or only TensorFlow (the paper's, named nowhere), else a run per framework
        holding only that framework's records and samples, with :attr:`framework` set. A run narrowed already
        is its own one part."""
        frameworks = self.frameworks
        if self.framework is not None or frameworks in ([], [OLD_FRAMEWORK]):
            return [self]
        parts = []
        for name in frameworks:
            part = Run(self.path, self.meta, self.records[self.records["framework"] == name].reset_index(drop=True),
                       self.unread_rows, framework=name)
            samples = self.samples
            if samples is not None and "framework" in samples:
                samples = samples[samples["framework"] == name].reset_index(drop=True)
            part._samples = samples
            parts.append(part)
        return parts

    @property
    def experiment(self) -> str:
        return self.meta["experiment"]

    @property
    def schema_version(self) -> int:
        """The version the run was written with (its records are read as the current one)."""
        return self.meta["schema_version"]

    @property
    def samples(self) -> pd.DataFrame | None:
        """Every timed iteration (``samples.csv``), or None for a run that kept none (version 1, or an
        experiment that times no iterations)."""
        if not hasattr(self, "_samples"):
            file = self.path / SAMPLES_FILE
            info = look_at(file)
            # an empty file: the first samples were refused (a full disk); the records still stand
            cls = record_type(self.experiment)
            self._samples = (_samples_framework(_checked(read_csv(a_file(file, info))[0], file, _sample_kinds(cls)),
                                                cls)
                             if info is not None and info.st_size else None)
        return self._samples

    def points(self, also: tuple[str, ...] = ()) -> pd.DataFrame:
        """One row per measured point, rounds folded, with the spread of its headline number (and across rounds of
        the columns ``also`` names: :func:`bench.results.records.points`)."""
        return points(self.records, self.experiment, self.samples, also=also)


def _samples_framework(samples: pd.DataFrame, cls: type[Record]) -> pd.DataFrame:
    """Samples whose record type's key has the framework, with it: tensorflow where a run from before the column (or
    a sample written without one) has none, as its records read."""
    if "framework" not in cls.key:
        return samples
    if "framework" not in samples:
        at = cls.key.index("framework")
        samples.insert(min(at, len(samples.columns)), "framework", OLD_FRAMEWORK)
    else:
        samples["framework"] = samples["framework"].astype(object).fillna(OLD_FRAMEWORK).astype(str)
    return samples


def with_rounds(records: pd.DataFrame, cls: type[Record]) -> pd.DataFrame:
    """Version 1 to 2: records of experiments with rounds get ``round`` 1 (version 1 measured every point once)."""
    if "round" in cls.columns() and "round" not in records:
        records.insert(records.columns.get_loc(cls.key[-1]) + 1, "round", 1)
    return records


def with_line_kinds(records: pd.DataFrame, cls: type[Record]) -> pd.DataFrame:
    """Version 2 to 3: records of lines get ``line_kind``, the catalogue's kind of their line
    (:mod:`bench.results.lines`; a name it does not know is a transport)."""
    if "line_kind" in cls.columns() and "line_kind" not in records and "transport" in records:
        records.insert(records.columns.get_loc("transport") + 1, "line_kind",
                       [kind_of(str(name)) for name in records["transport"]])
    return records


def with_frameworks(records: pd.DataFrame, cls: type[Record]) -> pd.DataFrame:
    """Version 3 to 4 (and any record written without one): records that name a framework get ``framework``
    tensorflow where they have none (:data:`~bench.results.records.OLD_FRAMEWORK`: every run before the column
    trained TensorFlow); ``framework_version`` stays as written (empty: the run's meta.json has the package's)."""
    columns = cls.columns()
    if "framework" not in columns:
        return records
    if "framework" not in records:
        before = columns[columns.index("framework") - 1]
        at = records.columns.get_loc(before) + 1 if before in records else len(records.columns)
        records.insert(at, "framework", OLD_FRAMEWORK)
    else:
        records["framework"] = records["framework"].astype(object).fillna(OLD_FRAMEWORK).astype(str)
    if "framework_version" not in records:
        records.insert(records.columns.get_loc("framework") + 1, "framework_version", None)
    return records


#: version -> the function that brings records of that version to the next (asv's way: one named step each)
UPGRADES = {1: with_rounds, 2: with_line_kinds, 3: with_frameworks}


def load_run(path: Path) -> Run:
    """Read a run directory, checking its schema version, required columns and the types of what readers use.

    Versions 1 to 4 are read, upgraded step by step (:data:`UPGRADES`): a version 1 run's records get ``round`` 1,
    a version 2 run's records of lines their ``line_kind``, a version 3 run's records of training their
    ``framework`` (tensorflow). A run whose ``meta.json``
    says ``running`` while the process that wrote it (on this host) is gone was killed without a
    chance to say so: it reads as ``killed``. Everything is bounded as the module says; anything a reader could
    not use is a one-line ResultsError.
    """
    path = Path(path)
    meta_file = path / META_FILE
    if (info := look_at(meta_file)) is None:
        raise ResultsError(f"{path} is not a results directory: it has no {META_FILE}")
    meta = _read_meta(a_file(meta_file, info))
    if meta["experiment"] not in RECORD_TYPES:
        raise ResultsError(f"{meta_file}: unknown experiment {shown(meta['experiment'])} (known: "
                           f"{', '.join(RECORD_TYPES)})")
    if meta.get("status") == "running" and not writer_alive(meta):
        meta["status"] = "killed"
    records_file = path / RECORDS_FILE
    if (info := look_at(records_file)) is None:
        raise ResultsError(f"{path} has no {RECORDS_FILE}: the run recorded no point")
    cls = record_type(meta["experiment"])
    records, unread = read_csv(a_file(records_file, info))
    records = _checked(records, records_file, _column_kinds(cls))
    missing = [c for c in REQUIRED_COLUMNS[meta["experiment"]] if c not in records.columns]
    if missing:
        raise ResultsError(f"{records_file} lacks required columns {missing}")
    for version in range(meta["schema_version"], SCHEMA_VERSION):
        records = UPGRADES[version](records, cls)
    records = with_frameworks(records, cls)  # a record of this version written without one reads as tensorflow too
    if meta["experiment"] == "micro":  # runs from before the column have it computed from their own records
        records = with_of_reference(records)
    return Run(path, meta, records, unread_rows=unread)


#: the types of the fields of meta.json that readers use (None, or absent, is always allowed), by their path
_META_TYPES: dict[tuple[str, ...], tuple[type, ...]] = {
    ("command",): (list,), ("start_time",): (str,), ("end_time",): (str,), ("status",): (str,), ("reason",): (str,),
    ("settings",): (dict,), ("host",): (str,), ("platform",): (str,), ("cpu",): (str,), ("cpu_count",): (int, float),
    ("memory_bytes",): (int, float), ("packages",): (dict,), ("git_commit",): (str,), ("pid",): (int,),
    ("settings", "fabric"): (str,), ("settings", "fabric_transport"): (str,), ("settings", "launcher"): (dict, str),
    ("settings", "task"): (str,), ("settings", "metric"): (str,), ("settings", "target"): (str,),
    ("settings", "launcher", "launcher"): (str,), ("settings", "launcher", "hosts"): (list,),
    ("settings", "launcher", "world_size"): (int,),
}
_TYPE_WORDS = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
               bool: "true or false", type(None): "null"}


def _read_meta(meta_file: Path) -> dict[str, Any]:
    """``meta.json`` parsed, bounded (size, depth, every string shown escaped and cut) and its fields' types checked."""
    redo = "it is not a meta.json written by bench: run the experiment again"
    try:
        with open(meta_file, "rb") as file:
            data = file.read(META_LIMIT_BYTES + 1)
    except OSError as exc:
        raise ResultsError(f"{meta_file} cannot be read ({exc.strerror or first_line(exc)})") from None
    if len(data) > META_LIMIT_BYTES:
        raise ResultsError(f"{meta_file} is larger than {META_LIMIT_BYTES // 2**20} MB; {redo}")
    try:
        meta = json.loads(data)
    except RecursionError:
        raise ResultsError(f"{meta_file} is nested deeper than {META_DEPTH_LIMIT} levels; {redo}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ResultsError(f"{meta_file} cannot be read ({printable(first_line(exc), 200)}); {redo}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("experiment"), str):
        raise ResultsError(f"{meta_file} is not a meta.json written by bench (expected an object with "
                           "'experiment' and 'schema_version'): run the experiment again")
    meta = _bounded(meta, meta_file, 0)
    version = meta.get("schema_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise ResultsError(f"{meta_file}: schema_version {shown(version)} is not supported (this bench reads "
                           f"{', '.join(map(str, READABLE_VERSIONS))}); a newer bench wrote it: upgrade to read it")
    for where, types in _META_TYPES.items():
        value: Any = meta
        for name in where:
            value = value.get(name) if isinstance(value, dict) else None
        if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            expected = " or ".join(dict.fromkeys(_TYPE_WORDS[t] for t in types))
            raise ResultsError(f"{meta_file}: '{'.'.join(where)}' is {_TYPE_WORDS.get(type(value), 'a value')}, "
                               f"expected {expected}; {redo}")
    return meta


#: meta.json's paths (a prediction's micro run and compute run): kept to a text's length rather than a name's
_LONG_META = frozenset({("settings", "micro_run"), ("settings", "compute_from")})


def _bounded(value: Any, meta_file: Path, depth: int, where: tuple[str, ...] = ()) -> Any:
    """A parsed JSON value with every string (keys too) shown escaped and cut to a name's length (a path of
    :data:`_LONG_META` to a text's); deeper than :data:`META_DEPTH_LIMIT` is a ResultsError. ``where``: the keys
    down to ``value``."""
    if depth > META_DEPTH_LIMIT:
        raise ResultsError(f"{meta_file} is nested deeper than {META_DEPTH_LIMIT} levels; it is not a meta.json "
                           "written by bench: run the experiment again")
    if isinstance(value, str):
        return printable(value, TEXT_LIMIT if where in _LONG_META else NAME_LIMIT)
    if isinstance(value, list):
        return [_bounded(item, meta_file, depth + 1, (*where, "[]")) for item in value]
    if isinstance(value, dict):
        return {printable(key, NAME_LIMIT): _bounded(item, meta_file, depth + 1, (*where, key))
                for key, item in value.items()}
    return value


#: record columns of free text (tensor names, source sites, lists of names, a path), kept longer than a name
_LONG_TEXT = frozenset({"unregistered_tensors", "site", "tensor", "variable", "shape", "bound", "micro_run"})


def _kind(annotation: Any) -> str | None:
    """``number`` or ``text`` for a record field's annotation (``int | None``, ``str``), None for another."""
    parts = {part.strip() for part in str(annotation).split("|")}
    if "bool" in parts:
        return None
    if parts & {"int", "float"}:
        return "number"
    return "text" if "str" in parts else None


def _column_kinds(cls: type[Record]) -> dict[str, str]:
    """What each column of the record type's records.csv must hold: ``number`` or ``text``."""
    return {f.name: kind for f in fields(cls) if (kind := _kind(f.type)) is not None}


def _sample_kinds(cls: type[Record]) -> dict[str, str]:
    """What each column of the record type's samples.csv must hold: its key's kinds, then numbers."""
    kinds = _column_kinds(cls)
    return {**{name: kinds[name] for name in cls.key if name in kinds},
            **{name: "number" for name in (*SAMPLE_INDEX, *cls.samples)}}


def _checked(frame: pd.DataFrame, path: Path, kinds: dict[str, str]) -> pd.DataFrame:
    """``frame`` with numbers where ``kinds`` says so (a cell that is none is a ResultsError naming the file, the
    column and the row), text as text, and every string shown escaped and cut."""
    import pandas as pd

    for column in frame.columns:
        series = frame[column]
        kind = kinds.get(column)
        if kind == "number":
            if pd.api.types.is_numeric_dtype(series):
                continue
            numbers = pd.to_numeric(series, errors="coerce")
            bad = series.notna() & numbers.isna()
            if bad.any():
                row = int(bad.to_numpy().argmax())
                raise ResultsError(f"{path}: column '{column}' holds {shown(series[bad].iloc[0])} in row {row + 2}, "
                                   "not a number; the file was not written by bench as it is: run the experiment "
                                   "again")
            frame[column] = numbers
            continue
        limit = TEXT_LIMIT if column in _LONG_TEXT or kind is None else NAME_LIMIT
        # text: object columns, and (pandas 3) columns of its own string type, in which ``is_object_dtype`` is False
        holds_text = pd.api.types.is_object_dtype(series) or pd.api.types.is_string_dtype(series.dtype)
        if kind == "text" and not holds_text:
            frame[column] = series.map(lambda v, limit=limit: v if pd.isna(v) else printable(_cell(v), limit))
            continue
        if holds_text:
            mapping = {v: printable(v, limit) for v in pd.unique(series.dropna()) if isinstance(v, str)}
            if any(key != shown_ for key, shown_ in mapping.items()):
                frame[column] = series.map(lambda v, m=mapping: m.get(v, v) if isinstance(v, str) else v)
    return frame


def _cell(value: Any) -> Any:
    """A number read where text belongs, as it was written: 12.0 back to 12."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


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
