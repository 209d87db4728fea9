"""The wire in a run: what cannot travel is refused where it is sent, naming it, and the run ends in one line."""

from __future__ import annotations

import pytest

from bench.launch import RankFailed, RankSpec, create
from bench.launch.wire import WireError
from tests.launch_jobs import BOUND_S


def returns_an_exception(ctx):
    """A job whose result is no data: an exception travels as text (describe_error), not as itself."""
    return ValueError("not data")


def not_a_job(path):
    """A function that is neither a rank job (no ctx) nor marked with wire_value."""
    return path


def test_a_result_that_cannot_travel_fails_its_rank_naming_it():
    with create("local") as launcher, pytest.raises(RankFailed) as failed:
        launcher.run([RankSpec(returns_an_exception, "maker")], BOUND_S)
    assert "its result cannot go to the coordinator: refusing builtins.ValueError" in str(failed.value)


def test_a_job_that_cannot_travel_is_refused_by_the_coordinator_naming_it():
    with create("local") as launcher, pytest.raises(WireError) as refused:
        launcher.run([RankSpec(not_a_job, "nothing")], BOUND_S)
    assert str(refused.value).startswith("refusing tests.test_wire_launch.not_a_job on the run's channels")
