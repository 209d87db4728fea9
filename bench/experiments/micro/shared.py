"""Memory the two sides of a line map together: a file in a private (0700) directory under /dev/shm, made by one
side without following links and removed as soon as the other has mapped it (or declined), so that nothing of it
is left however the line ends. The ready signals' ring (:class:`~bench.experiments.micro.loops.DirectSignals`)
and the harness line's word (``bench.experiments.references.null``) live in one."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Callable
from typing import TypeVar

Told = TypeVar("Told")


def make_shared(size: int, prefix: str, tell: Callable[[str, mmap.mmap], Told]) -> tuple[mmap.mmap, Told]:
    """A new file of ``size`` bytes, mapped here; ``tell(path, mapped)`` hands its name to the other side and
    returns once that side mapped it (or said it could not): then the name goes. Returns the map and what ``tell``
    returned."""
    private = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(private, "shared")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            return mapped, tell(path, mapped)
        except BaseException:
            mapped.close()
            raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.rmdir(private)


def open_shared(path: str, size: int) -> mmap.mmap:
    """The other side's file ``path``, mapped here (never through a link); OSError where it cannot be."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
