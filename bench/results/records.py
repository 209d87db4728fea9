"""One record type per experiment: the columns of ``records.csv`` (and of ``samples.csv``), listed once.

Every experiment builds its rows as one of these dataclasses, never as a dict of column names: a
misspelt or missing column is an error where the record is made. A type's fields are the columns of
its ``records.csv``, in order; fields without a default are required. Class attributes say what
readers need to know to compare runs:

- ``key``: the columns that name a measured point, the same across runs (micro: transport and size);
- ``measure``: the point's headline number, lower is better (micro: the median time per transfer);
- ``samples``: the per-iteration columns of ``samples.csv`` (micro: each timed transfer's time), written
  beside the records by experiments that time iterations (see :mod:`bench.results.store`).

Records of training (model, scale, converge) and of the models measured or analysed (models, analysis) say which
framework built the model (``framework``: tensorflow or torch, :mod:`bench.runtime.framework`) and its version;
the framework is part of their ``key``: a TensorFlow point is never a PyTorch one. Runs from before the column
read as tensorflow (:func:`bench.results.store.with_frameworks`).

Micro and model records have a ``round`` column: with ``bench micro --rounds N`` a point is measured N
times, interleaved with the other transports, one row each.

:func:`points` folds the rounds of each point into one row with the spread across them.

Why one module of 630 lines: the record types are the results contract, read as one table of every experiment's
columns; split, a reader would have to gather the columns of one run from several files, and ``record_type``'s
registry would import them all back anyway.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from bench.results.lines import kind_of

if TYPE_CHECKING:  # pandas is imported where frames are made: a rank that only writes records never loads it
    import pandas as pd


class ResultsError(ValueError):
    """A results directory or record that is missing, incomplete or of an unknown schema."""


#: the columns of samples.csv that every experiment's samples have after the point's key
SAMPLE_INDEX = ("round", "iteration")
#: what a micro record's ``source`` says: the sender's tensor written whole before each transfer, or not
MICRO_SOURCES = ("fresh", "reused")
#: what a record without a framework (a run from before the column) was trained with: TensorFlow, the paper's
#: (:data:`bench.runtime.framework.DEFAULT_FRAMEWORK`; not imported: readers import no runtime)
OLD_FRAMEWORK = "tensorflow"
#: how readers name each framework (a name not here is shown as it is)
FRAMEWORK_TITLES = {"tensorflow": "TensorFlow", "torch": "PyTorch"}


def framework_title(name: str) -> str:
    """A framework's name as readers show it: ``torch`` -> ``PyTorch``."""
    return FRAMEWORK_TITLES.get(name, name)


@dataclass(kw_only=True)
class Record:
    """One row of ``records.csv``."""

    experiment: ClassVar[str]
    key: ClassVar[tuple[str, ...]] = ()
    measure: ClassVar[str | None] = None
    samples: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def columns(cls) -> list[str]:
        """The columns of ``records.csv``, in order."""
        return [f.name for f in fields(cls)]

    @classmethod
    def required(cls) -> list[str]:
        """The columns every record carries (fields without a default)."""
        return [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]

    @classmethod
    def sample_columns(cls) -> list[str]:
        """The columns of ``samples.csv``: the point's key, round and iteration, then the measured values."""
        return [*cls.key, *SAMPLE_INDEX, *cls.samples]

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Record:
        """A record from a mapping of column names; a missing required or an unknown column is a ResultsError."""
        missing = [c for c in cls.required() if c not in row]
        if missing:
            raise ResultsError(f"record lacks required columns {missing}")
        unknown = [c for c in row if c not in cls.columns()]
        if unknown:
            raise ResultsError(f"record has columns {unknown} that {cls.experiment} records do not have")
        return cls(**row)

    def row(self) -> dict[str, Any]:
        """The record as ``column -> value``, in column order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def point(self) -> tuple:
        """The values of the key columns: which point this is."""
        return tuple(getattr(self, name) for name in self.key)


def latency_summary(micros: Sequence[float] | np.ndarray) -> dict[str, float]:
    """``p50_us, p99_us, mean_us, min_us, max_us`` of per-iteration times (µs): the one place they are computed."""
    values = np.asarray(micros, dtype=float)
    return {"p50_us": float(np.percentile(values, 50)), "p99_us": float(np.percentile(values, 99)),
            "mean_us": float(values.mean()), "min_us": float(values.min()), "max_us": float(values.max())}


class _OfALine:
    """A record of a line (its ``transport``): its ``line_kind`` is the catalogue's where the maker gave none."""

    transport: str
    line_kind: str | None

    def __post_init__(self) -> None:
        if self.line_kind is None:
            self.line_kind = kind_of(self.transport)


