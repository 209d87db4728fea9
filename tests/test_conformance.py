"""One behaviour suite that every registered transport must pass."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import numpy as np
import pytest

from tests.frameworks import framework_pointer, framework_tensor
from transports import Key, TensorSpec, TransportClosed, TransportError, TransportTimeout
from transports.memory import Memory, array_module, cuda_problem, memory_of
from transports.tensors import JAX_ALIGNMENT, as_framework, bfloat16

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.bool_]
if bfloat16() is not None:  # ml_dtypes' bfloat16: what TensorFlow and JAX hand over (transports/tensors.py)
    DTYPES.append(bfloat16())


def transfer(pair, array, name="t", step=0, src=0, dst=1):
    sent = pair[src].send_async(Key(name, step, src, dst), array)
    received = pair[dst].recv(Key(name, step, src, dst))
    sent.result(timeout=10)
    return received


def sample(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_arrives_intact(pair, dtype):
    array = sample((7, 5), dtype)
    received = transfer(pair, array)
    assert received.dtype == array.dtype
    np.testing.assert_array_equal(received, array)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (2, 3, 4, 5)], ids=str)
def test_shapes_including_scalars_and_empty(pair, shape):
    array = sample(shape, np.float32)
    received = transfer(pair, array)
    assert received.shape == shape
    np.testing.assert_array_equal(received, array)


def test_large_tensor(pair):
    array = sample((3, 1 << 20), np.float32)  # 12 MiB
    np.testing.assert_array_equal(transfer(pair, array), array)


@pytest.mark.parametrize("view", ["strided", "transposed", "reversed"])
def test_non_contiguous_input(pair, view):
    base = sample((6, 8), np.int32)
    array = {"strided": base[:, ::2], "transposed": base.T, "reversed": base[::-1]}[view]
    assert not array.flags.c_contiguous
    np.testing.assert_array_equal(transfer(pair, array), array)


def test_same_key_over_many_steps(pair):
    for step in range(30):
        array = np.full(100, step, dtype=np.int64)
        np.testing.assert_array_equal(transfer(pair, array, name="w", step=step), array)


def test_many_tensors_in_flight(pair):
    arrays = {i: np.full(1000 + i, i, dtype=np.float64) for i in range(40)}
    sends = [pair[0].send_async(Key(f"t{i}", 0, 0, 1), a) for i, a in arrays.items()]
    for i in reversed(range(40)):  # the opposite order to the sends
        np.testing.assert_array_equal(pair[1].recv(Key(f"t{i}", 0, 0, 1)), arrays[i])
    _done, pending = wait(sends, timeout=10)
    assert not pending


def test_recv_before_send(pair):
    key = Key("early", 3, 0, 1)
    receiving = pair[1].recv_async(key)
    time.sleep(0.2)
    assert not receiving.done()
    array = np.arange(12, dtype=np.float32)
    pair[0].send(key, array)
    np.testing.assert_array_equal(receiving.result(timeout=10), array)


def test_send_before_recv(pair):
    key = Key("late", 0, 0, 1)
    array = np.arange(12, dtype=np.float32)
    sending = pair[0].send_async(key, array)
    time.sleep(0.2)
    np.testing.assert_array_equal(pair[1].recv(key), array)
    sending.result(timeout=10)


def test_both_directions(pair):
    forward = sample((4,), np.float64, seed=1)
    backward = sample((5,), np.float64, seed=2)
    np.testing.assert_array_equal(transfer(pair, forward, src=0, dst=1), forward)
    np.testing.assert_array_equal(transfer(pair, backward, src=1, dst=0), backward)


def test_close_while_a_recv_waits_is_an_error_not_a_hang(pair):
    receiving = pair[1].recv_async(Key("never", 0, 0, 1))
    started = time.monotonic()
    pair[1].close()
    with pytest.raises(TransportClosed):
        receiving.result(timeout=15)
    assert time.monotonic() - started < 15


def test_recv_timeout_names_the_peer(pair):
    with pytest.raises(TransportTimeout, match="rank 0"):
        pair[1].recv(Key("missing", 0, 0, 1), timeout=0.5)


def test_sending_a_key_twice_before_it_is_received_is_an_error(pair):
    key = Key("dup", 0, 0, 1)
    first = pair[0].send_async(key, np.zeros(3))
    with pytest.raises((ValueError, TransportError)):
        pair[0].send_async(key, np.zeros(3)).result(timeout=10)
    pair[1].recv(key)
    first.result(timeout=10)


def test_keys_for_other_ranks_are_refused(pair):
    with pytest.raises(ValueError, match="src must be this rank"):
        pair[1].send_async(Key("x", 0, 0, 1), np.zeros(1))
    with pytest.raises(ValueError, match="no rank 5"):
        pair[0].send_async(Key("x", 0, 0, 5), np.zeros(1))


def test_allocate_gives_a_writable_tensor_of_the_spec(pair):
    spec = TensorSpec("w", (4, 8), np.float32, 0, 1)
    pair[0].placement.plan([spec])
    tensor = pair[0].placement.allocate(spec)
    assert tensor.shape == (4, 8) and tensor.dtype == np.float32 and tensor.flags.writeable
    tensor[...] = 1.5
    np.testing.assert_array_equal(transfer(pair, tensor, name="w"), tensor)


def test_ledger_counts_tensors_and_payload(pair):
    array = np.ones(1000, dtype=np.float32)
    before = [t.stats() for t in pair]
    transfer(pair, array)
    sender, receiver = (t.stats() - b for t, b in zip(pair, before, strict=True))
    assert sender.tensors_sent == 1 and receiver.tensors_received == 1
    assert sender.payload_bytes_sent == array.nbytes == receiver.payload_bytes_received


# -- many tensors posted together ------------------------------------------------


def test_recv_many_returns_every_tensor_in_the_order_asked(pair):
    arrays = {i: np.full(50 + i, i, dtype=np.float32) for i in range(12)}
    keys = [Key(f"m{i}", 0, 0, 1) for i in arrays]
    sends = [pair[0].send_async(key, arrays[i]) for i, key in zip(arrays, keys, strict=True)]
    received = pair[1].recv_many(list(reversed(keys)))
    for i, array in zip(reversed(list(arrays)), received, strict=True):
        np.testing.assert_array_equal(array, arrays[i])
    _done, pending = wait(sends, timeout=10)
    assert not pending


def test_recv_each_yields_each_key_once_as_it_arrives(pair):
    keys = [Key(f"e{i}", 4, 0, 1) for i in range(6)]
    first = pair[0].send_async(keys[3], np.full(8, 3.0))
    arrived = pair[1].recv_each(keys)
    key, array = next(arrived)  # only one was sent: it is the one that arrives
    assert key == keys[3]
    np.testing.assert_array_equal(array, np.full(8, 3.0))
    first.result(timeout=10)
    rest = [pair[0].send_async(k, np.full(8, float(i))) for i, k in enumerate(keys) if i != 3]
    got = dict(arrived)
    assert sorted(got) == sorted(k for k in keys if k != keys[3])
    for i, k in enumerate(keys):
        if k != keys[3]:
            np.testing.assert_array_equal(got[k], np.full(8, float(i)))
    _done, pending = wait(rest, timeout=10)
    assert not pending


def test_recv_many_over_several_steps_of_the_same_names(pair):
    names = [f"s{i}" for i in range(5)]
    for step in range(8):
        sends = [pair[0].send_async(Key(n, step, 0, 1), np.full(16, step * 10 + i, np.int64))
                 for i, n in enumerate(names)]
        received = pair[1].recv_many([Key(n, step, 0, 1) for n in names])
        assert [int(a[0]) for a in received] == [step * 10 + i for i in range(5)]
        _done, pending = wait(sends, timeout=10)
        assert not pending


def test_recv_many_timeout_names_the_missing_keys(pair):
    here, gone = Key("here", 0, 0, 1), Key("gone", 0, 0, 1)
    sent = pair[0].send_async(here, np.zeros(4))
    taken = []
    with pytest.raises(TransportTimeout, match=r"gone@0 .*rank 0"):
        for key, _array in pair[1].recv_each([here, gone], timeout=0.5):  # recv_many's, collected
            taken.append(key)
    # the pair's first connection may still be coming up (UCX's wire-up over an emulated RDMA device on a busy
    # machine took over 10 s), so 'here' may have missed the 0.5 s too; when it was taken, its send completes
    # (its own timeout bounds that, not a guess here); when not, closing the pair ends the send
    if here in taken:
        sent.result()


def test_recv_many_refuses_a_key_asked_twice(pair):
    with pytest.raises(ValueError, match="twice"):
        pair[1].recv_many([Key("d", 0, 0, 1), Key("d", 0, 0, 1)])


# -- persistent transfers (Transport.outbound / inbound) ----------------------------------


def planned_pair(pair, spec):
    for transport in pair:
        transport.placement.plan([spec])
    return pair[0].outbound(spec.name, 1), pair[1].inbound(spec.name, 0)


def sending_steps(outbound, array, steps, fill):
    """The sends of ``steps`` on a thread of their own (a send may wait for its receive: ``local``'s does)."""
    failures = []

    def run():
        try:
            for step in steps:
                fill(array, step)
                outbound.send(step, array)
        except BaseException as exc:  # the test's thread says it
            failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, failures


def lockstep():
    """A sender's fill of step ``step`` into its tensor that waits, from the second step on, until the receiver took
    the last one (it sets the event returned) before overwriting the tensor."""
    done = threading.Event()

    def fill(target, step):
        if step:
            assert done.wait(10)
            done.clear()
        target[:] = step

    return fill, done


def test_persistent_transfers_arrive_in_order_and_are_counted(pair):
    spec = TensorSpec("p", (256,), np.float32, 0, 1)
    outbound, inbound = planned_pair(pair, spec)
    array = pair[0].placement.allocate(spec)
    before = [t.stats() for t in pair]
    steps = range(12)
    fill, done = lockstep()
    thread, failures = sending_steps(outbound, array, steps, fill)
    for step in steps:
        received = inbound.recv(step)
        assert received.shape == spec.shape and received.dtype == spec.dtype
        assert (received == step).all(), step
        done.set()
    thread.join(10)
    assert not failures and not thread.is_alive()
    sender, receiver = (t.stats() - b for t, b in zip(pair, before, strict=True))
    assert sender.tensors_sent == receiver.tensors_received == len(steps)
    assert sender.payload_bytes_sent == receiver.payload_bytes_received == len(steps) * spec.nbytes


def test_persistent_and_keyed_transfers_of_one_tensor_mix(pair):
    spec = TensorSpec("mix", (8,), np.int64, 0, 1)
    outbound, inbound = planned_pair(pair, spec)
    for step in range(6):
        array = np.full(8, step, np.int64)
        if step % 2:
            thread, failures = sending_steps(outbound, array, [step], lambda target, step: None)
            received = pair[1].recv(Key("mix", step, 0, 1))
        else:
            sent = pair[0].send_async(Key("mix", step, 0, 1), array)
            received = inbound.recv(step)
            sent.result(timeout=10)
            thread, failures = None, []
        assert (received == step).all()
        if thread is not None:
            thread.join(10)
            assert not failures


def test_a_persistent_receive_times_out_naming_the_peer(pair):
    spec = TensorSpec("quiet", (4,), np.float64, 0, 1)
    outbound, inbound = planned_pair(pair, spec)
    thread, _ = sending_steps(outbound, np.ones(4), [0], lambda target, step: None)
    inbound.recv(0)
    thread.join(10)
    with pytest.raises(TransportTimeout, match="rank 0"):
        inbound.recv(1, timeout=0.5)


@pytest.mark.parametrize("way", ["unplanned", "planned", "persistent"])
def test_a_send_that_times_out_names_the_timeout_it_was_given(pair, way):
    """A send given ``timeout=`` that no receive meets gives up then, and says that time, not the transport's."""
    if way == "persistent" and pair[0].name == "local":
        pytest.skip("local's persistent send hands the array over at once: it never waits for a receive")
    array = np.ones(4)
    if way == "unplanned":
        send = lambda step: pair[0].send(Key("unread", step, 0, 1), array, timeout=0.5)  # noqa: E731
    else:
        outbound, inbound = planned_pair(pair, TensorSpec("unread", (4,), np.float64, 0, 1))
        thread, _ = sending_steps(outbound, array, [0], lambda target, step: None)
        inbound.recv(0)  # connected
        thread.join(10)
        send = (lambda step: outbound.send(step, array, timeout=0.5)) if way == "persistent" else (
            lambda step: pair[0].send(Key("unread", step, 0, 1), array, timeout=0.5))
    assert pair[0].timeout_s != 0.5
    with pytest.raises(TransportTimeout, match=r"within 0\.5 s") as raised:
        for step in range(1, 6):  # (a transport may let a send or two ahead of its receives)
            send(step)
    assert f"{pair[0].timeout_s:g} s" not in str(raised.value)


def test_persistent_transfers_refuse_what_a_key_would(pair):
    with pytest.raises(ValueError, match="no rank 5"):
        pair[0].outbound("x", 5)
    with pytest.raises(ValueError, match="no rank 7"):
        pair[1].inbound("x", 7)
    with pytest.raises(ValueError, match="name"):
        pair[0].outbound(b"x", 1)
    spec = TensorSpec("bad", (4,), np.float64, 0, 1)
    outbound, _inbound = planned_pair(pair, spec)
    with pytest.raises(ValueError, match="step"):
        outbound.send(-1, np.ones(4))


# -- where a tensor lives: host or device memory on each side ----------------------------------------------------

#: (sender's memory, receiver's memory): host always; device memory where a GPU and CuPy are (skipped saying why)
MEMORY_SIDES = [("host", "host"), ("cuda", "cuda"), ("cuda", "host"), ("host", "cuda")]


@pytest.fixture(params=MEMORY_SIDES, ids=lambda sides: "-".join(sides))
def memory(request):
    for side in request.param:
        problem = cuda_problem(Memory.parse(side))
        if problem is not None:
            pytest.skip(problem)
    return tuple(Memory.parse(side) for side in request.param)


def on_host(array):
    """A received array's values in host memory (a device array's copied off for the comparison)."""
    return array if type(array) is np.ndarray else array_module().asnumpy(array)


def staged_bytes(pair, spec, transfers):
    """The crossings of the bus the ledgers should show: a device side is staged through host memory unless the
    transfer goes from device to device on a transport that moves device memory itself (then none: zerocopy and
    rdma_cp where the fabric does)."""
    moved = [transport.moves_device(spec) for transport in pair]
    assert moved[0] == moved[1]  # both ends decide alike, from the one plan
    staged = spec.nbytes * transfers
    return ((staged if spec.src_memory.is_device and not moved[0] else 0),
            (staged if spec.dst_memory.is_device and not moved[1] else 0))


# the memory and framework cases test what every transport does around its wire (taking tensors in, staging):
# long under the Soft-RoCE guest's emulation (framework imports, a pair per case), left out of CI's guest session
@pytest.mark.long
def test_keyed_transfers_arrive_in_the_memory_planned(pair, memory):
    spec = TensorSpec("m", (3, 1000), np.float32, 0, 1, *memory)
    for transport in pair:
        transport.placement.plan([spec])
    tensor = pair[0].placement.allocate(spec)
    assert memory_of(tensor) == memory[0]
    values = sample(spec.shape, np.float32)
    tensor[...] = values if type(tensor) is np.ndarray else array_module().asarray(values)
    before = [t.stats() for t in pair]
    for step in range(3):
        received = transfer(pair, tensor, name="m", step=step)
        assert memory_of(received) == memory[1] and received.shape == spec.shape
        np.testing.assert_array_equal(on_host(received), values)
    sender, receiver = (t.stats() - b for t, b in zip(pair, before, strict=True))
    assert (sender.device_to_host_bytes, receiver.host_to_device_bytes) == staged_bytes(pair, spec, 3)
    assert sender.host_to_device_bytes == receiver.device_to_host_bytes == 0
    if pair[0].moves_device(spec):  # device to device: nothing in host memory on the way (rdma_cp copies on the GPU)
        assert sender.copied_bytes == receiver.copied_bytes == 0


@pytest.mark.long
def test_persistent_transfers_arrive_in_the_memory_planned(pair, memory):
    spec = TensorSpec("pm", (4096,), np.float32, 0, 1, *memory)
    outbound, inbound = planned_pair(pair, spec)
    tensor = pair[0].placement.allocate(spec)
    before = [t.stats() for t in pair]
    steps = range(5)
    fill, done = lockstep()
    thread, failures = sending_steps(outbound, tensor, steps, fill)
    for step in steps:
        received = inbound.recv(step)
        assert memory_of(received) == memory[1]
        assert (on_host(received) == step).all(), step
        done.set()
    thread.join(10)
    assert not failures and not thread.is_alive()
    sender, receiver = (t.stats() - b for t, b in zip(pair, before, strict=True))
    assert sender.tensors_sent == receiver.tensors_received == len(steps)
    assert (sender.device_to_host_bytes, receiver.host_to_device_bytes) == staged_bytes(pair, spec, len(steps))


@pytest.mark.long
def test_work_queued_on_a_received_device_tensor_reads_it_before_a_later_transfer_lands(pair, memory):
    """A received tensor is the receiver's until its next receive of that tensor: work queued on it by then (here
    kernels on the current stream, the one that reads it queued behind others) reads what arrived, not a later
    transfer that the next receive let the sender put into the same memory."""
    if not memory[1].is_device:
        pytest.skip("the receiver's memory is host memory: no work on it is queued on a device")
    cupy = array_module()
    spec = TensorSpec("q", (1 << 22,), np.float32, 0, 1, *memory)
    for transport in pair:
        transport.placement.plan([spec])
    tensors = [pair[0].placement.allocate(spec) for _ in range(3)]
    for step, tensor in enumerate(tensors):
        tensor[...] = step + 1
    received = transfer(pair, tensors[0], name="q", step=0)
    with cupy.cuda.Device(received.device.id):
        busy = cupy.ones(1 << 24, np.float32)
        for _ in range(400):  # about 10 ms of the GPU's time before the read of the received tensor
            busy = cupy.sqrt(busy)
        total = received.sum()
    # the receive of step 1 lets step 1 or 2 into the memory of step 0; nothing here waits for the GPU before
    last = [transfer(pair, tensors[step], name="q", step=step) for step in (1, 2)][-1]
    assert float(total) == spec.shape[0], "a later transfer overwrote the tensor while queued work still read it"
    assert (on_host(last) == 3).all()


@pytest.mark.long
def test_a_device_tensor_its_receiver_did_not_plan_arrives_in_host_memory(pair):
    """The sender planned a tensor from GPU to GPU, its receiver planned nothing: the receiver takes it as any
    tensor it did not plan, in host memory, with the values sent (zerocopy's dynamic path reads host memory only)."""
    if (problem := cuda_problem()) is not None:
        pytest.skip(problem)
    spec = TensorSpec("u", (3, 1000), np.float32, 0, 1, Memory.parse("cuda"), Memory.parse("cuda"))
    pair[0].placement.plan([spec])
    tensor = pair[0].placement.allocate(spec)
    values = sample(spec.shape, np.float32)
    tensor[...] = array_module().asarray(values)
    for step in range(2):
        received = transfer(pair, tensor, name="u", step=step)
        assert memory_of(received) == Memory.parse("host")
        np.testing.assert_array_equal(received, values)


@pytest.mark.long
def test_a_torch_device_tensor_goes_in_and_comes_out_of_device_memory_without_a_copy(pair):
    """A PyTorch tensor on the GPU is sent from its own memory (taken over through DLPack, not copied), arrives in
    the device memory planned, and goes back to PyTorch over the receive's memory."""
    if (problem := cuda_problem()) is not None:
        pytest.skip(problem)
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    if not torch.cuda.is_available():
        pytest.skip(f"this PyTorch ({torch.__version__}) has no CUDA")
    from transports.common import data_pointer
    from transports.tensors import adopt

    cuda = Memory.parse("cuda")
    spec = TensorSpec("td", (64, 16), np.float32, 0, 1, cuda, cuda)
    for transport in pair:
        transport.placement.plan([spec])
    values = sample(spec.shape, np.float32)
    tensor = torch.tensor(values, device="cuda:0")
    assert data_pointer(adopt(tensor)) == tensor.data_ptr()  # taken over, not copied
    before = [t.stats() for t in pair]
    for step in range(2):
        received = transfer(pair, tensor, name="td", step=step)
        assert memory_of(received) == cuda
        np.testing.assert_array_equal(on_host(received), values)
        handed = as_framework(received, "torch")
        assert handed.is_cuda and handed.data_ptr() == data_pointer(received)
        assert torch.equal(handed, tensor)
    sender, receiver = (t.stats() - b for t, b in zip(pair, before, strict=True))
    assert (sender.device_to_host_bytes, receiver.host_to_device_bytes) == staged_bytes(pair, spec, 2)
    if pair[0].moves_device(spec):
        assert sender.copied_bytes == receiver.copied_bytes == 0


#: frameworks whose host tensors go in through DLPack (each skipped where it is not installed)
FRAMEWORKS = ["tensorflow", "torch", "jax"]


@pytest.mark.long
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_host_tensors_of_other_frameworks_go_in_and_out_without_a_copy(pair, framework):
    """A framework's CPU tensor is sent from its own memory (the sender's ledger shows no more copies than for the
    same NumPy array) and a received array goes to the framework over the receive's memory."""
    values = sample((64, 16), np.float32)
    tensor = framework_tensor(framework, values)
    before = pair[0].stats()
    np.testing.assert_array_equal(transfer(pair, values, name="np"), values)
    numpy_copies = (pair[0].stats() - before).copied_bytes
    before = pair[0].stats()
    received = transfer(pair, tensor, name="fw")
    assert (pair[0].stats() - before).copied_bytes == numpy_copies
    np.testing.assert_array_equal(received, values)
    try:
        handed = as_framework(received, framework)
    except ValueError:  # refused only where a copy would be needed: memory the caller must not write, or, for JAX,
        assert not received.flags.writeable or (framework == "jax" and received.ctypes.data % JAX_ALIGNMENT)
        return  # memory off XLA's alignment
    assert framework_pointer(framework, handed) == received.ctypes.data
