"""What got faster or slower between two runs of one experiment (``bench compare BASE NEW``).

Both runs are read with :func:`bench.results.load_run` and folded into points
(:func:`bench.results.points`): one row per measured point (micro: transport and size; model and
scale: transport, model, batch size and servers; converge: the ``summary`` row of each transport and
task; models: model and batch size), its number being the median over the point's rounds. The number
compared is the record type's ``measure`` (micro ``p50_us``, model ``step_time_s``, converge
``time_to_target_s``, models ``compute_ms_per_sample``: lower is better), or the column ``--metric``
names (the throughput columns and ``scaling_efficiency``, ``of_reference`` are higher-is-better, every
other column lower-is-better).

Each value comes with a range, the noise the run measured around it: the lowest and highest round when
the point ran in two rounds or more (``bench micro --rounds N``), else the 95% confidence interval of the
median of its timed iterations (``samples.csv``), else none (the value itself).

A micro point is judged only when both runs measured it in at least :data:`ROUNDS_TO_CALL` (3) rounds: the
interval of one round's median is the noise within that round, and two single-round runs of an untouched
transport differ far beyond it (grpc_tcp: up to 1.53x). With fewer rounds the point is **not called** (``?``):
its ratio is shown, it is never a failure, and a line says to measure both with ``--rounds 3``. The machine's
drift between the runs, the median change of the reference lines' points (:attr:`Comparison.drift`), widens the
threshold for the other lines when it is larger. Experiments without ``--rounds`` are judged by the spreads they
have.

Per point, with ``ratio = new / base`` and its range ``[new_low / base_high, new_high / base_low]``:

- **same** when the two runs' ranges overlap (the ratio's range contains 1), or when the ratio is within
  the threshold: ``1 / (1 + t) <= ratio <= 1 + t``; marked ``~`` when the ranges do not overlap but the
  change is within the threshold, blank otherwise;
- **slower** (``+``) when the value got worse by more than the threshold over the whole range of the ratio
  (``new_low / base_high > 1 + t`` for a time, ``new_high / base_low < 1 / (1 + t)`` for a throughput), and the
  ratio itself by more than the machine's drift when that is larger;
- **faster** (``-``) symmetrically: better by more than the threshold (the log of the ratio beyond
  ``log(1 + t)`` either way, so a 2x slow-down and a 2x speed-up are as far from "same");
- **n/a** (``?``) when one run has no value (a reference line that does not measure the number,
  a column an old run lacks); never a failure;
- **added**: points only in the new run; listed, never a failure (the new run measured more);
- **removed**: points only in the base run: the new run lost them (a transport or a size that failed or was
  left out), and the comparison says nothing of them. Listed, and a failure unless the point is a reference line's.

Rows of either run's ``records.csv`` that could not be read (a last row cut short: the disk filled up or the run was
killed while writing it) are lost points too: what they measured is in neither the table nor the verdict.

A converge transport that did not reach its target has an infinite time: reaching it no more is slower.

A point of training (model, scale, converge) or of a model (models) is of one framework: a TensorFlow point and a
PyTorch one of the same line, model and batch are different points, never compared. Two runs of one framework are
compared as ever (the header names PyTorch's); a TensorFlow run and a PyTorch run have no point in common, which
the error says; a run that trained in both has its points matched by framework, and its summary per line and
framework (``zerocopy (torch)``).

The threshold is a percentage (``10%``) or a fraction (``0.1``); a bare number above 1 is refused as
ambiguous (write ``150%``). Zero is allowed: then only the noise decides.

Reference lines measure the machine, not this code (micro's ``ucx_perftest``, ``ucx_perftest_lat``,
``ib_write_bw``, ``ib_write_lat`` and ``memcpy``; the model runs' ``tf_grpc``, TensorFlow's own
runtime): they are compared and shown in a section of their own, and a slow-down there is named (it
says the machine changed, which explains the rest) but never fails the comparison.

:meth:`Comparison.exit_status` is 1 when at least one point (not a reference) is slower or lost
(:attr:`Comparison.lost`), else 0; the command gives 2 for bad input (:class:`CompareError`). Per transport (per
model for ``models`` runs) the geometric mean of the compared points' ratios sums it up, the next line names what
got slower, and a last line what was lost, if anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from bench.ground.sizes import format_size
from bench.results import ResultsError, Run, load_run, points, record_type
from bench.results import lines as catalogue
from bench.results.records import framework_title

#: the threshold when none is given: 10%
DEFAULT_THRESHOLD = 0.10

#: columns where more is better (every other column compared is a time, a count or a size: less is better)
HIGHER_IS_BETTER = frozenset({"throughput_MBps", "throughput_batches_per_s", "total_batches_per_s",
                              "scaling_efficiency", "of_reference"})


#: key columns that do not tell points apart once the rows compared are chosen (converge: only summaries)
_DROPPED_KEY = {"converge": ("kind", "step")}
#: per experiment, which rows are compared
_ROW_FILTER = {"converge": ("kind", "summary")}

#: columns that say how a point was measured: when they differ between the runs, the row says so
_SETTING_COLUMNS = ("extra_copies", "source", "fabric", "dtype", "compute", "analysis", "launcher", "link_rate",
                    "target")

#: the spread of a point's value (see bench.results.points)
SPREAD_WORDS = {"rounds": "lowest to highest round", "samples": "95% interval of the median of the iterations",
                 "none": "no spread measured"}

SAME, SLOWER, FASTER, NOT_COMPARED, ADDED, REMOVED = "same", "slower", "faster", "n/a", "added", "removed"
#: a point both runs measured, but in too few rounds to tell a change from the noise between runs
NOT_CALLED = "not called"

#: per experiment whose command measures a point again in rounds (``bench micro --rounds N``), the rounds each run
#: needs at a point to call a change there: one run's spread (a round's interval of the median, or two rounds)
#: does not bound a second run's
ROUNDS_TO_CALL = {"micro": 3}


class CompareError(ValueError):
    """Input that cannot be compared; the message names the problem and, after a ``;``, the fix."""


def parse_threshold(text: str | float) -> float:
    """A threshold as a fraction: ``"10%"`` -> 0.1, ``"0.1"`` -> 0.1; a bare number above 1 (``"10"``: 10%
    or 10x?), a negative, NaN or infinite one is a CompareError."""
    raw = str(text).strip()
    percent = raw.endswith("%")
    number = raw[:-1].strip() if percent else raw
    try:
        value = float(number)
    except ValueError:
        raise CompareError(f"--threshold '{raw}' is not a number; give a percentage such as 10% "
                           "or a fraction such as 0.1") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise CompareError(f"--threshold '{raw}' must be a finite number of at least 0; give a percentage "
                           "such as 10% or a fraction such as 0.1")
    if percent:
        return value / 100
    if value > 1:
        raise CompareError(f"--threshold '{raw}' is ambiguous (a fraction above 1); write {value:g}% for "
                           f"{value:g} percent, or {value * 100:g}% for {value:g} times")
    return value


@dataclass(frozen=True)
class Value:
    """One run's number for a point: the value (median over rounds), its range and where the range comes from."""

    value: float
    low: float
    high: float
    rounds: int
    spread: str  # rounds | samples | none
    settings: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def measured(self) -> bool:
        """Whether the run has a number for the point (not an empty cell)."""
        return not math.isnan(self.value)


