"""The graph analyzer (static and dynamic tensors from the traced step), and training with its plan."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.experiments.training import model_config, model_record, train
from bench.runtime.analyzer import DEDUP_SITE, PS_SITE, Plan
from bench.runtime.config import plan_of
from bench.runtime.local import train_locally
from transports import Key, TensorSpec

from .test_runtime import final_weights
from .test_zerocopy import close, pair_of

pytest.importorskip("tensorflow")

TINY_EMBEDDING = "tests.tiny_models:TINY_EMBEDDING"
F32, I32 = np.dtype(np.float32), np.dtype(np.int32)


def config(transport="zerocopy", options=None, servers=2, steps=3, label=""):
    return model_config(TINY_EMBEDDING, transport=transport, transport_options=options or {}, batch_size=4,
                       servers=servers, steps=steps, warmup=1, learning_rate=0.1, timeout_s=120, label=label)


# (index, path, shape, trainable, what the worker sends back: (name, shape, bound, dtype, site op type))
EXPECTED_VARIABLES = [
    (0, "sequential/embedding/embeddings", (50, 4), True,
     [("g0.values", None, (24, 4), F32, DEDUP_SITE), ("g0.indices", None, (24,), I32, DEDUP_SITE)]),
    (1, "sequential/hidden/kernel", (4, 5), True, [("g1", (4, 5), None, F32, "MatMul")]),
    (2, "sequential/hidden/bias", (5,), True, [("g2", (5,), None, F32, "BiasAddGrad")]),
    (3, "sequential/norm/gamma", (5,), True, [("g3", (5,), None, F32, "Mul")]),
    (4, "sequential/norm/beta", (5,), True, [("g4", (5,), None, F32, "Sum")]),
    (5, "sequential/logits/kernel", (5, 3), True, [("g5", (5, 3), None, F32, "MatMul")]),
    (6, "sequential/logits/bias", (3,), True, [("g6", (3,), None, F32, "BiasAddGrad")]),
    (7, "sequential/norm/moving_mean", (5,), False, [("u7", (5,), None, F32, "AddV2")]),
    (8, "sequential/norm/moving_variance", (5,), False, [("u8", (5,), None, F32, "AddV2")]),
]


def test_the_plan_of_a_small_model_with_static_and_dynamic_tensors_is_exactly_the_expected_one():
    plan = plan_of(config(servers=2))
    assert [(v.index, v.path, v.shape, v.trainable, v.sparse_rows) for v in plan.variables] == [
        (i, path, shape, trainable, 24 if i == 0 else 0) for i, path, shape, trainable, _ in EXPECTED_VARIABLES]
    expected = []
    for index, path, shape, trainable, updates in EXPECTED_VARIABLES:
        ps = 2 + index % 2  # round-robin over the two parameter servers (ranks 2 and 3)
        for worker in (0, 1):
            expected.append(("w" if trainable else "s") + f"{index}" + "|" + repr(
                (path, shape, None, F32, ps, worker, PS_SITE)))
            for name, update_shape, bound, dtype, site in updates:
                expected.append(f"{name}|" + repr((path, update_shape, bound, dtype, worker, ps, site)))
    got = [f"{t.name}|" + repr((t.variable, t.shape, t.bound, t.dtype, t.src, t.dst,
                                t.site if t.site in (PS_SITE, DEDUP_SITE) else t.site.split()[0]))
           for t in plan.transfers]
    assert got == expected
    roles = {t.name[0]: t.role for t in plan.transfers}
    assert roles == {"w": "weight", "g": "gradient", "s": "state", "u": "state update"}
    # what the transports are handed: the dynamic tensors without a shape
    specs = plan.specs(0)
    assert TensorSpec("g0.values", None, F32, 0, 2) in specs and TensorSpec("g1", (4, 5), F32, 0, 3) in specs
    assert all(spec.src == 0 or spec.dst == 0 for spec in specs)
    # registered memory: worker 0 receives every value (static) and sends the sparse rows from transport memory
    values = sum(int(np.prod(shape)) * 4 for _, _, shape, _, _ in EXPECTED_VARIABLES)
    assert plan.pool_bytes(0) == values + 24 * 4 * 4 + 24 * 4


def test_a_plan_survives_json_and_the_analysis_off_makes_every_tensor_dynamic():
    plan = plan_of(config(servers=1))
    again = Plan.from_json(json.loads(plan.dumps()))
    assert again == plan and again.transfers == plan.transfers
    off = plan.without_analysis()
    assert not off.analysis and all(not t.static and t.bound is not None for t in off.transfers)
    assert [t.nbytes for t in off.transfers] == [t.nbytes for t in plan.transfers]


@pytest.mark.parametrize("label", ["zerocopy", "zerocopy:no_analysis", "grpc_tcp"])
def test_the_dynamic_model_trains_to_the_same_values_as_locally(label):
    name, _, mode = label.partition(":")
    options = {"analysis": False} if mode == "no_analysis" else {}
    if name == "zerocopy":
        options["fabric_transport"] = "shm"
    run = config(name, options, label=label)
    _, local = train_locally(run)
    result = train(run)
    distributed = final_weights(result)
    assert sorted(distributed) == list(range(9))  # the weights and the BatchNorm state, all kept by the PS
    for index, value in local.items():
        np.testing.assert_allclose(distributed[index], value, rtol=1e-5, atol=1e-6, err_msg=f"variable {index}")
    record = model_record(run, result["outcome"]).row()
    if name == "zerocopy":
        # a sparse gradient is two dynamic tensors per worker; with the analysis off every tensor is
        tensors = 2 if mode == "" else sum(len(u) for *_, u in EXPECTED_VARIABLES) + len(EXPECTED_VARIABLES)
        assert record["dynamic_transfers_per_step"] == tensors * 2
        assert record["analysis"] == ("off" if mode else "on")


def test_without_the_analysis_a_model_of_more_tensors_than_threads_trains():
    # every send is dynamic and waits for its reader on one of the transport's 64 threads; the credits of
    # tensors connected later must not queue behind them (they did: the PS waited for them forever)
    run = model_config("tests.tiny_models:TINY_DEEP", transport="zerocopy",
                       transport_options={"fabric_transport": "shm", "analysis": False}, batch_size=2, servers=1,
                       steps=1, warmup=2, learning_rate=0.1, timeout_s=60, label="zerocopy:no_analysis")
    _, local = train_locally(run)
    distributed = final_weights(train(run))
    assert len(distributed) == 80
    for index, value in local.items():
        np.testing.assert_allclose(distributed[index], value, rtol=1e-5, atol=1e-6)


def test_the_parameter_servers_keep_the_batchnorm_statistics():
    run = config(servers=1, options={"fabric_transport": "shm"})
    initial = plan_of(run)
    result = train(run)
    state = final_weights(result)
    moving_mean, moving_variance = state[7], state[8]
    assert initial.variables[7].path.endswith("moving_mean")
    assert np.abs(moving_mean).max() > 0  # it starts at zeros: the workers' updates reached the PS
    assert not np.allclose(moving_variance, 1.0)  # it starts at ones


def test_zerocopy_training_of_the_dynamic_model_copies_nothing_and_registers_nothing_per_step():
    run = config(servers=1, options={"fabric_transport": "shm"}, steps=4)
    record = model_record(run, train(run)["outcome"]).row()
    assert record["copied_bytes_per_step"] == 0
    assert record["runtime_copied_bytes_per_step"] == 0
    # after the first step every sent tensor lies in registered memory: the PS's values in the pool, the
    # sparse rows in memory the transport gave, TensorFlow's gradients in the regions the tracing registered
    assert record["unregistered_sends_per_step"] == 0 and record["registration_hit_rate"] == 1.0
    assert record["registrations_per_step"] == 0
    assert record["site_regions"] >= 1


def test_without_the_analysis_zerocopy_registers_what_it_sends():
    run = config("zerocopy", {"fabric_transport": "shm", "analysis": False}, servers=1, label="zerocopy:no_analysis")
    record = model_record(run, train(run)["outcome"]).row()
    assert record["site_regions"] is None  # no tracing without the analysis
    assert record["unregistered_sends_per_step"] > 0 and record["registration_hit_rate"] < 1.0


def test_a_static_tensor_arriving_with_another_shape_is_an_error_naming_it_and_the_slot_is_untouched():
    spec = TensorSpec("g1", (4, 5), np.float32, 0, 1)
    pair = pair_of("zerocopy", "shm")
    pair[1].placement.plan([spec])  # only the receiver knows the shape: it placed the tensor, the sender learns it
    try:
        slot = pair[1]._incoming_slot("g1", 0)
        guard = slot.data.array.copy()
        receiving = pair[1].recv_async(Key("g1", 0, 0, 1))
        for wrong in (np.ones((5, 4), np.float32), np.ones((8, 5), np.float32), np.ones((4, 5), np.float64)):
            with pytest.raises(ValueError, match=r"g1@0 \(0->1\) has .* placed it as float32 \(4, 5\)"):
                pair[0].send(Key("g1", 0, 0, 1), wrong)
            np.testing.assert_array_equal(slot.data.array, guard)  # nothing was written
        right = np.arange(20, dtype=np.float32).reshape(4, 5)
        pair[0].send(Key("g1", 0, 0, 1), right)
        np.testing.assert_array_equal(receiving.result(timeout=30), right)
        # the queued path (a later send_async) checks the same
        receiving = pair[1].recv_async(Key("g1", 1, 0, 1))
        with pytest.raises(ValueError, match=r"g1@1 \(0->1\) has float32 \(2, 10\)"):
            pair[0].send_async(Key("g1", 1, 0, 1), np.ones((2, 10), np.float32)).result(timeout=30)
        receiving.cancel()
    finally:
        close(pair)