@dataclass(kw_only=True)
class MicroRecord(_OfALine, Record):
    """``bench micro``: one size over one transport (or reference line) in one round.

    Times are per transfer in µs from the sender's ``send`` to the receiver having consumed the
    tensor; ``throughput_MBps`` is size / mean time (MB = 2**20 bytes); the ledger columns are per
    transfer, both sides together. Reference lines (``ucx_perftest``, ``memcpy``, ...) leave empty
    what they do not measure (bench/experiments/references/ says which); peer lines (``mpi``, ``socket``,
    ...: bench/experiments/peers) have a transport's columns.
    """

    experiment = "micro"
    key = ("transport", "size_bytes")
    measure = "p50_us"
    samples = ("time_us", "transfer_us")

    transport: str
    #: what the line is (bench.results.lines: transport, local, tf_grpc, reference, peer); from the catalogue
    #: where not given
    line_kind: str | None = None
    size_bytes: int
    #: 1, 2, ... with --rounds: the same point measured again after every other transport's turn
    round: int = 1
    dtype: str | None = None
    warmup: int | None = None
    iters: int
    p50_us: float | None
    p99_us: float | None
    mean_us: float | None
    min_us: float | None = None
    max_us: float | None = None
    #: the same transfers split where recv returned: moving the tensor, then consuming it
    transfer_p50_us: float | None = None
    consume_p50_us: float | None = None
    throughput_MBps: float | None
    #: throughput / the same run's bandwidth reference at this size (ucx_perftest, ib_write_bw)
    of_reference: float | None = None
    #: p50 / the best (lowest) p50 of the same run's peer lines (mpi, socket, ...) at this size in this round
    of_peer: float | None = None
    sender_cpu_s: float | None
    receiver_cpu_s: float | None
    sender_cpu_us_per_transfer: float | None = None
    receiver_cpu_us_per_transfer: float | None = None
    copied_bytes_per_transfer: float | None
    serialisations_per_transfer: float | None = None
    deserialisations_per_transfer: float | None = None
    control_messages_per_transfer: float | None = None
    registrations: int | None = None
    registrations_per_transfer: float | None = None
    fabric: str | None = None
    #: copies of the payload the sender made on purpose before each send (--extra-copy: a known slow-down)
    extra_copies: int = 0
    #: where the tensor lived on each side (--memory: host, cuda:N)
    sender_memory: str = "host"
    receiver_memory: str = "host"
    #: the sender's tensor (``bench micro --source``, :data:`MICRO_SOURCES`): ``fresh``, written whole before each
    #: transfer outside the timed interval, as a backward pass writes a gradient; ``reused``, written only where
    #: the harness marks it, as OSU and nccl-tests (and the tools with loops of their own) send it; empty in runs
    #: from before the column (unknown)
    source: str | None = None
    #: the sender's whole writes of its tensor over the point (warm-up included: one per transfer when fresh, 0
    #: reused; empty for a tool whose loop is not ours), and the least time (µs) from the end of one to the clock
    #: read that starts its transfer, over the timed transfers (at or above 0: every write outside the timed
    #: interval)
    source_writes: int | None = None
    source_write_lead_min_us: float | None = None
    #: payload bytes per transfer copied between device and host memory (staging through the host), and from
    #: device to device, both sides together (apart from copied_bytes_per_transfer: host copies)
    device_to_host_bytes_per_transfer: float | None = None
    host_to_device_bytes_per_transfer: float | None = None
    device_to_device_bytes_per_transfer: float | None = None
    #: --contend N: busy processes beside the same point measured again (0: not measured so), and that
    #: measurement's p50 and p99, its p50 over the quiet one (steadiness: 1.0 is unmoved), and over the best
    #: peer's contended p50 at this size in this round
    contend: int = 0
    contended_p50_us: float | None = None
    contended_p99_us: float | None = None
    contended_of_quiet: float | None = None
    contended_of_peer: float | None = None