@dataclass(frozen=True)
class Row:
    """One point of the comparison: its key, both runs' values, the ratio new/base with its range, the verdict."""

    point: tuple
    state: str
    reference: bool
    base: Value | None
    new: Value | None
    ratio: float = math.nan
    ratio_low: float = math.nan
    ratio_high: float = math.nan
    #: the ranges do not overlap (a change beyond the measured noise, whatever the threshold)
    beyond_noise: bool = False
    note: str = ""

    @property
    def marker(self) -> str:
        """asv's column: ``+`` slower, ``-`` faster, ``~`` changed beyond the noise but within the threshold,
        ``?`` not compared, blank for the same."""
        if self.state == SAME:
            return "~" if self.beyond_noise else " "
        return {SLOWER: "+", FASTER: "-", NOT_COMPARED: "?", NOT_CALLED: "?"}.get(self.state, " ")

    @property
    def compared(self) -> bool:
        """Whether both runs measured the point (same, slower, faster, or too few rounds to call it)."""
        return self.state in (SAME, SLOWER, FASTER, NOT_CALLED)


@dataclass(frozen=True)
class GroupSummary:
    """Per transport (or model): how many points went which way, and the geometric mean of their ratios."""

    name: str
    reference: bool
    counts: dict[str, int]
    geometric_mean: float
    #: the ratio of the point that got slowest (nan when none got slower)
    worst: float


