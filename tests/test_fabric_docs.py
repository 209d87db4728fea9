"""docs/fabric-backend.md says what a fabric backend writes: its count and table match base.py's abstract methods."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import transports.fabric.base as base

PAGE = Path(__file__).resolve().parent.parent / "docs" / "fabric-backend.md"
NUMBERS = {"twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17}


def _abstract_methods() -> set[str]:
    """``Class.method`` for every abstract method of base.py's classes."""
    return {f"{cls.__name__}.{name}" for _, cls in inspect.getmembers(base, inspect.isclass)
            if cls.__module__ == base.__name__ for name in getattr(cls, "__abstractmethods__", ())}


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _table_methods(section: str) -> set[str]:
    """``Class.method`` for each method the section's table names (a row without a class continues the last)."""
    named, current = set(), None
    for row in section.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if not row.startswith("|") or len(cells) < 3 or (cells[0] and set(cells[0]) <= {"-"}) or cells[0] == "class":
            continue
        current = cells[0].strip("`") or current
        named |= {f"{current}.{name}" for name in re.findall(r"`(\w+)", cells[1])}
    return named


def test_the_page_names_every_abstract_method_of_base_and_no_other():
    section = _section(PAGE.read_text(), "What a backend writes")
    assert _table_methods(section) == _abstract_methods()


def test_the_page_states_how_many_methods_a_backend_writes():
    section = _section(PAGE.read_text(), "What a backend writes")
    stated = re.search(r"\b(\w+) methods, the paper's Table 1", section)
    assert stated is not None, "the page should say how many methods a backend writes"
    assert NUMBERS[stated.group(1).lower()] == len(_abstract_methods()) <= 15
