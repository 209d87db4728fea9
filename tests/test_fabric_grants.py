"""Memory a peer can reach is what it was granted: an insider (a rank of the run) and an outsider.

Three ranks: rank 0 receives ``a`` from rank 1 and ``b`` from rank 2. Rank 1 runs in a process of its own
(what it can reach must not depend on sharing rank 0's address space) and turns what rank 0 granted it
against rank 2's tensor.

Over tcp the fabric is its own stream (``transports/fabric/stream.py``), not UCX's tcp transport, which cannot
be made to check: its target copies a PUT_REQ's payload to the address in the request
(``uct_tcp_ep_handle_put_req`` in UCX's src/uct/tcp/tcp_ep.c), whatever ``UCX_TCP_PUT_ENABLE`` says and
whatever UCP features the context has. The stream's target checks each access against the key it granted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import transports
from transports import Key, TensorSpec
from transports.base import Cluster
from transports.zerocopy.protocol import TRAILER, TRAILER_AT, TRAILER_STRIDE, slot_stride, tag

ROOT = Path(__file__).resolve().parent.parent
SPECS = [TensorSpec("a", (16,), "float64", 1, 0), TensorSpec("b", (16,), "float64", 2, 0)]

#: rank 1, in a process of its own: connects for 'a', sends its step 0, then writes 666.0 and a trailer for
#: step 1 at the addresses of b's second slot and trailer, with the remote key rank 0 gave it for 'a'
INSIDER = """
    import json, sys
    import numpy as np
    import transports
    from transports import Key, TensorSpec
    from transports.base import Cluster
    from transports.fabric.base import FabricError, RemoteRegion
    given = json.loads(sys.argv[1])
    cluster = Cluster(tuple(given["addresses"]), given["token"])
    rank1 = transports.create("zerocopy", timeout_s=30, fabric_transport=given["fabric"])
    rank1.start(cluster, 1)
    rank1.placement.plan([TensorSpec(*spec) for spec in given["specs"]])
    rank1.send(Key("a", 0, 1, 0), np.ones(16))
    outgoing = rank1._outgoing[("a", 0)]
    key = outgoing.slot_targets[0].rkey  # what rank 0 granted rank 1
    data = RemoteRegion(given["slot"], 128, key)
    flag = RemoteRegion(given["trailer"], 9, key)
    trailer = np.zeros(9, np.uint8)
    trailer[:8].view(np.int64)[0] = 1
    trailer[8] = given["tag"]
    try:
        outgoing.channel.write_flagged(np.full(16, 666.0).view(np.uint8), data, trailer, flag, timeout=10)
        print("written")
    except (FabricError, ValueError) as exc:
        print("refused:", exc)
    rank1.close()
"""


@pytest.mark.parametrize("fabric", ["shm", "tcp"])
def test_a_rank_cannot_write_another_ranks_slot_with_its_own_key(fabric):
    cluster = Cluster.on_loopback(3)
    rank0, rank2 = (transports.create("zerocopy", timeout_s=30, fabric_transport=fabric) for _ in range(2))
    child = None
    try:
        rank0.start(cluster, 0)
        rank2.start(cluster, 2)
        for rank in (rank0, rank2):
            rank.placement.plan(SPECS)
        sending = rank2.send_async(Key("b", 0, 2, 0), np.full(16, 2.0))
        assert rank0.recv(Key("b", 0, 2, 0)).tolist() == [2.0] * 16
        sending.result(timeout=60)
        incoming = rank0._incoming[("b", 2)]
        slot = incoming.data.remote(slot_stride(128), 128)
        flag = incoming.control.remote(TRAILER_AT + TRAILER_STRIDE, TRAILER)
        before = incoming.arrays[1].copy(), incoming.trailers[1].copy()
        given = {"addresses": list(cluster.addresses), "token": cluster.token, "fabric": fabric,
                 "specs": [[s.name, list(s.shape), str(s.dtype), s.src, s.dst] for s in SPECS],
                 "slot": slot.addr, "trailer": flag.addr, "tag": tag(1)}
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(INSIDER), json.dumps(given)], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert rank0.recv(Key("a", 0, 1, 0), timeout=60).tolist() == [1.0] * 16
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-3000:]
        assert "refused:" in out, out
        # rank 0's memory for b is as it was, and b's step 1 (never sent by rank 2) does not arrive
        assert incoming.arrays[1].tobytes() == before[0].tobytes()
        assert incoming.trailers[1].tobytes() == before[1].tobytes()
        with pytest.raises(transports.TransportError):
            rank0.recv(Key("b", 1, 2, 0), timeout=2)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        for rank in (rank0, rank2):
            rank.close()


#: a process outside the run: its own UCX worker over tcp, told the rank's worker address (the worst case: a raw
#: client of UCX's tcp framing needs only the listener's address and port, which /proc/net/tcp shows every local
#: user), writes 64 bytes at an address of the rank's that was never registered, with a key of its own making
OUTSIDER = """
    import sys
    import numpy as np
    from transports.fabric.base import FabricError, RemoteRegion
    from transports.fabric.ucx.device import UcxDevice
    address, victim = bytes.fromhex(sys.argv[1]), int(sys.argv[2])
    device = UcxDevice("tcp")
    key = device.alloc(64).export().rkey
    try:
        device.channel([address]).write_flagged(np.full(64, 0x5A, np.uint8), RemoteRegion(victim, 64, key), timeout=10)
        print("written")
    except FabricError as exc:
        print("refused:", exc)
    device.close()
"""


def test_a_process_outside_the_run_cannot_write_a_ranks_memory_over_tcp():
    from transports.fabric.ucx.device import UcxDevice

    device = UcxDevice("tcp")
    victim = np.zeros(64, np.uint8)  # never registered, never exported
    try:
        child = subprocess.run([sys.executable, "-c", textwrap.dedent(OUTSIDER), device.address[0].hex(),
                                str(victim.ctypes.data)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr[-3000:]
        assert not victim.any(), f"an outsider wrote {victim.tobytes()[:8].hex()}... into unregistered memory"
        assert "refused:" in child.stdout, child.stdout
    finally:
        device.close()
