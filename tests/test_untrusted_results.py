"""Results directories written by someone else (issue 39, items 4 to 6).

A run directory may be writable by a group, and a results file may have been written by anyone: the suite never
writes through a link planted at a name it writes, and its readers (``report``, ``plot``, ``compare``) turn any
``meta.json`` and ``records.csv`` into a result or a one-line error, with names cut and control characters escaped
before they reach a figure, a table or a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bench import results
from bench.results import ResultsError, RunWriter, append_whole, load_run, replace_file
from tests.processes import unprivileged

#: the longest name shown (bench.results.text.NAME_LIMIT; written out so that this file loads on older code too)
NAME_LIMIT = 64

ESCAPES = "\x1b]0;pwned\x07\x1b[2J"


def micro_row(transport: str = "zerocopy", size: int = 1024, p50: float = 10.0) -> dict:
    return {"transport": transport, "size_bytes": size, "iters": 3, "p50_us": p50, "p99_us": p50 * 2,
            "mean_us": p50, "throughput_MBps": size / p50, "sender_cpu_s": 0.1, "receiver_cpu_s": 0.1,
            "copied_bytes_per_transfer": 0}


def micro_run(path: Path, transports=("zerocopy", "grpc_tcp"), settings: dict | None = None) -> Path:
    writer = RunWriter(path, "micro", settings or {"fabric": "ucx", "fabric_transport": "cma"})
    for i, transport in enumerate(transports):
        for size in (1024, 4096):
            writer.add(micro_row(transport, size, 10.0 * (i + 1)))
    writer.finish()
    return path


def edit_meta(run: Path, **changes) -> None:
    meta = json.loads((run / "meta.json").read_text())
    meta.update(changes)
    (run / "meta.json").write_text(json.dumps(meta))


def command(name: str, capsys, *argv: str) -> tuple[int, str, str]:
    """``bench NAME ARGV`` in this process: its exit status, stdout and stderr."""
    import importlib

    module = importlib.import_module(f"bench.commands.{name}")
    parser = argparse.ArgumentParser(prog=f"bench {name}")
    module.add_arguments(parser)
    status = module.run(parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return status, out, err


def one_line(status: int, err: str, fragment: str = "") -> None:
    assert status == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert fragment in err, err


@pytest.fixture
def no_figures(monkeypatch):
    """Reports without drawing (the tables are what these tests read)."""
    from bench.readers import plot

    monkeypatch.setattr(plot, "plot_run", lambda path, out_dir=None: [])


# -- item 4: nothing is written through a link -------------------------------------------------------------------


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file of someone else's (0600), which a link planted beside a run points at."""
    path = tmp_path / "elsewhere" / "secret"
    path.parent.mkdir()
    path.write_text("do not touch")
    path.chmod(0o600)
    return path


def untouched(victim: Path) -> bool:
    return victim.read_text() == "do not touch" and stat.S_IMODE(victim.stat().st_mode) == 0o600


def test_a_link_at_the_temporary_name_of_old_is_not_written_through(tmp_path, victim):
    target = tmp_path / "figure.png"
    (tmp_path / f".{target.name}.tmp-{os.getpid()}").symlink_to(victim)  # the name replace_file used to take
    replace_file(target, b"PNG")
    assert untouched(victim)
    assert target.read_bytes() == b"PNG" and not target.is_symlink()


def test_a_taken_temporary_name_is_passed_over_for_another(tmp_path, victim, monkeypatch):
    import secrets

    names = iter(["aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(names))
    target = tmp_path / "meta.json"
    (tmp_path / f".meta.json.tmp-{os.getpid()}-aaaaaaaaaaaa").symlink_to(victim)
    replace_file(target, "{}")
    assert untouched(victim)
    assert target.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".meta.json.tmp-{os.getpid()}-aaaaaaaaaaaa", "elsewhere",
                                                          "meta.json"]


def test_a_link_at_the_target_is_replaced_never_followed(tmp_path, victim):
    target = tmp_path / "report.html"
    target.symlink_to(victim)
    replace_file(target, "<p>page</p>")
    assert untouched(victim)
    assert not target.is_symlink() and target.read_text() == "<p>page</p>"


def test_a_failed_replace_names_the_file_asked_for_not_its_temporary_file(tmp_path):
    (tmp_path / "page.html").mkdir()  # a directory where the file goes: the rename over it fails
    with pytest.raises(IsADirectoryError) as caught:
        replace_file(tmp_path / "page.html", "<p>page</p>")
    assert caught.value.filename == str(tmp_path / "page.html") and ".tmp-" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]  # no temporary file left


def test_rows_are_never_appended_through_a_link(tmp_path, victim):
    target = tmp_path / "records.csv"
    target.symlink_to(victim)
    with pytest.raises(results.LinkError, match=r"records\.csv: the file is a symbolic link"):
        append_whole(target, "1,2\n", header="a,b\n")
    assert untouched(victim)


