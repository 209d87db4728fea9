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
import math
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

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


#: the largest records.csv and samples.csv a reader takes, in MiB (another file name: the records' limit). The
#: largest legitimate run writes far less: ``bench micro --sizes 1KB-1GB`` with every line, --rounds 10 and
#: --contend writes about 140 MiB of samples at the default iterations (about 7 MiB a round, 35 bytes a
#: sample), and well under 10 MiB of records
CSV_LIMITS_MIB = {"records.csv": 64, "samples.csv": 256}
#: the environment variable that raises (or lowers) the limit of every CSV a reader takes, in MiB
CSV_LIMIT_ENV = "BENCH_CSV_LIMIT_MB"
#: the most columns a CSV's header may name (bench writes at most 40), and the longest header line, in bytes
COLUMN_LIMIT = 1024
HEADER_LIMIT = 64 * 1024
#: how much of a file is looked at at once, so that looking at it costs this much memory whatever its size
_BLOCK = 1 << 20


def csv_limit(path: Path) -> int:
    """The most bytes a reader takes from the CSV file at ``path``: :data:`CSV_LIMITS_MIB` by its name, or
    :data:`CSV_LIMIT_ENV` (MiB) when set; a value there that is not a positive number is a ResultsError."""
    given = os.environ.get(CSV_LIMIT_ENV, "").strip()
    if not given:
        return CSV_LIMITS_MIB.get(path.name, CSV_LIMITS_MIB["records.csv"]) * 2**20
    try:
        mib = float(given)
    except ValueError:
        mib = math.nan
    if not 0 < mib < 2**40:
        raise ResultsError(f"{CSV_LIMIT_ENV}={printable(given, 40)} is not a size in MiB; give a number such as "
                           f"{CSV_LIMITS_MIB['samples.csv'] * 4}, or unset it")
    return int(mib * 2**20)


def read_csv(path: Path) -> tuple[pd.DataFrame, int]:
    """The CSV file at ``path`` and how many of its rows were left out, unread (a last row cut short: 0 or 1).

    The file is looked at before pandas parses it, a block at a time: larger than its limit (:func:`csv_limit`),
    binary data (a NUL byte, bytes that are not UTF-8) or a header of more than :data:`COLUMN_LIMIT` columns is a
    one-line ResultsError saying which and what was found; so is a file that is not CSV text. Memory spent is the
    frame's own, and the file's size is bounded."""
    import pandas as pd

    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size > (limit := csv_limit(path)):
                raise ResultsError(
                    f"{path} is {_mib(size)} MiB, more than the {_mib(limit)} MiB a reader takes from a "
                    f"{printable(path.name)} (bench writes far less; the file may not be bench's): if a run really "
                    f"wrote this much, set {CSV_LIMIT_ENV}={math.ceil(size / 2**20)} to read it")
            whole = _looked_at(path, file, size)
            file.seek(0)
            try:
                return pd.read_csv(io.BufferedReader(_Upto(file, whole))), int(whole < size)
            except pd.errors.EmptyDataError:
                raise ResultsError(f"{path} is empty: the run recorded no point") from None
            except (UnicodeDecodeError, ValueError) as exc:  # pandas' ParserError is a ValueError
                raise ResultsError(f"{path} cannot be read as CSV ({printable(first_line(exc), 200)})") from None
    except OSError as exc:
        raise ResultsError(f"{path} cannot be read ({exc.strerror or first_line(exc)})") from None


def _mib(size: int) -> str:
    return f"{math.ceil(size / 2**20):,}"


class _Upto(io.RawIOBase):
    """The first ``end`` bytes of an open file, as a file (pandas reads the rows before a torn one from it)."""

    def __init__(self, file: BinaryIO, end: int) -> None:
        self.file, self.left = file, end

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        got = self.file.readinto(memoryview(buffer)[:min(len(buffer), self.left)]) or 0
        self.left -= got
        return got


def _looked_at(path: Path, file: BinaryIO, size: int) -> int:
    """How many bytes of the file hold whole rows (a last row cut short left out, with a warning), after its every
    block was looked at for binary data and its header for its width; a ResultsError for either."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, header_end, last_line_end = 0, -1, 0
    while block := file.read(_BLOCK):
        pending = decoder.getstate()[0]
        if (found := _binary(pending + block, decoder, offset - len(pending), size)) is not None:
            # before the rows are looked at: garbage has no rows to be cut short
            raise ResultsError(f"{path} is not a CSV of records: it holds {found}; the file was not written by bench "
                               "as it is: run the experiment again")
        if header_end < 0:
            if (end := block.find(b"\n")) >= 0:
                header_end = offset + end
                _check_header(path, file, header_end)
            elif offset + len(block) > HEADER_LIMIT:
                header_end = offset + len(block)
                _check_header(path, file, header_end)
        if (end := block.rfind(b"\n")) >= 0:
            last_line_end = offset + end + 1
        offset += len(block)
    if header_end < 0:  # one line without its end: the header alone, or part of it (the reader says what is wrong)
        return offset
    return _without_torn_row(path, offset, last_line_end)


def _check_header(path: Path, file: BinaryIO, end: int) -> None:
    """The first line of the file (``end`` bytes, read again from the start) names at most :data:`COLUMN_LIMIT`
    columns and is at most :data:`HEADER_LIMIT` bytes long; else a ResultsError."""
    redo = "the file was not written by bench as it is: run the experiment again"
    if end > HEADER_LIMIT:
        raise ResultsError(f"{path}: its first line (the header) is longer than {HEADER_LIMIT // 1024} KiB; {redo}")
    here = file.tell()
    file.seek(0)
    columns = file.read(end).count(b",") + 1  # at most (a quoted name may hold a comma; bench's never do)
    file.seek(here)
    if columns > COLUMN_LIMIT:
        raise ResultsError(f"{path}: its header names {columns:,} columns, more than the {COLUMN_LIMIT:,} a "
                           f"reader takes (bench writes at most 40); {redo}")


def _binary(data: bytes, decoder: codecs.IncrementalDecoder, offset: int, size: int) -> str | None:
    """What makes ``data`` (a block that begins at ``offset`` of a file of ``size`` bytes, fed to ``decoder``)
    binary rather than CSV text (a NUL byte, bytes that are not UTF-8), and where; None for text. A character cut
    at the very end is a torn row's, not binary data."""
    first = data.find(b"\0")
    try:
        decoder.decode(data[len(decoder.getstate()[0]):], final=False)
    except UnicodeDecodeError as exc:
        first = exc.start if first < 0 else min(first, exc.start)
    if first < 0:
        return None
    return f"binary data, not text (byte 0x{data[first]:02x} at offset {offset + first} of {size})"


#: (path, size) of the files whose torn last row was warned about, so a file read twice warns once
_warned_torn: set[tuple[str, int]] = set()


def _without_torn_row(path: Path, size: int, whole: int) -> int:
    """How many of the file's ``size`` bytes to read: ``whole`` (up to its last line end) when a last row is cut
    short (no line end after it: a writer that ran out of disk, or was killed, mid-row), with a warning on stderr;
    all of them for a whole file."""
    if whole in (0, size):  # nothing cut, or not even the header is whole (the reader says what is wrong)
        return size
    key = (str(path), size)
    if key not in _warned_torn:
        _warned_torn.add(key)
        print(f"warning: {path}: its last row is cut short (the disk filled up or the run was killed while writing "
              "it); that row is skipped", file=sys.stderr)
    return whole


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
