"""The rendezvous file of a Slurm step: task 0 writes where it listens (and the token, unless every task has
``TENSOR_BENCH_TOKEN``) into a file readable by the user only, in a directory the step's nodes share; the other tasks
read it. A file or directory another user could have written or planted is refused (:func:`publish`,
:func:`read_published`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path

from bench.launch.messages import TOKEN_VARIABLE, LaunchError
from bench.launch.slurm_step import SlurmStep

#: where task 0 says where it listens (a directory the step's nodes share); default below
RENDEZVOUS_VARIABLE = "TENSOR_BENCH_RENDEZVOUS"
DEFAULT_RENDEZVOUS = Path("~/.cache/tensor-bench/rendezvous")
#: seconds the tasks of a step get to find each other: task 0 to write its file, the others to join
JOIN_S = 300.0


def rendezvous_dir(env: Mapping[str, str] = os.environ) -> Path:
    return Path(env.get(RENDEZVOUS_VARIABLE) or DEFAULT_RENDEZVOUS).expanduser()


def _refuse_unless_private(path: Path, fd: int, kind: str) -> None:
    """LaunchError (one line naming ``path`` and the fix) unless the open ``fd`` is this user's ``kind`` ("directory"
    or "file") and nobody else may write it: what another user could plant or change there, a task would trust."""
    st = os.fstat(fd)
    fix = f"set {RENDEZVOUS_VARIABLE} to a directory only you can write (chmod 700)"
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)
    if not is_kind:
        raise LaunchError(f"refusing {path}: not a {kind}; {fix}")
    if st.st_uid != os.geteuid():
        raise LaunchError(f"refusing {path}: owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); {fix}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LaunchError(f"refusing {path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); {fix}")


def _open_private(path: Path, kind: str, dir_fd: int | None = None) -> int:
    """``path`` opened without following a link (O_NOFOLLOW) and checked (:func:`_refuse_unless_private`).
    FileNotFoundError while it is not there."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if kind == "directory" else os.O_NONBLOCK)
    try:
        fd = os.open(path.name if dir_fd is not None else path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else f"not a {kind}" if exc.errno == errno.ENOTDIR \
            else exc.strerror
        raise LaunchError(f"refusing {path}: {what}; set {RENDEZVOUS_VARIABLE} to a directory only you can write "
                          "(chmod 700)") from None
    try:
        _refuse_unless_private(path, fd, kind)
    except BaseException:
        os.close(fd)
        raise
    return fd


def publish(path: Path, address: tuple[str, int], token: str | None) -> None:
    """Write ``path`` whole (a reader never sees half of it), readable by this user only, in a directory nobody
    else may write (refused otherwise: ``mkdir``'s mode applies only to a directory it creates)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder = _open_private(path.parent, "directory")
    draft = f".{path.name}.{os.getpid()}"
    try:
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump({"address": list(address), **({"token": token} if token else {})}, out)
            os.replace(draft, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(draft, dir_fd=folder)
            raise
    finally:
        os.close(folder)


#: the most a rendezvous file may hold
_PUBLISHED_BYTES = 4096


def _read_file(path: Path) -> str:
    """The rendezvous file's text, from a directory and a file that are this user's alone (else LaunchError)."""
    folder = _open_private(path.parent, "directory")
    try:
        fd = _open_private(path, "file", dir_fd=folder)
    finally:
        os.close(folder)
    with os.fdopen(fd, "rb") as f:
        return f.read(_PUBLISHED_BYTES + 1).decode(errors="replace")


def _parse_published(path: Path, text: str, step: SlurmStep) -> tuple[tuple[str, int], str]:
    said = json.loads(text)
    if len(text) > _PUBLISHED_BYTES or not isinstance(said, dict):
        raise LaunchError(f"{path} is not a rendezvous file of bench (remove it)")
    address, token = said.get("address"), os.environ.get(TOKEN_VARIABLE) or said.get("token")
    if not (isinstance(address, list) and len(address) == 2 and isinstance(address[0], str)
            and type(address[1]) is int and 0 < address[1] < 65536):
        raise LaunchError(f"{path} is not a rendezvous file of bench: no address (remove it)")
    if not token or not isinstance(token, str):
        raise LaunchError(f"{path} gives no token and {TOKEN_VARIABLE} is not set: every task of step "
                          f"{step.name} needs the same {TOKEN_VARIABLE}, or none")
    return (address[0], address[1]), token


def read_published(path: Path, step: SlurmStep) -> tuple[tuple[str, int], str]:
    """Task 0's address and token, once its file is there (at most :data:`JOIN_S`); a file or directory another
    user could have written is refused at once."""
    deadline = time.monotonic() + JOIN_S
    while True:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return _parse_published(path, _read_file(path), step)
        if time.monotonic() > deadline:
            raise LaunchError(f"task 0 of Slurm step {step.name} did not say where it listens within {JOIN_S:g} s "
                              f"(no {path}): is it running, and is {path.parent} shared by the step's nodes "
                              f"({', '.join(dict.fromkeys(step.nodes))})? Set {RENDEZVOUS_VARIABLE} to a "
                              "directory they share")
        time.sleep(0.05)