def test_plot_writes_no_figure_through_links_planted_in_the_run(tmp_path, victim, capsys):
    run = micro_run(tmp_path / "run")
    for stem in ("micro_time", "micro_throughput"):
        for fmt in ("png", "svg"):
            (run / f".{stem}.{fmt}.tmp-{os.getpid()}").symlink_to(victim)
    (run / "micro_time.png").symlink_to(victim)
    status, _, err = command("plot", capsys, str(run))
    assert status == 0, err
    assert untouched(victim)
    png = (run / "micro_time.png").read_bytes()
    assert png[:4] == b"\x89PNG" and not (run / "micro_time.png").is_symlink()


def test_a_directory_the_suite_makes_is_never_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").symlink_to(elsewhere)
    with pytest.raises(results.LinkError, match="the directory is a symbolic link"):
        RunWriter(tmp_path / "run", "micro", {})
    with pytest.raises(results.LinkError):
        results.make_dir(tmp_path / "run", parents=True, exist_ok=True)
    assert list(elsewhere.iterdir()) == []
    assert results.make_dir(tmp_path / "new" / "figures", parents=True).is_dir()
    assert results.make_dir(tmp_path / "new" / "figures", exist_ok=True).is_dir()


# -- item 5: what readers show is bounded and escaped ------------------------------------------------------------


def test_printable_escapes_control_characters_and_cuts():
    from bench.results.text import printable

    assert printable(ESCAPES) == "\\x1b]0;pwned\\x07\\x1b[2J"
    assert printable("a\nb\u202ec") == "a\\nb\\u202ec"
    assert printable("x" * 1000) == "x" * (NAME_LIMIT - 1) + "…"
    assert printable("x" * 1000, None) == "x" * 1000


def png_size(path: Path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])


def test_a_huge_transport_or_host_name_is_cut_before_a_figure(tmp_path):
    from bench.readers.plot import plot_run

    huge = "t" * 100_000
    run = micro_run(tmp_path / "run", transports=("zerocopy", huge))
    edit_meta(run, host="h" * 100_000, cpu="c" * 100_000)
    loaded = load_run(run)
    assert max(len(t) for t in loaded.records["transport"]) <= NAME_LIMIT
    assert len(loaded.meta["host"]) <= NAME_LIMIT and len(loaded.meta["cpu"]) <= NAME_LIMIT
    plot_run(run)
    width, height = png_size(run / "micro_time.png")
    assert width < 3000 and height < 3000, (width, height)


def test_compare_shows_escape_codes_from_records_escaped(tmp_path, capsys):
    base = micro_run(tmp_path / "base", transports=("zerocopy", f"evil{ESCAPES}"))
    new = micro_run(tmp_path / "new", transports=("zerocopy", f"evil{ESCAPES}"))
    edit_meta(new, host=f"other{ESCAPES}", git_commit=ESCAPES, start_time=ESCAPES)
    status, out, err = command("compare", capsys, str(base), str(new))
    assert status == 0, err
    assert "\x1b" not in out + err and "\x07" not in out + err
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J" in out


def test_the_markdown_report_shows_markup_from_meta_json_as_text(tmp_path, capsys, no_figures):
    run = micro_run(tmp_path / "run")
    edit_meta(run, host="<img src=x onerror=alert(1)>", cpu="**bold** [link](http://x) `code`", status="complete|x")
    status, _, err = command("report", capsys, str(run), "--out", str(tmp_path / "page.md"))
    assert status == 0, err
    text = (tmp_path / "page.md").read_text()
    assert "<img" not in text and "&lt;img src=x onerror=alert(1)&gt;" in text
    assert "**bold**" not in text and "\\*\\*bold\\*\\* \\[link\\](http://x) \\`code\\`" in text


@pytest.mark.parametrize("name", ["report", "plot"])
def test_settings_of_the_wrong_type_are_one_line(tmp_path, capsys, name, request):
    if name == "report":
        request.getfixturevalue("no_figures")
    run = micro_run(tmp_path / "run")
    edit_meta(run, settings="ucx")
    argv = [str(run), "--out", str(tmp_path / "page.html")] if name == "report" else [str(run)]
    status, _, err = command(name, capsys, *argv)
    one_line(status, err, "meta.json: 'settings' is a string, expected an object")


def test_a_launcher_of_the_wrong_type_inside_settings_is_named(tmp_path):
    run = micro_run(tmp_path / "run", settings={"launcher": {"hosts": 3}})
    with pytest.raises(ResultsError, match=r"'settings\.launcher\.hosts' is a number, expected a list"):
        load_run(run)


