"""The Soft-RoCE guest's RDMA session, begun as soon as the run's tests are collected, beside the host's tests.

Under QEMU's software emulation the session (``pytest -m rdma`` in the guest, ``tests/test_softroce.py``) takes
as long as the host's whole suite; run after it, it doubled CI's time. ``tests/conftest.py`` begins it here when
the run includes its test: QEMU starts from the main thread (it dies with the thread that started it), the boot
and the session run on a thread of their own, and the Soft-RoCE tests run last, where
``test_every_rdma_case_passes_on_the_guest_s_device`` waits for the outcome and checks it. The guest stays up
for the module's other tests and is stopped with it (or at the session's end).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "softroce"
#: the RDMA session's bound (CI's budget is 45 minutes in all; the session takes about 15 under emulation)
SESSION_TIMEOUT_S = 2700
#: the test that checks the session's outcome (tests/test_softroce.py)
SESSION_TEST = "test_every_rdma_case_passes_on_the_guest_s_device"


def load_tool():
    """``tools/softroce`` as a module."""
    loader = importlib.machinery.SourceFileLoader("softroce", str(TOOL))
    spec = importlib.util.spec_from_loader("softroce", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


softroce = load_tool()


def make_shares() -> tuple[Path, Path, list[Path]]:
    """Host directories under /tmp that the guest gets as --share (writable, at their paths): one directly under
    /tmp, one (``out``) in a directory of its own, which the guest shows around it like the rest of the host; and
    what to remove afterwards."""
    made = [Path(tempfile.mkdtemp(prefix="softroce-share-", dir="/tmp")) for _ in range(2)]
    (made[1] / "out").mkdir()
    (made[1] / "beside").write_text("beside the share\n")
    return made[0], made[1] / "out", made


def rdma_files() -> list[str]:
    """The test modules that hold rdma cases, collected here: under emulation the guest then imports only those
    (collecting every module there, TensorFlow's included, costs minutes)."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "rdma", "-p",
                             "no:cacheprovider", "tests"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                            env={**os.environ, "TENSOR_BENCH_REQUIRE_RDMA": "1"})
    files = sorted({line.split("::", 1)[0] for line in listed.stdout.splitlines() if "::" in line})
    if not files:
        raise RuntimeError(f"no rdma cases collected:\n{listed.stdout[-2000:]}{listed.stderr[-2000:]}")
    return files


def run_session(guest, files: list[str] | None = None) -> tuple[int, str, float]:
    """``pytest -m rdma`` over ``files`` in ``guest`` (none given: :func:`rdma_files`): (exit code, output,
    seconds)."""
    chunks: list[bytes] = []
    started = time.monotonic()
    env = {"TENSOR_BENCH_REQUIRE_RDMA": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    if not os.environ.get("TENSOR_BENCH_UCX_HOME"):
        env["TENSOR_BENCH_UCX_HOME"] = "/usr"  # Debian's UCX with verbs, for the ucx fabric's rdma cases
    code = guest.run([sys.executable, "-m", "pytest", "-q", "-m", "rdma and not long", "-p", "no:cacheprovider",
                      "-rfEs", *(files or rdma_files())], timeout=SESSION_TIMEOUT_S, cwd=str(ROOT), env=env,
                     output=chunks.append)
    return code, b"".join(chunks).decode(errors="replace"), time.monotonic() - started


@dataclass
class Outcome:
    """What the session came to: the exit code, its output and its time; or why it could not run (``skip``: the
    test bed cannot run here) or what broke (``error``)."""

    code: int = -1
    text: str = ""
    seconds: float = 0.0
    skip: str | None = None
    error: BaseException | None = None


class EarlySession:
    """The guest booted and the RDMA session run beside the host's tests (see the module docstring)."""

    def __init__(self, files: list[str] | None = None) -> None:
        #: the test modules of the run's own collection that hold rdma cases (none: every module that does)
        self.files = files
        self.top, self.nested, self._made = make_shares()
        self.guest = None
        self.outcome = Outcome()
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        """Start QEMU here (the caller's thread must outlive the guest: the main thread), the rest on a thread."""
        try:
            softroce.prepare(install=False, say=lambda line: None)
            self.guest = softroce.Guest(install=False, say=lambda line: None,
                                        shares=[str(self.top), str(self.nested)])
            self.guest.launch()
        except softroce.Unavailable as exc:
            self.outcome.skip = f"the Soft-RoCE test bed cannot run here: {exc}"
            self.done.set()
            return
        except BaseException as exc:  # the test reports it
            self.outcome.error = exc
            self.done.set()
            return
        self._thread = threading.Thread(target=self._run, name="softroce-session", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.guest.wait_ready()
            self.outcome.code, self.outcome.text, self.outcome.seconds = run_session(self.guest, self.files)
        except BaseException as exc:  # the test reports it
            self.outcome.error = exc
        finally:
            self.done.set()

    def wait(self, timeout: float) -> Outcome:
        """The outcome, once the session has ended (TimeoutError after ``timeout`` seconds)."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"the Soft-RoCE session did not end in {timeout:.0f} s")
        return self.outcome

    def close(self) -> None:
        """Stop the guest (the session's thread ends with it) and remove the shares."""
        if self.guest is not None:
            self.guest.close()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for path in self._made:
            shutil.rmtree(path, ignore_errors=True)