@dataclass
class Comparison:
    """Two runs compared point by point (:func:`compare_runs`); :meth:`format` is the report,
    :meth:`exit_status` what CI reads."""

    experiment: str
    metric: str
    higher_is_better: bool
    threshold: float
    key: list[str]
    base: Run
    new: Run
    rows: list[Row]
    #: the machine's change between the runs, as the reference lines measured it (the median of their points'
    #: ratios' distance from 1, as a fraction): a change of a point must be beyond it too to be called
    drift: float = 0.0
    #: the one framework every point of both runs trained in, when the key leaves it out (None: the key has it, or
    #: the experiment names none)
    framework: str | None = None

    @property
    def regressions(self) -> list[Row]:
        """The points (not references) that got slower beyond the threshold and the noise."""
        return [row for row in self.rows if row.state == SLOWER and not row.reference]

    @property
    def removed(self) -> list[Row]:
        """The points (not references) of the base run that the new one does not have."""
        return [row for row in self.rows if row.state == REMOVED and not row.reference]

    @property
    def lost(self) -> str | None:
        """What the comparison lost, in one line naming the fix: the base run's points (not references) that the
        new run lacks, and the rows of either run that could not be read; None when nothing was lost."""
        parts = []
        if removed := self.removed:
            listed = _point_list({row.point: None for row in removed}, self.key)
            parts.append(f"{len(removed)} point(s) of base not in new ({listed})")
        for label, run in (("base", self.base), ("new", self.new)):
            if run.unread_rows:
                parts.append(f"{run.unread_rows} row(s) of {label}'s records.csv that could not be read (cut short)")
        if not parts:
            return None
        return (f"lost: {'; '.join(parts)}: they are not compared; measure them again (or compare runs of the same "
                "points)")

    def exit_status(self) -> int:
        """1 when a point (not a reference) got slower or was lost, else 0."""
        return 1 if self.regressions or self.lost else 0

    @property
    def group_column(self) -> str:
        """The column the summary groups by: transport, or the first key column (models: the model)."""
        return "transport" if "transport" in self.key else self.key[0]

    def group_of(self, row: Row) -> str:
        """The transport (or model) of a row, with its framework where the runs trained in several
        (``zerocopy (torch)``)."""
        return _group(row.point, self.key)

    def summaries(self) -> list[GroupSummary]:
        """Per transport (or model), in the order of the rows: counts by state and the geometric mean ratio."""
        groups: dict[str, list[Row]] = {}
        for row in self.rows:
            groups.setdefault(self.group_of(row), []).append(row)
        out = []
        for name, rows in groups.items():
            counts = {state: sum(r.state == state for r in rows) for state in
                      (SLOWER, FASTER, SAME, NOT_CALLED, NOT_COMPARED, ADDED, REMOVED)}
            ratios = [r.ratio for r in rows if r.compared and 0 < r.ratio < math.inf]
            mean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else math.nan
            slower = [r.ratio for r in rows if r.state == SLOWER]
            worst = (min(slower) if self.higher_is_better else max(slower)) if slower else math.nan
            out.append(GroupSummary(name, any(r.reference for r in rows), counts, mean, worst))
        return out

    def format(self, only_changed: bool = False) -> str:
        """The report: a header, the table (points, then references), added and removed points, the summary
        per transport, and a last line naming what got slower. ``only_changed`` leaves out the rows that
        are the same or that neither run measured (the summary still counts them)."""
        from bench.readers.compare_text import comparison_lines  # it reads this module's types

        return "\n".join(comparison_lines(self, only_changed))


