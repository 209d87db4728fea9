"""Text taken from results files, made fit to show: one line, no control characters, a bounded length.

A results file may come from anyone who can write into a results directory, so what it says is shown, never obeyed:
a terminal escape (``ESC]0;...BEL``, ``ESC[2J``) in a transport's name would rewrite the terminal that
``bench compare`` prints to, a line break would forge a line of output, and a name of 100 KB would make a figure as
wide as the name. :func:`printable` shows control characters (and the invisible ones that reorder or hide text) as
Python writes them in a string literal (``\\x1b``, ``\\n``, ``\\u202e``) and cuts what is longer than a limit,
ending it with an ellipsis.
"""

from __future__ import annotations

import re
from typing import Any

#: the longest name (a transport, a model, a host) shown in a figure, a table or a terminal, in characters
NAME_LIMIT = 64
#: the longest free text of a record (a tensor's name, its source site) kept
TEXT_LIMIT = 256
ELLIPSIS = "…"

#: C0 and C1 controls, DEL, line and paragraph separators, zero-width and bidirectional formatting characters, the
#: byte-order mark and lone surrogates (which no UTF-8 output can hold)
_UNSHOWABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clip(text: str, limit: int = NAME_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, the last an ellipsis when it was longer."""
    return text if len(text) <= limit else text[:max(0, limit - 1)] + ELLIPSIS


def printable(value: Any, limit: int | None = NAME_LIMIT) -> str:
    """``str(value)`` as one line fit to show: control and invisible characters escaped (``\\x1b``), then cut to
    ``limit`` characters (None: not cut) with an ellipsis."""
    text = value if isinstance(value, str) else str(value)
    if limit is not None:
        text = text[:limit + 1]  # escaping only lengthens: what lies beyond cannot be shown anyway
    text = _UNSHOWABLE.sub(_escaped, text)
    return text if limit is None else clip(text, limit)


def shown(value: Any, limit: int = NAME_LIMIT) -> str:
    """A value from a results file quoted in a message: ``'name'`` (printable, cut), as ``{value!r}`` would
    quote a short string; a list or an object is named by its type (its repr could be as deep as the file)."""
    if isinstance(value, str):
        return f"'{printable(value, limit)}'"
    if value is None or isinstance(value, int | float):
        return printable(repr(value), limit)
    return {"list": "a list", "dict": "an object"}.get(type(value).__name__, f"a {type(value).__name__}")