@pytest.mark.parametrize("name", ["report", "plot", "compare"])
def test_a_meta_json_nested_100k_deep_is_one_line(tmp_path, capsys, name, request):
    if name == "report":
        request.getfixturevalue("no_figures")
    run = micro_run(tmp_path / "run")
    deep = "[" * 100_000 + "]" * 100_000
    (run / "meta.json").write_text('{"schema_version": 2, "experiment": "micro", "settings": ' + deep + "}")
    argv = {"report": [str(run), "--out", str(tmp_path / "page.html")], "plot": [str(run)],
            "compare": [str(run), str(micro_run(tmp_path / "other"))]}[name]
    status, _, err = command(name, capsys, *argv)
    one_line(status, err, "nested deeper than")


def test_a_meta_json_nested_just_below_pythons_limit_is_refused_too(tmp_path):
    run = micro_run(tmp_path / "run")
    deep = "[" * 500 + "]" * 500
    (run / "meta.json").write_text('{"schema_version": 2, "experiment": "micro", "x": ' + deep + "}")
    with pytest.raises(ResultsError, match="nested deeper than 32 levels"):
        load_run(run)


def test_a_huge_meta_json_is_refused_before_it_is_parsed(tmp_path):
    run = micro_run(tmp_path / "run")
    (run / "meta.json").write_text('{"schema_version": 2, "experiment": "micro", "x": "' + "x" * 5 * 2**20 + '"}')
    with pytest.raises(ResultsError, match="larger than 4 MB"):
        load_run(run)


def _break_column(run: Path, file: str, column: str, value: str) -> None:
    lines = (run / file).read_text().splitlines()
    header = lines[0].split(",")
    row = lines[1].split(",")
    row[header.index(column)] = value
    (run / file).write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")


def test_a_non_numeric_size_in_compare_is_one_line(tmp_path, capsys):
    base, new = micro_run(tmp_path / "base"), micro_run(tmp_path / "new")
    _break_column(new, "records.csv", "size_bytes", "big")
    status, _, err = command("compare", capsys, str(base), str(new))
    one_line(status, err, "column 'size_bytes' holds 'big' in row 2, not a number")


def _samples_run(path: Path) -> Path:
    writer = RunWriter(path, "micro", {})
    for transport in ("zerocopy", "grpc_tcp"):
        record = writer.record_type.from_row(micro_row(transport))
        writer.add(record)
        writer.add_samples(record, {"time_us": [10.0, 11.0, 12.0, 13.0], "transfer_us": [1.0] * 4})
    writer.finish()
    return path


def test_non_numeric_sample_times_in_compare_are_one_line(tmp_path, capsys):
    base, new = _samples_run(tmp_path / "base"), _samples_run(tmp_path / "new")
    _break_column(new, "samples.csv", "time_us", "slow")
    status, _, err = command("compare", capsys, str(base), str(new))
    one_line(status, err, "samples.csv: column 'time_us' holds 'slow'")


# -- a records.csv that is there but cannot be read says why -----------------------------------------------------


@pytest.mark.parametrize(("make", "what"), [(lambda path: path.mkdir(), "a directory"),
                                            (lambda path: os.mkfifo(path), "a named pipe (FIFO)")],
                         ids=["directory", "fifo"])
def test_a_records_csv_that_is_not_a_file_says_what_it_is(tmp_path, make, what):
    run = micro_run(tmp_path / "run")
    (run / "records.csv").unlink()
    make(run / "records.csv")
    with pytest.raises(ResultsError) as caught:
        load_run(run)  # a named pipe is never opened: that would wait for a writer
    assert str(caught.value).startswith(f"{run / 'records.csv'} cannot be read: it is {what}, not a file; ")
    assert "has no records.csv" not in str(caught.value)


def test_a_records_csv_of_binary_garbage_is_not_a_csv_and_not_cut_short(tmp_path, capsys):
    run = micro_run(tmp_path / "run")
    (run / "records.csv").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4)
    with pytest.raises(ResultsError) as caught:
        load_run(run)
    assert str(caught.value) == (f"{run / 'records.csv'} is not a CSV of records: it holds binary data, not text "
                                 "(byte 0x89 at offset 0 of 1040); the file was not written by bench as it is: run "
                                 "the experiment again")
    assert "cut short" not in capsys.readouterr().err


def test_a_character_cut_in_a_torn_last_row_is_not_binary(tmp_path, capsys):
    run = micro_run(tmp_path / "run", transports=("zerocopy",))
    data = (run / "records.csv").read_bytes()
    (run / "records.csv").write_bytes(data + "zerocopy-\u00e9".encode()[:-1])  # a row and a character cut short
    loaded = load_run(run)
    assert len(loaded.records) == 2 and loaded.unread_rows == 1
    assert "its last row is cut short" in capsys.readouterr().err


