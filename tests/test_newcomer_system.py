"""Every test that touches something of the system (network namespaces, mpirun, QEMU, Chromium, Slurm, a Debian
package, /dev/shm's size, a program on PATH) carries the mark ``system`` naming it, so that a machine without it (a
bare Debian root, a container) skips the test with one line saying what is missing (``tests/conftest.py``), and
``pytest -m system`` selects them.

What "touches" means is read from the code (the test's, and what of its module it uses: helpers, fixtures, constants,
transitively), never from its docstrings or comments: a name such as ``NetnsLauncher`` or ``MPIRUN``, ``shutil.which``
of such a program, a command line with ``--launcher netns``, a ``slurm_bed`` argument, and the like (``TOUCHES``).
"""

from __future__ import annotations

import ast
import functools
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import SYSTEM_NEEDS, SYSTEM_PARAMETERS, system_missing

TESTS = Path(__file__).resolve().parent

#: names in code that touch a need of the system (a kind of ``tests/conftest.py``'s SYSTEM_NEEDS or, before the
#: colon, SYSTEM_PARAMETERS)
NAMES = {
    "netns": {"NetnsLauncher", "check_support", "netns"},
    "mpirun": {"MPIRUN", "mpirun", "mpirun_path"},
    "qemu": {"softroce", "run_session", "EarlySession", "qemu"},
    "chromium": {"_browser", "_run_browser"},
    "slurm": {"SlurmBed", "slurm_bed", "srun", "sbatch"},
}
#: the mark's own probes (tests/conftest.py): a test may ask what is missing without needing it
PROBES = {"system_missing", "SYSTEM_NEEDS", "SYSTEM_PARAMETERS"}
#: the kinds of need the mark names
KINDS = set(SYSTEM_NEEDS) | set(SYSTEM_PARAMETERS)
#: programs that ``shutil.which`` looks for, by the need they belong to
PROGRAMS = {
    "ip": "netns", "tc": "netns", "mpirun": "mpirun", "mpiexec": "mpirun", "qemu-system-x86_64": "qemu",
    "chromium": "chromium", "chromium-browser": "chromium", "google-chrome": "chromium", "srun": "slurm",
    "sbatch": "slurm", "slurmctld": "slurm", "dpkg-query": "deb", "dpkg": "deb", "apt-get": "deb",
}
#: the launchers whose ranks need the system wherever they run (``--launcher NAME`` in a test's command line);
#: ``mpi`` and ``slurm`` are refused outside their job, which tests check anywhere
LAUNCHERS = {"netns": "netns"}
#: tests that touch a need but run either way (they check what happens with and without it): why, by test
OPTIONAL = {
    **dict.fromkeys(
        ["test_converge.py::test_every_transport_learns_the_same_thing",
         "test_converge.py::test_records_carry_time_the_metric_the_fabric_and_a_summary",
         "test_converge.py::test_the_figures_are_drawn"],
        "the shared run goes into a network namespace without a route where one can be made, else runs as it is"),
    "test_peers.py::test_the_mpi_lines_run_only_where_their_pair_crosses_the_runs_links":
        "checks the refusal anywhere, and where network namespaces can be made, the private host the line gets",
    "test_softroce.py::test_the_tool_says_in_one_line_which_directory_the_guest_cannot_have":
        "the tool refuses before it boots: no QEMU is needed",
    **dict.fromkeys(
        ["test_newcomer_mpi.py::test_where_no_namespace_can_be_made_the_mpi_lines_bind_to_loopback_and_say_so",
         "test_newcomer_mpi.py::test_where_neither_can_be_done_the_lines_are_left_out_saying_both_reasons"],
        "replaces the namespace probe with a refusal: a machine without namespaces, made anywhere"),
}


@dataclass
class Module:
    """A test module's code: its module-level definitions by name, and the marks that apply to all of it."""

    path: Path
    tree: ast.Module
    defs: dict[str, ast.AST] = field(default_factory=dict)
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (module file stem, its name there)


