"""``bench predict``'s cluster options (--cores-per-host, --shared-cores, --oversubscription, --async): passed to the
simulation, written in every record and in meta.json, said in the summary and the figures' titles; and a long
``--from`` path read back whole."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from bench.results import load_run
from bench.results.records import PredictRecord
from tests.test_predict_cli import MICRO, bench

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")


def test_predict_on_a_given_cluster_records_it_says_it_and_reads_a_long_micro_run_path_back_whole(tmp_path):
    from bench.readers.plot.predict import predict_efficiency_figure, predict_throughput_figure

    micro = tmp_path / ("a-folder-with-a-long-name-" * 4) / "micro"  # longer than a name (64 characters) is shown
    shutil.copytree(MICRO, micro)
    assert 64 < len(str(micro)) < 256
    out = tmp_path / "run"
    result = bench("predict", "fcn5", "--framework", "torch", "--compute", "paper", "--from", str(micro),
                   "--transport", "zerocopy,grpc_tcp", "--servers", "1,2", "--link-rate", "1gbit",
                   "--shared-cores", "2", "--oversubscription", "4:1", "--async", "--no-plot", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    run = load_run(out)
    records = run.records
    assert len(records) == 4
    assert set(records["shared_cores"]) == {2} and set(records["oversubscription"]) == {4.0}
    assert set(records["cores_per_host"]) == {PredictRecord.DEFAULT_CORES_PER_HOST}
    assert set(records["asynchronous"]) == {True}
    assert set(records["micro_run"]) == {str(micro)}  # whole, not cut to a name's length
    settings = run.meta["settings"]
    assert settings["micro_run"] == str(micro)
    assert (settings["shared_cores"], settings["oversubscription"], settings["asynchronous"]) == (2, 4.0, True)
    assert settings["cores_per_host"] == PredictRecord.DEFAULT_CORES_PER_HOST
    cluster = "2 shared cores, oversubscribed 4:1, async"
    assert f"fcn5, batch 32, 1gbit links, {cluster}: total mini-batches/s" in result.stdout
    for figure in (predict_throughput_figure(run), predict_efficiency_figure(run)):
        assert figure.get_suptitle().endswith(f"({cluster})")


def test_the_grid_passes_its_cluster_and_async_to_every_simulation():
    from bench.commands.predict import link_rates
    from bench.experiments.predict.costs import costs_from_run
    from bench.experiments.predict.grid import analyse, predict
    from bench.experiments.predict.simulate import Cluster, simulate

    model = analyse("fcn5", "torch", 32, "paper")
    costs = costs_from_run(MICRO, ["grpc_tcp"])
    rate = link_rates("1gbit")
    for asynchronous, cluster in [(True, {"shared_cores": 2, "oversubscription": 2.0}), (False, {"cores_per_host": 1}),
                                  (False, {})]:
        records = list(predict([model], costs, [4], rate, str(MICRO), asynchronous=asynchronous, **cluster))
        assert len(records) == 1
        shape = Cluster(4, rate[0].bps, **cluster)
        expected = simulate(model.plan.for_servers(4), costs["grpc_tcp"], shape, model.compute_s,
                            asynchronous=asynchronous)
        record = records[0]
        assert record.step_time_s == expected.step_s and record.saturated == expected.saturated
        assert (record.cores_per_host, record.shared_cores, record.oversubscription, record.asynchronous) == \
            (shape.cores_per_host, shape.shared_cores, shape.oversubscription, asynchronous)
    with pytest.raises(ValueError, match="below 1"):
        next(predict([model], costs, [4], rate, str(MICRO), oversubscription=0.5))


def test_a_records_cluster_in_words_only_where_it_is_not_the_default():
    from bench.experiments.predict.simulate import Cluster

    assert Cluster(1).cores_per_host == PredictRecord.DEFAULT_CORES_PER_HOST
    describe = PredictRecord.describe_cluster
    assert describe() == "" and describe(8, None, 1.0, False) == ""
    assert describe(16) == "16 cores per host" and describe(1) == "1 core per host"
    assert describe(8, 2) == "2 shared cores" and describe(16, 1) == "1 shared core"
    assert describe(oversubscription=4.0) == "oversubscribed 4:1"
    assert describe(asynchronous=True) == "async"
    # as a reader has them: NaN for none, NumPy numbers and bools, a bool read as text; nonsense is no cluster
    assert describe(np.int64(8), math.nan, np.float64(1.5), np.bool_(True)) == "oversubscribed 1.5:1, async"
    assert describe(np.float64(4.0), np.float64(2.0), 1.0, "True") == "2 shared cores, async"
    assert describe("lots", "x", "fast", "no") == ""


def test_records_from_before_the_cluster_columns_read_as_the_default_cluster():
    import pandas as pd

    from bench.readers.plot.predict import _cluster

    cluster = {"cores_per_host", "shared_cores", "oversubscription", "asynchronous"}
    assert cluster <= set(PredictRecord.columns()) and not cluster & set(PredictRecord.required())
    assert _cluster(pd.DataFrame({"model": ["fcn5"], "servers": [1]})) == ""
    assert _cluster(pd.DataFrame({"cores_per_host": [16, 16], "asynchronous": [False, False]})) == "16 cores per host"
