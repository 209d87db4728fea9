"""The parameter-server runtime: the same weights as local training over every transport."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import transports
from bench.experiments.training import model_config, model_record, train
from bench.runtime.analyzer import Layout, Plan, Transfer, Variable, gradient_buckets, gradient_key, weight_key
from bench.runtime.config import TrainConfig
from bench.runtime.local import train_locally
from bench.runtime.update import apply_sgd

pytest.importorskip("tensorflow")

TINY = "tests.tiny_models:TINY"
TRANSPORTS = [
    ("grpc_tcp", {}),
    ("zerocopy", {"fabric_transport": "shm"}),
    ("rdma_cp", {"fabric_transport": "shm"}),
    ("grpc_rdma", {"fabric_transport": "shm", "mode": "buffered"}),
    ("grpc_rdma", {"fabric_transport": "shm", "mode": "direct"}),
]


def config(transport="zerocopy", options=None, servers=1, steps=3):
    return model_config(TINY, transport=transport, transport_options=options or {}, batch_size=4,
                        servers=servers, steps=steps, warmup=1, learning_rate=0.1, timeout_s=120)


def final_weights(result):
    weights = {}
    for role, times in result["outcome"].values():
        if role == "ps":
            weights.update(times.extra["final_weights"])
    return weights


@pytest.mark.parametrize(("transport", "options"), TRANSPORTS,
                         ids=[f"{t}-{o.get('mode', '')}".rstrip("-") for t, o in TRANSPORTS])
def test_training_over_a_transport_ends_with_the_local_weights(transport, options):
    if not transports.availability(transport).ok:
        pytest.skip(transports.availability(transport).reason)
    run = config(transport, options)
    _, local = train_locally(run)
    distributed = final_weights(train(run))
    assert sorted(distributed) == sorted(local)
    for index, weight in local.items():
        np.testing.assert_allclose(distributed[index], weight, rtol=1e-5, atol=1e-6)


def test_two_servers_average_their_gradients_like_local_training():
    run = config("zerocopy", {"fabric_transport": "shm"}, servers=2)
    _, local = train_locally(run)
    distributed = final_weights(train(run))
    for index, weight in local.items():
        np.testing.assert_allclose(distributed[index], weight, rtol=1e-5, atol=1e-6)


def test_zerocopy_training_copies_no_payload():
    run = config("zerocopy", {"fabric_transport": "shm"})
    result = train(run)
    record = model_record(run, result["outcome"]).row()
    assert record["copied_bytes_per_step"] == 0
    assert record["runtime_copied_bytes_per_step"] == 0  # weights enter TensorFlow through DLPack in place
    # the record names the fabric and the UCX transports that carried the tensors (shared memory here)
    backend, _, carriers = record["fabric"].partition(":")
    assert backend == "ucx" and carriers and set(carriers.split(",")) <= {"cma", "posix", "sysv", "self", "tcp"}


def test_a_worker_sends_each_dense_gradient_while_its_step_computes():
    """Every gradient of the tiny model (dense) is handed to the transport by TensorFlow's threads during the
    backward pass, none after it; the weights still end as local training's."""
    run = config("zerocopy", {"fabric_transport": "shm"})
    result = train(run)
    [worker] = [times for role, times in result["outcome"].values() if role == "worker"]
    assert worker.extra["updates_sent_early"] == 4 * run.steps  # two kernels and two biases, every timed step
    assert worker.extra["stats"]["tensors_sent"] == 4 * run.steps
    assert model_record(run, result["outcome"]).row()["updates_sent_early_per_step"] == 4
    _, local = train_locally(run)
    for index, weight in final_weights(result).items():
        np.testing.assert_allclose(weight, local[index], rtol=1e-5, atol=1e-6)


