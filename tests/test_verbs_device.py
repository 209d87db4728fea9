"""The verbs fabric on a kernel RDMA device: what only a device shows (the simulated NIC of ``test_verbs.py`` cannot).

These cases carry the mark ``rdma``: they run in the Soft-RoCE guest (``tests/test_softroce.py``) or on a
machine with an RDMA NIC, and skip elsewhere. The device's own resource counts come from the kernel
(``rdma res show``, filtered to this process), not from the backend's bookkeeping.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from transports import fabric
from transports.fabric.rdma_devices import read_devices

from .conftest import fabric_marks

pytestmark = fabric_marks("verbs")


def open_pair(**options):
    return fabric.open_device("verbs", **options), fabric.open_device("verbs", **options)


def connect(a, b, lane: int = 0):
    return a.channel(b.address, lane, exchange=lambda request: b.accept(request, a.address))


def own_resources(kind: str) -> list[dict]:
    """This process's ``kind`` (qp, mr, cq, pd) objects as the kernel lists them (``rdma -j res show``)."""
    if shutil.which("rdma") is None:
        pytest.skip("the rdma tool (iproute2) is not installed")
    listed = subprocess.run(["rdma", "-j", "res", "show", kind], capture_output=True, text=True, check=True)
    return [entry for entry in json.loads(listed.stdout or "[]") if entry.get("pid") == os.getpid()]


def ours(*devices) -> set[int]:
    """The queue pair numbers of ``devices``' lanes."""
    return {lane.qp_num for device in devices for lanes in device._peers.values() for lane in lanes}


def counts() -> dict[str, int]:
    return {kind: len(own_resources(kind)) for kind in ("qp", "mr", "cq", "pd")}


def event_descriptors() -> int:
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[infinibandevent]"
        except OSError:
            continue
    return found


def test_queue_pairs_reach_rts_over_a_roce_v2_gid():
    a, b = open_pair(lanes_per_peer=2)
    try:
        connect(a, b).write_flagged(a.alloc(64).array, b.alloc(64).export(), timeout=30)
        queue_pairs = [qp for qp in own_resources("qp") if qp["type"] == "RC" and qp["lqpn"] in ours(a, b)]
        assert len(queue_pairs) == 4 and all(qp["state"] == "RTS" for qp in queue_pairs), queue_pairs
        # connected pairwise: each queue pair's remote is another of ours
        numbers = {qp["lqpn"]: qp["rqpn"] for qp in queue_pairs}
        assert all(numbers[remote] == local for local, remote in numbers.items())
        choice = a.choice
        port = next(p for d in read_devices() if d.name == choice.device for p in d.ports if p.number == choice.port)
        if port.ethernet:  # RoCE: the GID the queue pairs route by is a RoCE v2 one
            gid = next(g for g in port.gids if g.index == choice.gid_index)
            assert gid.type == "RoCE v2", gid
            attr, _ = connect(a, b).qp.query(a._pv.enums.IBV_QP_STATE | a._pv.enums.IBV_QP_AV)
            assert attr.ah_attr.is_global and attr.ah_attr.sgid_index == choice.gid_index
    finally:
        a.close()
        b.close()


def test_close_leaves_no_queue_pair_region_completion_queue_or_protection_domain():
    before, events = counts(), event_descriptors()
    a, b = open_pair(progress_threads=2, lanes_per_peer=2)
    source, target = a.alloc(1 << 16), b.alloc(1 << 16)
    kept = np.ones(4096)
    b.register(kept)
    connect(a, b).write_flagged(source.array, target.export(), timeout=30)
    during = counts()
    assert during["qp"] == before["qp"] + 4 and during["pd"] == before["pd"] + 2
    assert during["cq"] == before["cq"] + 4 and during["mr"] > before["mr"]
    assert event_descriptors() == events + 4  # a completion channel per progress thread, its descriptor found
    assert all(poller.event_fd is not None for poller in a._pollers)
    a.close()
    b.close()
    assert counts() == before
    assert event_descriptors() == events


def test_an_idle_progress_thread_sleeps_on_its_completion_channel():
    """With nothing in flight the progress thread waits for an event: it uses next to no CPU time."""
    a, b = open_pair()
    try:
        connect(a, b).write_flagged(a.alloc(64).array, b.alloc(64).export(), timeout=30)
        thread = next(t for t in threading.enumerate() if t.name == "verbs-progress-0")
        tid = thread.native_id

        def cpu_ticks() -> int:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime

        first = cpu_ticks()
        threading.Event().wait(2.0)
        assert cpu_ticks() - first <= 10  # at most 0.1 s of CPU in 2 s (a polling thread takes most of it)
    finally:
        a.close()
        b.close()


def test_two_transports_connecting_to_each_other_at_once_keep_one_connection():
    """Two transports whose first sends cross: each side's device connects to the other at the same moment;
    one connection stands (two queue pairs in all, one lane each) and tensors go both ways."""
    from transports import Cluster, Key
    from transports import create as create_transport

    before = len([qp for qp in own_resources("qp") if qp["type"] == "RC"])
    cluster = Cluster.on_loopback(2)
    pair = [create_transport("zerocopy", fabric="verbs", timeout_s=60) for _ in range(2)]
    for rank, transport in enumerate(pair):
        transport.start(cluster, rank)
    try:
        barrier = threading.Barrier(2)
        results = {}

        def exchange(rank):
            barrier.wait()
            sent = pair[rank].send_async(Key("x", 0, rank, 1 - rank), np.full(1000, rank, np.float32))
            results[rank] = pair[rank].recv(Key("x", 0, 1 - rank, rank))
            sent.result(timeout=60)

        threads = [threading.Thread(target=exchange, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert (results[0] == 1).all() and (results[1] == 0).all()
        assert len([qp for qp in own_resources("qp") if qp["type"] == "RC"]) == before + 2
    finally:
        for transport in pair:
            transport.close()
