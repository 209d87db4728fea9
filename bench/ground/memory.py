"""This process's memory, read from ``/proc/self/status``, and the machine's (written once for the launcher and the
experiments)."""

from __future__ import annotations

import contextlib
import ctypes
import resource

#: glibc's ``mallopt`` parameter for the size from which a block is its own mapping (<malloc.h>)
_M_MMAP_THRESHOLD = -3
#: from this size on, a freed block goes back to the system at once when :func:`return_large_frees` is on
LARGE_BLOCK_BYTES = 1 << 20


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mb() -> float:
    """This process's resident memory now (MB); NaN where it cannot be read."""
    now = _status_mb("VmRSS")
    return float("nan") if now is None else now


def private_mb() -> float:
    """This process's resident memory not backed by a file (MB): its heap and shared memory (``RssAnon`` +
    ``RssShmem``), what a leak grows. Unlike the whole RSS it does not move when the kernel drops and reloads
    pages of the program and its libraries (a machine without swap under memory pressure does); NaN where it
    cannot be read."""
    anon, shmem = _status_mb("RssAnon"), _status_mb("RssShmem")
    return float("nan") if anon is None else anon + (shmem or 0.0)


def return_large_frees(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """From now on, blocks of ``threshold`` bytes or more are mappings of their own, unmapped when freed.

    By default glibc raises that threshold to the largest block freed so far (up to 32 MiB) and keeps
    freed blocks below it in its heaps, one per thread arena: a process that allocates and frees a 4 MB
    buffer per transfer then holds one, two or three freed ones, as its threads happen to meet them,
    and its resident memory steps up and down by whole buffers with no leak at all. Fixing the threshold
    makes resident memory follow what is alive (the soak's leak verdict needs that), at the cost of
    mapping fresh pages for every large buffer: a soak is not a benchmark. False where this is not glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def peak_rss_mb() -> float:
    """This process's peak resident memory (MB) since :func:`reset_peak_rss`, or since it started."""
    peak = _status_mb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if peak is None else peak


def reset_peak_rss() -> None:
    """Start this process's peak memory afresh (a process that runs several ranks in turn, under MPI)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def machine_memory_bytes() -> int:
    """The memory this machine gives a process (bytes): physical memory, or its cgroup's limit when lower
    (the transports' own bound, ``transports.base.memory_bytes``, read in one place)."""
    from transports.base import memory_bytes

    return memory_bytes()


def available_memory_bytes() -> int | None:
    """The memory a new allocation can have now without swapping (bytes): ``MemAvailable`` of ``/proc/meminfo``,
    or what the cgroup's limit leaves (``memory.max`` less ``memory.current``) when less; None where neither can be
    read. What a run about to allocate is checked against (the total would count memory others hold)."""
    available: int | None = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    with (contextlib.suppress(OSError, ValueError), open("/sys/fs/cgroup/memory.max") as limit,
          open("/sys/fs/cgroup/memory.current") as current):
        text = limit.read().strip()
        if text.isdigit():
            left = max(0, int(text) - int(current.read().strip()))
            available = left if available is None else min(available, left)
    return available