def test_dense_gradients_are_handed_over_in_buckets_last_weights_first():
    """One call into the step's graph per bucket of about the bucket's bytes, not per gradient; a sparse gradient
    (IndexedSlices) is sent after the step, in no bucket."""
    tf = pytest.importorskip("tensorflow")
    from bench.runtime.tensorflow_bridge import dense_bytes

    mb = 1 << 20
    sparse = tf.IndexedSlices(tf.zeros([2, 4]), tf.constant([0, 3]), tf.constant([8, 4]))
    kb = 256  # float32s
    gradients = [tf.zeros([256 * kb]), sparse, tf.zeros([256 * kb]), tf.zeros([512 * kb]), tf.zeros([768 * kb])]
    sizes = dense_bytes(gradients)
    assert sizes == [mb // 4, None, mb // 4, mb // 2, 3 * mb // 4]
    assert gradient_buckets(sizes, bucket_bytes=mb) == [[4, 3], [2, 0]]
    assert gradient_buckets(sizes, bucket_bytes=4 * mb) == [[4, 3, 2, 0]]
    assert gradient_buckets(sizes, bucket_bytes=1) == [[4], [3], [2], [0]]


def test_grpc_tcp_training_shows_where_copies_remain():
    run = config("grpc_tcp")
    record = model_record(run, train(run)["outcome"]).row()
    model_bytes = (8 * 16 + 16 + 16 * 3 + 3) * 4
    # read-only message views cannot enter TensorFlow in place: one runtime copy of the weights
    assert record["runtime_copied_bytes_per_step"] == model_bytes
    # 3 copies per transfer, weights one way and gradients the other
    assert record["copied_bytes_per_step"] == 3 * 2 * model_bytes + model_bytes
    assert record["fabric"] == "none"


def test_the_ps_rejects_a_gradient_of_the_wrong_shape_naming_the_tensor():
    variable = Variable(3, "dense/kernel", (4, 2), np.dtype(np.float32))
    weight = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match=r"gradient for 'dense/kernel' \(variable 3\) has float32 \(2, 4\)"):
        apply_sgd(variable, weight, [np.zeros((2, 4), np.float32)], 0.1)
    assert not weight.any()


def scripted_plan(variables, servers=1):
    """A plan for ``variables`` with dense gradients (what the analyzer gives for such a model)."""
    layout = Layout(servers)
    transfers = []
    for v in variables:
        for server in range(servers):
            transfers.append(Transfer(weight_key(v), "weight", v.path, v.shape, None, v.dtype, layout.ps_of(v), server,
                                      "ps"))
            transfers.append(Transfer(gradient_key(v), "gradient", v.path, v.shape, None, v.dtype, server,
                                      layout.ps_of(v), "op"))
    return Plan("scripted", servers, 1, tuple(variables), tuple(transfers))


def test_variables_are_placed_round_robin_and_planned_both_ways():
    from bench.runtime.config import plan_of

    run = config(servers=2)
    plan = plan_of(run)
    layout = plan.layout
    assert [layout.ps_of(v) for v in plan.variables] == [2, 3, 2, 3]
    assert len(plan.transfers) == 4 * 2 * 2  # weights and gradients, to and from each worker
    assert {(t.name, t.src, t.dst) for t in plan.transfers if t.name == "w1"} == {("w1", 3, 0), ("w1", 3, 1)}
    assert all(t.static for t in plan.transfers)


def test_buffered_grpc_rdma_results_enter_tensorflow_without_a_runtime_copy():
    run = config("grpc_rdma", {"fabric_transport": "shm", "mode": "buffered"})
    record = model_record(run, train(run)["outcome"]).row()
    model_bytes = (8 * 16 + 16 + 16 * 3 + 3) * 4
    assert record["runtime_copied_bytes_per_step"] == 0  # results are 64-byte aligned and writable
    assert record["copied_bytes_per_step"] == 2 * 2 * model_bytes  # one copy on each side, both directions


def test_asynchronous_sgd_with_one_worker_is_plain_sgd():
    run = config("zerocopy", {"fabric_transport": "shm"})
    run.asynchronous = True
    _, local = train_locally(run)
    distributed = final_weights(train(run))
    for index, weight in local.items():
        np.testing.assert_allclose(distributed[index], weight, rtol=1e-5, atol=1e-6)


def test_asynchronous_sgd_with_two_workers_applies_every_gradient():
    run = config("zerocopy", {"fabric_transport": "shm"}, servers=2, steps=4)
    run.asynchronous = True
    result = train(run)
    record = model_record(run, result["outcome"]).row()
    assert record["steps"] == 4 and record["throughput_batches_per_s"] > 0
    applied = [t.extra["gradients_applied"] for role, t in result["outcome"].values() if role == "ps"]
    # each of the 4 variables got one gradient per worker per timed step
    assert sum(applied) == 4 * 2 * 4
    assert all(np.isfinite(w).all() for w in final_weights(result).values())
    assert_cpu_is_the_timed_steps(record)


