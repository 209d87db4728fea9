"""Reading a results file as what it is: input from anyone who could write the run directory.

- :func:`look_at`: what is at a path, nothing being there told apart from what keeps it from being looked at;
- :func:`a_file`: that it is a regular file (a named pipe is never opened);
- :func:`read_csv`: a CSV of records, binary data named as such, a last row cut short by a writer that could not
  finish it skipped with a warning and counted.

Each problem is a one-line :class:`~bench.results.records.ResultsError` naming the file and what was found.
"""

from __future__ import annotations

import codecs
import io
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench.results.records import ResultsError
from bench.results.text import printable

if TYPE_CHECKING:
    import pandas as pd


def look_at(path: Path) -> os.stat_result | None:
    """What is at ``path`` (links followed): its status, or None when nothing is there. Anything else that keeps
    it from being looked at (a directory on the way without permission, a loop of links) is a one-line
    ResultsError naming the OS error: a file that is there but cannot be read is never taken for one that is
    not there."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise ResultsError(f"{path} cannot be read ({exc.strerror or first_line(exc)})") from None


#: what a path is, by the type bits of its status, for a file that should be a regular one
_FILE_TYPES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def a_file(path: Path, info: os.stat_result) -> Path:
    """``path`` when ``info`` (its status) is a regular file's; else a ResultsError saying what is there instead
    (a named pipe is never opened: reading one would wait for a writer that may never come)."""
    if stat.S_ISREG(info.st_mode):
        return path
    what = next((words for test, words in _FILE_TYPES if test(info.st_mode)), "not a regular file")
    raise ResultsError(f"{path} cannot be read: it is {what}, not a file; the run directory was not written by bench "
                       "as it is: run the experiment again")


def read_csv(path: Path) -> tuple[pd.DataFrame, int]:
    """The CSV file at ``path`` and how many of its rows were left out, unread (a last row cut short: 0 or 1).
    A file that cannot be read, or is not CSV text, is a one-line ResultsError saying which and what was found."""
    import pandas as pd

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ResultsError(f"{path} cannot be read ({exc.strerror or first_line(exc)})") from None
    if (found := _binary(data)) is not None:  # before the rows are looked at: garbage has no rows to be cut short
        raise ResultsError(f"{path} is not a CSV of records: it holds {found}; the file was not written by bench as "
                           "it is: run the experiment again")
    whole = _without_torn_row(path, data)
    try:
        return pd.read_csv(io.BytesIO(whole)), int(len(whole) < len(data))
    except pd.errors.EmptyDataError:
        raise ResultsError(f"{path} is empty: the run recorded no point") from None
    except (UnicodeDecodeError, ValueError) as exc:  # pandas' ParserError is a ValueError
        raise ResultsError(f"{path} cannot be read as CSV ({printable(first_line(exc), 200)})") from None


def _binary(data: bytes) -> str | None:
    """What makes ``data`` binary rather than CSV text (a NUL byte, bytes that are not UTF-8), and where; None for
    text. A character cut at the very end is a torn row's, not binary data."""
    first = data.find(b"\0")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError as exc:
        first = exc.start if first < 0 else min(first, exc.start)
    if first < 0:
        return None
    return f"binary data, not text (byte 0x{data[first]:02x} at offset {first} of {len(data)})"


#: (path, size) of the files whose torn last row was warned about, so a file read twice warns once
_warned_torn: set[tuple[str, int]] = set()


def _without_torn_row(path: Path, data: bytes) -> bytes:
    """``data`` without a last row cut short (no line end after it: a writer that ran out of disk, or was killed,
    mid-row), with a warning on stderr; a whole file comes back unchanged."""
    whole = data.rfind(b"\n") + 1
    if whole in (0, len(data)):  # nothing cut, or not even the header is whole (the reader says what is wrong)
        return data
    key = (str(path), len(data))
    if key not in _warned_torn:
        _warned_torn.add(key)
        print(f"warning: {path}: its last row is cut short (the disk filled up or the run was killed while writing "
              "it); that row is skipped", file=sys.stderr)
    return data[:whole]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
