"""Tensors over 1 GiB and over 2 GiB: zerocopy, rdma_cp and grpc_rdma (buffered) move them whole (every byte
checked); the size checks that bound what a peer may make a rank hold; verbs' work requests of at most
MAX_WR_BYTES each.

The large cases hold a few GB (sender, receiver's slot, staging buffers): each is skipped where the
memory available is short of what it needs.
"""

from __future__ import annotations

import io
import os
import time

import numpy as np
import pytest

from bench.experiments import micro
from transports import Inbound, Key, PeerError, TensorSpec, TransportStats
from transports.fabric.settings import RdmaSettings
from transports.fabric.verbs import channel as verbs_channel
from transports.fabric.verbs import device as verbs_device
from transports.fabric.verbs.device import VerbsDevice
from transports.zerocopy import transport as zerocopy
from transports.zerocopy.protocol import META, ConnectReply, Meta

from .conftest import start_pair
from .test_verbs import _connected, _FakeNic

GIB = 1 << 30
#: seconds a transfer of a few GB may take on a loaded machine
LARGE_TIMEOUT_S = 180.0


def available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# -- zerocopy, rdma_cp and grpc_rdma move tensors over 1 GiB and 2 GiB -------------------------------------------------


@pytest.mark.parametrize(("name", "nbytes", "copies", "lanes"), [
    ("rdma_cp", GIB + 4096 + 1, 3, 2),  # just over 1 GiB (odd: uint8), spread over two lanes, staged
    ("zerocopy", int(2.1 * GIB) | 1, 2, 1),  # over 2 GiB in one write, from allocate()'s registered memory
    # buffered (its default): the sender's tensor and staging buffer, the receiver's staging buffer and result
    ("grpc_rdma", int(1.1 * GIB) | 1, 4, 1),
])
def test_a_tensor_over_1_gib_arrives_whole(name, nbytes, copies, lanes):
    """Before, the sender refused the receiver's slot ("'shape' (...) exceeds 1073741824 bytes"). Two transfers
    into the same slot, each compared byte for byte with what was sent (bench micro's pattern, stamped per
    transfer, so a piece left over from the first transfer fails the second)."""
    needed = copies * nbytes + GIB
    if available_bytes() < needed:
        pytest.skip(f"needs {needed / GIB:.1f} GiB of memory available")
    point = micro.Point(nbytes, warmup=0, iters=2)
    assert point.dtype == np.uint8 and point.stamped
    spec = point.spec
    pair = start_pair(name, fabric_transport="shm", lanes_per_peer=lanes)
    try:
        for transport in pair:
            # GBs to fault in and copy on two shared cores: the tests' short timeout is for small tensors
            transport.timeout_s = LARGE_TIMEOUT_S
            transport.placement.plan([spec])
        tensor = pair[0].placement.allocate(spec)
        flat = tensor.reshape(-1)
        micro.fill(flat)
        for step in range(2):
            micro.prepare(flat, point, step)
            key = Key(spec.name, step, 0, 1)
            sending = pair[0].send_async(key, tensor)
            received = pair[1].recv(key)
            sending.result(timeout=LARGE_TIMEOUT_S)
            assert received.shape == spec.shape and received.dtype == spec.dtype
            assert micro.first_wrong(received.reshape(-1), point, step) is None
            del received
        assert pair[1].stats().payload_bytes_received == 2 * nbytes
        if name == "grpc_rdma":  # one staging buffer each side, used again for the second transfer
            assert all(transport.pool.held_bytes("local") < 2 * nbytes for transport in pair)
    finally:
        for transport in pair:
            transport.close()


# -- bench micro checks every byte of a large transfer -------------------------------------------------------------


class Signals:
    def send(self, value) -> None:
        pass


class Delivering:
    """Delivers what bench micro's sender writes for each transfer, after ``spoil(step, delivered, before)``
    (``before``: the sender's tensor as it was for the transfer before)."""

    def __init__(self, point, spoil) -> None:
        self.point, self.spoil = point, spoil
        self.flat = np.empty(point.spec.shape, point.dtype)
        micro.fill(self.flat)

    def recv(self, key):
        before = self.flat.copy()
        micro.prepare(self.flat, self.point, key.step)
        delivered = self.flat.copy()
        self.spoil(key.step, delivered, before)
        return delivered

    def inbound(self, name, src):
        return Inbound(self, name, src, micro.RECEIVER)

    def stats(self):
        return TransportStats()


def receive(point, spoil):
    sides = []
    micro.receiver_loop(Delivering(point, spoil), [point], Signals(),
                        lambda payload: sides.append(payload) if isinstance(payload, micro.Side) else None, True)
    return sides


