"""The data path's hold on the memory it sends: an array that a send has bound its pointer to cannot be moved from
under it (NumPy's ``resize(..., refcheck=False)`` moves an array's buffer however many references hold the
array); each later send sends what the array holds now, or the move is refused."""

from __future__ import annotations

import numpy as np
import pytest

import transports
from transports import Key, TensorSpec

from .conftest import start_pair

if not transports.availability("zerocopy").ok:  # pragma: no cover
    pytest.skip(f"zerocopy not available: {transports.availability('zerocopy').reason}", allow_module_level=True)

#: elements of the tensor: its buffer (1 KiB) a small heap chunk, so that memory freed under a send is read, not
#: unmapped (which would kill the test's process rather than fail it)
ELEMENTS = 256


@pytest.fixture(params=["shm", "tcp"])
def fabric(request):
    return request.param


@pytest.fixture
def planned_pair(fabric):
    spec = TensorSpec("moved", (ELEMENTS,), np.float32, 0, 1)
    pair = start_pair("zerocopy", fabric_transport=fabric)
    for transport in pair:
        transport.placement.plan([spec])
    yield pair
    for transport in pair:
        transport.close()


def _senders(pair):
    """Both ways to send tensor 'moved' from rank 0 to rank 1: persistent and keyed."""
    outbound = pair[0].outbound("moved", 1)
    return {"outbound": outbound.send, "keyed": lambda step, array: pair[0].send(Key("moved", step, 0, 1), array)}


def _move(owner: np.ndarray) -> bool:
    """Whether ``owner``'s buffer could be moved elsewhere (resized far larger, its old buffer freed, then back
    to its size); False: refused."""
    size = owner.size
    try:
        owner.resize(1 << 20, refcheck=False)
    except ValueError as exc:
        assert "cannot resize" in str(exc)
        return False
    owner.resize(size, refcheck=False)
    return True


@pytest.mark.parametrize("way", ["outbound", "keyed"])
@pytest.mark.parametrize("view", [False, True], ids=["array", "view"])
def test_a_bound_array_moved_from_under_its_sends_is_refused_or_sent_as_it_is_now(fabric, planned_pair, way, view):
    """A send's array (or the array it views) moved by ``resize(refcheck=False)``, after the other way has sent
    another array (which is what let the move through before): the move is refused, or the next send of the
    array sends what it holds now. Never the bytes of its freed buffer. (A view's owner moved leaves the view
    dangling, NumPy's own doing: refused where a send keeps a pointer to the view, over shm.)"""
    senders = _senders(planned_pair)
    send, other_way = senders[way], senders["keyed" if way == "outbound" else "outbound"]
    inbound = planned_pair[1].inbound("moved", 0)
    owner = np.full(2 * ELEMENTS if view else ELEMENTS, 1.0, np.float32)
    array = owner[:ELEMENTS] if view else owner
    step = 0
    for _ in range(3):  # the first connects; the later ones go the planned way, bound to the array
        send(step, array)
        np.testing.assert_array_equal(inbound.recv(step), array)
        step += 1
    other = np.full(ELEMENTS, 2.0, np.float32)
    for _ in range(2):
        other_way(step, other)
        np.testing.assert_array_equal(inbound.recv(step), other)
        step += 1
    moved = _move(owner)
    if moved and view:
        assert fabric == "tcp"  # (the stream reads the array anew at each send: it keeps no pointer)
        array = owner[:ELEMENTS]  # (the old view points into the freed buffer)
    array[:] = np.arange(ELEMENTS, dtype=np.float32)
    send(step, array)
    np.testing.assert_array_equal(inbound.recv(step), np.arange(ELEMENTS, dtype=np.float32))


@pytest.mark.parametrize("way", ["outbound", "keyed"])
def test_an_array_released_by_its_sends_may_be_resized_and_a_resized_one_is_refused_naming_both_shapes(
        planned_pair, way):
    """The hold goes with the binding: once both ways have sent another array, the array resizes; sent resized,
    it is refused with both shapes."""
    senders = _senders(planned_pair)
    inbound = planned_pair[1].inbound("moved", 0)
    array, other = np.full(ELEMENTS, 1.0, np.float32), np.full(ELEMENTS, 2.0, np.float32)
    step = 0
    for sent in [array, array, other, other]:
        for send in senders.values():
            send(step, sent)
            inbound.recv(step)
            step += 1
    array.resize(4 * ELEMENTS, refcheck=False)  # no send holds it any more
    with pytest.raises(ValueError, match=rf"float32 \({4 * ELEMENTS},\), but the receiver placed it as float32 "
                                         rf"\({ELEMENTS},\)"):
        senders[way](step, array)
    other[:] = 5.0  # and the tensor's sends go on
    senders[way](step, other)
    assert (inbound.recv(step) == 5.0).all()


# -- a connect that fails for want of shared memory says so ---------------------------------------------------------


class _Statvfs:
    """What ``os.statvfs`` answers for a filesystem of ``size`` bytes with ``free`` of them free."""

    def __init__(self, size: int, free: int) -> None:
        self.f_frsize, self.f_blocks, self.f_bavail, self.f_bfree = 4096, size // 4096, free // 4096, free // 4096


@pytest.mark.parametrize("free_mib, named", [(3, True), (4096, False)], ids=["nearly-full", "roomy"])
def test_a_connect_ucx_finds_unreachable_names_a_nearly_full_dev_shm_and_its_free_space(monkeypatch, free_mib,
                                                                                     named):
    """UCX whose shared-memory filesystem is full opens no shared-memory transport (it says so on the console) and
    then finds the peer unreachable: the error names /dev/shm and its free space, where it is nearly full."""
    import os

    from transports.fabric.ucx import channel

    pair = start_pair("zerocopy", fabric_transport="shm")
    try:
        real_statvfs, real_lib = os.statvfs, channel._lib

        class Unreachable:  # UCX's answer to a connect without a transport both sides have
            def __getattr__(self, name):
                return getattr(real_lib, name)

            @staticmethod
            def tt_ep_create(*args):
                return -6  # UCS_ERR_UNREACHABLE

        def statvfs(path):
            if os.fspath(path) == "/dev/shm":
                return _Statvfs(64 << 20, free_mib << 20)
            return real_statvfs(path)

        monkeypatch.delenv("UCX_POSIX_DIR", raising=False)
        monkeypatch.setattr(os, "statvfs", statvfs)
        monkeypatch.setattr(channel, "_lib", Unreachable())
        with pytest.raises(transports.PeerError) as raised:
            pair[0].send(Key("far", 0, 0, 1), np.ones(4), timeout=10)
    finally:
        monkeypatch.undo()
        for transport in pair:
            transport.close()
    message = str(raised.value)
    assert "cannot reach rank 1" in message and "Destination is unreachable" in message
    assert ("/dev/shm has 3.0 MiB free of 64 MiB" in message) is named, message
