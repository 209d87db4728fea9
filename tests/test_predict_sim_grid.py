"""bench predict's grid: a transport's link rates simulated together, so a faster link never predicts a slower
step (issue 62), on a case where each rate simulated alone does."""

from __future__ import annotations

import numpy as np

from bench.experiments.predict.grid import LinkRate, _simulate_count
from bench.experiments.predict.simulate import Cluster, simulate
from tests.test_predict_simulate import make_cost, make_plan


def test_the_grid_never_predicts_a_slower_step_at_a_faster_rate_where_each_rate_alone_does():
    # two hosts of one core: at twice the rate one host's jobs reach its core in another order, a 3-step cycle
    # whose mean the simulated steps cut short (the doubling property's smallest failing case, shrunk)
    rng = np.random.default_rng(31)
    plan = make_plan([int(x) for x in rng.integers(1, 400_000, 8)],
                     [bool(x) for x in np.random.default_rng(32).random(8) < 0.8], 2)
    cost = make_cost((6.284502293877303e-06, 7.344667257474233e-05), (0.0, 0.00036635211342519444), 0.0)
    slow, fast = LinkRate("slow", 55_615_286_199), LinkRate("fast", 2 * 55_615_286_199)
    alone = {rate: simulate(plan, cost, Cluster(2, rate.bps, cores_per_host=1), 0.0).step_s for rate in (slow, fast)}
    assert alone[fast] > alone[slow]  # the anomaly, each rate on its own
    grid = _simulate_count(plan, 2, [fast, slow], {"t": cost}, 0.0, {"cores_per_host": 1})
    assert list(grid) == [("fast", "t"), ("slow", "t")]  # in the order of the rates given
    assert grid[("slow", "t")].step_s == alone[slow]
    assert grid[("fast", "t")].step_s <= grid[("slow", "t")].step_s
