"""Fixtures shared by the tests: a started pair of transports for every registered name."""

from __future__ import annotations

import pytest

import transports
from transports import Cluster, fabric

SHORT_TIMEOUT_S = 20.0


def transport_params():
    """Every registered transport in each of its variants; one that cannot run here (the transport, or the
    fabric the variant runs on) is skipped with its reason."""
    params = []
    for name in transports.names():
        status = transports.availability(name)
        marks = [] if status.ok else [pytest.mark.skip(reason=f"{name} not available here: {status.reason}")]
        variants = transports.transport_class(name).variants() if status.ok else {"": {}}
        for label, options in variants.items():
            backend = fabric.availability(options["fabric"]) if "fabric" in options else status
            marked = marks if backend.ok else [pytest.mark.skip(reason=f"{options['fabric']} fabric: {backend.reason}")]
            params.append(pytest.param((name, options), marks=marked, id=f"{name}-{label}" if label else name))
    return params


def start_pair(name: str, **options):
    cluster = Cluster.on_loopback(2)
    pair = [transports.create(name, timeout_s=SHORT_TIMEOUT_S, **options) for _ in range(2)]
    for rank, transport in enumerate(pair):
        transport.start(cluster, rank)
    return pair


@pytest.fixture(params=transport_params())
def pair(request):
    """Two started transports of one kind: rank 0 and rank 1."""
    name, options = request.param
    started = start_pair(name, **options)
    yield started
    for transport in started:
        transport.close()
