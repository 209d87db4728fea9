"""Fixtures shared by the tests: a started pair of transports for every registered name, the one-node Slurm of
the session (``slurm_bed``), and the marks of cases that need an RDMA device.

A case on an RDMA device (the verbs fabric, or UCX's ``rdma`` fabric transport) carries the mark
``rdma``. Where no device is, it skips saying why; the Soft-RoCE session (``tests/test_softroce.py``
runs ``pytest -m rdma`` in a guest with a kernel RDMA device, ``TENSOR_BENCH_REQUIRE_RDMA=1``) fails
such a case instead, so none is skipped for want of a device there.

A case that needs something of the system beyond the Python packages carries the mark ``system(NEED, ...)``:
``netns`` (root, ``ip`` and ``tc``, and a kernel that makes network namespaces), ``mpirun``, ``qemu``, ``chromium``,
``slurm`` (the one-node bed's daemons), ``mountns`` (a mount namespace with a /dev/shm of the test's own),
``deb:PACKAGE`` (a Debian package installed), ``shm:SIZE`` (``/dev/shm`` at
least that large) or ``tool:NAME`` (a program on PATH). Where a need is missing the case skips with one line saying
what is missing and how to add it (:data:`SYSTEM_NEEDS`); ``pytest -m system`` selects them all, and
``tests/test_newcomer_system.py`` checks that every case that touches such a thing carries the mark.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable

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
    for mark in item.iter_markers("system"):
        for need in mark.args:
            if (why := system_missing(need)) is not None:
                pytest.skip(f"needs {need}: {why}")


# -- what a case needs of the system (the mark ``system``) ----------------------------------------------------------


def _netns() -> str | None:
    from bench.launch.hosts import NetnsUnavailable, check_support

    try:
        check_support()
    except NetnsUnavailable as exc:
        return str(exc)
    return None


def _mpirun() -> str | None:
    from tests.mpirun import MPIRUN, NO_MPIRUN

    return NO_MPIRUN if MPIRUN is None else None


def _program(*names: str, install: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        if any(shutil.which(name) for name in names):
            return None
        return f"no {' or '.join(names)} on PATH ({install})"
    return probe


def _slurm() -> str | None:
    from tests.slurm import unavailable

    return unavailable()


def _mountns() -> str | None:
    """A mount namespace of a test's own with a fresh /dev/shm (root, ``unshare -m``, a root filesystem whose mounts
    can be made private: not a plain chroot)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare (util-linux)"
    tried = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, text=True)
    if tried.returncode != 0:
        lines = tried.stderr.strip().splitlines()
        return f"cannot mount a /dev/shm of a test's own: {lines[-1] if lines else f'exit code {tried.returncode}'}"
    return None


#: each need of the mark ``system`` without a parameter: a probe returning None where it is met, else one line saying
#: what is missing and how to add it
SYSTEM_NEEDS: dict[str, Callable[[], str | None]] = {
    "netns": _netns,
    "mpirun": _mpirun,
    "qemu": _program("qemu-system-x86_64", install="apt-get install qemu-system-x86; tools/softroce --prepare"),
    "chromium": _program("chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
                         install="apt-get install chromium"),
    "slurm": _slurm,
    "mountns": _mountns,
}


def _deb(package: str) -> str | None:
    if shutil.which("dpkg-query") is None:
        return f"no dpkg-query here to find the Debian package {package} (a Debian or Ubuntu machine has it)"
    status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    if status.returncode != 0 or not status.stdout.endswith(" installed"):
        return f"the Debian package {package} is not installed (apt-get install {package})"
    return None


def _shm(size: str) -> str | None:
    from bench.ground.sizes import format_size, parse_size

    need = parse_size(size)
    try:
        stat = os.statvfs("/dev/shm")
    except OSError as exc:
        return f"no /dev/shm here ({exc.strerror})"
    have = stat.f_blocks * stat.f_frsize
    if have < need:
        return (f"/dev/shm holds {format_size(have)}, below {size} (mount -o remount,size={size.rstrip('B')} "
                "/dev/shm)")
    return None


def _tool(name: str) -> str | None:
    return None if shutil.which(name) else f"no {name} on PATH"


#: the needs that take a parameter after a colon: ``deb:python3-torch``, ``shm:2GB``, ``tool:cc``
SYSTEM_PARAMETERS: dict[str, Callable[[str], str | None]] = {"deb": _deb, "shm": _shm, "tool": _tool}


@functools.cache
def system_missing(need: str) -> str | None:
    """None where ``need`` (an argument of the mark ``system``) is met here, else one line saying what is missing."""
    kind, colon, parameter = need.partition(":")
    if colon and kind in SYSTEM_PARAMETERS and parameter:
        return SYSTEM_PARAMETERS[kind](parameter)
    if not colon and need in SYSTEM_NEEDS:
        return SYSTEM_NEEDS[need]()
    raise ValueError(f"pytest.mark.system({need!r}): unknown need; known: {', '.join(SYSTEM_NEEDS)}, "
                     f"{', '.join(kind + ':...' for kind in SYSTEM_PARAMETERS)}")


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
