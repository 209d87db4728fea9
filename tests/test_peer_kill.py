"""A peer killed with SIGKILL, for every transport on both UCX transports: named, bounded, nothing left behind.

The victim (``tests/peer_victim.py``) runs in its own process and is killed
during setup (started, no tensor yet), while the survivor polls (one tensor
went through, the survivor then waits for one that never comes), in the
middle of a stream of large transfers, and after contact but before the
survivor asks for anything more (gone: its port refuses by then), with the
survivor as sender and as receiver. The survivor must raise an error that names the victim within its
configurable ``timeout_s`` (a ``PeerError`` as soon as it has heard from the
victim; before that a dead peer cannot be told from a slow starter, so a
``TransportTimeout`` naming it is right). Afterwards nothing of the case is
left: the survivor holds no registration, shared segment or extra file
descriptor, the victim's shared memory is gone and no child process remains.
Only the resources of these two processes are counted, never system-wide totals.
"""

from __future__ import annotations

import gc
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

import transports
from transports import Cluster, Key, PeerError, TransportError, TransportTimeout

from .conftest import fabric_marks
from .processes import children_of, open_files

#: the survivor's timeout: the bound within which a dead peer must be named
TIMEOUT_S = 30.0
#: in phase setup the survivor may not have heard from the victim: it is named when this expires
SETUP_TIMEOUT_S = 2.0
#: how long the test waits for a stage of the victim (the machine may be busy)
STAGE_S = 120.0

FABRIC_OK = transports.availability("zerocopy").ok
VARIANTS = [pytest.param(("grpc_tcp", {}), id="grpc_tcp")] + [
    pytest.param((name, options), id=label,
                 marks=pytest.mark.skipif(not FABRIC_OK, reason="the fabric (UCX) is not available here"))
    for name, options, label in [
        ("grpc_rdma", {"mode": "buffered", "fabric_transport": "shm"}, "grpc_rdma-buffered-shm"),
        ("grpc_rdma", {"mode": "buffered", "fabric_transport": "tcp"}, "grpc_rdma-buffered-tcp"),
        ("grpc_rdma", {"mode": "direct", "fabric_transport": "shm"}, "grpc_rdma-direct-shm"),
        ("rdma_cp", {"fabric_transport": "shm"}, "rdma_cp-shm"),
        ("rdma_cp", {"fabric_transport": "tcp"}, "rdma_cp-tcp"),
        ("zerocopy", {"fabric_transport": "shm"}, "zerocopy-shm"),
        ("zerocopy", {"fabric_transport": "tcp"}, "zerocopy-tcp"),
    ]
] + [
    # on an RDMA device (the Soft-RoCE guest): a dead peer's queue pairs fail, and the survivor names it
    pytest.param((name, options), id=label, marks=fabric_marks(options.get("fabric", "ucx"),
                                                               options.get("fabric_transport", "auto")))
    for name, options, label in [  # one: under emulation each case starts a process in seconds
        ("zerocopy", {"fabric": "verbs"}, "zerocopy-verbs"),
    ]
]
SENDER, RECEIVER = 0, 1  # ranks: the sender is rank 0, the receiver rank 1


class Victim:
    """The peer process; ``wait_for(stage)`` returns once it has printed that stage."""

    def __init__(self, setup: dict) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.peer_victim", json.dumps(setup)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def wait_for(self, stage: str) -> None:
        while True:
            try:
                line = self.lines.get(timeout=STAGE_S)
            except queue.Empty:
                pytest.fail(f"the victim never said {stage!r}: {self.output}")
            if line is None:
                pytest.fail(f"the victim ended before {stage!r} (exit {self.process.wait()}): {self.output}")
            self.output.append(line)
            if line == stage:
                return

    def shared_memory(self) -> set[str]:
        """The /dev/shm files the victim maps now (those it has not unlinked already)."""
        maps = Path(f"/proc/{self.process.pid}/maps").read_text().splitlines()
        return {line.split(None, 5)[5] for line in maps
                if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].startswith("/dev/shm/")
                and not line.endswith("(deleted)")}

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=STAGE_S)
        self.reader.join(timeout=STAGE_S)
        self.process.stdout.close()


