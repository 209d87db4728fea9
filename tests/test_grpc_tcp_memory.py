"""grpc_tcp keeps nothing per transfer: a received tensor dies with the caller's last reference to it.

``bench soak`` found the receiver growing by ~25 KB per 4 MB transfer (280 -> 511 MB in 150 s) and, in
training, worker and PS growing by GBs until the OOM killer. The cause: ``recv_async``'s future and the fetch's
future each held a done-callback naming the other, a reference cycle that carried the received tensor (both
hold it as their result). Reference counts never freed it; only the cyclic collector could, and it runs on
counts of allocated objects, which a few 4 MB (or 100 MB) arrays hardly move. These tests switch the
collector off, so whatever stays alive is referenced, and count: finalizers still alive, live futures and the
transport's per-key state, after a number of transfers with growing steps as the soak and training make.
"""

from __future__ import annotations

import gc
import weakref
from concurrent.futures import Future

import numpy as np
import pytest

from transports import Key

from .conftest import start_pair
from .processes import no_cyclic_collector

SIZE = 256 << 10  # big enough to be a real payload, small enough to be quick


@pytest.fixture
def pair():
    started = start_pair("grpc_tcp")
    yield started
    for transport in started:
        transport.close()


def live_futures() -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, Future))


def transfer(pair, step: int, *, recv_first: bool) -> tuple[np.ndarray, np.ndarray]:
    array = np.full(SIZE // 4, step, np.float32)
    key = Key("w", step, 0, 1)
    if recv_first:  # the soak's order: the request waits at the sender for the tensor
        receiving = pair[1].recv_async(key)
        pair[0].send(key, array)
        received = receiving.result(timeout=20)
    else:  # the tensor waits at the sender for the request
        sent = pair[0].send_async(key, array)
        received = pair[1].recv(key)
        sent.result(timeout=20)
    return array, received


@pytest.mark.parametrize("recv_first", [True, False], ids=["recv-first", "send-first"])
def test_received_and_sent_tensors_die_with_their_last_reference(pair, recv_first):
    with no_cyclic_collector():
        alive = []
        for step in range(40):
            array, received = transfer(pair, step, recv_first=recv_first)
            assert received[0] == step
            alive += [weakref.finalize(received, lambda: None), weakref.finalize(array, lambda: None)]
            del array, received
        still = sum(finalizer.alive for finalizer in alive)
        assert still == 0, f"{still} of {len(alive)} tensors are kept alive after the caller dropped them"


def test_tensors_received_together_die_with_their_last_reference(pair):
    """recv_many / recv_each (a training step's weights and gradients) post their receives through recv_async."""
    with no_cyclic_collector():
        alive = []
        for step in range(10):
            keys = [Key(f"w{i}", step, 0, 1) for i in range(4)]
            arrays = [np.full(SIZE // 4, step * 10 + i, np.float32) for i in range(4)]
            sends = [pair[0].send_async(key, array) for key, array in zip(keys, arrays, strict=True)]
            received = pair[1].recv_many(keys)
            for sent in sends:
                sent.result(timeout=20)
            assert [int(r[0]) for r in received] == [step * 10 + i for i in range(4)]
            alive += [weakref.finalize(r, lambda: None) for r in received]
            del received, arrays, sends
        still = sum(finalizer.alive for finalizer in alive)
        assert still == 0, f"{still} of {len(alive)} received tensors are kept alive"


def test_state_stays_bounded_over_growing_steps(pair):
    """What is alive after 20 transfers is what is alive after 200: nothing accumulates per key or per step."""
    sender, receiver = pair
    with no_cyclic_collector():
        for step in range(20):
            transfer(pair, step, recv_first=step % 2 == 0)
        futures_before = live_futures()
        for step in range(20, 200):
            transfer(pair, step, recv_first=step % 2 == 0)
        futures_after = live_futures()
    assert futures_after <= futures_before, f"live futures grew from {futures_before} to {futures_after}"
    for transport in pair:
        assert transport._outbox.pending() == (0, 0)
        assert not transport._receiving
        assert len(transport._channels) <= 1 and len(transport._heard) <= 1
        assert len(transport._tasks) <= 1  # one _release_when_up per channel
    assert sender.stats().tensors_sent == receiver.stats().tensors_received == 200