@functools.cache
def module(stem: str) -> Module | None:
    path = TESTS / f"{stem}.py"
    if not path.is_file():
        return None
    tree = ast.parse(path.read_text(), str(path))
    found = Module(path, tree)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.defs[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    found.defs[target.id] = node
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            source = node.module.removeprefix("tests.").lstrip(".") if (node.level or
                                                                        node.module.startswith("tests.")) else None
            for alias in node.names:
                if source:
                    found.imports[alias.asname or alias.name] = (source, alias.name)
    return found


def _without_docstrings(node: ast.AST) -> list[ast.AST]:
    """The nodes under ``node``, docstrings left out."""
    docstrings = set()
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            docstrings.add(id(body[0].value))
    return [inner for inner in ast.walk(node) if id(inner) not in docstrings]


def _touches_in(node: ast.AST) -> set[str]:
    """The needs that ``node``'s own code touches (not what the names it uses touch)."""
    touched: set[str] = set()
    nodes = _without_docstrings(node)
    for inner in nodes:
        name = inner.id if isinstance(inner, ast.Name) else inner.attr if isinstance(inner, ast.Attribute) else (
            inner.arg if isinstance(inner, ast.arg) else None)
        if name is not None:
            touched |= {need for need, names in NAMES.items() if name in names}
        if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute | ast.Name)
                and (inner.func.attr if isinstance(inner.func, ast.Attribute) else inner.func.id) == "which"
                and inner.args and isinstance(inner.args[0], ast.Constant) and inner.args[0].value in PROGRAMS):
            touched.add(PROGRAMS[inner.args[0].value])
        items = inner.elts if isinstance(inner, ast.List | ast.Tuple) else inner.args if isinstance(
            inner, ast.Call) else []
        if items:  # ["micro", "--launcher", "netns", ...] or bench("micro", "--launcher", "netns")
            values = [item.value if isinstance(item, ast.Constant) else None for item in items]
            for option, value in itertools.pairwise(values):
                if option == "--launcher" and value in LAUNCHERS:
                    touched.add(LAUNCHERS[value])
        if isinstance(inner, ast.List) and len(values := [item.value if isinstance(item, ast.Constant) else None
                                                          for item in inner.elts]) > 1 \
                and values[0] == "unshare" and "-m" in values:  # ["unshare", "-m", ...]: a mount namespace
            touched.add("mountns")
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            if "--launcher netns" in inner.value:
                touched.add("netns")
            if inner.value.startswith("/usr/lib/python3/dist-packages"):
                touched.add("deb")
    return touched


def _names_used(node: ast.AST) -> set[str]:
    used = {inner.id for inner in _without_docstrings(node) if isinstance(inner, ast.Name)}
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # fixtures asked for by argument
        used |= {arg.arg for arg in node.args.args}
    return used


def _resolve(mod: Module, name: str) -> tuple[Module, ast.AST] | None:
    if name in mod.defs:
        return mod, mod.defs[name]
    if name in mod.imports:
        stem, there = mod.imports[name]
        other = module(stem)
        if other is not None and there in other.defs:
            return other, other.defs[there]
    return None


def touches(mod: Module, node: ast.AST) -> set[str]:
    """The needs that ``node`` touches, with what it uses of its module (and of the test modules it imports from),
    transitively."""
    touched: set[str] = set()
    seen: set[int] = set()
    todo = [(mod, node)]
    while todo:
        where, current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        body = current
        if isinstance(current, ast.FunctionDef | ast.AsyncFunctionDef):  # its decorators are marks, not its code
            body = ast.Module(body=current.body + list(current.args.defaults), type_ignores=[])
            touched |= _touches_in(ast.Module(body=[ast.Expr(ast.Name(arg.arg)) for arg in current.args.args],
                                              type_ignores=[]))
        touched |= _touches_in(body)
        for name in _names_used(current):
            if name in PROBES:  # what the mark's probes read: asking whether a need is met needs nothing
                continue
            if (found := _resolve(where, name)) is not None and not _is_marks(found[1]):
                todo.append(found)
    return touched


def _is_marks(node: ast.AST) -> bool:
    """Whether ``node`` is an assignment of marks (``needs_x = pytest.mark...``, a list of ``pytest.param``): what
    its skip conditions read is what the marks are for, not what a test using them touches."""
    return isinstance(node, ast.Assign | ast.AnnAssign) and any(
        isinstance(inner, ast.Attribute) and inner.attr in ("mark", "param") and isinstance(inner.value, ast.Name)
        and inner.value.id == "pytest" for inner in ast.walk(node))