@pytest.mark.parametrize("size", [1 << 20, (1 << 20) + 3])
def test_bench_micro_takes_what_the_sender_wrote(size):
    point = micro.Point(size, warmup=1, iters=4)
    (side,) = receive(point, lambda step, delivered, before: None)
    # transfer 0 checked (the warm-up), 1 after it untimed, 2 to 5 timed
    assert side.transfers == point.transfers == 6 and len(side.times) == 4


def test_a_large_point_checks_one_transfer_in_every_few_and_times_neither_it_nor_the_next():
    point = micro.Point(1 << 20, warmup=3, iters=20)
    every = micro.CHECK_EVERY
    checked = [i for i in range(point.transfers) if point.checked(i)]
    timed = [i for i in range(point.transfers) if point.timed(i)]
    assert checked == list(range(0, point.transfers, every))
    assert len(timed) == 20 and timed[0] == 3 and not set(timed) & {i + d for i in checked for d in (0, 1)}
    small, soak = micro.Point(4096, warmup=3, iters=20), micro.Point(1 << 20, warmup=3, iters=20, check=True)
    assert not any(small.checked(i) for i in range(small.transfers)) and small.transfers == 23
    assert all(soak.checked(i) for i in range(soak.transfers)) and soak.transfers == 23
    assert [i for i in range(23) if soak.timed(i)] == list(range(3, 23))


@pytest.mark.parametrize("size", [1 << 20, (1 << 20) + 3])
def test_bench_micro_finds_a_piece_left_over_from_the_transfer_before(size):
    """A 4 KiB piece of a checked transfer that did not land (the slot still holds the transfer before's): the
    marker and the reduce-max are right, the bytes are not."""
    point = micro.Point(size, warmup=1, iters=12)
    page = 4096 // point.dtype.itemsize
    checked = micro.CHECK_EVERY

    def stale(step, delivered, before):
        if step == checked:
            delivered[5 * page : 6 * page] = before[5 * page : 6 * page]

    with pytest.raises(RuntimeError, match=rf"transfer {checked} of .* arrived wrong: element {5 * page} of "):
        receive(point, stale)


def test_bench_micro_finds_a_piece_written_at_the_wrong_place():
    point = micro.Point(16 << 20, warmup=0, iters=2)  # 4 Mi float32: pieces of 1 MiB swapped

    def swapped(step, delivered, before):
        piece = (1 << 20) // 4
        delivered[piece : 2 * piece], delivered[2 * piece : 3 * piece] = (delivered[2 * piece : 3 * piece].copy(),
                                                                           delivered[piece : 2 * piece].copy())

    with pytest.raises(RuntimeError, match=rf"transfer 0 of 16MB arrived wrong: element {(1 << 20) // 4} of"):
        receive(point, swapped)


def test_bench_micro_fills_and_checks_in_chunks():
    """The sender's fill and the receiver's check go a chunk at a time: no tensor-sized temporary."""
    point = micro.Point(3 * micro.CHUNK * 4 + 4096, warmup=0, iters=1)
    flat = np.empty(point.spec.shape, point.dtype)
    micro.fill(flat)
    np.testing.assert_array_equal(flat, micro.content(point))
    micro.prepare(flat, point, 7)
    assert micro.first_wrong(flat, point, 7) is None
    assert micro.first_wrong(flat, point, 6) == 0  # another transfer's stamps
    flat[-2] = np.float32(-0.0) if flat[-2] == 0 else -flat[-2]  # one sign bit
    assert micro.first_wrong(flat, point, 7) == flat.size - 2


# -- the size checks --------------------------------------------------------------------------------------------


def static_reply(shape, dtype="|u1", length=None, addr=1 << 20):
    nbytes = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
    region = {"addr": addr, "length": nbytes if length is None else length, "rkey": "ab" * 8}
    return {"mode": "static", "control": {"addr": 4096, "length": zerocopy.CONTROL_BYTES, "rkey": "ab" * 8},
            "slot": region, "shape": list(shape), "dtype": dtype}


def test_a_static_slot_of_any_size_the_address_space_holds_is_taken():
    for shape, dtype in [((5 * GIB,), "|u1"), ((655_360_000,), "<f4"), ((1 << 20, 1 << 20, 4), "<f8")]:
        answer = ConnectReply.parse(static_reply(shape, dtype))
        assert answer.shape == shape and answer.slot.length == int(np.prod(shape, dtype=object)) * answer.dtype.itemsize


