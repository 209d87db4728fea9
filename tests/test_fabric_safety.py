"""Faults and bad input on the fabric transports (zerocopy, rdma_cp) and the UCX device.

Anything that could crash the interpreter (UCX aborting on a bad address, a read of freed
memory) runs in a child process and the test asserts on its exit status and output. No test
allocates more than a few megabytes: sizes a peer claims are refused before any allocation.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transports import Key, TensorSpec, peer_input
from transports.control import ControlClient, port_is_held
from transports.fabric.base import RemoteRegion
from transports.zerocopy.protocol import (
    CREDIT_TABLE_ENTRIES,
    META,
    ConnectReply,
    ConnectRequest,
    Meta,
    slots_bytes,
)

from .conftest import start_pair
from .processes import open_sockets

ROOT = Path(__file__).resolve().parent.parent
FABRIC_TRANSPORTS = ["zerocopy", "rdma_cp"]


def run_child(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


# -- peer-supplied addresses -------------------------------------------------------------------------


def test_a_malformed_worker_address_is_an_error_not_an_abort():
    child = run_child("""
        from transports.fabric.ucx.device import UcxDevice
        from transports.fabric.base import FabricError
        device = UcxDevice('auto')
        for address in (b'\\xff' * 300, b'', b'\\x00' * 8, b'\\xff' * 100_000):
            try:
                device.channel([address])
            except FabricError as exc:
                print('refused:', exc)
            else:
                print('accepted', len(address))
        device.close()
    """)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.count("refused:") == 4, child.stdout


# -- parsers of what peers send: never anything but ValueError, and what passes is in range ---------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
hexes = st.binary(max_size=64).map(bytes.hex)
regions = st.fixed_dictionaries({
    "addr": st.integers(min_value=-5, max_value=2**64 + 5) | json_values,
    "length": st.integers(min_value=-5, max_value=2**64 + 5) | json_values,
    "rkey": hexes | json_values,
})


@settings(max_examples=300, deadline=None)
@given(st.one_of(regions, json_values))
def test_region_descriptors_from_peers_are_checked(data):
    try:
        region = RemoteRegion.from_json(data)
    except ValueError:
        return
    assert region.addr >= 0 and region.length >= 0 and region.addr + region.length <= 2**64
    assert 0 < len(region.rkey) <= 1024


@settings(max_examples=200, deadline=None)
@given(st.lists(hexes | json_values, max_size=3) | json_values)
def test_device_addresses_from_peers_are_checked(value):
    try:
        addresses = peer_input.device_address(value)
    except ValueError:
        return
    assert addresses and all(isinstance(a, bytes) and a for a in addresses)


connects = st.fixed_dictionaries({
    "name": st.text(max_size=20) | json_values,
    "src": st.integers(min_value=-3, max_value=5) | json_values,
    "device": st.lists(hexes, min_size=1, max_size=2) | json_values,
    "counters": regions | json_values,
    "index": st.integers(min_value=-2, max_value=2000) | json_values,
})


@settings(max_examples=300, deadline=None)
@given(st.one_of(connects, json_values))
def test_connect_requests_are_checked(request):
    try:
        connect = ConnectRequest.parse(request, cluster_size=2, own_rank=1)
    except ValueError:
        return
    assert connect.src == 0  # a rank of the cluster, not this one
    assert connect.counters.length == 16
    assert 0 <= connect.index < CREDIT_TABLE_ENTRIES and connect.table.addr >= 0


replies = st.fixed_dictionaries({
    "mode": st.sampled_from(["static", "dynamic"]) | json_values,
    "control": regions | json_values,
}, optional={
    "slot": regions | json_values,
    "shape": st.lists(st.integers(min_value=-2, max_value=2**62), max_size=10) | json_values,
    "dtype": st.sampled_from(["<f4", "|O", "V12", "float64", "x"]) | json_values,
    "slots": st.integers(min_value=-1, max_value=3) | json_values,
})


@settings(max_examples=300, deadline=None)
@given(st.one_of(replies, json_values))
def test_connect_replies_are_checked(reply):
    try:
        answer = ConnectReply.parse(reply)
    except ValueError:
        return
    if answer.mode == "static":
        nbytes = int(np.prod(answer.shape, dtype=object)) * answer.dtype.itemsize
        assert answer.slots in (1, 2) and answer.slot.length == slots_bytes(nbytes, answer.slots)
        assert answer.dtype.kind not in "OV"


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=META.itemsize, max_size=META.itemsize))
def test_meta_data_records_are_checked(raw):
    record = np.frombuffer(raw, np.uint8)
    try:
        meta = Meta.parse(record, limit=1 << 20)
    except ValueError:
        return
    assert meta.nbytes <= 1 << 20  # what the receiver allocates is bounded before it allocates
    assert int(np.prod(meta.shape, dtype=object)) * meta.dtype.itemsize == meta.nbytes
    if meta.source is not None:
        assert meta.source.length == meta.nbytes and meta.source.addr + meta.nbytes <= 2**64


def test_a_meta_data_record_claiming_more_than_the_limit_is_refused():
    record = np.zeros(1, META)
    record["ndim"], record["nbytes"], record["dtype"] = 1, 1 << 21, b"|u1"
    record["dims"][0, 0] = 1 << 21
    record["rkey_len"], record["addr"] = 8, 4096
    with pytest.raises(ValueError, match="1048576"):
        Meta.parse(record.view(np.uint8), limit=1 << 20)


# -- a read or write outside the memory a remote key covers -------------------------------------------


def test_an_operation_past_a_mapped_peer_region_is_refused():
    child = run_child("""
        import numpy as np
        from transports.fabric.base import FabricError, RemoteRegion
        from transports.fabric.ucx.device import UcxDevice
        a, b = UcxDevice('shm'), UcxDevice('shm')
        region = b.alloc(4096)
        good = region.export()
        channel = a.channel(b.address)
        local = np.zeros(4096, np.uint8)
        channel.wait(channel.read(local, good))
        for addr in (good.addr + (64 << 20), good.addr - (64 << 20)):
            try:
                channel.wait(channel.read(local, RemoteRegion(addr, 4096, good.rkey)))
                print('read outside')
            except FabricError as exc:
                print('refused:', exc)
        a.close(); b.close()
    """)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.count("refused:") == 2, child.stdout


def test_a_key_that_says_device_memory_of_host_memory_is_refused():
    # the memory type byte of a packed key (after the 64-bit map of memory domains) is the peer's word: a key to
    # host memory that claims device memory gets the device check, which finds no device allocation (no GPU or
    # none there), and is refused rather than copied into by this process's CPU or UCX's CUDA transports
    child = run_child("""
        import numpy as np
        from transports.fabric.base import FabricError, RemoteRegion
        from transports.fabric.ucx.channel import HOST_MEMORY, key_memory_type
        from transports.fabric.ucx.device import UcxDevice
        a, b = UcxDevice('shm'), UcxDevice('shm')
        good = b.alloc(4096).export()
        print('host key:', key_memory_type(good.rkey) == HOST_MEMORY)
        channel = a.channel(b.address)
        local = np.zeros(4096, np.uint8)
        forged = RemoteRegion(good.addr, 4096, good.rkey[:8] + bytes([1]) + good.rkey[9:])
        for op in (channel.read, channel.write):
            try:
                channel.wait(op(local, forged))
                print('done')
            except FabricError as exc:
                print('refused:', exc)
        channel.wait(channel.read(local, good))
        print('the true key still reads')
        a.close(); b.close()
    """)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "host key: True" in child.stdout, child.stdout
    assert child.stdout.count("refused:") == 2, child.stdout
    assert "no device allocation the CUDA driver knows" in child.stdout, child.stdout
    assert "the true key still reads" in child.stdout, child.stdout


def test_own_mappings_are_the_allocations_of_the_device():
    from transports.fabric.ucx.device import UcxDevice

    device = UcxDevice("shm")
    try:
        regions = [device.alloc(4096), device.alloc(1 << 20)]
        mappings = device.own_mappings()
        for region in regions:
            start = region.array.ctypes.data
            assert any(lo <= start and start + region.nbytes <= hi for lo, hi in mappings), (start, mappings)
        assert all(lo < hi for lo, hi in mappings)
        assert device.own_device_memory() == []
    finally:
        device.close()


@pytest.mark.parametrize("room", ["little", "plenty"])
def test_shared_memory_without_room_is_process_memory_without_an_error(room):
    """A shared segment goes where UCX puts shared memory (``/dev/shm``) only while half of that filesystem's free
    space holds it; otherwise it is process memory (no peer maps it: cma reaches it), and UCX is never asked for
    what it would refuse with an error on the console."""
    child = run_child(f"""
        import os
        from transports.fabric.ucx.channel import _shared_mappings
        from transports.fabric.ucx.device import UcxDevice
        if "{room}" == "little":  # 400 KB free, as in a container's small /dev/shm
            os.statvfs = lambda path: os.statvfs_result((4096, 4096, 1000, 100, 100, 0, 0, 0, 0, 255))
        device = UcxDevice('shm')
        region = device.alloc(8 << 20, shared=True)
        region.array[:] = 1
        shared = any(lo <= region.address < hi for lo, hi in _shared_mappings())
        print('shared' if shared else 'process memory')
        device.close()
    """)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == (["process", "memory"] if room == "little" else ["shared"]), child.stdout
    assert "ERROR" not in child.stderr, child.stderr[-2000:]


# -- a rank connects only as itself, once ---------------------------------------------------------------


@pytest.mark.parametrize("name", FABRIC_TRANSPORTS)
def test_a_rank_connects_only_as_itself_and_once(name):
    pair = start_pair(name, fabric_transport="shm")
    try:
        sending = pair[0].send_async(Key("w", 0, 0, 1), np.ones(16))
        pair[1].recv(Key("w", 0, 0, 1))
        sending.result(timeout=60)
        cluster = pair[0].cluster
        stranger = ControlClient(cluster.addresses[1], "rank 1", cluster.token)
        try:
            base = {"device": [a.hex() for a in pair[0].device.address],
                    "counters": pair[0].pool.alloc(16).remote().to_json(), "index": 0}
            for request, why in (
                ({"name": "w", "src": 0, **base}, "already connected"),  # a second connect for w from 0
                ({"name": "v", "src": 0, **base}, "denies"),  # rank 0 is not connecting 'v'
                ({"name": "v", "src": 7, **base}, "'src'"),  # not a rank of the cluster
                ({"name": "v", "src": 1, **base}, "this rank"),
            ):
                with pytest.raises(Exception, match=why):
                    stranger.call("connect", timeout=30, **request)
        finally:
            stranger.close()
        # the real sender still works
        sending = pair[0].send_async(Key("w", 1, 0, 1), np.full(16, 2.0))
        assert pair[1].recv(Key("w", 1, 0, 1)).tolist() == [2.0] * 16
        sending.result(timeout=60)
    finally:
        for transport in pair:
            transport.close()


# -- received views after close ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["static", "dynamic"])
@pytest.mark.parametrize("name", FABRIC_TRANSPORTS)
def test_a_received_tensor_stays_readable_after_close(name, mode):
    child = run_child(f"""
        import numpy as np
        from tests.conftest import start_pair
        from transports import Key, TensorSpec
        pair = start_pair({name!r}, fabric_transport="shm")
        if {mode!r} == "static":
            for t in pair:
                t.placement.plan([TensorSpec("w", (1000,), np.float32, 0, 1)])
        sending = pair[0].send_async(Key("w", 0, 0, 1), np.full(1000, 7, np.float32))
        got = pair[1].recv(Key("w", 0, 0, 1))
        sending.result(timeout=60)
        for t in pair:
            t.close()
        print("sum", float(got.sum()))
        got[:] = 1  # and writable: private memory now, no longer the peer's
        print("sum", float(got.sum()))
    """)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.split() == ["sum", "7000.0", "sum", "1000.0"]


# -- what the tests count is this process's own ------------------------------------------------------


def test_held_resources_count_only_this_process():
    from .processes import held_resources

    before = held_resources()
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import ctypes, sys, os
        libc = ctypes.CDLL(None)
        shmid = libc.shmget(0, 4096, 0o1600)
        with open('/dev/shm/tt-test-%d' % os.getpid(), 'wb') as f:
            f.write(b'x')
        print(shmid, flush=True)
        sys.stdin.read()
        libc.shmctl(shmid, 0, None)
        os.unlink('/dev/shm/tt-test-%d' % os.getpid())
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip()
        during = held_resources()
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert during[:2] == before[:2]  # (the pipes to the child are fds of ours)


# -- listeners: only on the interfaces of the cluster's addresses --------------------------------------


def _own_listeners() -> list[str]:
    """Local addresses of this process's listening TCP sockets."""
    inodes = {target[len("socket:["):-1] for target in open_sockets()}
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    found.append(fields[1])
    return found


