"""Figure 11 predicted against measured (issue 62): every ``bench scale`` point a ``bench predict`` run covers, its
measured total mini-batches per second beside the predicted, and beside the Optimus baseline's.

A prediction covers a measured point of the same model, framework, batch size per worker, transport, servers and
link rate (the scale run's ``--link-rate``; an unshaped run, ``--launcher local`` or netns without a rate, has no
rate a prediction is made at), with compute of the same kind (``paper``: the paper's Table 2 times, else measured
here) and the same synchronous or asynchronous step. Its **error** is predicted / measured - 1 of the total
mini-batches per second, signed: +10% predicts 10% more throughput than was measured.

**Optimus** (Peng et al., EuroSys '18) models a parameter-server job's step time as T(p, w) = θ0 + θ1·w/p + θ2·w +
θ3·p, fitted by non-negative least squares to a few steps sampled from the job itself. Here every server is one
worker and one parameter server (p = w = N), so T(N) = a + b·N with a, b >= 0 (:func:`optimus_fit`), predicting N /
T(N) batches/s (:func:`optimus_predict`). It is fitted per line (model, framework, batch size, transport, link
rate, launcher, compute) to the measured steps at 1 and 2 servers: the fewest points that fix its two parameters,
and the ones a user measures on one machine before asking about more. Its 1- and 2-server errors are therefore
zero by construction, so its median and largest errors are taken over the other server counts only; ours are given
over every point and over those same points, like for like. (A line through both points needs a, b >= 0: the
2-server step at least the 1-server one, at most twice it. Outside that one of them is clamped to 0, the other the
least squares: b = 0 where the 2-server step was the faster, a = 0 where the total throughput fell with the second
server; the 1- and 2-server errors are then not zero, and still not counted.)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

import pandas as pd

from bench.ground.paper import model_name
from bench.readers.report.page import Section, Table
from bench.readers.report.text import MISSING, line_name, listing, missing, num, ordered
from bench.results import Run
from bench.results.records import OLD_FRAMEWORK, PredictRecord, framework_title

#: the server counts Optimus is fitted to; its errors there are zero by construction and not counted
FITTED = (1, 2)
#: what makes a measured point and a prediction the same point
_POINT = ["model", "framework", "batch_size", "transport", "servers", "rate_bps", "computed", "asynchronous"]
#: a line Optimus is fitted to: a point without its server count, with the launcher that ran it
_LINE = ["model", "framework", "batch_size", "transport", "rate_bps", "computed", "asynchronous", "launcher"]
#: a table: the predictions of one model, framework, batch size and link rate
_PANEL = ["model", "framework", "batch_size", "rate_bps", "computed", "asynchronous"]


def optimus_fit(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """Optimus's step time ``T(N) = a + b·N`` fitted to ``(servers, step seconds)`` points by non-negative least
    squares: ``(a, b)``, both at or above 0. ValueError for points at fewer than two server counts."""
    pairs = [(float(n), float(t)) for n, t in points]
    if len({n for n, _ in pairs}) < 2:
        raise ValueError(f"Optimus's fit needs steps measured at two server counts at least, not {len(pairs)} "
                         "point(s) at one: measure the line at 1 and 2 servers")
    k = len(pairs)
    mean_n, mean_t = sum(n for n, _ in pairs) / k, sum(t for _, t in pairs) / k
    b = sum((n - mean_n) * (t - mean_t) for n, t in pairs) / sum((n - mean_n) ** 2 for n, _ in pairs)
    a = mean_t - b * mean_n
    if a >= 0 and b >= 0:
        return a, b
    # the least squares lie outside a, b >= 0: the answer is on an edge, b = 0 or a = 0, each the least squares in
    # the other (at least 0); the better of the two
    edges = [(max(mean_t, 0.0), 0.0), (0.0, max(sum(n * t for n, t in pairs) / sum(n * n for n, _ in pairs), 0.0))]
    return min(edges, key=lambda fit: sum((fit[0] + fit[1] * n - t) ** 2 for n, t in pairs))


def optimus_predict(fit: tuple[float, float], servers: int) -> float:
    """The total mini-batches per second Optimus's fit predicts at ``servers``: N / T(N) (NaN for no step)."""
    a, b = fit
    step = a + b * servers
    return servers / step if step > 0 else math.nan