def test_a_static_slot_is_checked_without_overflow():
    # dimensions whose int64 product wraps to a small number: the check grows the product dimension by dimension
    wrapping = (1 << 33, 1 << 33, 1 << 2)
    assert int(np.prod(wrapping, dtype=np.int64)) == 0
    for shape in [wrapping, (2**62, 2**62), (2**63,), (1 << 40, 1 << 40, 0)]:
        reply = static_reply(shape, length=64)
        with pytest.raises(ValueError, match=r"shape|slot"):
            ConnectReply.parse(reply)
    with pytest.raises(ValueError, match="exceeds 1024 bytes"):
        ConnectReply.parse(static_reply((32, 64)), limit=1024)
    with pytest.raises(ValueError, match="does not hold"):  # the slot must hold exactly the shape
        ConnectReply.parse(static_reply((4096,), length=4095))


def test_the_dynamic_path_takes_at_most_1_gib_and_never_more_than_the_receiver_holds():
    record = np.zeros(1, META)
    record["ndim"], record["dtype"], record["rkey_len"], record["addr"] = 2, b"<f4", 8, 4096
    record["dims"][0, :2] = (1 << 16, 1 << 12)  # 1 GiB: the bound, taken
    record["nbytes"] = GIB
    assert Meta.parse(record.view(np.uint8)).nbytes == GIB
    record["dims"][0, :2] = (1 << 16, (1 << 12) + 1)
    record["nbytes"] = GIB + (1 << 18)
    with pytest.raises(ValueError, match="exceeds 1073741824 bytes"):
        Meta.parse(record.view(np.uint8))
    record["dims"][0, :2] = (1 << 40, 1 << 40)  # 2**82 elements: refused, not wrapped
    record["nbytes"] = 0
    with pytest.raises(ValueError, match="'shape'"):
        Meta.parse(record.view(np.uint8), limit=1 << 62)


def test_a_receiver_refuses_what_it_cannot_hold_with_a_peer_error_naming_the_peer(monkeypatch):
    """A sender's meta-data record announcing more than the receiver's memory (here: a receiver of 1 MiB) is
    refused before any allocation; the PeerError names the sender."""
    pair = start_pair("zerocopy", fabric_transport="shm", analysis=False)
    try:
        pair[1].memory_bytes = pair[1].max_dynamic_bytes = 1 << 20
        key = Key("g", 0, 0, 1)
        sending = pair[0].send_async(key, np.ones(1 << 19, np.float32))  # 2 MiB
        with pytest.raises(PeerError, match=r"rank 0 at 127\.0\.0\.1:\d+ sent a meta-data record .* exceeds 1048576"):
            pair[1].recv(key)
        sending.cancel()
    finally:
        for transport in pair:
            transport.close()


def test_a_rank_refuses_to_place_a_static_tensor_beyond_its_memory():
    pair = start_pair("zerocopy", fabric_transport="shm")
    try:
        huge = TensorSpec("w", (1 << 40, 1 << 20), np.float32, 0, 1)  # 4 EiB
        with pytest.raises(ValueError, match=r"cannot place 'w' from rank 0: .* more than this rank's memory"):
            pair[1].placement.plan([huge])
        wrapping = TensorSpec("v", (1 << 33, 1 << 33, 4), np.uint8, 0, 1)  # an int64 product of 0
        with pytest.raises(ValueError, match="more than this rank's memory"):
            pair[1].placement.plan([wrapping])
        assert not pair[1].placement.specs  # nothing of a refused plan is kept
    finally:
        for transport in pair:
            transport.close()


def test_a_dynamic_send_over_1_gib_is_refused_before_the_wire(monkeypatch):
    pair = start_pair("zerocopy", fabric_transport="shm", analysis=False)
    try:
        monkeypatch.setattr(zerocopy, "MAX_DYNAMIC_BYTES", 1 << 20)
        with pytest.raises(ValueError, match="dynamic allocation moves at most 1048576"):
            pair[0].send(Key("g", 0, 0, 1), np.ones((1 << 18) + 1, np.float32))
    finally:
        for transport in pair:
            transport.close()


def test_a_tensor_spec_counts_its_bytes_exactly():
    """Before, an int64 product: a shape of 2**64 elements counted 0 bytes, and one of 2**63 a negative count."""
    assert TensorSpec("v", (1 << 33, 1 << 33, 4), np.uint8, 0, 1).nbytes == 1 << 68
    assert TensorSpec("w", (1 << 40, 1 << 23), np.float32, 0, 1).nbytes == 1 << 65
    assert TensorSpec("x", (np.int64(3), 5), np.float64, 0, 1).nbytes == 120
    assert type(TensorSpec("y", (2, 3), np.float32, 0, 1).nbytes) is int
    assert TensorSpec("z", None, np.float32, 0, 1).nbytes is None


