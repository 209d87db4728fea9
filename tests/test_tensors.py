"""Where tensors live (``transports/memory.py``) and how tensors of any framework go in and out of a transport without
a copy (``transports/tensors.py``): memory kinds and their parsing, what the driver says here, DLPack intake from
NumPy, TensorFlow, PyTorch and JAX (data pointers equal, the ledger at zero copies), and the hand-over of a received
array to each framework over the same memory."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import start_pair
from tests.frameworks import framework_module, framework_pointer, framework_tensor
from transports import Key, TensorSpec
from transports.memory import HOST, Memory, cuda_problem, driver, memory_of, parse_sides
from transports.tensors import adopt, as_framework, data_pointer

FRAMEWORKS = ["tensorflow", "torch", "jax"]


# -- memory kinds --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "memory"), [("host", HOST), ("cuda", Memory("cuda", 0)),
                                               ("cuda:3", Memory("cuda", 3)), (" cuda:0 ", Memory("cuda", 0))])
def test_memory_kinds_parse(text, memory):
    assert Memory.parse(text) == memory
    assert Memory.parse(str(memory)) == memory


@pytest.mark.parametrize("text", ["gpu", "host:0", "cuda:", "cuda:-1", "cuda:x", "", "CUDA", "cuda:1234"])
def test_a_wrong_memory_kind_names_the_kinds_there_are(text):
    with pytest.raises(ValueError, match="host, cuda, cuda:N"):
        Memory.parse(text)


def test_memory_sides_are_one_kind_for_both_or_sender_then_receiver():
    assert parse_sides("host") == (HOST, HOST)
    assert parse_sides("cuda:1,host") == (Memory("cuda", 1), HOST)
    for text in ("host,host,host", "cuda,", ",host"):
        with pytest.raises(ValueError, match="sender's and receiver's"):
            parse_sides(text)


def test_a_spec_carries_each_sides_memory_and_host_is_the_default():
    spec = TensorSpec("w", (2,), np.float32, 0, 1)
    assert (spec.src_memory, spec.dst_memory) == (HOST, HOST)
    spec = TensorSpec("w", (2,), np.float32, 0, 1, "cuda:1", "host")
    assert (spec.src_memory, spec.dst_memory) == (Memory("cuda", 1), HOST)
    with pytest.raises(ValueError, match="host, cuda, cuda:N"):
        TensorSpec("w", (2,), np.float32, 0, 1, "vram")


def test_host_memory_always_works_and_device_memory_says_why_not_in_one_line():
    assert cuda_problem(HOST) is None
    problem = cuda_problem(Memory("cuda", 0))
    found = driver()
    if found.problem is not None:
        assert problem is not None and "NVIDIA" in problem and "\n" not in problem
        assert found.gpus == ()
    elif problem is None:
        assert found.gpus and found.cuda_version is not None
    beyond = cuda_problem(Memory("cuda", 99))
    assert beyond is not None and "\n" not in beyond


def test_a_host_array_lives_in_host_memory():
    assert memory_of(np.zeros(3)) == HOST


# -- in: tensors of any framework, over their own memory ----------------------------------------------------------


def test_a_numpy_array_is_taken_as_it_is():
    array = np.arange(4.0)
    assert adopt(array) is array


def test_a_numpy_subclass_and_a_buffer_are_taken_over_their_memory():
    class Labelled(np.ndarray):
        pass

    labelled = np.arange(6.0).reshape(2, 3).view(Labelled)
    taken = adopt(labelled)
    assert type(taken) is np.ndarray and taken.ctypes.data == labelled.ctypes.data
    buffer = bytearray(16)
    assert adopt(buffer).ctypes.data == np.frombuffer(buffer, np.uint8).ctypes.data


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_host_tensor_of_a_framework_is_taken_over_its_memory(framework):
    values = np.arange(48, dtype=np.float32).reshape(6, 8)
    tensor = framework_tensor(framework, values)
    taken = adopt(tensor)
    assert type(taken) is np.ndarray and memory_of(taken) == HOST
    assert taken.ctypes.data == framework_pointer(framework, tensor)
    np.testing.assert_array_equal(taken, values)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_received_array_goes_to_a_framework_over_its_memory(framework):
    framework_module(framework)
    array = aligned(1024)
    handed = as_framework(array, framework)
    assert framework_pointer(framework, handed) == array.ctypes.data == data_pointer(array)


def aligned(count: int, offset: int = 0) -> np.ndarray:
    """``count`` float32 zeros starting ``offset`` bytes past a 64-byte boundary (NumPy aligns to 16 only)."""
    raw = np.zeros(count * 4 + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    return raw[start : start + count * 4].view(np.float32)


def test_jax_is_refused_memory_it_would_copy():
    pytest.importorskip("jax")
    with pytest.raises(ValueError, match="64-byte alignment"):
        as_framework(aligned(256, offset=16), "jax")


def test_a_read_only_array_is_handed_over_writable_only_where_the_memory_is():
    array = np.zeros(16, np.float32)
    view = array.view()
    view.flags.writeable = False
    assert as_framework(view, "numpy") is view
    pytest.importorskip("torch")
    assert as_framework(view, "torch").data_ptr() == array.ctypes.data
    frozen = np.frombuffer(bytes(64), np.float32)  # memory nobody may write
    with pytest.raises(ValueError, match="read-only"):
        as_framework(frozen, "torch")


def test_an_unknown_framework_is_named():
    with pytest.raises(ValueError, match="one of numpy, cupy, torch"):
        as_framework(np.zeros(2), "mxnet")


def test_a_device_tensor_without_cupy_is_refused_naming_the_extra():
    class DeviceTensor:  # what Numba or CuPy hand over: the interface of memory on a GPU
        @property
        def __cuda_array_interface__(self):
            return {"shape": (4,), "typestr": "<f4", "data": (0x7F0000000000, False), "version": 3}

    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here: a device tensor would be taken")
    pair = start_pair("local")
    try:
        with pytest.raises(ValueError, match=r"cuda1[23]"):
            pair[0].send(Key("d", 0, 0, 1), DeviceTensor(), timeout=1)
    finally:
        for transport in pair:
            transport.close()


# -- the CI target: a TensorFlow and a PyTorch CPU tensor over zerocopy with no copy --------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_tensor_crosses_zerocopy_with_no_copy_either_side(framework):
    """A planned tensor of ``framework`` sent over zerocopy from its own memory and received into the slot, handed
    to the framework: the two ledgers count no copy, and the receive's memory is the framework tensor's."""
    values = np.arange(1 << 14, dtype=np.float32)
    tensor = framework_tensor(framework, values)
    pair = start_pair("zerocopy")
    try:
        spec = TensorSpec("fw", values.shape, np.float32, 0, 1)
        for transport in pair:
            transport.placement.plan([spec])
        before = [t.stats() for t in pair]
        for step in range(3):
            sent = pair[0].send_async(Key("fw", step, 0, 1), tensor)
            received = pair[1].recv(Key("fw", step, 0, 1))
            sent.result(timeout=10)
            handed = as_framework(received, framework)
            assert framework_pointer(framework, handed) == received.ctypes.data
            np.testing.assert_array_equal(np.from_dlpack(handed), values)
        sender, receiver = (t.stats() - b for t, b in zip(pair, before, strict=True))
        assert sender.tensors_sent == receiver.tensors_received == 3
        assert sender.copied_bytes == receiver.copied_bytes == 0
        assert sender.device_to_host_bytes == receiver.host_to_device_bytes == 0
    finally:
        for transport in pair:
            transport.close()


# -- bfloat16 (ml_dtypes'), which NumPy's DLPack refuses -----------------------------------------------------------


def _bfloat16():
    from transports.tensors import bfloat16

    dtype = bfloat16()
    if dtype is None:
        pytest.skip("ml_dtypes is not installed here")
    return dtype


def _framework_bfloat16(framework: str, values: np.ndarray):
    """A CPU bfloat16 tensor of ``framework`` holding ``values`` (bfloat16), in memory of its own."""
    module = framework_module(framework)
    if framework == "torch":
        return framework_tensor(framework, values.astype(np.float32)).to(module.bfloat16)
    return framework_tensor(framework, values)


def _bfloat16_pointer(framework: str, tensor) -> int:
    """The address of a bfloat16 ``tensor``'s first byte as its framework says (TensorFlow: its DLPack export's,
    read as uint16, since NumPy takes no bfloat16 capsule)."""
    from transports.tensors import DL_BFLOAT, DL_UINT, _relabelled

    if framework == "tensorflow":
        return np.from_dlpack(_relabelled(tensor, DL_BFLOAT, DL_UINT)).ctypes.data
    return framework_pointer(framework, tensor)


class _Bfloat16Producer:
    """A DLPack producer of bfloat16 (as a framework's tensor is) over ``bits`` (uint16), without any framework;
    ``code``: another DLPack type code for them."""

    def __init__(self, bits: np.ndarray, code: int = 4) -> None:
        self.bits, self.code = bits, code

    def __dlpack__(self, **_options):
        from transports.tensors import DL_UINT, _relabelled

        return _relabelled(self.bits, DL_UINT, self.code).__dlpack__()

    def __dlpack_device__(self):
        return self.bits.__dlpack_device__()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_bfloat16_tensor_of_a_framework_is_taken_over_its_memory(framework):
    values = np.arange(48, dtype=np.float32).reshape(6, 8).astype(_bfloat16())
    tensor = _framework_bfloat16(framework, values)
    taken = adopt(tensor)
    assert type(taken) is np.ndarray and taken.dtype == _bfloat16()
    assert taken.ctypes.data == _bfloat16_pointer(framework, tensor)
    np.testing.assert_array_equal(taken, values)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_received_bfloat16_array_goes_to_a_framework_over_its_memory_and_back(framework):
    framework_module(framework)
    array = aligned(24).view(_bfloat16())
    array[:] = np.arange(48, dtype=np.float32)
    handed = as_framework(array, framework)
    assert "bfloat16" in str(handed.dtype)
    assert _bfloat16_pointer(framework, handed) == array.ctypes.data
    back = adopt(handed)
    assert back.dtype == _bfloat16() and back.ctypes.data == array.ctypes.data
    np.testing.assert_array_equal(back, array)


def test_a_bfloat16_dlpack_producer_is_taken_without_any_framework():
    """What a framework's DLPack export of bfloat16 is (its capsule's dtype DLPack's bfloat16 code) is taken as
    ml_dtypes' bfloat16 over the same memory; NumPy alone refuses it."""
    bits = np.arange(8, dtype=np.float32).astype(_bfloat16()).view(np.uint16)
    with pytest.raises((BufferError, RuntimeError, TypeError, ValueError)):
        np.from_dlpack(_Bfloat16Producer(bits))
    taken = adopt(_Bfloat16Producer(bits))
    assert taken.dtype == _bfloat16() and taken.ctypes.data == bits.ctypes.data
    np.testing.assert_array_equal(taken.astype(np.float32), np.arange(8, dtype=np.float32))


def test_a_dlpack_producer_numpy_refuses_for_another_reason_is_refused_as_numpy_says():
    producer = _Bfloat16Producer(np.zeros(4, np.uint16), code=99)  # a type code no one knows
    with pytest.raises(RuntimeError, match="Unsupported dtype"):
        adopt(producer)
