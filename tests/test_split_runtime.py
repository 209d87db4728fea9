"""The runtime split by role (issue 63): the names other layers still take from ``bench.runtime.ps``."""

from __future__ import annotations

import importlib

import pytest

import bench.runtime.ps as ps


def test_every_name_kept_in_ps_is_the_one_in_the_module_of_its_role():
    assert set(ps.MOVED) == {"RuntimeCopies", "build_model", "framework", "plan_of", "worker_batch", "run_worker",
                             "train_locally"}
    for name, module in ps.MOVED.items():
        assert getattr(ps, name) is getattr(importlib.import_module(f"bench.runtime.{module}"), name)
    from bench.runtime.ps import plan_of, run_worker, train_locally  # as bench/experiments/training.py does

    assert (plan_of.__module__, run_worker.__module__, train_locally.__module__) == (
        "bench.runtime.config", "bench.runtime.worker", "bench.runtime.local")


def test_a_name_ps_does_not_have_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'apply_sgd'"):
        ps.apply_sgd  # noqa: B018 (moved to bench.runtime.update, and nothing outside the runtime takes it from ps)