def _is_loopback(hex_address: str) -> bool:
    host = hex_address.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian
        return bytes.fromhex(host)[::-1][0] == 127
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return words == bytes(15) + b"\x01" or (words[:12] == bytes(10) + b"\xff\xff" and words[12] == 127)


@pytest.mark.parametrize("fabric", ["auto", "tcp"])
@pytest.mark.parametrize("name", FABRIC_TRANSPORTS)
def test_fabric_listens_on_loopback_only_for_a_loopback_cluster(name, fabric):
    pair = start_pair(name, fabric_transport=fabric)
    try:
        sending = pair[0].send_async(Key("w", 0, 0, 1), np.ones(1 << 10))
        pair[1].recv(Key("w", 0, 0, 1))
        sending.result(timeout=60)
        listeners = _own_listeners()
        assert listeners, "the pair should listen somewhere (control path, UCX)"
        assert all(_is_loopback(address) for address in listeners), listeners
    finally:
        for transport in pair:
            transport.close()


# -- liveness -------------------------------------------------------------------------------------------


def test_a_held_port_is_alive_and_a_closed_one_is_not():
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        assert port_is_held(address)
    assert not port_is_held(address)



@pytest.mark.parametrize("error, held", [
    (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), False),
    (OSError(errno.EHOSTUNREACH, "no route to host"), False),
    (TimeoutError("timed out"), True),
    (OSError(errno.EMFILE, "too many open files"), True),
    (OSError(errno.EADDRNOTAVAIL, "cannot assign requested address"), True),
], ids=["refused", "unreachable", "too-slow", "out-of-descriptors", "out-of-ports"])
def test_only_a_refusal_or_an_unreachable_host_says_a_port_is_not_held(monkeypatch, error, held):
    """A connect that fails for want of this process's own descriptors or ports (a busy machine) says nothing of
    the peer: taking it for death failed a living peer's transfers and hung its partner for the whole timeout."""
    import socket

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(socket, "create_connection", failing)
    assert port_is_held("127.0.0.1:9") is held

