"""bench predict's cost model: a transport's transfer split into host time, latency and wire, from a micro run."""

from __future__ import annotations

import math
import shutil
from itertools import pairwise
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.experiments.predict.costs import cost_from_points, costs_from_run, sizes_needed
from bench.results import load_run
from bench.runtime.analyzer import Output, Variable, plan_from

#: a real `bench micro --sizes 1KB,64KB,1MB,16MB --transports zerocopy,rdma_cp,grpc_rdma,grpc_tcp --no-peers
#: --no-references --iters 50` on this project's 2-core machine (README.md beside it)
MICRO = Path(__file__).parent / "data" / "predict" / "micro"
TRANSPORTS = ["zerocopy", "rdma_cp", "grpc_rdma", "grpc_tcp"]
FEW = settings(max_examples=25, deadline=None, derandomize=True)


def test_an_infinite_link_gives_at_least_the_measured_p50_at_every_measured_size_and_a_link_adds_its_wire():
    costs = costs_from_run(MICRO, TRANSPORTS)
    points = load_run(MICRO).points()
    assert sorted(costs) == sorted(TRANSPORTS)
    for transport, cost in costs.items():
        rows = points[points["transport"] == transport]
        assert len(rows) == 4
        for size, p50_us in zip(rows["size_bytes"], rows["p50_us"], strict=True):
            # both sides' CPU, one after the other: from the p50 to the p50 plus its host time again
            p50 = p50_us * 1e-6
            assert p50 * (1 - 1e-9) <= cost.transfer_s(int(size)) <= (2 * p50 - cost.latency_s) * (1 + 1e-9)
            assert cost.transfer_s(int(size), 1e9) == pytest.approx(cost.transfer_s(int(size)) + size * 8 / 1e9,
                                                                    rel=1e-9)
            sender, receiver = cost.host_s(int(size))
            assert sender >= 0 and receiver >= 0 and cost.latency_s >= 0
    # the measured ordering at 16 MB holds in the model: gRPC over TCP costs the most host time, zerocopy the least
    host = {t: sum(c.host_s(16 << 20)) for t, c in costs.items()}
    assert host["zerocopy"] < host["grpc_tcp"] and host["rdma_cp"] < host["grpc_tcp"]


@FEW
@given(st.lists(st.tuples(st.integers(1, 1 << 30), st.floats(0.1, 1e5), st.floats(0, 1e5), st.floats(0, 1e5)),
                min_size=1, max_size=6, unique_by=lambda r: r[0]))