def assert_cpu_is_the_timed_steps(record):
    """A worker's and a PS's CPU a step: some, and no more than the machine's cores could give in a step (with room
    for the moments between steps). Taken over the whole process life instead, the model's building and the first
    connects (seconds) would be many times a tiny model's step (milliseconds)."""
    most = (os.cpu_count() or 1) * record["step_time_s"] * 2
    assert 0 < record["worker_cpu_s_per_step"] < most and 0 < record["ps_cpu_s_per_step"] < most, record


def test_a_record_gives_each_process_s_cpu_a_step():
    run = config("grpc_tcp")
    assert_cpu_is_the_timed_steps(model_record(run, train(run)["outcome"]).row())


LEDGER = ("tensors_sent", "tensors_received", "payload_bytes_sent", "payload_bytes_received", "copied_bytes")


def test_replayed_compute_moves_the_same_tensors_as_real_compute():
    from bench.experiments.training import prepare

    real = config("grpc_tcp", servers=2)  # the transport with copies on both sides, and the runtime's own
    replay = prepare(dataclasses.replace(real, compute="replay"))
    assert replay.compute_s > 0 and [v.shape for v in replay.plan.variables] == [(8, 16), (16,), (16, 3), (3,)]
    outcomes = [train(run)["outcome"] for run in (real, replay)]
    for rank in range(4):
        (role, real_times), (same_role, replayed_times) = outcomes[0][rank], outcomes[1][rank]
        assert role == same_role
        ledgers = [{k: times.extra["stats"][k] for k in LEDGER} for times in (real_times, replayed_times)]
        assert ledgers[0] == ledgers[1]
        assert real_times.copied_bytes == replayed_times.copied_bytes  # the runtime's own copies too
    records = [model_record(run, outcome).row() for run, outcome in zip((real, replay), outcomes, strict=True)]
    assert records[0]["copied_bytes_per_step"] == records[1]["copied_bytes_per_step"]


def test_replayed_processes_build_no_model():
    from bench.experiments.training import prepare

    replay = prepare(config("zerocopy", {"fabric_transport": "shm"}, servers=1))
    replay = prepare(dataclasses.replace(replay, compute="replay"))
    outcome = train(replay)["outcome"]
    # TensorFlow alone takes hundreds of MB; the replaying ranks never import it
    assert all(times.extra["peak_rss_mb"] < 200 for _, times in outcome.values())


def test_paper_compute_is_the_papers_time_per_sample_times_the_batch():
    from bench.experiments.training import TrainingError, prepare

    fcn5 = model_config("fcn5", transport="zerocopy", transport_options={}, batch_size=4, compute="paper")
    assert prepare(fcn5).compute_s == pytest.approx(4 * 4.88e-3)
    with pytest.raises(TrainingError, match=r"the paper gives no compute time for model 'tests\.tiny_models:TINY'"):
        prepare(dataclasses.replace(config(), compute="paper"))


# -- the overlapped parameter server, in one process ----------------------------------------------


class Recording:
    """A transport that records, in order, every weight it sends and every gradient it receives."""

    def __init__(self, transport) -> None:
        self.transport = transport
        self.events: list[tuple[str, str, int]] = []

    def __getattr__(self, name):
        return getattr(self.transport, name)

    def send_async(self, key, array):
        self.events.append(("sent", key.name, key.step))
        return self.transport.send_async(key, array)

    def recv(self, key, timeout=None):
        array = self.transport.recv(key, timeout)
        self.events.append(("received", key.name, key.step))
        return array

    def recv_each(self, keys, timeout=None):
        for key, array in self.transport.recv_each(keys, timeout):
            self.events.append(("received", key.name, key.step))
            yield key, array

    def recv_many(self, keys, timeout=None):
        keys = list(keys)
        arrived = dict(self.recv_each(keys, timeout))
        return [arrived[key] for key in keys]


def gradient(variable, step):
    """What the scripted worker sends: different for every variable and step."""
    return np.full(variable.shape, (step + 1) * (1 + variable.index) / 8, variable.dtype)