def test_plan_keeps_static_placement():
    """A sanity check that the checked connect path still places planned tensors (static mode)."""
    pair = start_pair("zerocopy", fabric_transport="shm")
    try:
        for t in pair:
            t.placement.plan([TensorSpec("p", (4,), np.float64, 0, 1)])
        sending = pair[0].send_async(Key("p", 0, 0, 1), np.arange(4.0))
        assert pair[1].recv(Key("p", 0, 0, 1)).tolist() == [0.0, 1.0, 2.0, 3.0]
        sending.result(timeout=60)
    finally:
        for transport in pair:
            transport.close()


# -- malformed meta-data records and trailers on the fabric path ------------------------------------------


def _connected(name):
    """A pair that has moved tensor 'w' (dynamic: not planned) from rank 0 to rank 1 once."""
    pair = start_pair(name, fabric_transport="shm")
    sending = pair[0].send_async(Key("w", 0, 0, 1), np.ones(16))
    pair[1].recv(Key("w", 0, 0, 1))
    sending.result(timeout=60)
    return pair


def _forge(pair, seq, flag=None, **fields):
    """Write into rank 1's control block what a misbehaving rank 0 could write there."""
    from transports.zerocopy.protocol import TRAILER_AT, tag

    incoming = pair[1]._incoming[("w", 0)]
    record = incoming.control.array[: META.itemsize].view(META)
    for field, value in fields.items():
        if field == "dims":
            record["dims"][0, : len(value)] = value
        else:
            record[field] = value
    trailer = incoming.control.array[TRAILER_AT:]
    trailer[:8].view(np.int64)[0] = seq
    trailer[8] = tag(seq) if flag is None else flag