# -- building a comparison -----------------------------------------------------------------------------


def compare(base_path: Path | str, new_path: Path | str, threshold: float = DEFAULT_THRESHOLD,
            metric: str | None = None) -> Comparison:
    """Load two run directories and compare them (:func:`compare_runs`); CompareError for bad input."""
    runs = [_load(Path(path), label) for path, label in ((base_path, "BASE"), (new_path, "NEW"))]
    try:
        return compare_runs(runs[0], runs[1], threshold=threshold, metric=metric)
    except ResultsError as exc:  # read on demand: samples.csv
        text = str(exc)
        raise CompareError(text + ("" if ";" in text else "; give runs written by a bench command")) from None


def _load(path: Path, label: str) -> Run:
    fix = "give a run directory written by a bench command (results/<experiment>-<time>/)"
    if not path.exists():
        raise CompareError(f"{label} {path} does not exist; {fix}")
    if not path.is_dir():
        raise CompareError(f"{label} {path} is not a directory; {fix}")
    try:
        return load_run(path)
    except ResultsError as exc:
        text = str(exc)
        if "is not a results directory" in text:
            raise CompareError(f"{label} {text}; {fix}") from None
        raise CompareError(f"{label}: {text}" + ("" if ";" in text else f"; {fix}")) from None


def compare_runs(base: Run, new: Run, threshold: float = DEFAULT_THRESHOLD, metric: str | None = None) -> Comparison:
    """Compare ``new`` against ``base`` point by point on ``metric`` (default: the experiment's measure).

    The semantics (ranges, threshold, references) are this module's docstring's. CompareError when the
    runs are of different experiments, of one without a headline measure, have no point in common, or
    ``metric`` is not a numeric column of their records.
    """
    if not threshold >= 0 or math.isinf(threshold):
        raise CompareError(f"threshold {threshold!r} must be a finite number of at least 0; give e.g. 0.1 (10%)")
    if base.experiment != new.experiment:
        raise CompareError(f"BASE {base.path} is a {base.experiment} run and NEW {new.path} a {new.experiment} run; "
                           "compare two runs of the same experiment")
    experiment = base.experiment
    cls = record_type(experiment)
    if cls.measure is None or not cls.key:
        comparable = ", ".join(name for name in ("micro", "model", "scale", "converge", "models"))
        raise CompareError(f"{experiment} runs have no headline measure to compare; bench compare takes "
                           f"{comparable} runs")
    metric = metric or cls.measure
    key = [c for c in cls.key if c not in _DROPPED_KEY.get(experiment, ())]
    framework = None
    if "framework" in key:
        if base.frameworks and new.frameworks and not set(base.frameworks) & set(new.frameworks):
            raise CompareError(f"BASE {base.path} trained {_framework_names(base)} and NEW {new.path} "
                               f"{_framework_names(new)}: a point of one framework is not the same point of another; "
                               "compare runs of the same --framework")
        if len(both := set(base.frameworks) | set(new.frameworks)) <= 1:  # one framework: no column to tell apart
            key.remove("framework")
            framework = next(iter(both), None)
    base_values = _values(base, metric, key)
    new_values = _values(new, metric, key)
    common = [p for p in base_values if p in new_values]
    if not common:
        raise CompareError(f"BASE and NEW have no point in common (BASE has {_point_list(base_values, key)}; "
                           f"NEW has {_point_list(new_values, key)}); compare runs of the same "
                           f"{' and '.join(column_title(c) for c in key)}")
    higher = metric in HIGHER_IS_BETTER
    infinite_when_missing = experiment == "converge" and metric == cls.measure
    # the lines that measure the machine or another project (a reference, a peer library, TensorFlow's own), not
    # this code: as the runs' records say (line_kind), else the catalogue (bench.results.lines)
    kinds = {**catalogue.kinds_in(base.records), **catalogue.kinds_in(new.records)}
    references = frozenset(name for name, kind in kinds.items() if kind in catalogue.NOT_OURS_KINDS)
    is_reference = {point: "transport" in key and point[key.index("transport")] in references
                    for point in [*base_values, *new_values]}
    drift = _drift([(base_values[p], new_values[p]) for p in base_values if p in new_values and is_reference[p]])
    judge = _Judge(threshold, higher, infinite_when_missing, metric, ROUNDS_TO_CALL.get(experiment, 1), drift)
    rows = []
    for point in [*base_values, *(p for p in new_values if p not in base_values)]:
        old, now = base_values.get(point), new_values.get(point)
        if old is None or now is None:
            rows.append(Row(point, ADDED if old is None else REMOVED, is_reference[point], old, now))
            continue
        rows.append(judge(point, is_reference[point], old, now))
    # the rows of one transport (and framework) together, in the order the runs measured them (sorted() is stable)
    order = {name: i for i, name in enumerate(dict.fromkeys(_group(row.point, key) for row in rows))}
    rows = sorted(rows, key=lambda row: order[_group(row.point, key)])
    return Comparison(experiment, metric, higher, threshold, key, base, new, rows, drift, framework)