@dataclass(kw_only=True)
class ModelRecord(_OfALine, Record):
    """``bench model``: one model, batch size and server count over one transport (or ``local``, ``tf_grpc``).

    Times are seconds per step, averaged over the workers and the timed steps; throughput is mini-batches
    per second per worker; copies and registrations are per step, all processes together.
    """

    experiment = "model"
    key = ("transport", "framework", "model", "batch_size", "servers")
    measure = "step_time_s"
    samples = ("worker", "step_time_s")

    transport: str
    #: what the line is (bench.results.lines: transport, local, tf_grpc); from the catalogue where not given
    line_kind: str | None = None
    #: the framework that built and trained the model (tensorflow, torch: bench.runtime.framework) and its version;
    #: empty in runs from before the column, read as tensorflow
    framework: str | None = None
    framework_version: str | None = None
    model: str
    batch_size: int
    servers: int
    round: int = 1
    #: where the weights, gradients and received tensors lived (``host``, ``cuda:0``: ``--memory``); empty in runs
    #: from before the column, which were all in host memory
    memory: str | None = None
    steps: int
    step_time_s: float
    throughput_batches_per_s: float
    compute_s: float
    comm_s: float
    apply_s: float | None = None
    ps_wait_s: float | None = None
    #: CPU seconds a step of one worker's process and of one PS's (the mean over them), every thread of it: its
    #: transport's work, the runtime's, a computed step's (compute replayed waits, on no core)
    worker_cpu_s_per_step: float | None = None
    ps_cpu_s_per_step: float | None = None
    worker_peak_rss_mb: float | None = None
    ps_peak_rss_mb: float | None = None
    copied_bytes_per_step: float | None = None
    runtime_copied_bytes_per_step: float | None = None
    registrations_per_step: float | None = None
    control_messages_per_step: float | None = None
    model_mb: float | None = None
    fabric: str | None = None
    isolated_network: bool | None = None
    compute: str | None = None
    launcher: str | None = None
    link_rate: str | None = None
    link_peak_MBps: float | None = None
    # the graph analysis: on/off (zerocopy), what went by dynamic allocation, and how many sent tensors were
    # in registered memory already (registration-cache hits), with the allocator regions the tracing registered
    analysis: str | None = None
    dynamic_transfers_per_step: float | None = None
    unregistered_sends_per_step: float | None = None
    registration_hit_rate: float | None = None
    site_regions: int | None = None
    unregistered_tensors: str | None = None
    #: updates a worker sent while its step's backward pass still ran (dense gradients, as TensorFlow's dataflow
    #: sends them), per step and worker
    updates_sent_early_per_step: float | None = None
    #: bytes crossing between device and host memory (staging) and copied device to device, all processes per step
    device_to_host_bytes_per_step: float | None = None
    host_to_device_bytes_per_step: float | None = None
    device_to_device_bytes_per_step: float | None = None


@dataclass(kw_only=True)
class ScaleRecord(ModelRecord):
    """``bench scale``: a model record, and how throughput grows with the servers."""

    experiment = "scale"

    # required here (optional in a model record): field() drops the default the model record's class holds
    launcher: str = field()
    compute: str = field()
    link_rate: str = field()
    total_batches_per_s: float | None = None
    #: throughput / (servers x the 1-server throughput of the same transport, model and batch size)
    scaling_efficiency: float