def _marks_in(mod: Module, node: ast.AST, seen: set[int] | None = None) -> set[str]:
    """The needs named by ``pytest.mark.system(...)`` in ``node`` (a decorator, a ``pytestmark``), following names."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return set()
    seen.add(id(node))
    marked: set[str] = set()
    for inner in ast.walk(node):
        if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr == "system"
                and isinstance(inner.func.value, ast.Attribute) and inner.func.value.attr == "mark"):
            for arg in inner.args:
                if isinstance(arg, ast.Constant):
                    marked.add(arg.value.partition(":")[0])
                else:  # system(*NEEDS[name]): the needs named in what it takes them from
                    marked |= {need for name in ast.walk(arg) if isinstance(name, ast.Name)
                               and (found := _resolve(mod, name.id)) is not None
                               for constant in ast.walk(found[1]) if isinstance(constant, ast.Constant)
                               and (need := str(constant.value).partition(":")[0]) in KINDS}
        elif isinstance(inner, ast.Name) and (found := _resolve(mod, inner.id)) is not None:
            where, definition = found
            if isinstance(definition, ast.Assign | ast.AnnAssign):
                marked |= _marks_in(where, definition, seen)
    return marked


def _module_marks(mod: Module, scope: list[ast.stmt]) -> set[str]:
    marked: set[str] = set()
    for node in scope:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            marked |= _marks_in(mod, node.value)
    return marked


def unmarked() -> list[str]:
    """Every test that touches a need of the system and does not carry the mark naming it: one line each."""
    problems = []
    for path in sorted(TESTS.glob("test_*.py")):
        if path.name == Path(__file__).name:  # this scan names what it looks for
            continue
        mod = module(path.stem)
        assert mod is not None
        everywhere = _module_marks(mod, mod.tree.body)
        scopes = [(node, everywhere) for node in mod.tree.body]
        for node in mod.tree.body:
            if isinstance(node, ast.ClassDef):
                within = everywhere | _module_marks(mod, node.body) | set().union(
                    *(_marks_in(mod, d) for d in node.decorator_list))
                scopes += [(inner, within) for inner in node.body]
        for node, marked in scopes:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.name.startswith("test"):
                continue
            marked = marked | set().union(*(_marks_in(mod, d) for d in node.decorator_list))
            for arg in node.args.args:  # a fixture of the module whose parameters carry the mark
                fixture = mod.defs.get(arg.arg)
                if isinstance(fixture, ast.FunctionDef):
                    marked |= set().union(*(_marks_in(mod, d) for d in fixture.decorator_list))
            if f"{path.name}::{node.name}" in OPTIONAL:
                continue
            if missing := touches(mod, node) - marked:
                problems.append(f"{path.name}::{node.name} touches {', '.join(sorted(missing))} without "
                                f"pytest.mark.system({', '.join(repr(need) for need in sorted(missing))})")
    return problems


def test_every_test_that_touches_the_system_carries_the_mark():
    problems = unmarked()
    assert not problems, "\n".join(problems)


def test_the_scan_finds_a_test_that_touches_the_system_unmarked(tmp_path, monkeypatch):
    """The scan itself: a module with an unmarked test of each kind, and the same tests marked."""
    source = '''
import shutil
import pytest
from bench.launch.netns import NetnsLauncher

needs_ip = pytest.mark.system("netns")


def _helper():
    return NetnsLauncher()


def test_by_helper():
    _helper()


def test_by_command_line(tmp_path):
    bench("micro", "--launcher", "netns")


def test_by_which():
    assert shutil.which("chromium")


def test_by_fixture(slurm_bed):
    pass


@needs_ip
def test_marked_through_a_name():
    _helper()


@pytest.mark.system("chromium")
def test_marked():
    shutil.which("chromium")


def test_untouched():
    """Says mpirun and NetnsLauncher only in words."""
'''
    (tmp_path / "test_planted.py").write_text(source)
    monkeypatch.setitem(globals(), "TESTS", tmp_path)
    module.cache_clear()
    try:
        problems = unmarked()
    finally:
        module.cache_clear()
    assert [line.split(" ")[0] for line in problems] == [
        "test_planted.py::test_by_helper", "test_planted.py::test_by_command_line", "test_planted.py::test_by_which",
        "test_planted.py::test_by_fixture"]
    assert problems[0].endswith("touches netns without pytest.mark.system('netns')")


def test_a_missing_need_skips_with_one_line_naming_it(monkeypatch):
    """The mark's probes: a need met or not gives None or one line; an unknown need is an error naming the known."""
    monkeypatch.setenv("PATH", "/nonexistent")
    system_missing.cache_clear()
    try:
        for need in ("chromium", "qemu", "tool:cc", "deb:python3"):
            why = system_missing(need)
            assert why is not None and "\n" not in why and ("no " in why or "not installed" in why), (need, why)
        assert "remount" in system_missing("shm:1000TB")
        with pytest.raises(ValueError, match="unknown need; known: netns, mpirun"):
            system_missing("frobnicator")
    finally:
        system_missing.cache_clear()
    assert set(SYSTEM_NEEDS) == {"netns", "mpirun", "qemu", "chromium", "slurm", "mountns"}
    assert set(SYSTEM_PARAMETERS) == {"deb", "shm", "tool"}