def predicted_against_measured(runs: list[tuple[str, Run]]) -> Section | None:
    """The section over every ``bench predict`` and ``bench scale`` run of the page: a table per model, batch size
    and link rate of the measured points a prediction covers; None without runs of both."""
    predicted = [(label, run) for label, run in runs if run.experiment == "predict" and not run.records.empty]
    measured = [(label, run) for label, run in runs if run.experiment == "scale" and not run.records.empty]
    if not predicted or not measured:
        return None
    section = Section("figure11-predicted-measured", "Figure 11 predicted against measured", None,
                      gathered=[*predicted, *measured])
    points = pd.concat([_measured(label, run) for label, run in measured], ignore_index=True)
    shaped = points[points["rate_bps"].notna()]  # an unshaped point has no rate a prediction is made at
    fits = _optimus_fits(shaped)
    summary: list[list[str]] = []
    every: list[pd.DataFrame] = []
    for label, run in predicted:
        rows = shaped.merge(_predictions(run), on=_POINT)
        for _, group in rows.groupby(_PANEL, sort=False, dropna=False):
            group = _with_optimus(group, fits)
            every.append(group)
            name = _panel_name(group.iloc[0], label, len(predicted) > 1)
            section.tables.append(_table(name, group, label))
            summary.append(_summary_row(name, group))
            section.notes.append(_verdict(name, group))
        section.notes.append(f"The predictions of run {label} assumed {cluster_text(run)}.")
    if not every:
        section.notes.insert(0, _none_matched(predicted, points))
        return section
    if len(every) > 1:
        together = pd.concat(every, ignore_index=True)
        summary.append(_summary_row("all tables", together))
        if together["compared"].any():
            section.notes.append(_verdict("All tables together", together))
    section.tables.append(Table("predicted-measured-errors", "Absolute errors of the predicted total throughput: "
                                "the median and the largest, ours over every point and over the points Optimus "
                                "predicts (beyond 2 servers), and Optimus's over those",
                                ["table", "points", "ours: median", "ours: largest", "beyond 2 servers",
                                 "ours there: median", "ours there: largest", "Optimus: median", "Optimus: largest"],
                                summary))
    section.notes.append("Optimus (Peng et al., EuroSys '18) is the baseline: each line's step time T(N) = a + b·N "
                         "(a, b >= 0; every server one worker and one parameter server) fitted by non-negative "
                         "least squares to its measured 1- and 2-server steps, predicting N / T(N) mini-batches/s. "
                         "Its 1- and 2-server errors are zero by construction (but where the 2-server step was "
                         "faster than the 1-server one, b then 0, or more than twice it, a then 0), so its errors "
                         "are counted beyond 2 servers only, and ours over those same points beside every point.")
    return section


def _measured(label: str, run: Run) -> pd.DataFrame:
    """A scale run's points (rounds folded) with what matches them to a prediction and their total batches/s."""
    frame = run.points()
    settings = run.meta.get("settings") or {}
    total = frame["throughput_batches_per_s"] * frame["servers"]
    if "total_batches_per_s" in frame:
        total = frame["total_batches_per_s"].fillna(total)
    return pd.DataFrame({
        "run": label, "model": frame["model"].astype(str), "framework": _frameworks(frame),
        "batch_size": frame["batch_size"].astype(int), "transport": frame["transport"].astype(str),
        "servers": frame["servers"].astype(int),
        "rate_bps": [rate_bps(r) for r in _column(frame, "link_rate", settings.get("link_rate"))],
        "computed": [_computed(c) for c in _column(frame, "compute", settings.get("compute"))],
        "asynchronous": bool(settings.get("asynchronous", False)),
        "launcher": [str(x) if not missing(x) else "" for x in _column(frame, "launcher", "")],
        "measured": total.astype(float)})


def _predictions(run: Run) -> pd.DataFrame:
    """A predict run's predictions, keyed as :func:`_measured`'s points are."""
    frame = run.records
    frame = frame[frame["kind"] == "predicted"] if "kind" in frame else frame
    settings = run.meta.get("settings") or {}
    return pd.DataFrame({
        "model": frame["model"].astype(str), "framework": _frameworks(frame),
        "batch_size": frame["batch_size"].astype(int), "transport": frame["transport"].astype(str),
        "servers": frame["servers"].astype(int), "rate_bps": frame["link_rate_bps"].astype(float),
        "link_rate": frame["link_rate"].astype(str), "compute": frame["compute"].astype(str),
        "computed": [_computed(c) for c in frame["compute"]],
        "asynchronous": [_flag(x) for x in _column(frame, "asynchronous", settings.get("asynchronous", False))],
        "predicted": frame["total_batches_per_s"].astype(float)})


