"""Hypothesis: a meta.json and a records.csv (and samples.csv) of any shape, read the way ``bench report``,
``bench plot`` and ``bench compare`` read them, give a result or a one-line error of the suite's own type: never a
traceback, never a name longer than a name may be, never a control character on its way to a terminal or a page.

Examples are small (a few rows, short nesting) and few, so the suite stays fast; the bounds they check (size,
depth, length) are the ones the readers enforce however large the input.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bench.readers.compare import CompareError, compare
from bench.readers.report import ReportError, build_report, render_html, render_markdown
from bench.results import REQUIRED_COLUMNS, ResultsError, load_run
from bench.results.text import NAME_LIMIT, TEXT_LIMIT

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: characters that matter: controls (terminal escapes), Markdown and HTML, CSV's own, and any other
_SPECIAL = st.sampled_from(["\x1b", "\x07", "\x00", "\n", "\r", "\t", "\u202e", "\ud800", "|", "*", "_", "`", "<",
                            ">", "&", "[", "]", "#", ",", '"', "'", "\\"])
TEXT = st.one_of(
    st.text(st.one_of(_SPECIAL, st.characters()), max_size=12),
    st.sampled_from(["zerocopy", "grpc_tcp", "local", "ucx_perftest", "memcpy", "1KB", "nan", "inf", "-1", ""]),
    st.integers(1, 3).map(lambda n: "x" * (NAME_LIMIT * 3 * n)),  # longer than any name may be shown
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(TEXT, inner, max_size=3)), max_leaves=12)
NUMBER = st.one_of(st.integers(-5, 2**62), st.floats(allow_nan=True, allow_infinity=True))


def mostly(typed, times: int = 4):
    """``typed`` most of the time, any JSON value now and then (the wrong type for the field)."""
    return st.integers(0, times).flatmap(lambda i: JSON if i == 0 else typed)


SETTINGS = st.fixed_dictionaries({}, optional={
    "fabric": mostly(TEXT), "fabric_transport": mostly(TEXT), "task": mostly(TEXT), "metric": mostly(TEXT),
    "target": mostly(TEXT), "servers": JSON, "batch_size": JSON,
    "launcher": mostly(st.one_of(TEXT, st.fixed_dictionaries({}, optional={
        "hosts": mostly(st.lists(TEXT, max_size=3)), "launcher": mostly(TEXT), "world_size": mostly(NUMBER)})))})
#: fields the readers use, with the type bench writes them with (and now and then another)
META_FIELDS = {
    "settings": mostly(SETTINGS, 8), "host": mostly(TEXT), "cpu": mostly(TEXT), "cpu_count": mostly(NUMBER),
    "platform": mostly(TEXT), "start_time": mostly(TEXT), "end_time": mostly(TEXT),
    "status": mostly(st.one_of(st.sampled_from(["complete", "failed", "running"]), TEXT)),
    "git_commit": mostly(TEXT), "packages": mostly(st.dictionaries(TEXT, TEXT, max_size=3)), "pid": JSON,
    "memory_bytes": mostly(NUMBER), "command": mostly(st.lists(TEXT, max_size=3)),
}


@st.composite
def metas(draw) -> bytes:
    """A meta.json: mostly bench's shape with fields of any value, now and then any JSON, deep nesting or bytes."""
    kind = draw(st.sampled_from(["shaped"] * 8 + ["any", "deep", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=40))
    if kind == "deep":
        depth = draw(st.integers(30, 3000))
        return ('{"schema_version": 2, "experiment": "micro", "settings": ' + "[" * depth + "]" * depth
                + "}").encode()
    if kind == "any":
        return json.dumps(draw(JSON)).encode()
    meta = {"schema_version": draw(mostly(st.sampled_from([1, 2, 3]), 8)),
            "experiment": draw(mostly(st.sampled_from(["micro", "model", "scale", "converge", "models", "analysis",
                                                       "soak"]), 8))}
    for name in draw(st.lists(st.sampled_from(sorted(META_FIELDS)), max_size=6, unique=True)):
        meta[name] = draw(META_FIELDS[name])
    return json.dumps(meta).encode()


@st.composite
def records(draw, experiment: str) -> str:
    """A records.csv: the experiment's columns (a required one left out now and then), cells of their kind mostly
    and of anything now and then: text with controls, huge names, NaN, inf, negative and huge numbers, nothing."""
    from bench.results import record_type
    from bench.results.store import _column_kinds

    cls = record_type(experiment if experiment in REQUIRED_COLUMNS else "micro")
    kinds = _column_kinds(cls)
    columns = list(cls.required())
    if draw(st.integers(0, 5)) == 0:
        columns.remove(draw(st.sampled_from(columns)))
    columns += draw(st.lists(st.sampled_from([*cls.columns(), "extra"]), max_size=3, unique=True))
    columns = list(dict.fromkeys(columns))
    number = st.one_of(st.integers(-5, 2**62).map(str), st.floats(allow_nan=True).map(repr), st.just(""))
    key = {"transport": st.sampled_from(["zerocopy", "grpc_tcp", "ucx_perftest", "mpi"]),
           "kind": st.sampled_from(["step", "eval", "summary"]), "size_bytes": st.sampled_from(["1024", "4096"])}
    anything = st.one_of(TEXT, number)
    cells = [key.get(c, number if kinds.get(c) == "number" else TEXT) for c in columns]
    broken = draw(st.integers(0, 3)) == 0  # one column of anything
    if broken:
        cells[draw(st.integers(0, len(cells) - 1))] = anything
    rows = draw(st.lists(st.tuples(*cells), max_size=4))
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(columns)
    writer.writerows(rows)
    return out.getvalue()


def _write(path: Path, meta: bytes, rows: str | None, samples: str | None) -> Path:
    path.mkdir()
    (path / "meta.json").write_bytes(meta)
    if rows is not None:
        (path / "records.csv").write_text(rows, errors="surrogatepass")
    if samples is not None:
        (path / "samples.csv").write_text(samples, errors="surrogatepass")
    return path


@st.composite
def run_files(draw) -> tuple[bytes, str | None, str | None]:
    meta = draw(metas())
    try:
        experiment = json.loads(meta).get("experiment", "micro")
    except (ValueError, AttributeError, RecursionError):
        experiment = "micro"
    experiment = experiment if isinstance(experiment, str) else "micro"
    rows = draw(st.one_of(st.none(), records(experiment), records(experiment), records(experiment)))
    samples = draw(st.one_of(st.none(), st.sampled_from([
        "transport,size_bytes,round,iteration,time_us,transfer_us\nzerocopy,1024,1,0,1.0,1.0\n"
        "zerocopy,1024,1,1,2.0,1.0\nzerocopy,1024,1,2,x\x1by,1.0\n",
        "transport,size_bytes,round,iteration,time_us,transfer_us\nzerocopy,1024,1,0,1.0,1.0\n",
        "a,b\n1\n"])))
    return meta, rows, samples


def one_line(exc: BaseException) -> None:
    text = str(exc)
    assert "\n" not in text and "\x1b" not in text, text
    assert len(text) < 2000, text


def _shown_strings(run) -> None:
    """Every string the readers took is a name's or a text's length at most, and has no control character."""
    for value in _leaves(run.meta):
        if isinstance(value, str):
            assert len(value) <= NAME_LIMIT and not re.search("[\x00-\x1f\x7f]", value), value
    for column in run.records.columns:
        for value in run.records[column]:
            if isinstance(value, str):
                assert len(value) <= TEXT_LIMIT and not re.search("[\x00-\x1f\x7f]", value), value


def _leaves(value):
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += list(item.keys()) + list(item.values())
        elif isinstance(item, list):
            stack += item
        else:
            yield item


@FUZZ
@given(files=run_files())
# a column the experiment does not know, read by pandas 3 as its own string type (not object), kept a control byte
@example(files=(b'{"schema_version": 1, "experiment": "scale"}',
                "transport,model,batch_size,servers,steps,step_time_s,throughput_batches_per_s,compute_s,comm_s,"
                "compute,launcher,link_rate,scaling_efficiency,extra\r\nzerocopy,,0,0,0,,,,,,,,,\x1f\r\n", None))
# micro records with no size, or an infinite one, where of_reference is computed (a run from before the column)
@example(files=(b'{"schema_version": 1, "experiment": "micro"}',
                "size_bytes,iters,p50_us,p99_us,mean_us,throughput_MBps,sender_cpu_s,receiver_cpu_s,"
                "copied_bytes_per_transfer,transport\r\n,,0,,,,,,,ucx_perftest\r\n", None))
@example(files=(b'{"schema_version": 1, "experiment": "micro"}',
                "size_bytes,iters,p50_us,p99_us,mean_us,throughput_MBps,sender_cpu_s,receiver_cpu_s,"
                "copied_bytes_per_transfer,transport\r\nINF,,,,0,,,,,zerocopy\r\n", None))
def test_load_run_gives_a_bounded_run_or_one_line(files):
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / "run", *files)
        try:
            run = load_run(path)
        except ResultsError as exc:
            one_line(exc)
            return
        _shown_strings(run)
        try:
            run.samples  # noqa: B018 - read on demand
        except ResultsError as exc:
            one_line(exc)


