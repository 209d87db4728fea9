"""Check whether this machine is ready for a fabric, one line per check: RDMA devices and ports (state, link layer,
active MTU, the GID index a verbs run would use), the locked-memory limit against what a run registers, huge
pages, ptrace scope (UCX's single-copy shared memory), /dev/shm, the UCX in use (version, origin, transports and
whether one reaches the RDMA ports), pyverbs and the rdma-core under it, and perftest. Each line says ok, warn,
fail or skip (the check does not apply to the fabric asked) and, when not ok, the fix. Exit status 0 when the
machine is ready for the fabric asked, 1 when a check it needs failed."""

from __future__ import annotations

import argparse

from bench import options

HELP = "is this machine ready for a fabric: RDMA ports, locked memory, UCX, pyverbs (exit 1 if not)"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench doctor', 'is this machine ready for the default fabric (ucx)? exit status 1 if not'),
    ('bench doctor --fabric verbs --memory 4GB', 'ready for verbs, registering 4 GB?'),
)
STARTS_RANKS = False


def memory_size(text: str) -> int:
    """``--memory``: one size such as ``4GB`` (binary units)."""
    from bench.ground.sizes import SizeError, parse_size

    try:
        return parse_size(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _default_memory() -> str:
    from bench.commands.micro import DEFAULT_SIZES
    from bench.experiments.doctor import run_memory
    from bench.ground.sizes import format_size, parse_sizes

    return format_size(run_memory(parse_sizes(DEFAULT_SIZES)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fabric_options(parser, "the fabric transport the run would ask for: auto is checked for an RDMA "
                               "port the fabric cannot reach (a run refuses then); shm and tcp ask for none")
    parser.add_argument("--memory", type=memory_size, default=_default_memory(), metavar="SIZE",
                        help="what a run registers per process, checked against the locked-memory limit and /dev/shm; "
                        "the default is what a default 'bench micro' sweep (1KB-1GB) may register")
    # doctor reports the fabric's problems as checks, so the refusal before commands does not stop it
    parser.set_defaults(diagnoses_fabric=True)


def run(args: argparse.Namespace) -> int:
    from bench.experiments.doctor import diagnose, exit_status, format_checks, size_text

    checks = diagnose(args.fabric, args.fabric_transport, args.memory)
    print(f"bench doctor: --fabric {args.fabric} --fabric-transport {args.fabric_transport}, "
          f"--memory {size_text(args.memory)}")
    for line in format_checks(checks):
        print(f"  {line}")
    status = exit_status(checks)
    failed = [check.name for check in checks if check.state == "fail"]
    print(f"ready for --fabric {args.fabric}" if status == 0 else
          f"not ready for --fabric {args.fabric}: {', '.join(dict.fromkeys(failed))} failed")
    return status
