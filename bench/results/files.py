"""Writing results files so that a full or failing disk never leaves one half written.

Every file a run, a report or a plot writes goes through one of two helpers:

- :func:`replace_file` writes the whole content to a temporary file beside the target and renames it over the
  target: a reader sees the old file or the new one, never a mix; on failure the temporary file is removed and
  the old file stays as it was.
- :func:`append_whole` appends rows with one ``write`` and, should the disk take only part of them, truncates
  the file back to its size before: a row is there whole or not at all.

One more, :func:`overwrite_in_place`, is the last resort of a run's ``meta.json`` on a disk with no block left for a
new file: it writes into the blocks the file holds already (never more bytes than the file has).

Neither follows a symbolic link, nor does :func:`make_dir` for the directories the suite makes: a run directory
may be writable by a group, whose members could plant links at the names the suite writes (the temporary file's,
the target's) to make it overwrite a file of theirs choosing. The temporary file gets a random name and is made
with ``O_CREAT|O_EXCL|O_NOFOLLOW`` (a name taken, by a link or a file, is never opened: another is tried), and the
rename puts the new file in place of a link at the target rather than writing through it; an append opens with
``O_NOFOLLOW``, and a link there is refused in one line (:class:`LinkError`).

A write that fails because the disk is full or failing (:data:`DISK_ERRNOS`) raises :class:`DiskError`, an
``OSError`` naming the file and the fix; the directories it happened in are remembered for the rest of the
process (:func:`disk_failed`), so a command does not try to draw figures onto a disk that just refused a row.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

#: the errors of a full (ENOSPC, EDQUOT: over quota) or failing (EIO) disk, or one turned read-only under a run
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})

_failed_dirs: set[Path] = set()


class DiskError(OSError):
    """A results file could not be written whole: the disk is full or failing. ``str()`` is one line naming the
    file, the cause and the fix."""

    def __init__(self, code: int, path: Path, fix: str = "free space there or choose another --out") -> None:
        super().__init__(code, os.strerror(code), str(path))
        self.path = Path(path)
        self.fix = fix

    def __str__(self) -> str:
        return f"cannot write {self.path}: {self.strerror}; {self.fix}"


def is_disk_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk is full or failing (rather than, say, a missing directory or permission)."""
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def disk_failed(directory: Path) -> bool:
    """Whether a write into ``directory`` failed on a full or failing disk earlier in this process."""
    return Path(directory).absolute() in _failed_dirs


def _disk_error(exc: OSError, path: Path) -> OSError:
    """``exc`` as a :class:`DiskError` for ``path`` when it is one (remembering the directory), else as it was."""
    if not is_disk_error(exc):
        return exc
    _failed_dirs.add(Path(path).absolute().parent)
    return exc if isinstance(exc, DiskError) else DiskError(exc.errno or errno.EIO, path)


def _write_all(fd: int, data: bytes, path: Path) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:  # the disk took nothing and said nothing: call it full
            raise DiskError(errno.ENOSPC, path)
        view = view[written:]


class LinkError(OSError):
    """A file or directory the suite was to write is a symbolic link (planted there, it would send the write
    elsewhere): nothing was written. ``str()`` is one line naming it and the fix."""

    def __init__(self, path: Path, what: str = "file") -> None:
        super().__init__(errno.ELOOP, "is a symbolic link", str(path))
        self.path = Path(path)
        self.what = what

    def __str__(self) -> str:
        return (f"cannot write {self.path}: the {self.what} is a symbolic link, which bench never writes through; "
                "remove it (and check who can write into its directory) or choose another --out")


#: how many random names :func:`replace_file` tries for its temporary file before it gives up
_TEMPORARY_TRIES = 100


