"""The Soft-RoCE test bed (``tools/softroce``) and, in one guest boot per test session, every RDMA case of the suite.

The cases that need an RDMA device carry the mark ``rdma`` (``tests/conftest.py``); on a machine without
one they skip. Here a guest with a kernel RDMA device (``rdma_rxe`` on its NIC, ``rxe0``) runs them all with
``pytest -m rdma``, where a case that cannot run on the device fails instead of skipping; the count of cases
run goes into the session's summary. The guest boots once for this module (about 10 s under QEMU's
software emulation) and is stopped after it; where the test bed cannot run (no QEMU, no Debian packages:
``.ci/run`` installs them) these tests skip with the one line that says why. The guest has its own /tmp: a checkout,
a venv or a share there (CI's clone may be under /tmp) is shown in the guest at its path, which these tests check.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import SOFTROCE_SUMMARY

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "softroce"
#: the RDMA session's bound (CI's budget is 45 minutes in all; the session takes about 10 under emulation)
SESSION_TIMEOUT_S = 2700


def _load_tool():
    loader = importlib.machinery.SourceFileLoader("softroce", str(TOOL))
    spec = importlib.util.spec_from_loader("softroce", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


softroce = _load_tool()


#: the host's directories that the guest has its own of (tmpfs), where a checkout or a share may be on the host
SCRATCH = [scratch for scratch in ("/tmp", "/var/tmp", "/dev/shm") if os.access(scratch, os.W_OK)]


@pytest.fixture(scope="module")
def shares():
    """Host directories under /tmp that the module's guest has as --share (writable, at their paths): one directly
    under /tmp, one (``out``) in a directory of its own, which the guest shows around it like the rest of the host."""
    made = [Path(tempfile.mkdtemp(prefix="softroce-share-", dir="/tmp")) for _ in range(2)]
    (made[1] / "out").mkdir()
    (made[1] / "beside").write_text("beside the share\n")
    yield made[0], made[1] / "out"
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def guest(shares):
    """One booted guest for the module's tests; skipped with the reason where the test bed cannot run."""
    if os.environ.get("TENSOR_BENCH_REQUIRE_RDMA"):
        pytest.skip("already inside the RDMA session")
    try:
        softroce.prepare(install=False, say=lambda line: None)
    except softroce.Unavailable as exc:
        pytest.skip(f"the Soft-RoCE test bed cannot run here: {exc}")
    booted = softroce.Guest(install=False, say=lambda line: None, shares=[str(share) for share in shares])
    try:
        booted.start()
    except BaseException:
        booted.close()
        raise
    yield booted
    qemu = booted.qemu
    booted.close()
    assert qemu.poll() is not None  # QEMU is gone with the guest


def test_a_command_s_output_and_exit_code_come_back(guest):
    chunks: list[bytes] = []
    code = guest.run(["sh", "-c", "echo to-stdout; echo to-stderr >&2; cat /sys/class/infiniband/rxe0/ports/1/state;"
                      " pwd; exit 3"], timeout=300, output=chunks.append)
    text = b"".join(chunks).decode()
    assert code == 3
    assert "to-stdout" in text and "to-stderr" in text
    assert "ACTIVE" in text  # a kernel RDMA device, up
    assert str(Path.cwd()) in text  # the command ran where this process is


@pytest.mark.parametrize("scratch", SCRATCH)
def test_a_host_directory_where_the_guest_has_its_own_tmp_is_where_it_is(guest, scratch, monkeypatch):
    """A command run from a directory made under /tmp (or /var/tmp, /dev/shm) after the guest booted, as from a clone
    there, runs in it and reads the host's files there and those its arguments name; what it writes there stays in
    the guest, as elsewhere on the host's root."""
    with (tempfile.TemporaryDirectory(prefix="softroce-cwd-", dir=scratch) as made,
          tempfile.TemporaryDirectory(prefix="softroce-arg-", dir=scratch) as other):
        work = Path(made) / "clone" / "tests"
        work.mkdir(parents=True)
        (work / "marker").write_text("the host's file\n")
        argument = Path(other) / "argument"
        argument.write_text("the argument's file\n")
        monkeypatch.chdir(work)
        chunks: list[bytes] = []
        code = guest.run(["sh", "-c", 'pwd; cat marker "$1"; echo written > marker; cat marker', "sh", str(argument)],
                         timeout=300, output=chunks.append)
        lines = b"".join(chunks).decode(errors="replace").splitlines()
        assert (code, lines) == (0, [str(work), "the host's file", "the argument's file", "written"])
        assert (work / "marker").read_text() == "the host's file\n"  # the host's root is read-only to the guest


def test_shares_under_tmp_are_written_through_and_their_surroundings_seen(guest, shares):
    top, nested = shares
    chunks: list[bytes] = []
    code = guest.run(["sh", "-c", 'pwd; echo one > result; echo two > "$1/result"; cat "$1/../beside"', "sh",
                      str(nested)], timeout=300, cwd=str(top), output=chunks.append)
    assert (code, b"".join(chunks).decode(errors="replace").splitlines()) == (0, [str(top), "beside the share"])
    assert ((top / "result").read_text(), (nested / "result").read_text()) == ("one\n", "two\n")


