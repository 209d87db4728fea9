"""Train MODEL on 1, 2, 4, ... servers (each a worker and a parameter server) over each transport and record the
total mini-batches per second and the scaling efficiency (throughput / (servers x the 1-server throughput of the
same transport)). The Local line is one process without communication, times the number of servers. On a
machine with few cores, real compute competes with communication for the CPU: --compute replay (the default
here) waits each worker's measured compute time instead."""

from __future__ import annotations

import argparse
from typing import Any

from bench import options
from bench.commands.common import add_framework_option
from bench.commands.model import run_trainings

HELP = "throughput against the number of servers, per transport, with the Local line (the paper's Figure 11)"
#: shown at the end of --help: each command line and what it does
EXAMPLES = (
    ('bench scale vgg16 --servers 1,2,4', 'zerocopy and grpc_tcp at 1, 2 and 4 servers, and Local'),
    ('bench scale vgg16 --launcher netns --link-rate 10gbit', 'each server its own emulated host on 10 Gbit/s'),
)
STARTS_RANKS = True

#: the optional part of the install it needs (checked before anything starts)
EXTRAS = ("models",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_training_options(parser, "scale", "zerocopy,grpc_tcp", steps=10, compute="replay")
    add_framework_option(parser)
    parser.add_argument("--servers", dest="server_counts", type=options.int_list, default=[1, 2, 4],
                        help="comma list of server counts")
    parser.set_defaults(asynchronous=False)


def run(args: argparse.Namespace, launcher: Any) -> int:
    from bench.experiments.training import ScaleRecords

    return run_trainings(args, launcher, "scale", sorted(set(args.server_counts)), ScaleRecords(), scaled_local=True)
