"""Private hosts for programs that listen on every interface (TensorFlow's servers, perftest's tools): the launch
layer chooses where their ranks run by what a launcher is, never by its name."""

from __future__ import annotations

import pytest

from bench.experiments.references.ucx_perftest import UcxPerftest
from bench.launch import LaunchError, LauncherUnavailable
from bench.launch.hosts import NetnsUnavailable
from bench.launch.local import LocalLauncher
from bench.launch.mpi import MpiLauncher
from bench.launch.netns import NetnsLauncher
from bench.launch.private import private_hosts

needs_namespaces = pytest.mark.system("netns")


def _refuse_namespaces(monkeypatch) -> None:
    def refuse() -> None:
        raise NetnsUnavailable("namespaces refused by the test")

    monkeypatch.setattr("bench.launch.netns.check_support", refuse)


@needs_namespaces
def test_under_local_the_ranks_get_one_private_emulated_host_of_their_own():
    given = LocalLauncher()
    chosen = private_hosts(given, "a listener")
    try:
        assert chosen.own and chosen.isolated and isinstance(chosen.launcher, NetnsLauncher)
        assert chosen.launcher is not given and "private emulated host" in chosen.note
    finally:
        chosen.launcher.close()


@needs_namespaces
def test_a_launcher_whose_hosts_are_private_is_used_as_it_is():
    given = NetnsLauncher()
    try:
        chosen = private_hosts(given, "a listener")
        assert chosen.launcher is given and chosen.isolated and not chosen.own
    finally:
        given.close()


def test_a_launcher_that_does_not_start_its_ranks_is_used_as_it_is():
    given = object.__new__(MpiLauncher)  # its class says what it is; no MPI is initialised here
    chosen = private_hosts(given, "a listener")
    assert chosen.launcher is given and not chosen.isolated and not chosen.own


def test_without_namespaces_a_loopback_run_is_refused_naming_the_fix(monkeypatch):
    _refuse_namespaces(monkeypatch)
    with pytest.raises(LauncherUnavailable, match=r"namespaces refused by the test.*a listener would listen on every "
                                                  r"interface of the host, not on 127\.0\.0\.1.*--bind"):
        private_hosts(LocalLauncher(), "a listener")


def test_without_namespaces_a_run_bound_to_the_network_stays_where_it_was_asked(monkeypatch):
    _refuse_namespaces(monkeypatch)
    given = LocalLauncher()
    given.bind = "192.0.2.7"  # what --bind ADDRESS leaves on the launcher: the ranks are meant to be reachable
    chosen = private_hosts(given, "a listener")
    assert chosen.launcher is given and not chosen.isolated and "--bind 192.0.2.7" in chosen.note


def test_a_perftest_line_is_left_out_where_its_listener_would_be_public():
    """Under mpi with the default loopback bind, ucx_perftest would listen on the hosts' own networks: the line
    refuses (the run leaves it out with one line) instead of running there."""
    given = object.__new__(MpiLauncher)
    given.bind = "127.0.0.1"
    with pytest.raises(LaunchError, match=r"ucx_perftest listens on every interface .* --launcher mpi .*--bind "
                                          r"ADDRESS.*--no-references"):
        UcxPerftest().hosts(given)
