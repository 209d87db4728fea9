"""The fabric on device memory: which transfers a transport moves from GPU to GPU itself, and what the ucx fabric
asks of UCX for it. Everything here runs without a GPU; the transfers themselves are the conformance suite's
``cuda-cuda`` cases (``tests/test_conformance.py``), which run where a GPU is and skip here saying why."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import start_pair
from transports import TensorSpec
from transports.fabric.base import FabricError
from transports.memory import cuda_problem

ucx = pytest.importorskip("transports.fabric.ucx.device")


def offers(*names):
    return lambda name: name in names


@pytest.mark.parametrize(("tls", "offered", "given"), [
    ("posix,cma", ("cuda_copy", "cuda_ipc"), "posix,cma,cuda_copy,cuda_ipc"),  # shm, a GPU here
    ("rc", ("cuda_copy",), "rc,cuda_copy"),  # rdma: GPUDirect where rc registers GPU memory
    ("posix,cma", (), "posix,cma"),  # no GPU: nothing named that UCX would warn about
    ("posix,cuda_ipc", ("cuda_copy", "cuda_ipc"), "posix,cuda_ipc,cuda_copy"),  # none named twice
    ("^sysv,tcp", ("cuda_copy", "cuda_ipc"), "^sysv,tcp"),  # auto: every transport but two takes them in already
])
def test_a_transport_list_the_fabric_chose_takes_in_the_cuda_transports_offered(tls, offered, given):
    assert ucx.with_device_transports(tls, offers=offers(*offered)) == given


@pytest.mark.parametrize(("tls", "offered", "moves"), [
    ("^sysv,tcp", ("cuda_copy",), True),
    ("^sysv,tcp,cuda", ("cuda_copy",), False),  # the user's exclusion
    ("^sysv,tcp,cuda_copy", ("cuda_copy",), False),
    ("posix,cma,cuda_copy,cuda_ipc", ("cuda_copy",), True),
    ("posix,cma,cuda", ("cuda_copy",), True),  # UCX's alias
    ("posix,cma", ("cuda_copy",), False),  # a user's list without them
    ("^sysv,tcp", (), False),  # no GPU, or a UCX built without CUDA
])
def test_ucx_moves_device_memory_where_it_offers_and_is_given_cuda_copy(tls, offered, moves):
    assert ucx.moves_device_memory(tls, offers=offers(*offered)) is moves


def test_a_device_says_whether_it_moves_device_memory_here_and_why_not():
    from transports.fabric import open_device

    here = cuda_problem() is None and ucx.library.offers_transport("cuda_copy")
    for fabric_transport in ("shm", "tcp"):
        device = open_device("ucx", fabric_transport)
        try:
            moves = device.moves_device_memory
            problem = device.device_memory_problem()
            assert moves == (here and fabric_transport != "tcp") and (problem is None) == moves
            if fabric_transport == "tcp":
                assert "stream carries host memory only" in problem
            elif not moves:
                assert f"UCX_TLS={device.tls}" in problem and "GPU" in problem
        finally:
            device.close()


def test_device_memory_is_refused_by_a_device_that_cannot_register_it_naming_why():
    class DeviceTensor:  # what Numba or CuPy hand over: the interface of memory on a GPU
        nbytes = 16

        @property
        def __cuda_array_interface__(self):
            return {"shape": (4,), "typestr": "<f4", "data": (0x7F0000000000, False), "version": 3}

    from transports.fabric import open_device

    device = open_device("ucx", "tcp")
    try:
        with pytest.raises(FabricError, match="cannot register device memory here: over --fabric-transport tcp"):
            device.register(DeviceTensor())
        assert device.registrations() == 0
    finally:
        device.close()


SPECS = {
    "cuda-cuda": TensorSpec("t", (8,), np.float32, 0, 1, "cuda", "cuda"),
    "cuda:0-cuda:1": TensorSpec("t", (8,), np.float32, 0, 1, "cuda:0", "cuda:1"),
}
STAGED = {
    "host-host": TensorSpec("t", (8,), np.float32, 0, 1),
    "cuda-host": TensorSpec("t", (8,), np.float32, 0, 1, "cuda", "host"),
    "host-cuda": TensorSpec("t", (8,), np.float32, 0, 1, "host", "cuda"),
    "dynamic": TensorSpec("t", None, np.float32, 0, 1, "cuda", "cuda"),  # no shape: the dynamic path reads it
}


@pytest.mark.parametrize(("name", "options", "writes"), [
    ("zerocopy", {}, True), ("rdma_cp", {}, True),
    ("grpc_rdma", {"mode": "direct"}, True),  # the result tensor on its device, written from the source tensor
    ("grpc_rdma", {"mode": "buffered"}, False),  # the proxy buffer is host memory
], ids=["zerocopy", "rdma_cp", "grpc_rdma-direct", "grpc_rdma-buffered"])
def test_only_a_static_transfer_from_device_to_device_goes_without_host_memory(name, options, writes):
    pair = start_pair(name, fabric_transport="shm", **options)
    try:
        for transport in pair:
            device_capable = transport.writes_device_memory and transport.device.moves_device_memory
            assert transport.device_memory == device_capable
            assert transport.writes_device_memory == writes
            for label, spec in SPECS.items():
                assert transport.moves_device(spec) == device_capable, label
            for label, spec in STAGED.items():
                assert not transport.moves_device(spec), label
            assert not transport.moves_device(None)
    finally:
        for transport in pair:
            transport.close()


def test_a_flagged_put_can_order_its_data_before_its_flag_with_a_bounded_flush():
    """Where UCX moves GPU memory a flagged put orders its data before its flag with a flush of the endpoint, which
    its deadline bounds (shim.c: tt_put_flagged's flush_between), not with a fence, which spins unbounded on a copy
    that never completes. Here on host memory the peer's memory is not mapped: each transfer is UCX's put."""
    import threading

    from tests.test_fabric_conformance import connect
    from transports.fabric import open_device

    a, b = open_device("ucx", "shm"), open_device("ucx", "shm")
    try:
        assert a.flush_between == int(a.moves_device_memory)
        a.flush_between = 1
        size = 1 << 20
        source, slots, control = a.alloc(size, shared=False), b.alloc(2 * size, shared=False), b.alloc(128)
        staging, credits = a.alloc(64), a.alloc(64)
        control.array[:] = 0
        flags = b.flag_set([control.array[8:9]])
        channel = connect(a, b)
        for round_ in range(1, 4):  # one put at a time: the flag, once up, finds all of its data
            flags.reset()
            source.array[:] = round_
            staging.array[0] = 1
            writer = threading.Thread(target=channel.write_flagged, args=(
                source.array, slots.export().at(0, size), staging.array[:1], control.export().at(8, 1)))
            writer.start()
            assert flags.wait_any(10.0) == 0
            assert (slots.array[:size] == round_).all()
            writer.join(10)
            control.array[8] = 0
        trailers = [control.array[0:9], control.array[64:73]]
        take = b.take_plan(trailers)
        exported = control.export()
        plan = channel.send_plan([slots.export().at(0, size), slots.export().at(size, size)],
                                 [exported.at(0, 9), exported.at(64, 9)], staging.array[:9],
                                 credits.array[:8].view(np.uint64))
        assert not plan.mapped and plan._plan.flush_between == 1
        for seq in range(4):
            credits.array[:8].view(np.uint64)[0] = seq  # (as the receiver's credit would set it)
            source.array[:] = 10 + seq
            assert plan.send(source.array, seq, seq, 10.0, timeout=10) is True
            assert take.take(seq, seq, 10.0) is True
            assert (slots.array[(seq % 2) * size:(seq % 2 + 1) * size] == 10 + seq).all()
    finally:
        a.close()
        b.close()


def test_the_shim_holds_a_cuda_context_for_ucx_only_where_the_driver_gives_one():
    ucx.load()
    held = ucx._lib.tt_cuda_use(0)
    if cuda_problem() is None:
        assert held == 0
    else:  # no driver here: nothing is held, and a thread entering UCX is left as it is
        assert held != 0
    ucx._lib.tt_cuda_enter()


def test_bench_micro_moves_device_memory_between_two_processes(tmp_path):
    """The one case here that runs sender and receiver in two processes, as ``bench micro --memory cuda`` does: CUDA
    IPC (UCX's cuda_ipc) reaches a peer's GPU memory only from another process, so the in-process pairs of the
    conformance suite never unpack such a key or put through it."""
    import subprocess
    import sys

    from bench.results import load_run

    if (problem := cuda_problem()) is not None:
        pytest.skip(problem)
    out = tmp_path / "run"
    lines = ["zerocopy", "rdma_cp", "grpc_rdma:direct", "grpc_tcp"]
    result = subprocess.run([sys.executable, "-m", "bench.cli", "micro", "--memory", "cuda", "--sizes", "1KB,1MB",
                             "--iters", "20", "--warmup", "2", "--transports", ",".join(lines), "--no-references",
                             "--no-peers", "--no-plot", "--out", str(out)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = load_run(out).records.set_index(["transport", "size_bytes"])
    assert sorted(set(records.index.get_level_values(0))) == sorted(lines), result.stderr[-3000:]
    assert (records["sender_memory"] == "cuda:0").all() and (records["receiver_memory"] == "cuda:0").all()
    for size in (1024, 1 << 20):
        for line in ("zerocopy", "rdma_cp", "grpc_rdma:direct"):  # GPU to GPU: nothing crosses to the host
            assert records.loc[(line, size), "device_to_host_bytes_per_transfer"] == 0, line
            assert records.loc[(line, size), "host_to_device_bytes_per_transfer"] == 0, line
        assert records.loc[("zerocopy", size), "copied_bytes_per_transfer"] == 0
        # TensorFlow's GPU RecvTensor path: the sender copies to the host before it serialises, the receiver back
        assert records.loc[("grpc_tcp", size), "device_to_host_bytes_per_transfer"] == size
        assert records.loc[("grpc_tcp", size), "host_to_device_bytes_per_transfer"] == size
