"""Registered tensor memory is the owning user's alone: another user of the same group reaches none of it.

A holder process (this module run as ``python -m tests.test_memory_permissions``) starts a pair of
one transport over UCX shared memory, sends float tensors of a known pattern (static: preallocated
with ``allocate``; dynamic: not planned) and keeps both sides open with the tensors registered.
Meanwhile an intruder forked from this (root) process takes another uid (:data:`INTRUDER_UID`,
unused) with the holder's group as its only group and tries every way into the holder's shared
memory: ``shmat`` of each SysV segment the holder created (``/proc/sysvipc/shm``, creator pid),
read-only and read-write; ``open`` of each ``/dev/shm`` file it maps that still has a name, of each
of its descriptors of a shared-memory file (``/proc/PID/fd/N``, the way UCX's posix transport hands
a segment to a peer) and of each shared mapping's ``/proc/PID/map_files`` entry. Every attempt must
fail. UCX's sysv transport made its segments mode 0660, so before the fix the intruder attached all
of them and read the tensors; the fabric leaves sysv out (``transports/fabric/ucx/device.py``).

Both UCX builds in use are checked: the libucx-cu12 wheel and, where its binding is built, the UCX
of ``$TENSOR_BENCH_UCX_HOME`` (Debian's: ``/usr``). Only the holder's own resources are looked at.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

#: a uid no account has: the other local user
INTRUDER_UID = 64123
#: the tensors' float32 value; the intruder looks for a run of it in what it reaches
PATTERN = 1234.5678
NEEDLE = np.full(16, PATTERN, dtype=np.float32).tobytes()
#: (transport, options) the holder runs: each creates UCX shared memory (the pool, the worker's FIFO)
VARIANTS = [
    pytest.param(("zerocopy", {"fabric_transport": "shm"}), id="zerocopy-shm"),
    pytest.param(("zerocopy", {"fabric_transport": "auto"}), id="zerocopy-auto"),
    pytest.param(("grpc_rdma", {"mode": "buffered", "fabric_transport": "shm"}), id="grpc_rdma-buffered-shm"),
    pytest.param(("grpc_rdma", {"mode": "direct", "fabric_transport": "shm"}), id="grpc_rdma-direct-shm"),
    pytest.param(("rdma_cp", {"fabric_transport": "shm"}), id="rdma_cp-shm"),
]
UCX_HOME_VARIABLE = "TENSOR_BENCH_UCX_HOME"
SYSTEM_UCX = os.environ.get(UCX_HOME_VARIABLE) or "/usr"
BUILDS = [pytest.param(None, id="wheel"), pytest.param(SYSTEM_UCX, id="system-ucx")]
STAGE_S = 120.0

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the intruder is a forked process that takes another uid in the same group")


def holder_environment(ucx_home: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop(UCX_HOME_VARIABLE, None)
    env.pop("UCX_TLS", None)  # the fabric's own choice of transports is what is tested
    if ucx_home:
        env[UCX_HOME_VARIABLE] = ucx_home
    return env


@functools.cache
def fabric_problem(ucx_home: str | None) -> str | None:
    """None when the UCX binding for ``ucx_home`` (None: the wheel) loads, else why not."""
    probe = subprocess.run(
        [sys.executable, "-c", "from transports.fabric.ucx.device import load; load()"],
        env=holder_environment(ucx_home), capture_output=True, text=True, timeout=STAGE_S)
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or ["the UCX binding does not load"])[-1]


def segments_created_by(pid: int, since: float) -> list[dict[str, str]]:
    """The SysV shared-memory segments ``pid`` created (changed ``since``: not an earlier process's with the
    same pid that some other process still keeps attached): shmid, perms (octal), size, uid, gid."""
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()
    header = lines[0].split()
    rows = [dict(zip(header, line.split(), strict=False)) for line in lines[1:]]
    return [row for row in rows if row.get("cpid") == str(pid) and int(row.get("ctime", 0)) >= int(since)]


def shared_files_of(pid: int) -> dict[str, list[str]]:
    """Ways to ``pid``'s shared-memory files: paths under /dev/shm that still exist, its descriptors of
    /dev/shm or memfd files (/proc/PID/fd/N) and its shared file mappings (/proc/PID/map_files/RANGE)."""
    names, descriptors, mappings = set(), [], []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) > 5 else ""
        if path.startswith(("/dev/shm/", "/memfd:")) or path.startswith("/SYSV"):
            mappings.append(f"/proc/{pid}/map_files/{fields[0]}")
        if path.startswith("/dev/shm/") and not path.endswith("(deleted)") and Path(path).exists():
            names.add(path)
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith(("/dev/shm/", "/memfd:")):
            descriptors.append(str(entry))
    return {"names": sorted(names), "descriptors": descriptors, "mappings": mappings}


def intrude(gid: int, segments: dict[int, int], paths: list[str]) -> list[str]:
    """From a forked child running as :data:`INTRUDER_UID` in group ``gid`` only: what of ``segments``
    (shmid -> size) and ``paths`` it could attach or open (and whether it saw the tensors' data there)."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the intruder: only system calls from here to _exit
        reached = []
        try:
            os.close(reader)
            os.setgroups([gid])
            os.setgid(gid)
            os.setuid(INTRUDER_UID)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.shmat.restype = ctypes.c_void_p
            libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
            libc.shmdt.argtypes = [ctypes.c_void_p]
            shm_rdonly = 0o10000
            for shmid, size in segments.items():
                for flags, how in ((shm_rdonly, "read-only"), (0, "read-write")):
                    address = libc.shmat(shmid, None, flags)
                    if address in (None, ctypes.c_void_p(-1).value):
                        continue
                    seen = NEEDLE in ctypes.string_at(address, size)
                    reached.append(f"shmat({shmid}) {how}: {size} bytes" + (", the tensor's floats" if seen else ""))
                    libc.shmdt(address)
            for path in paths:
                try:
                    with open(path, "rb") as opened:
                        data = opened.read(64 << 20)
                except OSError:
                    continue
                reached.append(f"open({path}): {len(data)} bytes" + (", the tensor's floats" if NEEDLE in data
                                                                         else ""))
            os.write(writer, json.dumps(reached).encode())
        except BaseException as exc:  # reported to the parent: nothing may unwind out of the fork
            os.write(writer, json.dumps([f"the intruder failed: {exc!r}"]).encode())
        finally:
            os._exit(0)
    os.close(writer)
    chunks = []
    while chunk := os.read(reader, 1 << 16):
        chunks.append(chunk)
    os.close(reader)
    os.waitpid(child, 0)
    return json.loads(b"".join(chunks) or b"[]")


class Holder:
    """The holder process: ``ready`` once its tensors went through and stay registered; ``finish()`` ends it."""

    def __init__(self, name: str, options: dict, ucx_home: str | None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.test_memory_permissions", json.dumps({"name": name, "options": options})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=holder_environment(ucx_home))
        line = self.process.stdout.readline()
        if not line:
            _, errors = self.process.communicate(timeout=STAGE_S)
            pytest.fail(f"the holder ended before its tensors were registered: {errors[-2000:]}")
        self.state = json.loads(line)

    def finish(self) -> str:
        """End the holder; what it wrote to stderr."""
        _, errors = self.process.communicate("done\n" if self.process.poll() is None else None, timeout=STAGE_S)
        return errors


@needs_root
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("ucx_home", BUILDS)
def test_another_user_of_the_group_reaches_no_registered_memory(variant, ucx_home):
    if (problem := fabric_problem(ucx_home)) is not None:
        pytest.skip(f"the UCX fabric ({ucx_home or 'libucx-cu12'}) is not available here: {problem}")
    name, options = variant
    started = time.time()
    holder = Holder(name, options, ucx_home)
    try:
        pid = holder.process.pid
        segments = segments_created_by(pid, started)
        files = shared_files_of(pid)
        gid = os.stat(f"/proc/{pid}").st_gid
        assert segments or files["descriptors"] or files["mappings"], "the run made no shared memory to check"
        reached = intrude(gid, {int(row["shmid"]): int(row["size"]) for row in segments},
                          files["names"] + files["descriptors"] + files["mappings"])
    finally:
        errors = holder.finish()
    described = [f"shmid {row['shmid']} perms {row['perms']} uid {row['uid']} gid {row['gid']} size {row['size']}"
                 for row in segments]
    assert reached == [], (f"uid {INTRUDER_UID} in group {gid} reached the holder's memory ({holder.state['used']}): "
                           f"{reached}; its SysV segments: {described}")
    # the holder's segments (if any) are the owner's alone, and what it used is reported
    assert all(int(row["perms"], 8) & 0o077 == 0 for row in segments), described
    assert "sysv" not in holder.state["used"]
    assert not re.search(r"UCX\s+WARN", errors), errors  # the transports the fabric names are all there


@pytest.mark.parametrize(("requested", "given"), [
    ("", "^sysv,tcp"), ("all", "^sysv,tcp"),  # auto: every transport but sysv and tcp
    ("shm", "posix,cma"), ("sm,tcp", "posix,cma"), ("mm", "posix"),  # aliases spelt out: what this UCX offers
    ("posix,sysv,tcp", "posix"), ("self", "self"), ("rc", "rc"),
    ("^tcp", "^tcp,sysv"), ("^sysv", "^sysv,tcp"), ("^shm", "^shm,tcp"),
])
def test_the_fabric_never_asks_ucx_for_sysv_or_tcp(requested, given):
    from transports.fabric.ucx.device import owner_only_tls

    assert owner_only_tls(requested, offers=lambda name: name in ("posix", "cma")) == given


def test_asking_for_sysv_alone_is_an_error_that_says_what_to_use():
    from transports.fabric.base import FabricError
    from transports.fabric.ucx.device import owner_only_tls

    with pytest.raises(FabricError, match=r"UCX_TLS=sysv leaves no transport.*UCX_TLS=posix,cma"):
        owner_only_tls("sysv", offers=lambda name: True)
    with pytest.raises(FabricError, match=r"UCX_TLS=tcp leaves no transport.*--fabric-transport tcp"):
        owner_only_tls("tcp", offers=lambda name: True)


def hold(name: str, options: dict) -> None:
    """The holder: a pair over UCX, tensors of PATTERN sent static and dynamic, kept until stdin says done."""
    import transports
    from transports import Cluster, Key, TensorSpec

    cluster = Cluster.on_loopback(2)
    pair = [transports.create(name, timeout_s=60, **options) for _ in range(2)]
    for rank, transport in enumerate(pair):
        transport.start(cluster, rank)
    # small tensors live in the pool's shared tier (UCX-allocated shared memory), large ones in its local tier
    static = [TensorSpec("small", (1 << 14,), np.float32, 0, 1), TensorSpec("large", (1 << 20,), np.float32, 0, 1)]
    for transport in pair:
        transport.placement.plan(static)
    sent = {}
    for spec in static:
        sent[spec.name] = pair[0].placement.allocate(spec)
        sent[spec.name][:] = PATTERN
    sent["dynamic"] = np.full(1 << 14, PATTERN, dtype=np.float32)  # not planned: sent dynamically
    kept = []
    for label, tensor in sent.items():
        key = Key(label, 0, 0, 1)
        sending = pair[0].send_async(key, tensor)
        kept.append(pair[1].recv(key))
        sending.result(timeout=60)
    assert all((received == PATTERN).all() for received in kept)
    used = sorted({carrier for transport in pair for carrier in transport.describe().get("used", [])})
    print(json.dumps({"used": used}), flush=True)
    sys.stdin.readline()
    for transport in pair:
        transport.close()


if __name__ == "__main__":
    setup = json.loads(sys.argv[1])
    hold(setup["name"], setup["options"])