_MODELS_META = (b'{"schema_version": 1, "experiment": "models", "command": null, "cpu": null, "cpu_count": null, '
                b'"end_time": null, "git_commit": null, "packages": {}}')


def _models_records(compute_ms: str) -> str:
    return ("model,variables,model_mb,batch_size,compute_ms_per_sample\r\n,0,0,,0\r\n,0,,0,0\r\n"
            f"{'x' * 200},0,,0,{compute_ms}\r\n0,,0,,\r\n")


@FUZZ
@given(base=run_files(), new=run_files())
# a ratio of 1e+264 / 755617 was written out in full, 260 digits, in a line of a long name
@example(base=(_MODELS_META, _models_records("755617"), None), new=(_MODELS_META, _models_records("1e+264"), None))
def test_compare_gives_a_comparison_or_one_line(base, new):
    with tempfile.TemporaryDirectory() as tmp:
        a, b = _write(Path(tmp) / "base", *base), _write(Path(tmp) / "new", *new)
        try:
            text = compare(a, b).format()
        except CompareError as exc:
            one_line(exc)
            return
        assert "\x1b" not in text and "\x07" not in text
        assert all(len(line) < 4 * NAME_LIMIT + 400 for line in text.splitlines())


@FUZZ
@given(files=run_files())
def test_report_gives_a_page_or_one_line(files):
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / "run", *files)
        try:
            report = build_report([path], Path(tmp) / "figures", figures=False)
        except (ReportError, ResultsError) as exc:
            one_line(exc)
            return
        markdown = render_markdown(report, {})
        page = render_html(report)
        for text in (markdown, page):
            assert "\x1b" not in text and "<script" not in text.lower().replace("&lt;script", "")
        for warning in report.warnings:
            one_line(warning)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=run_files())
def test_plot_draws_or_says_why_in_one_line(files):
    from bench.commands import plot as command

    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / "run", *files)
        parser = argparse.ArgumentParser(prog="bench plot")
        command.add_arguments(parser)
        err = io.StringIO()
        import contextlib

        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = command.run(parser.parse_args([str(path)]))
        assert status in (0, 1, 2)
        lines = err.getvalue().strip().splitlines()
        assert status == 0 or len(lines) == 1, lines
        assert "Traceback" not in err.getvalue() and "\x1b" not in err.getvalue()
