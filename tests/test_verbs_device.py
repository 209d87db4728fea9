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
import sys
import textwrap
import threading
from pathlib import Path

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
    listed = subprocess.run(["rdma", "-j", "-d", "res", "show", kind], capture_output=True, text=True, check=True)
    return [entry for entry in json.loads(listed.stdout or "[]") if entry.get("pid") == os.getpid()]


def ours(*devices) -> set[int]:
    """The queue pair numbers of ``devices``' lanes."""
    return {lane.qp_num for device in devices for lanes in device._peers.values() for lane in lanes}


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


#: a process's RDMA objects: those the kernel lists (``rdma res``, by their ids) that were not there when the
#: process started. The kernel names the creating thread, not the process, so objects are told apart by id;
#: the test process waits for this one meanwhile and makes none. Also its completion-channel descriptors.
_COUNTING = """
import json, os, subprocess
IDS = {"qp": "lqpn", "mr": "mrn", "cq": "cqn", "pd": "pdn"}
def listed():
    found = {}
    for kind, key in IDS.items():
        shown = subprocess.run(["rdma", "-j", "res", "show", kind], capture_output=True, text=True, check=True)
        found[kind] = {entry[key] for entry in json.loads(shown.stdout or "[]") if key in entry}
    return found
START = listed()
def counts():
    now = listed()
    found = {kind: len(now[kind] - START[kind]) for kind in IDS}
    found["events"] = sum(1 for fd in os.listdir("/proc/self/fd")
                          if os.path.exists(f"/proc/self/fd/{fd}")
                          and os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[infinibandevent]")
    return found
"""


def run_isolated(code: str) -> dict:
    """Run ``code`` (after :data:`_COUNTING`) in a fresh process, so that only its own objects are counted; it
    prints one JSON line last."""
    if shutil.which("rdma") is None:
        pytest.skip("the rdma tool (iproute2) is not installed")
    result = subprocess.run([sys.executable, "-c", _COUNTING + textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_close_leaves_no_queue_pair_region_completion_queue_or_protection_domain():
    seen = run_isolated("""
        import numpy as np
        from transports import fabric
        before = counts()
        a, b = (fabric.open_device("verbs", progress_threads=2, lanes_per_peer=2) for _ in range(2))
        source, target = a.alloc(1 << 16), b.alloc(1 << 16)
        kept = np.ones(4096)
        b.register(kept)
        a.channel(b.address, 0, exchange=lambda r: b.accept(r, a.address)).write_flagged(
            source.array, target.export(), timeout=60)
        during = counts()
        found = all(poller.event_fd is not None for device in (a, b) for poller in device._pollers)
        a.close()
        b.close()
        print(json.dumps({"before": before, "during": during, "after": counts(), "found": found}))
    """)
    before, during, after = seen["before"], seen["during"], seen["after"]
    assert during["qp"] == before["qp"] + 4 and during["pd"] == before["pd"] + 2, seen
    assert during["cq"] == before["cq"] + 4 and during["mr"] >= before["mr"] + 3, seen
    # a device's context has its async event descriptor, each progress thread a completion channel's
    assert during["events"] == before["events"] + 2 * (1 + 2) and seen["found"], seen
    assert after == before, seen


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
    seen = run_isolated("""
        import threading
        import numpy as np
        from transports import Cluster, Key, create
        before = counts()
        cluster = Cluster.on_loopback(2)
        pair = [create("zerocopy", fabric="verbs", timeout_s=120) for _ in range(2)]
        for rank, transport in enumerate(pair):
            transport.start(cluster, rank)
        barrier, results = threading.Barrier(2), {}

        def exchange(rank):
            barrier.wait()
            sent = pair[rank].send_async(Key("x", 0, rank, 1 - rank), np.full(1000, rank, np.float32))
            results[rank] = pair[rank].recv(Key("x", 0, 1 - rank, rank))
            sent.result(timeout=120)

        threads = [threading.Thread(target=exchange, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        ok = bool((results[0] == 1).all() and (results[1] == 0).all())
        during = counts()
        extra = sum(len(t.device._extra) for t in pair)
        for transport in pair:
            transport.close()
        print(json.dumps({"before": before, "during": during, "after": counts(), "ok": ok, "extra": extra}))
    """)
    assert seen["ok"], seen
    assert seen["during"]["qp"] == seen["before"]["qp"] + 2 and seen["extra"] == 0, seen  # one connection
    assert seen["after"] == seen["before"], seen
