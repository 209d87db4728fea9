"""What a page is made of: tables of formatted cells, figures, sections and the report holding them.

Sections fill these; rendering (:mod:`bench.readers.report.html_page`, :mod:`bench.readers.report.markdown_page`)
shows them and knows no experiment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench.readers.report.text import ZERO_COPY, both_names, naming
from bench.results import Run


class ReportError(ValueError):
    """Nothing to report on: no run directory, or a path that is none; the message names the fix."""


@dataclass
class Table:
    """A table of formatted cells; ``name`` identifies it on the page (``data-table``)."""

    name: str
    caption: str
    header: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    """A figure drawn from a run: its PNG in the report's temporary directory, and its caption (the first line of
    the figure's own title)."""

    stem: str
    png: Path
    title: str = ""

    @property
    def caption(self) -> str:
        """What the figure shows, in words: its title, or (a figure without one) its name's words."""
        return self.title or self.stem.replace("_", " ").capitalize()


@dataclass
class Section:
    """One figure or table of the paper as one run reproduces it (a kind shown once: as all its runs do)."""

    key: str
    title: str
    run: Run | None = None
    run_label: str = ""
    paper: list[tuple[str, str]] = field(default_factory=list)  # (quote, section of the paper)
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    #: why the numbers differ from the paper's, from the run's data
    notes: list[str] = field(default_factory=list)
    #: one line when the figures could not be drawn
    figure_note: str = ""
    #: the runs of the sections gathered into this one (a kind shown once per page), after its own
    gathered: list[tuple[str, Run]] = field(default_factory=list)

    @property
    def runs(self) -> list[tuple[str, Run]]:
        """``(label, run)`` of every run the section shows: its own, then the gathered ones."""
        return ([(self.run_label, self.run)] if self.run is not None else []) + self.gathered

    def gather(self, other: Section) -> None:
        """Take in ``other``'s runs, tables, figures and notes; quotes and notes it already has are not repeated."""
        self.gathered += other.runs
        self.paper += [quote for quote in other.paper if quote not in self.paper]
        self.tables += other.tables
        self.figures += other.figures
        self.notes += [note for note in other.notes if note not in self.notes]
        self.figure_note = self.figure_note or other.figure_note


@dataclass
class Report:
    """Every section of a page, the runs behind it and what went wrong making it."""

    runs: list[tuple[str, Run]]
    sections: list[Section]
    created: str
    warnings: list[str] = field(default_factory=list)
    #: the tables above the sections: the runs, and the paper's setup against theirs
    overview: list[Table] = field(default_factory=list)

    def lead(self) -> str:
        """The paragraph under the page's title: when and from what it was made, what a ratio is, and every line by
        both its names once (the paper's, then bench's), by the paper's alone after."""
        names = naming(run.records for _, run in self.runs)
        return (f"Report made {self.created} from {len(self.runs)} run(s). Ratios are speed-ups: how many times "
                f"faster (or higher in throughput) {both_names(ZERO_COPY)} is." + (f" {names}" if names else ""))