def _group(point: tuple, key: list[str]) -> str:
    """The transport (else the first key column: a models run's model) of a point, with its framework when the key
    has one (``zerocopy (torch)``)."""
    name = str(point[key.index("transport") if "transport" in key else 0])
    if "framework" in key and (framework := point[key.index("framework")]) is not None:
        return f"{name} ({framework})"
    return name


def _framework_names(run: Run) -> str:
    """The frameworks a run trained in, as ``PyTorch (torch)``."""
    return " and ".join(f"{framework_title(name)} ({name})" for name in run.frameworks)


def _drift(pairs: list[tuple[Value, Value]]) -> float:
    """The machine's change between two runs as their reference lines' points measured it: the median of how far
    each ratio is from 1 (``exp(|log ratio|) - 1``); 0 without references measured in both."""
    changes = [abs(math.log(new.value / old.value)) for old, new in pairs
               if old.measured and new.measured and 0 < old.value < math.inf and 0 < new.value < math.inf]
    return math.expm1(float(np.median(changes))) if changes else 0.0


def _values(run: Run, metric: str, key: list[str]) -> dict[tuple, Value]:
    """The run's points: key -> Value of ``metric``."""
    records = run.records
    column_filter = _ROW_FILTER.get(run.experiment)
    samples = run.samples
    if column_filter is not None:
        column, wanted = column_filter
        records = records[records[column] == wanted] if column in records else records.iloc[0:0]
        samples = None
    allowed = [c for c in record_type(run.experiment).columns() if c not in key and c != "round"]
    if metric not in records or metric not in allowed or not pd.api.types.is_numeric_dtype(records[metric]):
        numeric = [c for c in allowed if c in records and pd.api.types.is_numeric_dtype(records[c])
                   and c not in _DROPPED_KEY.get(run.experiment, ())]
        raise CompareError(f"--metric {metric}: {run.experiment} records of {run.path} have no numeric column "
                           f"'{metric}'; choose one of {', '.join(numeric)}")
    if records.empty:
        return {}
    folded = points(records, run.experiment, samples, also=[metric])
    out: dict[tuple, Value] = {}
    for _, row in folded.iterrows():
        point = tuple(_plain(row[c]) for c in key)
        if point in out:  # the same point twice once the dropped key columns are gone: keep the first
            continue
        value = float(row[metric]) if pd.notna(row[metric]) else math.nan
        rounds = int(row["rounds"]) if "rounds" in row and pd.notna(row["rounds"]) else 1
        if pd.notna(row[f"{metric}_low"]):
            low, high = float(row[f"{metric}_low"]), float(row[f"{metric}_high"])
        else:
            low = high = value
        # a column other than the measure has a spread across rounds only (no interval from the samples)
        spread = str(row["spread"]) if metric == record_type(run.experiment).measure or rounds >= 2 else "none"
        settings = {c: _plain(row[c]) for c in _SETTING_COLUMNS if c in row}
        out[point] = Value(value, low if not math.isnan(value) else math.nan,
                           high if not math.isnan(value) else math.nan, rounds, spread, settings)
    return out


