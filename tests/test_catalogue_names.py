"""Every line's name from the catalogue (``bench/results/lines.py``): no module writes one as a string of its own.

A line's name written by hand is a second place to change when a line is renamed, and one that nothing checks:
the modules of ``bench/`` and ``transports/`` take a line's name from the catalogue's constants (``ZERO_COPY``,
``GRPC_TCP``, ...; ``bench.LOCAL``, ``bench.TF_GRPC``) or from a registry built from it. A string constant equal to
a line's name is found wherever it is (a docstring is prose, not a name), except in the places listed below, each
with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import transports
from bench import LOCAL, TF_GRPC
from bench.results import lines as catalogue

ROOT = Path(__file__).resolve().parent.parent
NAMES = frozenset(name for kind in catalogue.KINDS for name in catalogue.names(kind))
EVERY = None
#: path, or folder ending in "/" -> (the names it may write, None: any; why)
ALLOWED: dict[str, tuple[frozenset[str] | None, str]] = {
    "bench/__init__.py": (frozenset({LOCAL, TF_GRPC}), "the two baselines' names are defined here, for every layer; "
                                                        "the catalogue takes them from here"),
    "transports/": (EVERY, "transports/ imports nothing from bench/ (DESIGN.md): a transport and the transports' "
                           "registry name themselves (test_the_transports_registry_is_the_catalogue_s checks them), "
                           "a fabric backend its reference tools, the pool its 'local' tier"),
    "bench/experiments/peers/": (EVERY, "a peer or calibration line's class names the catalogue entry whose "
                                        "implementation it is (tests/test_lines.py checks the registries against "
                                        "it); 'nixl', 'mooncake', 'socket' also name a module or a fabric"),
    "bench/experiments/references/": (EVERY, "a reference line's class names the catalogue entry whose "
                                             "implementation it is, and the tool it runs (named as its line)"),
    "bench/launch/": (frozenset({"local", "mpi"}), "launcher names: local and mpi are launchers too"),
    "bench/readers/report/notes.py": (frozenset({"local", "mpi"}), "launcher names: the launchers a run used"),
    "bench/options.py": (frozenset({"local"}), "the default launcher's name"),
    "bench/experiments/micro/plan.py": (frozenset({"local", "memcpy"}), "'local' is a launcher; 'memcpy' the "
                                                                       "name a run of no line plans memory for"),
    "bench/readers/summary.py": (frozenset({"local"}), "a kind (catalogue.KINDS), which shares its line's name"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of ``tree``'s module, classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _allowed(relative: str) -> frozenset[str] | None:
    """The names ``relative`` may write (None: any), by its entry or its folder's in :data:`ALLOWED`."""
    for place, (names, _why) in ALLOWED.items():
        if relative == place or (place.endswith("/") and relative.startswith(place)):
            return names
    return frozenset()


def literal_names(relative: str, source: str) -> list[str]:
    """``path:line 'name'`` for each string constant of ``source`` that is a line's name, docstrings aside."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    return [f"{relative}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
            and id(node) not in prose]


def test_no_module_writes_a_line_s_name_outside_the_catalogue():
    found = []
    for package in ("bench", "transports"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative == "bench/results/lines.py":
                continue
            allowed = _allowed(relative)
            if allowed is None:
                continue
            found += [hit for hit in literal_names(relative, path.read_text()) if hit.split(" ")[1][1:-1]
                      not in allowed]
    assert found == [], "take these names from bench/results/lines.py's constants (or bench.LOCAL, bench.TF_GRPC)"


def test_the_finder_sees_names_in_code_and_not_in_prose():
    source = '"""zerocopy in a docstring is prose."""\nBASE = "grpc_tcp"\nclaims = {("vgg16", "rdma_cp"): 1}\n'
    assert literal_names("x.py", source) == ["x.py:2 'grpc_tcp'", "x.py:3 'rdma_cp'"]
    assert _allowed("bench/launch/local.py") == {"local", "mpi"} and _allowed("bench/ground/paper.py") == set()


def test_the_training_lines_registry_is_the_catalogue_s():
    from bench.experiments.training import REGISTRY

    assert dict(REGISTRY) == {line.name: line.training for line in catalogue.trained()}
    assert catalogue.line(LOCAL).training and catalogue.line(TF_GRPC).training


def test_the_transports_registry_is_the_catalogue_s():
    """transports/ imports nothing from bench/, so its registry names the transports itself: each is a transport
    line of the catalogue (or local), and each of the catalogue's transport lines (a mode aside) is registered."""
    lines = {name.partition(":")[0] for name in catalogue.names("transport")} | {LOCAL}
    assert set(transports.REGISTRY) == lines
