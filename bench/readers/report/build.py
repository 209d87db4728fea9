"""Putting a page together: the runs named, each run's sections (from the registry,
:data:`bench.readers.report.sections.SECTIONS`), its figures placed, the sections in the registry's order (those
of a kind shown once gathered into one).

A run that trained models in more than one framework is shown as one run per framework
(:meth:`bench.results.Run.by_framework`): its sections, tables and figures never set a PyTorch point beside a
TensorFlow one as the same; the sections of a framework other than TensorFlow (the paper's) name it in their
titles, and their runs' labels too (``model-<time> (torch)``)."""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from bench.readers.report.overview import overview_tables
from bench.readers.report.page import Figure, Report, ReportError, Section
from bench.readers.report.sections import SECTIONS, Kind
from bench.readers.report.text import listing
from bench.results import META_FILE, RECORDS_FILE, ResultsError, Run, load_run, look_at, make_dir, printable
from bench.results.records import framework_title


def find_runs(paths: Sequence[Path], skipped: list[str] | None = None) -> list[Path]:
    """The run directories named: each path itself, or, for a directory without ``meta.json``, the run
    directories directly inside it (``bench report results/``, ``bench plot results/``). A ReportError names a path
    that is neither.

    A run inside a directory that has no records (a run that failed before its first point) is left out, a line
    saying so added to ``skipped``: one failed run does not keep its folder from being read."""
    return [path for path, _ in _find(paths, skipped)]


def _find(paths: Sequence[Path], skipped: list[str] | None) -> list[tuple[Path, bool]]:
    """:func:`find_runs`, each run with whether it was found inside a directory named (True) or named itself."""
    found: dict[Path, bool] = {}
    for path in map(Path, paths):
        info = _look(path)
        if info is None:
            raise ReportError(f"'{printable(path, None)}' does not exist; give a run directory such as "
                              "results/micro-<time>/")
        if not stat.S_ISDIR(info.st_mode):
            raise ReportError(f"'{printable(path, None)}' is a file, not a run directory; give the directory holding "
                              "its meta.json and records.csv")
        if _look(path / META_FILE) is not None:
            found.setdefault(path, False)
            continue
        try:
            entries = sorted(path.iterdir())
        except OSError as exc:
            raise ReportError(f"'{printable(path, None)}' cannot be read ({exc.strerror or exc}); give a directory "
                              "bench can list") from None
        inside = [p for p in entries if _may_be_run(p)]
        if not inside:
            raise ReportError(f"'{printable(path, None)}' is not a results directory (it has no {META_FILE}) and "
                              "holds none; give a run directory written by bench micro, model, scale, converge, models "
                              "or analyze, or a directory holding them")
        with_records = [p for p in inside if _has_records(p)]
        for run in inside:
            if run not in with_records and skipped is not None:
                skipped.append(f"{printable(run, None)} skipped: it has no {RECORDS_FILE} (the run recorded no "
                               "point)")
        for run in with_records:
            found.setdefault(run, True)
    return list(found.items())


def _look(path: Path) -> os.stat_result | None:
    """:func:`bench.results.look_at`, a path that cannot be looked at being a ReportError naming the OS error."""
    try:
        return look_at(path)
    except ResultsError as exc:
        raise ReportError(printable(exc, None)) from None


def _may_be_run(entry: Path) -> bool:
    """Whether an entry of a directory of runs is a run directory: a directory with ``meta.json``, or one that
    cannot be looked into (whether it is a run cannot be told: reading it says why it cannot be read)."""
    try:
        info = look_at(entry)
        return info is not None and stat.S_ISDIR(info.st_mode) and look_at(entry / META_FILE) is not None
    except ResultsError:
        return True


def _has_records(run: Path) -> bool:
    """Whether the run directory has a records.csv that is not empty: False only when there is none (or an empty
    one); one that is there but cannot be read counts as there (reading it says what is wrong)."""
    try:
        info = look_at(run / RECORDS_FILE)
    except ResultsError:
        return True
    return info is not None and (info.st_size > 0 or not stat.S_ISREG(info.st_mode))