def test_each_side_is_its_cpu_within_the_p50_flat_below_and_linear_above_the_measured_sizes(rows):
    points = [{"size_bytes": size, "p50_us": p50, "sender_cpu_us_per_transfer": cs, "receiver_cpu_us_per_transfer": cr}
              for size, p50, cs, cr in rows]
    cost = cost_from_points("t", points)
    for point in points:
        host = point["p50_us"] * 1e-6 - cost.latency_s
        cpu = point["sender_cpu_us_per_transfer"] * 1e-6, point["receiver_cpu_us_per_transfer"] * 1e-6
        sides = cost.host_s(point["size_bytes"])
        # each side: its own CPU, at least its share of the p50's host time, at most all of it
        assert sum(sides) >= host * (1 - 1e-9) - 1e-15
        for side, spent in zip(sides, cpu, strict=True):
            assert side <= host * (1 + 1e-9) + 1e-15
            assert side >= min(spent, host) * (1 - 1e-9) - 1e-15
        if sum(cpu) <= host:  # neither side's CPU beyond its share of the host time: the p50 itself
            assert cost.transfer_s(point["size_bytes"]) == pytest.approx(point["p50_us"] * 1e-6, rel=1e-9,
                                                                         abs=1e-15)
    assert cost.latency_s >= 0
    smallest, largest = min(cost.sizes), max(cost.sizes)
    assert cost.host_s(max(1, smallest // 2)) == cost.host_s(smallest)
    # between two measured sizes each side's host time lies between its values there
    for (a, b), (sa, sb) in zip(pairwise(cost.sizes), pairwise(cost.sender_s), strict=True):
        middle = cost.host_s(int(math.sqrt(a * b)))[0]
        assert min(sa, sb) - 1e-15 <= middle <= max(sa, sb) + 1e-15
    # beyond the largest: linear in bytes (the same step in bytes adds the same time), never shrinking
    x1, x2, x3 = (cost.host_s(largest + k * (1 << 20))[0] for k in (1, 2, 3))
    assert x1 >= cost.host_s(largest)[0] - 1e-15
    assert x3 - x2 == pytest.approx(x2 - x1, rel=1e-6, abs=1e-15)


def test_the_latency_is_the_small_size_p50_neither_side_is_on_a_cpu_for():
    rows = [{"size_bytes": 1024, "p50_us": 1000.0, "sender_cpu_us_per_transfer": 700.0,
             "receiver_cpu_us_per_transfer": 800.0},
            {"size_bytes": 1 << 20, "p50_us": 1300.0, "sender_cpu_us_per_transfer": 900.0,
             "receiver_cpu_us_per_transfer": 1100.0}]
    cost = cost_from_points("grpc", rows)
    assert cost.latency_s == pytest.approx(200e-6)
    # the rest is host time: each side's own CPU where it spent more than its share of it (both at once), at
    # most the host time (800 us at 1 KB, 1100 us at 1 MB)
    assert cost.host_s(1024) == pytest.approx((700e-6, 800e-6))
    assert cost.host_s(1 << 20) == pytest.approx((900e-6, 1100e-6))
    # sides that spent less than the p50 between them: the host time split as their CPU, 1100 us in 1:3
    quiet = cost_from_points("q", [rows[0], {**rows[1], "sender_cpu_us_per_transfer": 100.0,
                                             "receiver_cpu_us_per_transfer": 300.0}])
    assert quiet.host_s(1 << 20) == pytest.approx((1100e-6 / 4, 1100e-6 * 3 / 4))
    assert quiet.transfer_s(1 << 20) == pytest.approx(1300e-6)
    # a side that polls is on a CPU the whole transfer: no latency left
    polling = cost_from_points("zc", [{**rows[0], "receiver_cpu_us_per_transfer": 1500.0}])
    assert polling.latency_s == 0


def test_a_missing_transport_is_one_error_naming_the_run_and_the_fix():
    with pytest.raises(ValueError) as error:
        costs_from_run(MICRO, ["zerocopy", "nosuch"])
    message = str(error.value)
    assert "\n" not in message
    assert str(MICRO) in message and "no points of nosuch" in message
    assert "bench micro --transports nosuch" in message


def test_a_missing_column_is_one_error_naming_the_run_and_the_fix(tmp_path):
    run = tmp_path / "micro"
    shutil.copytree(MICRO, run)
    records = pd.read_csv(run / "records.csv")
    records.drop(columns=["receiver_cpu_us_per_transfer"]).to_csv(run / "records.csv", index=False)
    with pytest.raises(ValueError) as error:
        costs_from_run(run, ["zerocopy"])
    message = str(error.value)
    assert "\n" not in message
    assert str(run) in message and "receiver_cpu_us_per_transfer" in message and "bench micro" in message
    # a column present but empty at one size is named with the size
    blank = records.copy()
    blank.loc[blank["transport"] == "zerocopy", "sender_cpu_us_per_transfer"] = np.nan
    blank.to_csv(run / "records.csv", index=False)
    with pytest.raises(ValueError, match=r"no sender_cpu_us_per_transfer for zerocopy at \d+ bytes"):
        costs_from_run(run, ["zerocopy"])


def test_the_sizes_a_plan_needs_are_its_tensors_sizes():
    f32 = np.dtype(np.float32)
    variables = [Variable(0, "a", (10, 4), f32), Variable(1, "b", (4,), f32), Variable(2, "c", (3,), f32, False),
                 Variable(3, "table", (100, 8), f32, sparse_rows=20)]
    outputs = {v.index: Output(v.shape, f32, "op") for v in variables[:3]}
    outputs[3] = Output(None, f32, "gather", index_dtype=np.dtype(np.int64))
    plan = plan_from("hand", variables, outputs, 2, 4)
    # weights and gradients 160, 16, 12 bytes; the table 3200 (its value), its rows at their bound 640 and their
    # indices 160
    assert sizes_needed(plan) == [12, 16, 160, 640, 3200]
