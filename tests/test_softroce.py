"""The Soft-RoCE test bed (``tools/softroce``) and, in one guest boot per test session, every RDMA case of the suite.

The cases that need an RDMA device carry the mark ``rdma`` (``tests/conftest.py``); on a machine without one they
skip. Here a guest with a kernel RDMA device (``rdma_rxe`` on its NIC, ``rxe0``) runs them all with ``pytest -m
rdma``, where a case that cannot run on the device fails instead of skipping; the count of cases run goes into the
session's summary. The guest boots once (about 10 s under QEMU's software emulation), as soon as the run's tests are
collected, and the session runs beside the host's tests (``tests/softroce_session.py``); this module's tests run
last and use that guest, which is stopped after them. Where the test bed cannot run (no QEMU, no Debian packages:
``.ci/run`` installs them) these tests skip with the one line that says why. The guest has its own /tmp: a checkout,
a venv or a share there (CI's clone may be under /tmp) is shown in the guest at its path, which these tests check.
"""

from __future__ import annotations

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

from .conftest import EARLY_SESSION, SOFTROCE_SUMMARY
from .softroce_session import SESSION_TIMEOUT_S, TOOL, make_shares, run_session, softroce

#: the host's directories that the guest has its own of (tmpfs), where a checkout or a share may be on the host
SCRATCH = [scratch for scratch in ("/tmp", "/var/tmp", "/dev/shm") if os.access(scratch, os.W_OK)]


@pytest.fixture(scope="module")
def early(request):
    """The session begun beside the host's tests (``tests/softroce_session.py``), or None where it was not."""
    return request.config.stash.get(EARLY_SESSION, None)


@pytest.fixture(scope="module")
def shares(early):
    """Host directories under /tmp that the module's guest has as --share (writable, at their paths): one directly
    under /tmp, one (``out``) in a directory of its own, which the guest shows around it like the rest of the host."""
    if early is not None:
        yield early.top, early.nested
        return
    top, nested, made = make_shares()
    yield top, nested
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def guest(shares, early):
    """One booted guest for the module's tests: the early session's once it has ended, else one of their own;
    skipped with the reason where the test bed cannot run."""
    if os.environ.get("TENSOR_BENCH_REQUIRE_RDMA"):
        pytest.skip("already inside the RDMA session")
    if early is not None:
        outcome = early.wait(SESSION_TIMEOUT_S + 600)
        if outcome.skip:
            pytest.skip(outcome.skip)
        if early.guest is not None and early.guest.qemu is not None and early.guest.qemu.poll() is None:
            qemu = early.guest.qemu
            yield early.guest
            early.close()
            assert qemu.poll() is not None  # QEMU is gone with the guest
            return
        # the session's guest is gone (its time ran out, or it broke): these tests boot one of their own
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


@pytest.mark.system("qemu")
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
@pytest.mark.system("qemu")
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


@pytest.mark.system("qemu")
def test_shares_under_tmp_are_written_through_and_their_surroundings_seen(guest, shares):
    top, nested = shares
    chunks: list[bytes] = []
    code = guest.run(["sh", "-c", 'pwd; echo one > result; echo two > "$1/result"; cat "$1/../beside"', "sh",
                      str(nested)], timeout=300, cwd=str(top), output=chunks.append)
    assert (code, b"".join(chunks).decode(errors="replace").splitlines()) == (0, [str(top), "beside the share"])
    assert ((top / "result").read_text(), (nested / "result").read_text()) == ("one\n", "two\n")


@pytest.mark.system("qemu")
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


@pytest.mark.system("qemu")
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


@pytest.mark.timeout(SESSION_TIMEOUT_S + 900)
@pytest.mark.system("qemu")
def test_every_rdma_case_passes_on_the_guest_s_device(early, request):
    """``pytest -m rdma`` in the guest: every case on an RDMA device (verbs, UCX over rc_verbs) runs and passes, but
    those marked ``long`` (minutes each under emulation: run them with ``tools/softroce .venv/bin/pytest -m rdma``).
    It ran beside the host's tests (``tests/softroce_session.py``); run alone, it runs here."""
    if os.environ.get("TENSOR_BENCH_REQUIRE_RDMA"):
        pytest.skip("already inside the RDMA session")
    if early is None:
        code, text, seconds = run_session(request.getfixturevalue("guest"))
    else:
        outcome = early.wait(SESSION_TIMEOUT_S + 600)
        if outcome.skip:
            pytest.skip(outcome.skip)
        if outcome.error is not None:
            raise outcome.error
        code, text, seconds = outcome.code, outcome.text, outcome.seconds
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", text)}
    summary = (f"Soft-RoCE guest (rxe0): {counts.get('passed', 0)} RDMA cases passed, {counts.get('failed', 0)} "
               f"failed, {counts.get('error', 0) + counts.get('errors', 0)} errors, {counts.get('skipped', 0)} "
               f"skipped, in {seconds:.0f} s")
    request.config.stash[SOFTROCE_SUMMARY] = summary
    tail = "\n".join(text.splitlines()[-60:])
    assert code == 0, f"{summary}\n{tail}"
    assert counts.get("passed", 0) >= 300, f"{summary}: fewer RDMA cases than the suite has\n{tail}"
    # skips inside a case (a transport without the feature a case is about) are allowed; none for want of a device
    assert "no RDMA device" not in text and "rdma_missing" not in text, tail