def test_every_transport_bounds_a_tensor_by_one_reading_of_the_memory(monkeypatch):
    """One function says what a rank can hold (physical memory, or its cgroup's limit when lower), in
    transports.base; the fabric transports and grpc_tcp's wire use it, not copies of their own."""
    from transports import base, fabric_transport
    from transports.grpc_rdma import transport as grpc_rdma
    from transports.grpc_tcp import wire

    assert grpc_rdma.memory_bytes is base.memory_bytes
    assert wire.memory_bytes is base.memory_bytes
    assert zerocopy.memory_bytes is base.memory_bytes
    assert not hasattr(fabric_transport, "memory_bytes")
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < base.memory_bytes() <= physical

    real_open = open

    def limited(path, *args, **kwargs):
        if str(path) == "/sys/fs/cgroup/memory.max":
            return io.StringIO(f"{GIB}\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", limited)
    assert base.memory_bytes() == min(GIB, physical)


# -- verbs: no work request moves more than MAX_WR_BYTES --------------------------------------------------------


@pytest.fixture
def small_nic(monkeypatch):
    """The simulated NIC, whose work requests move at most 4 KiB: a transfer of a few pieces stands for one
    of several GiB on a real NIC."""
    nic = _FakeNic()
    monkeypatch.setattr(verbs_device, "_pyverbs", lambda: nic.pv)
    monkeypatch.setattr(verbs_channel, "MAX_WR_BYTES", 4096)
    return nic


@pytest.fixture
def small_requests(small_nic):
    """Two verbs devices on ``small_nic`` (two lanes, the smallest send queue)."""
    nic = small_nic
    devices = [VerbsDevice(progress_threads=2, lanes_per_peer=2, settings=RdmaSettings(queue_depth=4))
               for _ in range(2)]
    yield nic, devices
    for device in devices:
        device.close()


def requests_of(nic):
    """(opcode, bytes, local address, remote address, signaled) of each work request posted."""
    return [(wr.opcode, wr.sg[0].length, wr.sg[0].addr, wr.addr, bool(wr.send_flags & 2)) for wr in nic.posted]


def test_a_flagged_write_larger_than_a_work_request_is_cut_in_order(small_requests):
    nic, (a, b) = small_requests
    channel, _ = _connected((a, b))
    target, flag = b.alloc(10 * 4096 + 100), b.alloc(64)
    flag.array[:] = 0
    data = np.random.default_rng(3).integers(0, 256, target.nbytes, dtype=np.uint8)
    nic.posted.clear()
    channel.write_flagged(data, target.export(), np.ones(1, np.uint8), flag.export().at(0, 1))
    assert bytes(target.array) == bytes(data) and flag.array[0] == 1
    posted = requests_of(nic)
    pieces, trailer = posted[:-1], posted[-1]
    assert len(pieces) == 11 and all(length <= 4096 for _, length, _, _, _ in pieces)
    assert sum(length for _, length, _, _, _ in pieces) == data.nbytes
    start = data.__array_interface__["data"][0]
    offsets = np.cumsum([0] + [length for _, length, _, _, _ in pieces[:-1]])
    assert [(local - start, remote - target.address) for _, _, local, remote, _ in pieces] == \
        [(offset, offset) for offset in offsets]  # each piece from its place to its place, in order
    assert trailer[1] == 1 and trailer[3] == flag.address and trailer[4]  # the flag last, signaled
    # a send queue of 4: batches of 4 requests, each ending signaled (12 requests: 3 completions)
    assert [signaled for *_, signaled in posted] == [False, False, False, True] * 3
    assert channel._slots._value == 4  # every entry freed


def test_a_read_and_a_write_with_immediate_are_cut_too(small_requests):
    nic, (a, b) = small_requests
    channel, _ = _connected((a, b))
    source = b.alloc(3 * 4096 + 7)
    source.array[:] = np.arange(source.nbytes) % 251
    back = np.zeros(source.nbytes, np.uint8)
    nic.posted.clear()
    channel.read_now(back, source.export())
    assert bytes(back) == bytes(source.array)
    assert [(opcode, length) for opcode, length, *_ in requests_of(nic)] == [(4, 4096)] * 3 + [(4, 7)]
    nic.posted.clear()
    target = b.alloc(source.nbytes)
    channel.write_with_imm(back, target.export(), imm=77)
    assert bytes(target.array) == bytes(back)
    # plain writes, then the immediate with the last piece: one event at the peer, once everything landed
    assert [(opcode, length) for opcode, length, *_ in requests_of(nic)] == [(0, 4096)] * 3 + [(1, 7)]
    got, deadline = [], time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        b.wait_for_activity(0.1)
        got += b.take_immediates()
    assert [imm for _, imm in got] == [77]


