"""Room for UCX's shared memory: whether this process can still open UCX's shared-memory transports (descriptors,
the free space of the directory its segments live in), said in one line when a connection fails for want of it, and
how large a shared segment may be."""

from __future__ import annotations

import errno
import os
import resource

#: descriptors UCX's shared-memory transports take when a worker opens them (segments, FIFOs, event descriptors)
SHARED_MEMORY_DESCRIPTORS = 16


def descriptors_short() -> str | None:
    """Why UCX may have opened no shared-memory transport, where this process holds nearly as many descriptors as
    its limit allows (the peer, started alike, then has none either); None otherwise."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError as exc:
        if exc.errno != errno.EMFILE:
            return None
        held = soft  # not one left to list them with
    if held + SHARED_MEMORY_DESCRIPTORS < soft:
        return None
    return (f"this process holds {held} of the {soft} descriptors it may open, too few for UCX's shared-memory "
            "transports")


#: free room below which the shared-memory filesystem may be why UCX opened no shared-memory transport: a worker's
#: receive FIFO and descriptor pool take a few MiB there, and its segments for registered memory more
SHARED_MEMORY_NEEDED = 64 << 20


def shared_dir() -> str:
    """The directory UCX's posix transport makes its segments in (``UCX_POSIX_DIR``, else ``/dev/shm``)."""
    return os.environ.get("UCX_POSIX_DIR") or "/dev/shm"


def shared_memory_short() -> str | None:
    """Why UCX may have opened no shared-memory transport, where the filesystem its segments live in is nearly
    full or unusable (UCX says so on the console only, then finds the peer unreachable); None otherwise."""
    where = shared_dir()
    try:
        room = os.statvfs(where)
    except OSError as exc:
        return f"{where}, where UCX makes its shared-memory segments, cannot be used ({exc.strerror})"
    free, size = room.f_bavail * room.f_frsize, room.f_blocks * room.f_frsize
    if free >= SHARED_MEMORY_NEEDED:
        return None
    return (f"{where} has {free / (1 << 20):.1f} MiB free of {size / (1 << 20):.0f} MiB, too little for UCX's "
            f"shared-memory segments: free room there, or give it more (a container: --shm-size)")


def shared_room() -> int:
    """Bytes of shared memory a segment may take: half of what the directory UCX puts it in (``UCX_POSIX_DIR``,
    else ``/dev/shm``; often small in containers) has free, so that other programs keep room there and UCX is not
    asked for what it would refuse with an error on the console (it then falls back to process memory)."""
    try:
        free = os.statvfs(shared_dir())
    except OSError:
        return 0
    return free.f_bavail * free.f_frsize // 2