def test_records_without_permission_are_named_as_unreadable_not_missing(tmp_path):
    """A run of a folder that cannot be looked into, and a records.csv without read permission: each named as
    unreadable with the OS's reason (not as a run without records.csv, nor as a page that cannot be written), and
    the folder's other runs reported."""
    prefix = unprivileged()
    folder = tmp_path / "results"
    micro_run(folder / "micro-1")
    locked = micro_run(folder / "micro-2")
    unreadable = micro_run(folder / "micro-3")
    (unreadable / "records.csv").chmod(0)
    locked.chmod(0o600)  # listed, not searchable: nothing in it can be looked at
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MPLCONFIGDIR": str(tmp_path / "mpl")}
    try:
        result = subprocess.run([*prefix, sys.executable, "-m", "bench.cli", "report", str(folder), "--out",
                                 str(tmp_path / "page.md")], capture_output=True, text=True, timeout=300, env=env)
    finally:
        locked.chmod(0o700)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"bench report: warning: {locked} skipped: {locked / 'meta.json'} cannot be read (Permission denied)",
        f"bench report: warning: {unreadable} skipped: {unreadable / 'records.csv'} cannot be read (Permission denied)"]
    assert "micro-1" in (tmp_path / "page.md").read_text()


# -- item 6: a run without records does not break its folder -----------------------------------------------------


def _folder_with_a_failed_run(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "results"
    micro_run(folder / "micro-1")
    failed = folder / "micro-2"
    RunWriter(failed, "micro", {}).finish("failed", reason="killed for memory")  # no records.csv
    return folder, failed


def test_report_of_a_folder_skips_a_run_without_records_with_one_warning(tmp_path, capsys, no_figures):
    folder, failed = _folder_with_a_failed_run(tmp_path)
    status, _, err = command("report", capsys, str(folder), "--out", str(tmp_path / "page.md"))
    assert status == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and str(failed) in warnings[0] and "no records.csv" in warnings[0], err
    assert "micro-1" in (tmp_path / "page.md").read_text()


def test_plot_of_a_folder_skips_a_run_without_records_with_one_warning(tmp_path, capsys, monkeypatch):
    from bench.readers import plot

    monkeypatch.setattr(plot, "plot_run", lambda path, out_dir=None: [Path(path) / "drawn.png"])
    folder, failed = _folder_with_a_failed_run(tmp_path)
    status, out, err = command("plot", capsys, str(folder))
    assert status == 0, err
    assert len(err.strip().splitlines()) == 1 and str(failed) in err and "no records.csv" in err, err
    assert out.split() == [str(folder / "micro-1" / "drawn.png")]


def test_a_folder_of_runs_none_with_records_is_one_line(tmp_path, capsys):
    folder, _ = _folder_with_a_failed_run(tmp_path)
    (folder / "micro-1" / "records.csv").unlink()
    status, _, err = command("report", capsys, str(folder), "--out", str(tmp_path / "page.md"))
    one_line(status, err, "none of the 2 run(s) found could be read")


# -- item 6: a size that cannot fit in the memory available ------------------------------------------------------


def test_a_size_beyond_the_memory_available_is_refused_before_any_rank(tmp_path, monkeypatch, capsys):
    from bench.ground import memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 100 * 2**20)
    parser = argparse.ArgumentParser(prog="bench micro")
    from bench.commands import micro

    micro.add_arguments(parser)
    args = parser.parse_args(["--sizes", "64MB", "--transports", "zerocopy,grpc_tcp", "--no-peers",
                              "--out", str(tmp_path / "run")])
    launched = []

    class Launcher:
        name = "local"

        def __getattr__(self, attribute):
            launched.append(attribute)
            raise AssertionError(f"a rank was about to start ({attribute})")

    status = micro.run(args, Launcher())
    _, err = capsys.readouterr()
    one_line(status, err, "a 64MB transfer holds about 0.2 GB at once (the sender's and the receiver's tensor and "
                          "grpc_tcp's copy of each), but 0.1 GB of memory is available now (MemAvailable)")
    assert not (tmp_path / "run").exists() and not launched


def test_what_a_point_holds_depends_on_its_lines():
    from bench.experiments.micro.plan import memory_needed

    assert memory_needed(2**30, ["zerocopy"], set()) == (2 * 2**30, "zerocopy")
    assert memory_needed(2**30, ["zerocopy", "grpc_tcp"], set())[0] == 4 * 2**30
    assert memory_needed(2**30, ["zerocopy"], {"zerocopy"})[0] == 3 * 2**30
    assert memory_needed(2**30, ["grpc_tcp"], set(), both_sides=False)[0] == 2 * 2**30


def test_the_memory_available_is_read_from_meminfo():
    from bench.ground.memory import available_memory_bytes

    available = available_memory_bytes()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert available is not None and 0 < available <= total
