"""The process of one rank started by a launcher on this machine: ``python -m bench.launch.rank HUB RANK [PARENT]``.

The run's token comes on standard input (never on the command line, where ``ps`` shows it). The
process joins the hub, runs its assignment and exits; it exits at once when the coordinator is
gone. SIGTERM ends it cleanly: transports close and registered memory is released.

``PARENT`` is the coordinator's pid. The rank asks the kernel to kill it when its parent dies
(``PR_SET_PDEATHSIG``), then checks that its parent is still ``PARENT``: had the coordinator died
before the request, the rank would have been re-parented and would never get the signal, so it exits
instead. Under ``--launcher netns`` the rank is started through ``ip netns exec``, which execs it in
place, so its parent is the coordinator too. The signal is SIGKILL because it must work whatever the
rank is doing (a main thread in a long C call that holds the GIL runs no Python signal handler, and
the thread that would notice the hub connection closing cannot run either). It only fires when the
coordinator dies without ending its ranks first (SIGKILL, a crash): on SIGINT, SIGTERM or SIGHUP
the coordinator sends SIGTERM to its ranks, which close their transports before it exits.

A rank that crashes (SIGSEGV, SIGBUS, SIGFPE, SIGABRT in a library) writes the Python stacks of its
threads into its log (:mod:`faulthandler`, on a duplicate of the log's descriptor, so the stacks are
written even while TensorFlow's start-up lines are held back), and the launcher's message of its death
ends with that log.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys

from bench.ground import quiet_tensorflow
from bench.launch.context import connect, serve_rank

#: from <linux/prctl.h>
PR_SET_PDEATHSIG = 1


def hub_address(text: str) -> str | tuple[str, int]:
    """``/path/to/socket`` (Unix) or ``host:port`` (TCP)."""
    if text.startswith("/"):
        return text
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` here when the parent dies; False if ``parent`` is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return True  # not on Linux: the hub connection still ends the rank with its coordinator
    except (OSError, AttributeError):
        return True
    return os.getppid() == parent


def main(argv: list[str]) -> None:
    faulthandler.enable(file=os.dup(2), all_threads=True)  # the log, whatever later becomes of descriptor 2
    quiet_tensorflow.install()
    address, rank = hub_address(argv[0]), int(argv[1])
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if len(argv) > 2 and not die_with_parent(int(argv[2])):
        sys.exit(3)  # the coordinator died before we could ask to die with it: nobody is left to report to
    token = sys.stdin.readline().strip()
    serve_rank(connect(address, token), rank, in_own_process=True)


if __name__ == "__main__":
    main(sys.argv[1:])
