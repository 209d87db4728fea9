"""``bench micro --help`` names the peer lines, their calibrations and the reference lines from the catalogue
(``bench/results/lines.py``), not from a list written by hand beside it."""

from __future__ import annotations

import argparse

from bench.commands import micro
from bench.results import lines as catalogue


def _micro_help() -> str:
    parser = argparse.ArgumentParser(prog="bench micro")
    micro.add_arguments(parser)
    return " ".join(parser.format_help().split())  # argparse's wrapping aside


def test_a_peer_line_added_to_the_catalogue_is_named_in_micro_help_with_its_calibration():
    peer = catalogue.Line("fresh_peer", "peer", "Fresh Library", "Fresh Library (peer)",
                          implementation="tests.peer_faults:CorruptingSocketLink", about="a library added later")
    plain = catalogue.Line("fresh_peer_plain", "reference", "Fresh plain loop", "Fresh in a plain loop",
                           implementation="tests.peer_faults:CorruptingSocketLink", calibrates="fresh_peer")
    with catalogue.added(peer, plain):
        text = _micro_help()
    assert "fresh_peer: fresh_peer_plain" in text  # --calibrate: each peer line and its plain loop
    assert "Fresh Library" in text  # --peers: the libraries a user could pick instead
    assert "fresh_peer" not in _micro_help()


def test_micro_help_names_every_peer_calibration_and_reference_line_of_the_catalogue():
    text = _micro_help()
    for name in catalogue.micro_peers():
        assert catalogue.line(name).paper in text, name
    for entry in catalogue.calibrations():
        assert f"{entry.calibrates}: {entry.name}" in text, entry.name
    for entry in catalogue.of_kind("reference"):
        assert entry.name in text, entry.name
