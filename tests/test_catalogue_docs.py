"""docs/architecture.md held to the code where it states a name or a rule a program can check.

- the layer diagram's lists: the transports, fabric backends and launchers it names are the registries' (no more,
  no fewer), and the modules it names under ``bench/experiments/`` and ``bench/readers/`` exist;
- the table "What each layer imports": every import (``import``/``from``, at any depth of a module) of a layer's
  modules reaches only the layer itself and what its row names;
- the registries it names are registries (``transports.common.Registry``).

(Paths, options and dotted names that must exist are tests/test_docs.py's.)
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import transports
from bench.launch import AUTO
from bench.launch import REGISTRY as LAUNCHERS
from transports import fabric
from transports.common import Registry

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
#: the words a row of the imports table uses for a layer, and the layer's folder
LAYER_WORDS = {"experiments": "bench/experiments/", "readers": "bench/readers/", "launch": "bench/launch/",
               "runtime": "bench/runtime/", "results": "bench/results/", "ground": "bench/ground/",
               "transports": "transports/", "fabric": "transports/fabric/"}


def _diagram() -> list[str]:
    """The lines of the page's first code block (the layer diagram)."""
    text = PAGE.read_text()
    start = text.index("```\n") + 4
    return text[start:text.index("```", start)].splitlines()


def _diagram_line(folder: str) -> str:
    """The diagram's line for ``folder`` with the lines that continue it (the description alone)."""
    lines = _diagram()
    index = next(i for i, line in enumerate(lines) if line.lstrip(" ├└─").startswith(folder + " "))
    text = lines[index].lstrip(" ├└─")[len(folder):]
    for more in lines[index + 1:]:
        if more.lstrip(" ├└─").split(" ")[0].endswith(("/", ".py")):
            break
        text += " " + more.strip()
    return text.strip()


def listed(text: str) -> list[str]:
    """``"...: local, netns, mpi and slurm (job launchers), auto"`` -> the names after the last colon, remarks in
    parentheses dropped."""
    items = re.sub(r"\([^)]*\)", "", text.rsplit(":", 1)[1])
    return [item.strip() for item in re.split(r",| and ", items) if item.strip()]


def test_the_diagram_names_every_transport_backend_and_launcher():
    assert sorted(listed(_diagram_line("transports/"))) == sorted(transports.names())
    assert sorted(re.search(r"backends, (.*)$", _diagram_line("transports/fabric/")).group(1).split(" and ")) \
        == sorted(fabric.names())
    assert sorted(listed(_diagram_line("bench/launch/"))) == sorted([*LAUNCHERS, AUTO])


@pytest.mark.parametrize("folder", ["bench/experiments/", "bench/readers/"])
def test_the_modules_the_diagram_names_exist(folder):
    text = _diagram_line(folder)
    text = text[text.index(":") + 1:] if ":" in text else text
    names = [item.strip() for item in re.split(r",", re.sub(r"\([^)]*\)", "", text)) if item.strip()]
    assert names
    missing = [name for name in names if not (ROOT / folder / f"{name}.py").exists()
               and not (ROOT / folder / name / "__init__.py").exists()]
    assert missing == []


def import_rows() -> dict[str, set[str]]:
    """The imports table: each layer's folder (or module) -> the folders and modules its row lets it import
    (a word of :data:`LAYER_WORDS`, or a path in backquotes; what follows "nothing from" or "never" is no leave)."""
    text = PAGE.read_text()
    table = text[text.index("## What each layer imports"):]
    rows = {}
    for line in table.splitlines()[4:]:
        if not line.startswith("|"):
            break
        _, layers, imports, _ = line.split("|")
        imports = re.split(r"nothing from|never", imports)[0]
        allowed = {path for path in re.findall(r"`([^`]+)`", imports) if "/" in path}
        words = re.sub(r"`[^`]*`", "", imports)  # a layer by its word; "the fabric's device discovery" is no layer
        allowed |= {folder for word, folder in LAYER_WORDS.items() if re.search(rf"\b{word}\b(?!')", words)}
        own = set(re.findall(r"`([^`]+)`", layers))
        rows |= {layer: allowed | own for layer in own}
    return rows


def _target(module: str) -> str:
    """A module's path in the repository (``bench.results.lines`` -> ``bench/results/lines.py``; a package ->
    its ``__init__.py``)."""
    path = module.replace(".", "/")
    return f"{path}/__init__.py" if (ROOT / path / "__init__.py").exists() else f"{path}.py"


def imports_of(path: Path) -> set[str]:
    """The project's modules ``path`` imports, as paths (``from package import module`` is the module)."""
    package = path.relative_to(ROOT).parent.as_posix().replace("/", ".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *filter(None, [base])])
            for alias in node.names:
                whole = ROOT / base.replace(".", "/") / alias.name
                found.add(f"{base}.{alias.name}" if whole.is_dir() or whole.with_suffix(".py").exists() else base)
    return {_target(name) for name in found if name.split(".")[0] in ("bench", "transports")}


#: imports the page does not allow, each with why it is still here (none now)
KNOWN: dict[tuple[str, str], str] = {}


def test_every_layer_imports_only_what_its_row_says():
    """... and the names in bench/__init__.py, which every layer of bench/ may import (the page's rules say so)."""
    assert "`bench/__init__.py`" in PAGE.read_text().split("Rules that hold across them:")[1].split("\n\n")[1]
    rows = import_rows()
    assert {"bench/results/", "bench/readers/", "transports/", "transports/fabric/"} <= set(rows)
    wrong = []
    for package in ("bench", "transports"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            layer = max((row for row in rows if relative.startswith(row)), key=len, default=None)
            if layer is None:
                continue
            for target in sorted(imports_of(path)):
                if (relative, target) in KNOWN or (target == "bench/__init__.py" and layer.startswith("bench/")):
                    continue
                if not any(target.startswith(allowed) if allowed.endswith("/") else target == allowed
                           for allowed in rows[layer]):
                    wrong.append(f"{relative} imports {target} ({layer}'s row does not name it)")
    assert wrong == []


def test_the_registries_the_page_names_are_registries():
    named = set(re.findall(r"`((?:bench|transports)(?:\.\w+)*\.(?:REGISTRY|BACKENDS))`", PAGE.read_text()))
    assert len(named) >= 6
    for dotted in sorted(named):
        module, _, attribute = dotted.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), attribute), Registry), dotted


def test_the_readers_of_the_table_and_lists():
    assert listed("a run: local, netns, mpi and slurm (job launchers), auto") == ["local", "netns", "mpi", "slurm",
                                                                                   "auto"]
    rows = import_rows()
    assert rows["bench/runtime/"] == {"bench/runtime/", "transports/"}
    # a path in backquotes leaves that path, not its layer's word; a possessive is no leave
    assert "transports/common.py" in rows["transports/fabric/"] and "transports/" not in rows["transports/fabric/"]
    assert "transports/fabric/" not in rows["bench/launch/"]
    assert "bench/" not in rows["transports/"] and "bench/experiments/" not in rows["bench/readers/"]
    assert imports_of(ROOT / "bench" / "results" / "lines.py") == {"bench/__init__.py"}