@dataclass(kw_only=True)
class SoakRecord(Record):
    """``bench soak``: one process of one measured point (a micro size or a model run) of one transport."""

    experiment = "soak"
    key = ("phase", "transport", "size_bytes", "model", "process")

    phase: str
    transport: str
    size_bytes: int | None = None
    model: str | None = None
    process: str
    seconds: float | None = None
    transfers: int | None = None
    tensors_sent: int
    tensors_received: int
    corrupted: int
    lost: int
    rss_start_mb: float
    rss_end_mb: float
    rss_growth_mb: float | None = None
    p50_us: float | None = None
    throughput_MBps: float | None = None
    step_time_s: float | None = None
    fabric: str | None = None


@dataclass(kw_only=True)
class ConvergeRecord(Record):
    """``bench converge``: a step (training loss), an evaluation (held-out loss and metric) or, per transport,
    the summary (time to the target); ``kind`` says which (bench/experiments/converge.py)."""

    experiment = "converge"
    key = ("kind", "transport", "framework", "task", "step")
    measure = "time_to_target_s"

    kind: str
    transport: str
    task: str
    #: the framework that built and trained the model (tensorflow, torch: bench.runtime.framework) and its version;
    #: empty in runs from before the column, read as tensorflow
    framework: str | None = None
    framework_version: str | None = None
    step: int | None = None
    wall_s: float | None = None
    train_loss: float | None = None
    heldout_loss: float | None = None
    metric: str | None = None  # the held-out metric's name
    metric_value: float | None = None
    batch_size: int | None = None
    servers: int | None = None
    learning_rate: float | None = None
    target: str | None = None
    steps_to_target: int | None = None
    time_to_target_s: float | None = None
    speedup_vs_grpc_tcp: float | None = None
    paper_speedup_vs_grpc_tcp: float | None = None
    fabric: str | None = None


@dataclass(kw_only=True)
class ModelsRecord(Record):
    """``bench models``: the paper's Table 2 measured here, one model a row, beside the paper's numbers."""

    experiment = "models"
    key = ("model", "framework", "batch_size")
    measure = "compute_ms_per_sample"

    model: str
    #: the framework that built and trained the model (tensorflow, torch: bench.runtime.framework) and its version;
    #: empty in runs from before the column, read as tensorflow
    framework: str | None = None
    framework_version: str | None = None
    variables: int
    paper_variables: int | None = None
    parameters: int | None = None
    model_mb: float
    paper_model_mb: float | None = None
    batch_size: int
    compute_ms_per_sample: float
    paper_compute_ms_per_sample: float | None = None


@dataclass(kw_only=True)
class AnalysisRecord(Record):
    """``bench analyze``: one cross-process tensor of a model's transfer plan."""

    experiment = "analysis"
    key = ("model", "framework", "servers", "batch_size", "tensor", "src", "dst")

    model: str
    #: the framework that built and trained the model (tensorflow, torch: bench.runtime.framework) and its version;
    #: empty in runs from before the column, read as tensorflow
    framework: str | None = None
    framework_version: str | None = None
    servers: int
    batch_size: int
    analysis: bool = True
    tensor: str
    role: str
    placement: str  # static or dynamic
    shape: str | None = None
    bound: str | None = None
    dtype: str
    bytes: int | None = None
    src: int
    dst: int
    variable: str | None = None
    site: str | None = None


