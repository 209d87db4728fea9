"""The one registry helper (``transports.common.Registry``) and the three registries built on it: transports, fabric
backends and launchers (the fabric's own checks are in ``tests/test_fabric_registry.py``)."""

from __future__ import annotations

import sys

import pytest

import transports
from bench import launch
from transports import fabric
from transports.common import Availability, Registry


class Unknown(ValueError):
    pass


def test_entries_keep_their_order_and_are_imported_only_when_asked_for(tmp_path, monkeypatch):
    (tmp_path / "lazy_entry_module.py").write_text("THING = 'here'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("thing", {"zeta": "lazy_entry_module:THING", "alpha": ("json:dumps", "JSON, as text")},
                        unknown=Unknown)
    assert registry.names() == ["zeta", "alpha"] and list(registry) == ["zeta", "alpha"] and len(registry) == 2
    assert dict(registry) == {"zeta": "lazy_entry_module:THING", "alpha": "json:dumps"}
    assert registry.descriptions() == {"zeta": "", "alpha": "JSON, as text"}
    assert "zeta" in registry and "beta" not in registry
    assert "lazy_entry_module" not in sys.modules
    assert registry.load("zeta") == "here" and registry.module("zeta") == "lazy_entry_module"
    monkeypatch.delitem(sys.modules, "lazy_entry_module")


def test_an_unknown_name_raises_the_registrys_error_listing_the_known_ones():
    registry = Registry("thing", {"a": "json:dumps", "b": "json:loads"}, unknown=Unknown)
    for call in (registry.load, registry.check, registry.module, lambda name: registry.availability(name, print)):
        with pytest.raises(Unknown, match=r"^unknown thing 'c' \(known: a, b\)$"):
            call("c")
    with pytest.raises(LookupError, match="unknown thing 'c'"):
        Registry("thing", {"a": "json:dumps"}).load("c")


def test_an_entry_that_cannot_be_imported_is_unavailable_not_an_error():
    registry = Registry("thing", {"gone": "no_such_module_for_the_registry_test:Thing", "here": "json:dumps"})
    status = registry.availability("gone", lambda loaded: Availability(True))
    assert not status.ok and status.reason.startswith("cannot import no_such_module_for_the_registry_test: No module")
    probed = registry.availability("here", lambda loaded: Availability(loaded.__name__ == "dumps", "probed"))
    assert probed == Availability(True, "probed")
    with pytest.raises(ImportError):
        registry.load("gone")


def test_an_entry_must_name_a_module_and_an_attribute():
    with pytest.raises(ValueError, match="thing 'x': 'json' is not 'module:attribute'"):
        Registry("thing", {"x": "json"})


# -- the three registries --------------------------------------------------------------------------------------


def test_transports_are_registered_in_the_order_of_figures():
    assert transports.names() == ["grpc_tcp", "grpc_rdma", "rdma_cp", "zerocopy", "local"]
    assert "zerocopy" in transports.REGISTRY and "nope" not in transports.REGISTRY
    assert transports.transport_class("local").__name__ == "LocalTransport"
    with pytest.raises(transports.UnknownTransport,
                       match=r"unknown transport 'nope' \(known: grpc_tcp, grpc_rdma, rdma_cp, zerocopy, local\)"):
        transports.transport_class("nope")


def test_fabric_backends_and_launchers_are_registries_too():
    assert isinstance(fabric.BACKENDS, Registry) and isinstance(transports.REGISTRY, Registry)
    assert launch.REGISTRY.names() == ["local", "netns", "mpi", "slurm"] == list(launch.LAUNCHERS)
    assert launch.LAUNCHERS["local"] == "processes on this machine (the default)"
    assert [launch.REGISTRY.load(name).name for name in launch.REGISTRY] == ["local", "netns", "mpi", "slurm"]


def test_every_launcher_says_which_launch_options_it_takes():
    for name in launch.REGISTRY:
        cls = launch.REGISTRY.load(name)
        assert set(cls.options) <= set(launch.OPTIONS) and set(cls.refuses) <= set(launch.OPTIONS) - set(cls.options)
    assert {name: launch.REGISTRY.load(name).options for name in launch.REGISTRY} == {
        "local": ("bind",), "netns": ("link_rate",), "mpi": ("bind",), "slurm": ("bind",)}


@pytest.mark.parametrize(("name", "option", "said"), [
    ("local", "link_rate", "--link-rate shapes the links between emulated hosts: use it with --launcher netns"),
    ("mpi", "link_rate", "--link-rate shapes the links between emulated hosts: use it with --launcher netns"),
    ("netns", "bind", "--bind does not apply to --launcher netns: every host has its own address"),
])
def test_a_launcher_refuses_an_option_it_does_not_take_before_it_starts_anything(name, option, said):
    # before construction: mpi would initialise MPI, netns would need root
    with pytest.raises(launch.LaunchError) as refused:
        launch.create(name, **{option: "lo" if option == "bind" else "1gbit"})
    assert str(refused.value) == said