def _column(frame: pd.DataFrame, name: str, default: Any) -> list[Any]:
    """A column's values, or ``default`` for every row of a frame without it (records from before the column)."""
    return list(frame[name]) if name in frame else [default] * len(frame)


def _frameworks(frame: pd.DataFrame) -> list[str]:
    return [OLD_FRAMEWORK if missing(x) or x == "" else str(x) for x in _column(frame, "framework", OLD_FRAMEWORK)]


def _flag(value: Any) -> bool:
    """A true or false cell as CSV gives it back (``True``, ``true``, 1), empty read as false."""
    return not missing(value) and str(value).strip().lower() in ("true", "1", "1.0", "yes")


def rate_bps(text: Any) -> float:
    """A scale record's ``link_rate`` (``10gbit``) in bits per second; NaN for an unshaped run ('', ``unshaped``)
    or a rate that does not read."""
    from bench.ground.sizes import parse_rate

    if missing(text) or str(text).strip() in ("", "unshaped"):
        return math.nan
    try:
        return float(parse_rate(str(text).strip()))
    except ValueError:
        return math.nan


def _computed(mode: Any) -> str:
    """A compute mode as a prediction matches it: the paper's times, or this machine's (measured and replayed, or
    computed: both take the time computing takes here)."""
    return "paper" if str(mode) == "paper" else "here"


def _optimus_fits(points: pd.DataFrame) -> dict[tuple, tuple[float, float]]:
    """Optimus's fit per line (:data:`_LINE`) measured at 1 and 2 servers: every such point of every scale run."""
    fits: dict[tuple, tuple[float, float]] = {}
    sampled = points[points["servers"].isin(FITTED) & (points["measured"] > 0)]
    for line, group in sampled.groupby(_LINE, sort=False, dropna=False):
        steps = [(n, n / total) for n, total in zip(group["servers"], group["measured"], strict=True)]
        if len({n for n, _ in steps}) == len(FITTED):
            fits[line] = optimus_fit(steps)
    return fits


def _with_optimus(rows: pd.DataFrame, fits: dict[tuple, tuple[float, float]]) -> pd.DataFrame:
    """The rows of a table with the errors, Optimus's prediction and error (NaN for a line it has no fit of), and
    whether each is a point Optimus is judged at (beyond the server counts it was fitted to)."""
    rows = rows.copy()
    rows["error"] = rows["predicted"] / rows["measured"] - 1
    optimus = [optimus_predict(fits[line], n) if line in fits else math.nan
               for line, n in zip(_keys(rows, _LINE), rows["servers"], strict=True)]
    rows["optimus"] = optimus
    rows["optimus_error"] = rows["optimus"] / rows["measured"] - 1
    rows["compared"] = ~rows["servers"].isin(FITTED) & rows["optimus_error"].notna()
    order = {line: i for i, line in enumerate(ordered(rows["transport"]))}
    return rows.sort_values(["transport", "servers", "run"], key=lambda c: c.map(order) if c.name == "transport"
                            else c, kind="stable").reset_index(drop=True)


def _keys(rows: pd.DataFrame, columns: list[str]) -> list[tuple]:
    """Each row's values of ``columns``, as groupby keys a group."""
    return list(zip(*(rows[c] for c in columns), strict=True))


def _panel_name(row: Any, label: str, several: bool) -> str:
    """A table's name in the summary and the verdicts: ``VGG16, batch 32, 10gbit`` (with what sets it apart)."""
    name = f"{model_name(row.model)}, batch {int(row.batch_size)}, {row.link_rate}"
    if row.framework != OLD_FRAMEWORK:
        name += f", {framework_title(row.framework)}"
    if row.computed == "paper":
        name += ", the paper's compute"
    if row.asynchronous:
        name += ", asynchronous"
    return f"{name} (run {label})" if several else name


