"""The process of one rank started by a launcher on this machine: ``python -m bench.launch.rank HUB RANK``.

The run's token comes on standard input (never on the command line, where ``ps`` shows it). The
process joins the hub, runs its assignment and exits; it exits at once when the coordinator is
gone. SIGTERM ends it cleanly: transports close and registered memory is released.
"""

from __future__ import annotations

import signal
import sys

from bench.launch.base import connect, serve_rank


def hub_address(text: str) -> str | tuple[str, int]:
    """``/path/to/socket`` (Unix) or ``host:port`` (TCP)."""
    if text.startswith("/"):
        return text
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def main(argv: list[str]) -> None:
    address, rank = hub_address(argv[0]), int(argv[1])
    token = sys.stdin.readline().strip()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    serve_rank(connect(address, token), rank, in_own_process=True)


if __name__ == "__main__":
    main(sys.argv[1:])