def own_shared_mappings() -> int:
    """SysV segments and /dev/shm files this process has mapped."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return sum(1 for line in maps if "SYSV" in line or "/dev/shm/" in line)


def sysv_segments_created_by(pid: int) -> list[str]:
    table = Path("/proc/sysvipc/shm")
    if not table.exists():
        return []
    rows = [line.split() for line in table.read_text().splitlines()[1:]]
    return [" ".join(row) for row in rows if len(row) > 4 and row[4] == str(pid)]


def exchange(transport: transports.Transport, name: str, step: int, sending: bool, nbytes: int = 64):
    src, dst = SENDER, RECEIVER
    if sending:
        return transport.send(Key(name, step, src, dst), np.ones(nbytes, dtype=np.uint8))
    return transport.recv(Key(name, step, src, dst))


@pytest.fixture(scope="module", autouse=True)
def warm_up():
    """Let gRPC and UCX make their process-wide threads and descriptors once, before anything is counted.

    gRPC tears its process-wide state (pollers: an epoll and an eventfd each) down on a thread of its
    own when its last channel or server closes, and makes it again with the next: one idle channel
    held for the module keeps that state in place, so a case counts only what it made itself.
    """
    keeper = grpc.insecure_channel("127.0.0.1:9")  # never connected: it holds gRPC's state, nothing else
    names = ["grpc_tcp"] + (["zerocopy"] if FABRIC_OK else [])
    for name in names:
        for fabric in (["shm", "tcp"] if name == "zerocopy" else [None]):
            options = {"fabric_transport": fabric} if fabric else {}
            cluster = Cluster.on_loopback(2)
            pair = [transports.create(name, timeout_s=TIMEOUT_S, **options) for _ in range(2)]
            for rank, transport in enumerate(pair):
                transport.start(cluster, rank)
            sending = pair[0].send_async(Key("w", 0, 0, 1), np.ones(8))
            pair[1].recv(Key("w", 0, 0, 1))
            sending.result(timeout=TIMEOUT_S)
            for transport in pair:
                transport.close()
    # and the first call to a peer that is not there (gRPC starts its reconnection machinery then)
    lonely = transports.create("grpc_tcp", timeout_s=1)
    lonely.start(Cluster.on_loopback(2), 1)
    with pytest.raises(TransportTimeout):
        lonely.recv(Key("w", 0, 0, 1))
    lonely.close()
    yield
    keeper.close()


#: the variants that also run phase gone: grpc_tcp's own liveness, and the fabric transports' (shared by them all)
#: over both UCX transports
GONE_VARIANTS = {"grpc_tcp", "zerocopy-shm", "zerocopy-tcp"}
CASES = [pytest.param(variant.values[0], phase, id=f"{variant.id}-{phase}", marks=variant.marks)
         for variant in VARIANTS for phase in ("setup", "poll", "transfer", "gone")
         if phase != "gone" or variant.id in GONE_VARIANTS]


@pytest.mark.parametrize("survivor_sends", [True, False], ids=["survivor-sends", "survivor-receives"])
@pytest.mark.parametrize(("variant", "phase"), CASES)
def test_a_killed_peer_is_named_in_bounded_time_and_nothing_is_left(variant, survivor_sends, phase):
    name, options = variant
    timeout_s = SETUP_TIMEOUT_S if phase == "setup" else TIMEOUT_S
    survivor_rank, victim_rank = (SENDER, RECEIVER) if survivor_sends else (RECEIVER, SENDER)
    files_before, shared_before, children_before = open_files(), own_shared_mappings(), children_of(os.getpid())
    cluster = Cluster.on_loopback(2)
    victim = Victim({"addresses": list(cluster.addresses), "token": cluster.token, "transport": name,
                     "options": options, "rank": victim_rank, "role": "receiver" if survivor_sends else "sender",
                     "phase": phase, "timeout_s": TIMEOUT_S})
    survivor = transports.create(name, timeout_s=timeout_s, **options)
    pool = ThreadPoolExecutor(1)
    try:
        survivor.start(cluster, survivor_rank)
        peer = survivor.peer_name(victim_rank)
        victim.wait_for("started")
        if phase != "setup":
            exchange(survivor, "contact", 0, survivor_sends)
            victim.wait_for("contact")
        moved = threading.Semaphore(0)
        victim_memory, victim_pid = victim.shared_memory(), victim.process.pid
        if phase == "gone":  # dead before the survivor asks: its port refuses, the next call must not wait it out
            victim.kill()

        def survive() -> None:
            if phase == "transfer":  # the stream the victim is in the middle of, until it fails
                for step in range(1 << 30):
                    exchange(survivor, "stream", step, survivor_sends, nbytes=32 << 20)
                    moved.release()
            exchange(survivor, "never" if phase in ("poll", "gone") else "contact", 0, survivor_sends)

        outcome: Future = pool.submit(survive)
        if phase == "transfer":
            assert moved.acquire(timeout=STAGE_S), "no tensor of the stream went through"
        elif phase != "gone":
            threading.Event().wait(0.5)  # the survivor is now waiting on the victim
        if phase != "gone":
            victim_memory = victim.shared_memory()
            victim.kill()

        with pytest.raises(TransportError) as failure:
            outcome.result(timeout=timeout_s + STAGE_S)  # no hang: the bound is the survivor's timeout
        message = str(failure.value)
        assert peer in message, message
        if phase == "setup":
            assert isinstance(failure.value, PeerError | TransportTimeout), message
        else:  # it had heard from the victim: its death is detected, not waited out
            assert isinstance(failure.value, PeerError), message
        if phase == "gone":  # dead before the call: no call waited for it until its deadline
            assert "DEADLINE_EXCEEDED" not in message and "did not complete within" not in message, message
    finally:
        if victim.process.poll() is None:
            victim.kill()
        survivor.close()
        pool.shutdown(wait=True)

    if survivor.uses_fabric:
        assert survivor.device.registrations() == 0
    # the failed call's error holds gRPC's call object (and its socket) until it is dropped
    del failure, outcome
    gc.collect()
    assert own_shared_mappings() <= shared_before
    files_after = open_files()  # one look: what the message shows is what was counted
    assert len(files_after) <= len(files_before), sorted(set(files_after.items()) - set(files_before.items()))
    assert sysv_segments_created_by(victim_pid) == []
    assert [path for path in victim_memory if Path(path).exists()] == []
    assert children_of(os.getpid()) == children_before