def _open_temporary(path: Path) -> tuple[int, Path]:
    """A new file beside ``path``, ``.<name>.tmp-<pid>-<random>``, made by this call (``O_EXCL``: a name taken by
    anything, a planted link included, is not opened but another tried) and never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_TEMPORARY_TRIES):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, f"no free temporary name after {_TEMPORARY_TRIES} tries", str(path))


def replace_file(path: Path, data: bytes | str, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` whole or not at all: into a new temporary file beside it (random name, made with
    ``O_EXCL|O_NOFOLLOW``), flushed to the disk (``durable``), then renamed over ``path`` (a link there is
    replaced, never written through). On any failure the temporary file is removed and ``path`` keeps its old
    content (or stays absent). Disk errors are raised as :class:`DiskError`."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp: Path | None = None
    try:
        fd, tmp = _open_temporary(path)
        try:
            _write_all(fd, data, path)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:  # only the file this call made: never one a name clash found there
            with contextlib.suppress(OSError):
                tmp.unlink()
        if isinstance(exc, OSError):
            if exc.errno is not None and exc.filename not in (None, str(path)) and not isinstance(exc, DiskError):
                # the temporary file is this function's own: the error names the file the caller asked for
                exc = OSError(exc.errno, exc.strerror, str(path))
            raise _disk_error(exc, path) from None
        raise


def overwrite_in_place(path: Path, data: bytes | str) -> None:
    """Write ``data`` over the bytes of the existing file ``path`` and cut it to ``data``'s length: for a disk that
    has no block left for :func:`replace_file`'s new file, as the blocks the file holds are written again (never a
    link; ``data`` no longer than the file, so no block is asked for). Not whole-or-nothing as a rename is: only
    for a file whose old content is worth less than the new (meta.json saying ``running`` of a run that failed).
    Disk errors are raised as :class:`DiskError`; a file too short for ``data`` is one too (ENOSPC)."""
    path = Path(path)
    data = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkError(path) from None
        raise _disk_error(exc, path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if len(data) > info.st_size:  # more would ask the disk for a block it does not have
            raise DiskError(errno.ENOSPC, path)
        written = os.pwrite(fd, data, 0)
        if written != len(data):
            raise DiskError(errno.ENOSPC, path)
        os.ftruncate(fd, len(data))  # cutting a file frees blocks, it never asks for one
        os.fsync(fd)
    except OSError as exc:
        raise _disk_error(exc, path) from None
    finally:
        os.close(fd)


def append_whole(path: Path, data: bytes | str, header: bytes | str = b"") -> None:
    """Append ``data`` to ``path`` (created if absent; ``header`` goes first into a file that is empty) in one
    ``write``; should the disk take only part of it, the file is truncated back to its size before, so no row is
    left half written. Disk errors are raised as :class:`DiskError`."""
    path = Path(path)
    data = data.encode("utf-8") if isinstance(data, str) else data
    header = header.encode("utf-8") if isinstance(header, str) else header
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkError(path) from None
        raise _disk_error(exc, path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device planted at the name: no row goes there
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        before = os.fstat(fd).st_size
        whole = (header + data) if before == 0 else data
        try:
            written = os.write(fd, whole)
            if written != len(whole):  # a short write: the disk filled up part way
                raise DiskError(errno.ENOSPC, path)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                if before == 0:
                    path.unlink()  # the file this began: no empty file (not even a header) stays behind
                else:
                    os.ftruncate(fd, before)
            if isinstance(exc, OSError):
                raise _disk_error(exc, path) from None
            raise
    finally:
        os.close(fd)


def make_dir(path: Path, *, parents: bool = False, exist_ok: bool = False) -> Path:
    """Make the directory ``path`` (and its missing parents with ``parents``) without following a link at its
    name: a link there (to a directory or not) is a :class:`LinkError`, whatever ``exist_ok`` says. A directory
    there already is fine with ``exist_ok``; anything else there is ``FileExistsError``. Links among the parents
    that exist (``results`` linked to a scratch disk) are followed, as any path's are."""
    path = Path(path)
    try:
        path.mkdir(parents=parents, exist_ok=False)
    except FileExistsError:
        if not exist_ok or path.is_symlink():
            if path.is_symlink():
                raise LinkError(path, "directory") from None
            raise
    info = os.lstat(path)  # what is at the name now: the directory made (or found), not a link swapped in
    if stat.S_ISLNK(info.st_mode):
        raise LinkError(path, "directory")
    if not stat.S_ISDIR(info.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a directory", str(path))
    return path