@dataclass(frozen=True)
class _Judge:
    """The verdict on one point both runs have (this module's docstring says how)."""

    threshold: float
    higher: bool
    infinite_when_missing: bool
    metric: str
    #: the rounds both runs need at a point to call a change there
    rounds: int = 1
    drift: float = 0.0

    def __call__(self, point: tuple, reference: bool, old: Value, now: Value) -> Row:
        return _judge(point, reference, old, now, self)


def _judge(point: tuple, reference: bool, old: Value, now: Value, how: _Judge) -> Row:
    """The verdict on one point both runs have."""
    threshold, higher, infinite_when_missing, metric = how.threshold, how.higher, how.infinite_when_missing, how.metric
    notes = [f"{name} {old.settings[name]} -> {now.settings[name]}" for name in old.settings
             if name in now.settings and old.settings[name] != now.settings[name]]
    if infinite_when_missing:  # converge: no time to the target means the target was not reached
        old, now = _not_reached(old), _not_reached(now)
        if math.isinf(old.value) and math.isinf(now.value):
            notes.insert(0, "target reached in neither run")
            return Row(point, SAME, reference, old, now, note="; ".join(notes))
        notes[:0] = [f"target not reached in {label}" for label, v in (("base", old), ("new", now))
                     if math.isinf(v.value)]
    if not old.measured or not now.measured:
        missing = [label for label, v in (("base", old), ("new", now)) if not v.measured]
        notes.insert(0, f"no {metric} in " + (missing[0] if len(missing) == 1 else "either run"))
        return Row(point, NOT_COMPARED, reference, old, now, note="; ".join(notes))
    ratio = _ratio(now.value, old.value)
    low, high = _ratio(now.low, old.high), _ratio(now.high, old.low)
    overlap = now.low <= old.high and old.low <= now.high
    if min(old.rounds, now.rounds) < how.rounds:  # one run's noise does not bound another's: no call
        notes.insert(0, f"{old.rounds}/{now.rounds} round(s): --rounds {how.rounds} to call a change")
        return Row(point, NOT_CALLED, reference, old, now, ratio, low, high, False, "; ".join(notes))
    # the whole range of the ratio beyond the threshold (the rounds' spreads apart by more than it: two untouched
    # runs' rounds can lie apart, just), and the ratio beyond the machine's drift that the reference lines measured
    # too (not theirs: they are the drift)
    margin = max(threshold, 0.0 if reference else how.drift)
    up, down = 1 + threshold, 1 / (1 + threshold)
    later = (high < down and ratio < 1 / (1 + margin)) if higher else (low > up and ratio > 1 + margin)
    sooner = (low > up and ratio > 1 + margin) if higher else (high < down and ratio < 1 / (1 + margin))
    state = SAME if overlap else SLOWER if later else FASTER if sooner else SAME
    return Row(point, state, reference, old, now, ratio, low, high, not overlap, "; ".join(notes))


def _not_reached(value: Value) -> Value:
    if value.measured:
        return value
    return Value(math.inf, math.inf, math.inf, value.rounds, value.spread, value.settings)


def _ratio(a: float, b: float) -> float:
    """a / b, where 0 / 0 and inf / inf are 1 (no change) and x / 0 is infinite."""
    if a == b:
        return 1.0
    if b == 0:
        return math.inf
    return a / b


def _plain(value: Any) -> Any:
    """A key or setting value as a plain Python value: an integral float as an int, NaN as None."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if value.is_integer():
            return int(value)
    return value


# -- the report ----------------------------------------------------------------------------------------


_TITLES = {"size_bytes": "size", "batch_size": "batch"}


def column_title(column: str) -> str:
    return _TITLES.get(column, column)


def point_text(point: tuple, key: list[str]) -> str:
    return " ".join(key_text(value, column) for value, column in zip(point, key, strict=True))


def key_text(value: Any, column: str) -> str:
    if value is None:
        return "-"
    if column == "size_bytes" and isinstance(value, int):
        return format_size(value)
    return str(value)


def _point_list(values: dict[tuple, Value | None], key: list[str], most: int = 6) -> str:
    if not values:
        return "no point"
    names = [point_text(p, key) for p in values]
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
