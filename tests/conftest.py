"""Fixtures shared by the tests: a started pair of transports for every registered name, the one-node Slurm of
the session (``slurm_bed``), and the marks of cases that need an RDMA device.

A case on an RDMA device (the verbs fabric, or UCX's ``rdma`` fabric transport) carries the mark
``rdma``. Where no device is, it skips saying why; the Soft-RoCE session (``tests/test_softroce.py``
runs ``pytest -m rdma`` in a guest with a kernel RDMA device, ``TENSOR_BENCH_REQUIRE_RDMA=1``) fails
such a case instead, so none is skipped for want of a device there.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import pytest

import transports
from tests.slurm import SlurmBed, unavailable
from transports import Cluster, fabric

#: a test pair's transport timeout: the bound within which a living peer answers. In the Soft-RoCE guest's session
#: (TENSOR_BENCH_REQUIRE_RDMA=1) everything runs under QEMU's software emulation, on a machine that may be busy: a
#: living peer took over 20 s there for 40 small tensors over UCX rc_verbs, so the bound is wider, not a retry
SHORT_TIMEOUT_S = 120.0 if os.environ.get("TENSOR_BENCH_REQUIRE_RDMA") == "1" else 20.0
#: set in the Soft-RoCE session: a case that needs an RDMA device fails where it would skip
REQUIRE_RDMA = os.environ.get("TENSOR_BENCH_REQUIRE_RDMA") == "1"


def on_rdma(backend: str, fabric_transport: str = "auto") -> bool:
    """Whether a fabric backend and transport carry data over an RDMA device (and nothing else)."""
    return backend == "verbs" or fabric_transport == "rdma"


@functools.cache
def _fabric_status(backend: str, fabric_transport: str) -> fabric.Availability:
    return fabric.availability(backend, fabric_transport)


def fabric_marks(backend: str = fabric.DEFAULT, fabric_transport: str = "auto") -> list:
    """The marks of a case on ``backend`` over ``fabric_transport``: ``rdma`` for cases on an RDMA device, and
    a skip with the reason where the fabric cannot run here (in the Soft-RoCE session, a failure instead)."""
    rdma = on_rdma(backend, fabric_transport)
    marks = [pytest.mark.rdma] if rdma else []
    status = _fabric_status(backend, fabric_transport)
    if not status.ok:
        label = f"{backend} fabric" + (f" over {fabric_transport}" if fabric_transport != "auto" else "")
        reason = f"{label}: {status.reason}"
        marks.append(pytest.mark.rdma_missing(reason) if rdma and REQUIRE_RDMA else pytest.mark.skip(reason=reason))
    return marks


#: the Soft-RoCE session's counts (tests/test_softroce.py), printed at the end of the run
SOFTROCE_SUMMARY = pytest.StashKey[str]()
#: the Soft-RoCE session begun beside the host's tests (tests/softroce_session.py)
EARLY_SESSION = pytest.StashKey["EarlySession"]()


def pytest_collection_modifyitems(session, config, items):
    """Where the run includes the Soft-RoCE session: begin it now, beside the host's tests, and run the Soft-RoCE
    tests last, the session's own check first among them (it waits for the session; the others then reuse its
    guest). Under emulation the session takes as long as the host's suite: one after the other doubled CI's time."""
    from tests.softroce_session import SESSION_TEST, EarlySession

    if REQUIRE_RDMA or config.option.collectonly or not any(item.name == SESSION_TEST for item in items):
        return
    softroce = [item for item in items if item.path.name == "test_softroce.py"]
    softroce.sort(key=lambda item: item.name != SESSION_TEST)
    items[:] = [item for item in items if item.path.name != "test_softroce.py"] + softroce
    # the modules of this run's rdma cases, from its own collection: a second collection of the suite for the
    # guest cost a dozen seconds of CPU. A run of the Soft-RoCE tests alone holds none: the guest then runs all
    early = EarlySession(sorted({item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("rdma")}))
    config.stash[EARLY_SESSION] = early
    early.begin()


def pytest_sessionfinish(session, exitstatus):
    early = session.config.stash.get(EARLY_SESSION, None)
    if early is not None:
        early.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    summary = config.stash.get(SOFTROCE_SUMMARY, None)
    if summary is not None:
        terminalreporter.write_line(summary)


def pytest_runtest_setup(item):
    missing = item.get_closest_marker("rdma_missing")
    if missing is not None:
        pytest.fail(f"an RDMA case could not run on this machine's RDMA device: {missing.args[0]}", pytrace=False)


def transport_params():
    """Every registered transport in each of its variants; one that cannot run here (the transport, or the
    fabric the variant runs on) is skipped with its reason."""
    params = []
    for name in transports.names():
        status = transports.availability(name)
        marks = [] if status.ok else [pytest.mark.skip(reason=f"{name} not available here: {status.reason}")]
        variants = transports.transport_class(name).variants() if status.ok else {"": {}}
        for label, options in variants.items():
            marked = list(marks)
            if "fabric" in options or "fabric_transport" in options:
                marked += fabric_marks(options.get("fabric", fabric.DEFAULT), options.get("fabric_transport", "auto"))
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


@pytest.fixture(scope="session")
def slurm_bed():
    """The session's one-node Slurm (``tests/slurm.py``): started the first time a test asks for it, in a
    directory of its own, stopped and removed at the session's end. A test skips where it cannot run here."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    # not tmp_path_factory: pytest keeps those directories, and a unix socket's path must stay short
    bed = SlurmBed(tempfile.mkdtemp(prefix="slurm-bed-"))
    try:
        bed.up()
        yield bed
    finally:
        try:
            bed.down()
        finally:
            shutil.rmtree(bed.dir, ignore_errors=True)