def test_the_ps_sends_a_variables_next_weights_before_the_other_gradients_are_in():
    from concurrent.futures import ThreadPoolExecutor

    from bench.runtime.config import initial_weights
    from bench.runtime.ps import run_ps
    from transports import Cluster, Key

    variables = [Variable(0, "a", (3,), np.dtype(np.float32)), Variable(1, "b", (2, 2), np.dtype(np.float32))]
    run = TrainConfig(model="scripted", workload=None, transport="local", transport_options={}, batch_size=1,
                      steps=3, warmup=0, learning_rate=0.5, compute="replay", plan=scripted_plan(variables),
                      timeout_s=20)

    expected = initial_weights(run, variables)
    cluster = Cluster(("worker", "ps"))
    with transports.create("local") as worker, transports.create("local") as ps, ThreadPoolExecutor(1) as pool:
        worker.start(cluster, 0)
        ps.start(cluster, 1)
        recording = Recording(ps)
        serving = pool.submit(run_ps, run, recording, run.plan, 0)
        try:
            weights = {v.index: worker.recv(Key(weight_key(v), 0, 1, 0), 20).copy() for v in variables}
            for step in range(run.steps):
                for variable in variables:
                    np.testing.assert_allclose(weights[variable.index], expected[variable.index], rtol=1e-6)
                # one variable's gradient, then that variable's next weights, only then the other gradient:
                # a PS that waits for every gradient of a step before sending anything never gets there
                order = variables if step % 2 == 0 else variables[::-1]
                for variable in order:
                    worker.send_async(Key(gradient_key(variable), step, 0, 1), gradient(variable, step)).result(20)
                    expected[variable.index] -= run.learning_rate * gradient(variable, step)
                    if step + 1 < run.steps:
                        key = Key(weight_key(variable), step + 1, 1, 0)
                        weights[variable.index] = worker.recv(key, 20).copy()
            times = serving.result(20)
        finally:
            ps.close()  # a PS still waiting fails instead of outliving the test
    for variable in variables:  # each variable updated once per step, with that step's gradient
        np.testing.assert_allclose(times.extra["final_weights"][variable.index], expected[variable.index], rtol=1e-6)
    events = recording.events
    for step in range(run.steps - 1):
        first, second = (variables if step % 2 == 0 else variables[::-1])
        assert events.index(("sent", weight_key(first), step + 1)) < events.index(
            ("received", gradient_key(second), step))
    assert times.extra["gradients_applied"] == len(variables) * run.steps


class Announcing:
    """The launcher's messages to one rank, in one process."""

    rank, name = 1, "ps 0"

    def __init__(self) -> None:
        self.queue: list = []

    def send_to(self, rank, payload) -> None:
        self.queue.append(payload)

    def receive(self, timeout=None):
        if not self.queue:
            raise TimeoutError("nothing to receive")
        return self.queue.pop(0)


def test_the_content_check_covers_receives_posted_together():
    from bench.experiments.soak import CheckedTransport
    from transports import Cluster, Key

    cluster = Cluster(("worker", "ps"))
    with transports.create("local") as sender, transports.create("local") as receiver:
        sender.start(cluster, 0)
        receiver.start(cluster, 1)
        hub = Announcing()
        announcing, checked = CheckedTransport(sender, hub, 1), CheckedTransport(receiver, hub, 1)
        keys = [Key(f"g{i}", 0, 0, 1) for i in range(3)] + [Key(f"g{i}", 1, 0, 1) for i in range(3)]
        arrays = {key: np.full(4, i, np.float32) for i, key in enumerate(keys)}
        sends = [announcing.send_async(key, array) for key, array in arrays.items()]
        arrays[keys[1]][0] = 99  # changed after its checksum went out: arrives as corrupted
        received = checked.recv_many(keys[:3])
        assert [int(r[-1]) for r in received] == [0, 1, 2]
        assert checked.received == 3 and checked.corrupted == 1
        arrays[keys[5]][0] = 99
        assert {key for key, _ in checked.recv_each(keys[3:])} == set(keys[3:])
        for sent in sends:
            sent.result(5)
        assert announcing.sent == 6
        assert checked.counts(drain_s=0.01) == {"tensors_sent": 0, "tensors_received": 6, "corrupted": 2, "lost": 0}