def _table(name: str, rows: pd.DataFrame, label: str) -> Table:
    several = rows["run"].nunique() > 1
    body = []
    for r in rows.itertuples(index=False):
        body.append([line_name(r.transport), str(int(r.servers)), num(r.measured), num(r.predicted), _signed(r.error),
                     num(r.optimus), _signed(r.optimus_error) + ("" if r.compared or missing(r.optimus_error)
                                                               else " (fitted)"), *([r.run] if several else [])])
    first = rows.iloc[0]
    tag = "-".join(str(x) for x in (first.model, int(first.batch_size), first.link_rate, first.framework,
                                    first.computed, "async" if first.asynchronous else "sync"))
    return Table(f"predicted-measured-{tag}", f"{name}: total mini-batches per second measured (bench scale) and "
                 f"predicted (run {label}), the error predicted / measured - 1, and Optimus's prediction (fitted to "
                 "the 1- and 2-server points) and error",
                 ["line", "servers", "measured", "predicted", "error", "Optimus", "Optimus error",
                  *(["measured in"] if several else [])], body)


def _signed(error: Any) -> str:
    """An error as a signed percentage, ``+4.2%``; one that rounds to none ``0.0%`` (never ``-0.0%``)."""
    if missing(error):
        return MISSING
    text = f"{error:+.1%}"
    return "0.0%" if text[1:] == "0.0%" else text


def _absolute(errors: Iterable[float]) -> tuple[str, str]:
    """The median and the largest absolute error, as cells."""
    values = [abs(e) for e in errors if not missing(e)]
    if not values:
        return MISSING, MISSING
    return f"{statistics.median(values):.1%}", f"{max(values):.1%}"


def _summary_row(name: str, rows: pd.DataFrame) -> list[str]:
    compared = rows[rows["compared"]]
    return [name, str(len(rows)), *_absolute(rows["error"]), str(len(compared)), *_absolute(compared["error"]),
            *_absolute(compared["optimus_error"])]


def _verdict(name: str, rows: pd.DataFrame) -> str:
    """Which of ours and Optimus's median absolute error is lower, over the points both predict."""
    compared = rows[rows["compared"]]
    if compared.empty:
        unfitted = sorted({line_name(t) for t, o in zip(rows["transport"], rows["optimus"], strict=True)
                           if missing(o)})
        why = (f"{listing(unfitted)} not measured at both 1 and 2 servers, so Optimus has no fit there; "
               if unfitted else "")
        return (f"{name}: {why}no point beyond 2 servers to set the two side by side (Optimus is exact at 1 and 2): "
                f"measure 4 servers too (bench scale {rows.iloc[0].model} --launcher netns --link-rate "
                f"{rows.iloc[0].link_rate} --servers 1,2,4).")
    ours = statistics.median(abs(e) for e in compared["error"])
    theirs = statistics.median(abs(e) for e in compared["optimus_error"])
    lower = "ours is lower" if ours < theirs else "Optimus's is lower" if theirs < ours else "they are equal"
    return (f"{name}: over the {len(compared)} point(s) beyond 2 servers the median absolute error is {ours:.1%} "
            f"predicted, {theirs:.1%} with Optimus's fit: {lower}.")


def _none_matched(predicted: list[tuple[str, Run]], points: pd.DataFrame) -> str:
    """The one line saying no measured point is one a prediction covers, and how to measure one."""
    first = _predictions(predicted[0][1]).iloc[0]
    unshaped = int(points["rate_bps"].isna().sum())
    why = f" ({unshaped} of them unshaped: no link rate to predict at)" if unshaped else ""
    return (f"None of the {len(points)} measured scale point(s){why} is one a prediction covers (the same model, "
            f"framework, batch size, transport, servers and link rate): measure one with bench scale {first.model} "
            f"--launcher netns --link-rate {first.link_rate} --batch-size {int(first.batch_size)}"
            + (" --compute paper" if first.computed == "paper" else " --compute replay") + ".")


def cluster_text(run: Run) -> str:
    """The cluster a predict run's records say it assumed, in :meth:`PredictRecord.describe_cluster`'s words (a run
    from before they recorded one assumed the defaults)."""
    present = [n for n in ("cores_per_host", "shared_cores", "oversubscription", "asynchronous") if n in run.records]
    found = list(dict.fromkeys(PredictRecord.describe_cluster(**dict(zip(present, values, strict=True)))
                               for values in zip(*(run.records[n] for n in present), strict=True))) if present else [""]
    return listing(f"{words} (else as the defaults: {_DEFAULT_CLUSTER})" if words else _DEFAULT_CLUSTER
                   for words in found)


#: the cluster bench predict assumes unless told otherwise
_DEFAULT_CLUSTER = "hosts of 8 cores, each with one NIC at the link rate, a non-blocking switch and synchronous steps"