def test_a_write_spread_over_lanes_is_cut_on_each_lane(small_requests):
    nic, (a, b) = small_requests
    lanes = [_connected((a, b), lane)[0] for lane in range(2)]
    target, flag = b.alloc(1 << 16), b.alloc(1)
    flag.array[:] = 0
    data = np.random.default_rng(4).integers(0, 256, 1 << 16, dtype=np.uint8)
    nic.posted.clear()
    a.write_flagged_lanes(lanes, data, target.export(), np.ones(1, np.uint8), flag.export())
    assert bytes(target.array) == bytes(data) and flag.array[0] == 1
    assert all(length <= 4096 for _, length, *_ in requests_of(nic))
    assert len(nic.posted) == 16 + 1


@pytest.mark.parametrize(("name", "options"), [("zerocopy", {}), ("rdma_cp", {}), ("zerocopy", {"analysis": False})],
                         ids=["zerocopy", "rdma_cp", "zerocopy-dynamic"])
def test_the_fabric_transports_move_a_tensor_of_several_work_requests_over_verbs(small_nic, name, options):
    """zerocopy (static and dynamic: a one-sided read) and rdma_cp over the verbs backend of the simulated NIC,
    a tensor of several work requests (one of several GiB on a real NIC), on two lanes."""
    nic = small_nic
    spec = TensorSpec("w", (5000,), np.float64, 0, 1)  # 40000 bytes: 10 requests
    pair = start_pair(name, fabric="verbs", lanes_per_peer=2, **options)
    try:
        for transport in pair:
            transport.placement.plan([spec])
        for step in range(2):
            data = np.arange(5000, dtype=np.float64) * 1.5 + step
            sending = pair[0].send_async(Key("w", step, 0, 1), data)
            received = pair[1].recv(Key("w", step, 0, 1))
            sending.result(timeout=20)
            assert np.array_equal(received, data)
        assert max(wr.sg[0].length for wr in nic.posted) == 4096
    finally:
        for transport in pair:
            transport.close()


def test_local_hands_each_tensor_over_in_one_thread_and_is_checked_as_every_line():
    """bench micro's Local line: sender and receiver in the calling thread (no thread waits on another), timed
    and checked as every line is (one transfer in CHECK_EVERY compared byte for byte, untimed)."""
    import threading

    import transports
    from transports import Cluster

    pair = [transports.create("local") for _ in range(2)]
    cluster = Cluster.on_loopback(2)
    for rank, transport in enumerate(pair):
        transport.start(cluster, rank)
    points = [micro.Point(1024, warmup=2, iters=10), micro.Point(1 << 20, warmup=2, iters=10)]
    # the threads the loop leaves behind: the session's own may end meanwhile (the Soft-RoCE session's, beside
    # the host's tests), so a count of them all is not this test's to check
    reports, before = [], set(threading.enumerate())
    try:
        micro.solo_loop(pair[0], pair[1], points, reports.append)
    finally:
        for transport in pair:
            transport.close()
    assert set(threading.enumerate()) - before == set()
    sides = [r for r in reports if isinstance(r, micro.Side)]
    assert [(s.role, s.size_bytes) for s in sides] == [("sender", 1024), ("receiver", 1024),
                                                       ("sender", 1 << 20), ("receiver", 1 << 20)]
    for point, (sender, receiver) in zip(points, (sides[:2], sides[2:]), strict=True):
        assert len(sender.times) == len(receiver.times) == 10
        assert receiver.transfers == point.transfers and receiver.stats.tensors_received == point.transfers - 2


def test_the_collector_is_off_while_a_side_s_transfers_run_and_on_after():
    """As timeit: a cyclic collection would land in whichever transfer is being timed."""
    import gc

    seen = []
    point = micro.Point(1024, warmup=1, iters=3)
    receive(point, lambda step, delivered, before: seen.append(gc.isenabled()))
    assert seen == [False] * point.transfers and gc.isenabled()
    soak = micro.Point(1024, warmup=1, iters=3, check=True)  # the soak watches memory: it keeps the collector
    seen.clear()
    receive(soak, lambda step, delivered, before: seen.append(gc.isenabled()))
    assert seen == [True] * soak.transfers