@dataclass(kw_only=True)
class PredictRecord(_OfALine, Record):
    """``bench predict``: one predicted step of a model over a transport at a server count and link rate, from a
    micro run's costs and a simulation of the step (bench/experiments/predict); ``kind`` is always ``predicted``:
    nothing here was trained. Throughput and efficiency read as ``bench scale``'s; the fractions (``compute``,
    ``host``, ``wire``, ``wait``: of a worker's step, averaged over the workers simulated) sum to 1; ``saturated``
    is the busiest resource (``nic:egress:<host>``, ``nic:ingress:<host>``, ``cpu:<host>``, ``cpu:shared``,
    ``switch``) and ``saturated_utilisation`` its busy share of the step; ``nic_bytes_per_step`` the bytes the
    busiest NIC sends and receives per step. The cluster predicted for (``cores_per_host``, ``shared_cores``,
    ``oversubscription``, ``asynchronous``) is in words in :meth:`describe_cluster`."""

    experiment = "predict"
    key = ("transport", "framework", "model", "batch_size", "servers", "link_rate")
    measure = "step_time_s"
    #: each host's cores unless a record says otherwise (the simulation's ``Cluster`` default)
    DEFAULT_CORES_PER_HOST = 8

    kind: str = "predicted"
    transport: str
    line_kind: str | None = None
    framework: str | None = None
    framework_version: str | None = None
    model: str
    batch_size: int
    servers: int
    #: as given (``10gbit``), and in bits per second
    link_rate: str
    link_rate_bps: float
    #: each host's cores for host work (the simulation's ``Cluster``: 8 unless ``--cores-per-host``; records from
    #: before the column were made with 8); unused where ``shared_cores`` is set
    cores_per_host: int = DEFAULT_CORES_PER_HOST
    #: every host's work on one pool of this many cores (hosts emulated on one machine), or None
    shared_cores: int | None = None
    #: the switch's oversubscription (1.0: non-blocking)
    oversubscription: float = 1.0
    #: asynchronous parameter servers (each worker's gradient applied as it comes)
    asynchronous: bool = False
    #: how the workers' compute was timed (``replay``: measured here once; ``paper``: Table 2) and its seconds
    compute: str
    compute_s: float
    step_time_s: float
    throughput_batches_per_s: float
    total_batches_per_s: float
    #: total / (servers x the 1-server throughput of the same transport, model, batch size and link rate)
    scaling_efficiency: float
    compute_fraction: float
    host_fraction: float
    wire_fraction: float
    wait_fraction: float
    saturated: str
    saturated_utilisation: float
    nic_bytes_per_step: int
    #: the workers simulated, each standing for every ``classes``-th one (= servers: every worker)
    classes: int | None = None
    #: the ``bench micro`` run the transfer costs come from
    micro_run: str

    @staticmethod
    def describe_cluster(cores_per_host: Any = DEFAULT_CORES_PER_HOST, shared_cores: Any = None,
                         oversubscription: Any = 1.0, asynchronous: Any = False) -> str:
        """The cluster predicted for in words where it is not the default (hosts of 8 cores, a non-blocking switch,
        synchronous parameter servers), e.g. ``2 shared cores, oversubscribed 4:1, async``; '' where it is. Takes
        the values as a reader has them too: NaN or None for none, ``'True'`` or a NumPy bool for true."""

        def number(value: Any) -> float | None:
            if value is None or isinstance(value, bool | str):
                return None
            try:
                value = float(value)
            except (TypeError, ValueError):
                return None
            return value if math.isfinite(value) else None

        parts = []
        shared, cores, ratio = number(shared_cores), number(cores_per_host), number(oversubscription)
        if shared is not None:
            parts.append(f"{shared:g} shared core{'' if shared == 1 else 's'}")
        elif cores is not None and cores != PredictRecord.DEFAULT_CORES_PER_HOST:
            parts.append(f"{cores:g} core{'' if cores == 1 else 's'} per host")
        if ratio is not None and ratio > 1:
            parts.append(f"oversubscribed {ratio:g}:1")
        if str(asynchronous).strip().lower() == "true":
            parts.append("async")
        return ", ".join(parts)

    @property
    def cluster(self) -> str:
        """This record's cluster in words (:meth:`describe_cluster`)."""
        return self.describe_cluster(self.cores_per_host, self.shared_cores, self.oversubscription, self.asynchronous)

    @staticmethod
    def describe_resource(resource: Any) -> str:
        """A ``saturated`` resource for a person: ``nic:ingress:0`` -> ``host 0's NIC ingress``."""
        parts = str(resource).split(":")
        if parts[0] == "nic" and len(parts) == 3:
            return f"host {parts[2]}'s NIC {parts[1]}"
        if parts[0] == "cpu" and len(parts) == 2:
            return "the pool of shared cores" if parts[1] == "shared" else f"host {parts[1]}'s CPU (its worker and PS)"
        if str(resource) == "switch":
            return "the switch (oversubscribed)"
        return str(resource)