def test_a_directory_the_guest_cannot_have_is_refused_before_the_command(guest):
    """A command in /proc (the guest has its own) is refused before it runs; the guest goes on to the next, whose
    argument in /proc is the guest's."""
    with pytest.raises(softroce.Hidden, match="/proc/self"):
        guest.run(["true"], timeout=300, cwd="/proc/self")
    chunks: list[bytes] = []
    assert guest.run(["cat", "/proc/sys/kernel/hostname"], timeout=300, output=chunks.append) == 0
    assert b"".join(chunks) == b"softroce\n"


def test_the_tool_says_in_one_line_which_directory_the_guest_cannot_have():
    """Run by hand in /proc, or with a --share under /sys, the tool exits 77 at once (no boot) with one line naming
    the directory; no test bed is needed for that."""
    for argv, cwd, named, own in ((["pwd"], "/proc", "/proc", "/proc"),
                                  (["--share", "/sys/kernel", "pwd"], "/", "/sys/kernel", "/sys")):
        started = time.monotonic()
        result = subprocess.run([sys.executable, str(TOOL), "--no-install", *argv], cwd=cwd, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == softroce.EXIT_UNAVAILABLE, result.stderr
        assert result.stderr.splitlines() == [f"softroce: cannot run here: {named} cannot be seen in the guest: it "
                                              f"has its own {own}"]
        assert time.monotonic() - started < 30  # said before booting


def test_the_time_running_out_stops_qemu_and_leaves_nothing(tmp_path):
    """The tool as a user runs it, with too short a time: it exits 124 and neither QEMU nor its files remain.

    The tool runs under a small parent that adopts orphans (a child subreaper), so a QEMU left behind would
    show up as that parent's child; the check counts only the processes of this test."""
    try:
        softroce.prepare(install=False, say=lambda line: None)
    except softroce.Unavailable as exc:
        pytest.skip(f"the Soft-RoCE test bed cannot run here: {exc}")
    reaper = textwrap.dedent(f"""
        import ctypes, json, os, subprocess, sys, time
        ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans come to this process
        code = subprocess.call([sys.executable, {str(TOOL)!r}, "--timeout", "3", "--no-install", "sleep", "600"],
                               env={{**os.environ, "TMPDIR": {str(tmp_path)!r}}})
        time.sleep(1)
        left = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    stat = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(stat[1]) == os.getpid():
                    left.append(open(f"/proc/{{pid}}/cmdline").read().replace("\\0", " "))
        print(json.dumps({{"code": code, "left": left}}))
    """)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", reaper], capture_output=True, text=True, timeout=120)
    outcome = __import__("json").loads(result.stdout.strip().splitlines()[-1])
    assert outcome["code"] == softroce.EXIT_TIMEOUT, result.stderr
    assert "did not finish" in result.stderr or "time ran out" in result.stderr
    assert outcome["left"] == []  # no QEMU adopted by the reaper: none outlived the tool
    assert list(tmp_path.iterdir()) == []  # the job directory went with it
    assert time.monotonic() - started < 60


def rdma_files() -> list[str]:
    """The test modules that hold rdma cases, collected here: under emulation the guest then imports only those
    (collecting every module there, TensorFlow's included, costs minutes)."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "rdma", "-p",
                             "no:cacheprovider", "tests"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                            env={**os.environ, "TENSOR_BENCH_REQUIRE_RDMA": "1"})
    files = sorted({line.split("::", 1)[0] for line in listed.stdout.splitlines() if "::" in line})
    assert files, f"no rdma cases collected:\n{listed.stdout[-2000:]}{listed.stderr[-2000:]}"
    return files


@pytest.mark.timeout(SESSION_TIMEOUT_S + 300)
def test_every_rdma_case_passes_on_the_guest_s_device(guest, request):
    """``pytest -m rdma`` in the guest: every case on an RDMA device (verbs, UCX over rc_verbs) runs and passes, but
    those marked ``long`` (minutes each under emulation: run them with ``tools/softroce .venv/bin/pytest -m rdma``)."""
    chunks: list[bytes] = []
    started = time.monotonic()
    env = {"TENSOR_BENCH_REQUIRE_RDMA": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    if not os.environ.get("TENSOR_BENCH_UCX_HOME"):
        env["TENSOR_BENCH_UCX_HOME"] = "/usr"  # Debian's UCX with verbs, for the ucx fabric's rdma cases
    code = guest.run([sys.executable, "-m", "pytest", "-q", "-m", "rdma and not long", "-p", "no:cacheprovider",
                      "-rfEs", *rdma_files()], timeout=SESSION_TIMEOUT_S, cwd=str(ROOT), env=env,
                     output=chunks.append)
    text = b"".join(chunks).decode(errors="replace")
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", text)}
    summary = (f"Soft-RoCE guest (rxe0): {counts.get('passed', 0)} RDMA cases passed, {counts.get('failed', 0)} "
               f"failed, {counts.get('error', 0) + counts.get('errors', 0)} errors, {counts.get('skipped', 0)} "
               f"skipped, in {time.monotonic() - started:.0f} s")
    request.config.stash[SOFTROCE_SUMMARY] = summary
    tail = "\n".join(text.splitlines()[-60:])
    assert code == 0, f"{summary}\n{tail}"
    assert counts.get("passed", 0) >= 300, f"{summary}: fewer RDMA cases than the suite has\n{tail}"
    # skips inside a case (a transport without the feature a case is about) are allowed; none for want of a device
    assert "no RDMA device" not in text and "rdma_missing" not in text, tail