@pytest.mark.parametrize("forged", [
    {"nbytes": 1 << 40, "dims": [1 << 37]},  # more than the receiver takes: refused before allocating
    {"addr": 1 << 46},  # pointing away from the sender's buffer, where nothing is mapped
    # (a record pointing just past the sender's buffer, into memory the sender has mapped, is read over
    # cma from the sender's own address space: only the sender's memory, which it chose to expose; in
    # this test both ranks share one process, so whether that address is mapped depends on the tests
    # that ran before, and the case cannot be told apart here)
    {"dtype": b"|O"},
    {"ndim": 200},
    {"rkey_len": 60_000},
])
@pytest.mark.parametrize("name", FABRIC_TRANSPORTS)
def test_a_malformed_meta_data_record_is_refused_naming_the_peer(name, forged):
    from transports import PeerError

    pair = _connected(name)
    try:
        _forge(pair, 1, **forged)
        with pytest.raises(PeerError, match=r"rank 0 at .*meta-data record|reading .* rank 0 at"):
            pair[1].recv(Key("w", 1, 0, 1), timeout=30)
    finally:
        for transport in pair:
            transport.close()


@pytest.mark.parametrize("name", FABRIC_TRANSPORTS)
def test_a_malformed_trailer_is_refused_naming_the_peer(name):
    from transports import PeerError

    pair = _connected(name)
    try:
        _forge(pair, 1, flag=77)
        with pytest.raises(PeerError, match=r"rank 0 at .*malformed trailer"):
            pair[1].recv(Key("w", 1, 0, 1), timeout=30)
    finally:
        for transport in pair:
            transport.close()