RECORD_TYPES: dict[str, type[Record]] = {cls.experiment: cls for cls in (
    MicroRecord, ModelRecord, ScaleRecord, SoakRecord, ConvergeRecord, ModelsRecord, AnalysisRecord,
    PredictRecord)}


def record_type(experiment: str) -> type[Record]:
    """The record type of ``experiment``; a ResultsError names the known ones."""
    try:
        return RECORD_TYPES[experiment]
    except KeyError:
        raise ResultsError(f"unknown experiment '{experiment}' (known: {', '.join(RECORD_TYPES)})") from None


# -- points: the rounds of each measured point folded into one row ------------------------------------------

#: a point's spread when the run measured it once: the distribution-free 95% confidence interval of the
#: median of its samples (order statistics n/2 -+ 1.96 sqrt(n)/2), the noise within the run
_Z95 = 1.96


def median_interval(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """The 95% confidence interval of the median of ``values``, from their order statistics (no assumption
    about their distribution); ``(nan, nan)`` for fewer than 3 values."""
    ordered = np.sort(np.asarray(values, dtype=float))
    n = len(ordered)
    if n < 3:
        return math.nan, math.nan
    half = _Z95 * math.sqrt(n) / 2
    low = max(0, math.floor(n / 2 - half))
    high = min(n - 1, math.ceil(n / 2 + half) - 1)
    return float(ordered[low]), float(ordered[high])


def points(records: pd.DataFrame, experiment: str, samples: pd.DataFrame | None = None,
           also: Sequence[str] = ()) -> pd.DataFrame:
    """One row per measured point (``key``): every numeric column the median over the point's rounds, the
    first value of the others, ``rounds`` the number of rounds, and ``<measure>_low``/``<measure>_high`` its
    spread (also for the throughput column, the measure's inverse, and across rounds only for the columns
    ``also`` names):

    - across rounds (the lowest and highest round's value) when the point was measured in two or more;
    - else the 95% confidence interval of the median of its samples (``samples.csv``) when there are any;
    - else the value itself (no noise measured).

    ``spread`` says which (``rounds``, ``samples`` or ``none``).
    """
    import pandas as pd

    cls = record_type(experiment)
    if not cls.key or cls.measure is None or records.empty:
        return records.copy()
    key = [c for c in cls.key if c in records]
    measure = cls.measure
    throughput = {"p50_us": "throughput_MBps", "step_time_s": "throughput_batches_per_s"}.get(measure)
    frame = records.copy()
    if "round" not in frame:
        frame["round"] = 1
    grouped = frame.groupby(key, sort=False, dropna=False)
    rest = [c for c in frame.columns if c not in key and c != "round"]
    numeric = [c for c in rest if pd.api.types.is_numeric_dtype(frame[c])]
    folded = grouped[numeric].median() if numeric else grouped.size().to_frame("_n").drop(columns="_n")
    others = [c for c in rest if c not in numeric]
    if others:
        folded = folded.join(grouped[others].first())
    folded["rounds"] = grouped["round"].nunique()
    spread_columns = list(dict.fromkeys(c for c in (measure, throughput, *also) if c and c in frame))
    for column in spread_columns:
        folded[f"{column}_low"] = grouped[column].min()
        folded[f"{column}_high"] = grouped[column].max()
    folded["spread"] = np.where(folded["rounds"] >= 2, "rounds", "none")
    folded = folded.reset_index()
    intervals = _sample_intervals(samples, cls, key)
    if intervals is not None and measure in folded:
        merged = folded[key].merge(intervals, on=key, how="left")
        use = (folded["rounds"] < 2).to_numpy() & merged["low"].notna().to_numpy()
        low, high = merged["low"].to_numpy(dtype=float), merged["high"].to_numpy(dtype=float)
        if throughput in folded:
            # throughput is size (or a batch) per unit of the measure: its interval is the measure's, inverted
            scale = (folded[throughput] * folded[measure]).to_numpy(dtype=float)
            with np.errstate(divide="ignore", invalid="ignore"):
                folded.loc[use, f"{throughput}_low"] = (scale / high)[use]
                folded.loc[use, f"{throughput}_high"] = (scale / low)[use]
        folded.loc[use, f"{measure}_low"] = low[use]
        folded.loc[use, f"{measure}_high"] = high[use]
        folded.loc[use, "spread"] = "samples"
    return folded[[*key, *rest, "rounds", *[f"{c}_{end}" for c in spread_columns for end in ("low", "high")],
                   "spread"]]


def _sample_intervals(samples: pd.DataFrame | None, cls: type[Record], key: list[str]) -> pd.DataFrame | None:
    """Per point (the ``key`` columns), ``low`` and ``high``: the 95% interval of the median of its per-iteration
    measure (one sample per iteration: a model run's workers averaged); None without samples."""
    import pandas as pd

    value = {"p50_us": "time_us", "step_time_s": "step_time_s"}.get(cls.measure or "")
    if samples is None or samples.empty or value not in samples or any(k not in samples for k in key):
        return None
    if "worker" in cls.samples:  # several per iteration (a model run's workers): their mean
        per_iteration = samples.groupby([*key, *SAMPLE_INDEX], sort=False)[value].mean().reset_index()
    else:  # one sample per iteration already: no grouping by iteration (millions of groups in a long run)
        per_iteration = samples[[*key, value]]
    rows = [(*(point if isinstance(point, tuple) else (point,)), *median_interval(group[value]))
            for point, group in per_iteration.groupby(key, sort=False)]
    return pd.DataFrame(rows, columns=[*key, "low", "high"])


@dataclass(frozen=True)
class Ratio:
    """``numerator / denominator`` of two measured values, with its range from their spreads: the lowest and
    highest ratio the two spreads allow. ``overlap`` says whether the two spreads overlap (then the runs or
    transports cannot be told apart at this point: "same")."""

    value: float
    low: float
    high: float
    overlap: bool

    def __str__(self) -> str:
        if math.isnan(self.value):
            return "-"
        if self.low == self.value == self.high:
            return f"{self.value:.2f}x"
        return f"{self.value:.2f}x ({self.low:.2f}-{self.high:.2f})"


def ratio(numerator: Mapping[str, Any], denominator: Mapping[str, Any], column: str) -> Ratio:
    """The ratio of ``column`` between two points (rows of :func:`points`), with the range their
    ``<column>_low``/``<column>_high`` spreads give (the value itself where a point has none)."""

    def spread(row: Mapping[str, Any]) -> tuple[float, float, float]:
        value = _number(row.get(column))
        low, high = _number(row.get(f"{column}_low")), _number(row.get(f"{column}_high"))
        return value, (value if math.isnan(low) else low), (value if math.isnan(high) else high)

    n, n_low, n_high = spread(numerator)
    d, d_low, d_high = spread(denominator)
    if math.isnan(n) or math.isnan(d) or d <= 0 or d_low <= 0:
        return Ratio(math.nan, math.nan, math.nan, False)
    return Ratio(n / d, n_low / d_high, n_high / d_low, n_low <= d_high and d_low <= n_high)


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