def run_labels(paths: Sequence[Path]) -> list[str]:
    """A short, unique label per run: its directory's name, with the parent's when two share a name."""
    names = [p.name or str(p) for p in paths]
    labels = [f"{p.parent.name}/{p.name}" if names.count(n) > 1 else n for p, n in zip(paths, names, strict=True)]
    return [printable(label) for label in labels]  # a directory's name is anyone's who could write beside it


def draw_figures(run: Run, out_dir: Path) -> tuple[list[Figure], str]:
    """The run's figures (PNG) drawn into ``out_dir``, each with its title, or none and a one-line reason."""
    try:
        from bench.readers.plot import plot_run

        make_dir(out_dir, parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            written = plot_run(run, out_dir=out_dir)
    except Exception as exc:  # a figure that fails must not cost the run its tables
        text = str(exc).strip().splitlines()
        return [], f"Figures could not be drawn: {text[0] if text else type(exc).__name__}"
    pngs = [Path(p) for p in written if Path(p).suffix.lower() == ".png" and Path(p).is_file()]
    return [Figure(p.stem, p, png_title(p)) for p in pngs], ""


def png_title(path: Path) -> str:
    """The first line of the title a PNG carries (its ``Title`` text chunk: :func:`bench.readers.plot.save_figure`
    writes the figure's), shown escaped; empty when it has none or cannot be read."""
    try:
        with open(path, "rb") as file:
            data = file.read(2**20)  # the text chunks come before the image data
    except OSError:
        return ""
    at = 8  # after the signature
    while at + 8 <= len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        if kind == b"IDAT":
            break
        if kind == b"tEXt" and body.startswith(b"Title\0"):  # Latin-1 text
            return printable(body[len(b"Title\0"):].decode("latin-1").split("\n")[0].strip(), 200)
        if kind == b"iTXt" and body.startswith(b"Title\0\0"):  # UTF-8, uncompressed: after a language and a name
            text = body[len(b"Title\0\0") + 1:].split(b"\0", 2)[-1]
            return printable(text.decode("utf-8", "replace").split("\n")[0].strip(), 200)
        at += 12 + length
    return ""


def build_report(paths: Sequence[Path], figure_dir: Path, figures: bool = True) -> Report:
    """Read the runs, make their sections and draw their figures into ``figure_dir`` (ResultsError for a path
    that is not a readable run)."""
    skipped: list[str] = []
    runs: list[Run] = []
    for path, in_folder in _find(paths, skipped):
        try:
            run = load_run(path)
            run.samples  # noqa: B018 - read now, as compare and plot read it: a broken samples.csv is the run's
            runs.append(run)
        except ResultsError as exc:
            if not in_folder:  # a run named itself must be readable; one of a folder is left out, saying why
                raise
            skipped.append(f"{printable(path, None)} skipped: {exc}")
    if not runs:
        more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
        raise ReportError(f"none of the {len(skipped)} run(s) found could be read: {skipped[0] if skipped else 'none'}"
                          f"{more}; give runs written by bench micro, model, scale, converge, models or analyze")
    labels = run_labels([r.path for r in runs])
    report = Report(list(zip(labels, runs, strict=True)), [], datetime.now().astimezone().isoformat(timespec="seconds"),
                    warnings=skipped)
    report.overview = overview_tables(report)
    order = list(dict.fromkeys(kind.key for kind in SECTIONS))
    placed: list[tuple[tuple[int, int], Kind | None, Section]] = []
    for index, (label, whole) in enumerate(report.runs, start=1):
        parts = whole.by_framework()
        for run in parts:  # a framework's points apart from another's
            made = run_sections(run, label if run.framework is None else f"{label} ({run.framework})",
                                report.warnings)
            if figures:
                where = f"{index:02d}" if len(parts) == 1 else f"{index:02d}-{run.framework}"
                drawn, note = draw_figures(run, figure_dir / where)
                place_figures(made, drawn, note)
            placed += [((order.index(kind.key), SECTIONS.index(kind)) if kind else (len(order), 0), kind, section)
                       for kind, section in made]
    for kind in SECTIONS:  # the sections across runs, each over every run of the page it reads
        if kind.across is not None:
            runs = [(label, run) for label, run in report.runs if run.experiment in kind.experiments]
            placed += [((order.index(kind.key), SECTIONS.index(kind)), kind, section)
                       for section in across_section(kind, runs, report.warnings)]
    placed.sort(key=lambda item: item[0])  # stable: sections of one kind in the order of their runs
    shown_once: dict[str, Section] = {}
    for _, kind, section in placed:
        if kind is not None and kind.once:
            if section.key in shown_once:
                shown_once[section.key].gather(section)
                continue
            shown_once[section.key] = section
        report.sections.append(section)
    _unique_titles(report.sections)
    return report


def _unique_titles(sections: list[Section]) -> None:
    """A title two sections share (two runs of one experiment, shown apart) gets its runs' labels: every title, and
    every link to it, says which section it is."""
    titles = [section.title for section in sections]
    for section in sections:
        if titles.count(section.title) > 1 and section.runs:
            section.title += f" (run {', '.join(label for label, _ in section.runs)})"


def run_sections(run: Run, label: str, problems: list[str]) -> list[tuple[Kind | None, Section]]:
    """The sections of one run with the kind that made each, in the registry's order; for a run whose records defy
    them (or that no section reads) one section without a kind that says why, the problem added to ``problems``."""
    try:
        made = [(kind, kind.make(run, label)) for kind in SECTIONS
                if run.experiment in kind.experiments and kind.make is not None]
        if not any(run.experiment in kind.experiments for kind in SECTIONS):
            raise ReportError(f"no section of the report reads {run.experiment} runs")
    except Exception as exc:  # a run whose records defy the tables still shows up, saying why
        first = (str(exc).strip().splitlines() or [""])[0]
        problem = f"{label}: its tables could not be made ({type(exc).__name__}: {first})"
        problems.append(problem)
        return [(None, Section("other", f"{run.experiment} run", run, label,
                               notes=[problem + "; were its records edited by hand?"]))]
    made = [(kind, section) for kind, section in made if section is not None]
    if run.framework is not None:  # one framework's part of a run: its sections say which (a gathered one: its label)
        for kind, section in made:
            if not kind.once:
                section.title += f" ({framework_title(run.framework)})"
    return made


def across_section(kind: Kind, runs: list[tuple[str, Run]], problems: list[str]) -> list[Section]:
    """The section of a kind across runs over ``runs`` (none when it has nothing for them, or no run is given); for
    runs whose records defy it, one section without tables that says why, the problem added to ``problems``."""
    if not runs or kind.across is None:
        return []
    try:
        section = kind.across(runs)
    except Exception as exc:  # the runs still show in their own sections; this one says why it is missing
        first = (str(exc).strip().splitlines() or [""])[0]
        problem = (f"{listing(label for label, _ in runs)}: the {kind.key} tables could not be made "
                   f"({type(exc).__name__}: {first})")
        problems.append(problem)
        return [Section("other", f"{kind.key} across runs", None, gathered=runs,
                        notes=[problem + "; were their records edited by hand?"])]
    return [] if section is None else [section]


def place_figures(made: list[tuple[Kind | None, Section]], figures: list[Figure], note: str) -> None:
    """Each figure to the run's section whose kind shows it (by the beginning of its name); the others, and the
    note saying why none could be drawn, to the first section that shows any figure (else the run's first)."""
    if not made:
        return
    showing = [(kind.figures, section) for kind, section in made if kind is not None and kind.figures]
    home = showing[0][1] if showing else made[0][1]
    for figure in figures:
        owner = next((section for stems, section in showing if figure.stem.startswith(stems)), home)
        owner.figures.append(figure)
    if note:
        home.figure_note = note
