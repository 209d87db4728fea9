"""The README and docs/ name only what exists: commands, options, files, modules, and nothing outside the repository.

The checker reads each page's fenced code blocks and inline code spans (and, for links, its prose):

- a command line or code span ``bench CMD ...`` (also ``.venv/bin/bench``, after ``mpirun``, ``srun``, ...) names a
  subcommand of ``bench`` (``bench.cli.build_parser()``), and every ``--option`` after it up to the end of the shell
  command is an option of that subcommand; so is every option of a table row whose first cell is ``bench CMD``;
- options before ``bench``, or in a command of another tool, are checked against that tool: the repository's own
  tools (``tools/softroce``, ...) by their source, outside tools (pip, mpirun, srun, ...) by :data:`EXTERNAL_OPTIONS`;
- any other ``--option`` anywhere in a page is an option of some ``bench`` command or of one of those tools;
- a path with a ``/`` in code (``transports/zerocopy/transport.py``, ``tools/softroce``) exists in the repository,
  unless it is one a run or an install makes (:data:`MADE_ELSEWHERE`); a link's target exists relative to the page,
  with its ``#anchor`` a heading there; no link leaves the repository, and no page names ``../shared``;
- a dotted name of this project's packages (``bench.experiments.micro.MicroLine``) imports.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: tools from outside the repository that the docs give options to, and the options they may be given
EXTERNAL_OPTIONS = {
    "pip": {"--no-deps", "--no-build-isolation", "--quiet", "--upgrade"},
    "apt-get": {"--no-install-recommends"},
    "mpirun": {"--allow-run-as-root", "--oversubscribe"},
    "srun": {"--ntasks-per-node"},
}
#: the repository's own tools: their options are those their source spells
REPO_TOOLS = tuple(sorted(f"tools/{tool.name}" for tool in (ROOT / "tools").iterdir() if tool.is_file()))
#: path prefixes that name what an install or a run makes, or what lives on the system, not files of the repository
MADE_ELSEWHERE = (".venv/", "results/", "logs/", "lib/x86_64-linux-gnu")
#: http(s) links the docs may carry (none: everything they need is in the repository)
ALLOWED_URLS: set[str] = set()
#: the packages whose dotted names are resolved
PACKAGES = ("bench", "transports")

OPTION = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
FENCE = re.compile(r"^\s*```")
SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
URL = re.compile(r"https?://[^\s)>`\"']+")
#: ``bench CMD`` where bench is a word of its own (``.venv/bin/bench`` too, not ``tensor-transport-bench``)
BENCH = re.compile(r"(?:^|(?<=[\s/]))bench[ \t]+([a-z][\w|-]*)")
#: the end of one shell command: a separator, or a pipe into another program (``a | --b`` is an alternative)
SHELL_END = re.compile(r"&&|\|\||;|\$\(|\|\s+(?!-)|\s#\s")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)+/?|[\w.-]+/")
DOTTED = re.compile(rf"(?<![\w./-])(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


# -- what exists ------------------------------------------------------------------------------------------------


@functools.cache
def bench_options() -> dict[str, frozenset[str]]:
    """Subcommand -> its option strings (``--help`` included), from the parser ``bench`` itself builds."""
    from bench.cli import build_parser

    parser = build_parser()
    [commands] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    top = {option for action in parser._actions for option in action.option_strings}
    return {name: frozenset(top | {option for action in sub._actions for option in action.option_strings})
            for name, sub in commands.choices.items()}


@functools.cache
def tool_options() -> dict[str, frozenset[str]]:
    """Tool -> the options it may be given: the repository's tools' from their source, the others' as listed."""
    found = {name: frozenset(options) for name, options in EXTERNAL_OPTIONS.items()}
    for tool in REPO_TOOLS:
        found[tool] = frozenset(OPTION.findall((ROOT / tool).read_text()))
    return found


@functools.cache
def any_option() -> frozenset[str]:
    return frozenset().union(*bench_options().values(), *tool_options().values())


def resolves(dotted: str) -> bool:
    """Whether ``a.b.c.d`` is a module, or an attribute (chain) of the longest module prefix that imports."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                target = getattr(target, name)
        except AttributeError:
            return False
        return True
    return False


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped, spaces as dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose, _ = split_code(page.read_text())
    return {slug(m.group(1)) for line in prose.splitlines() if (m := HEADING.match(line))}


# -- reading a page -------------------------------------------------------------------------------------------


def split_code(text: str) -> tuple[str, list[str]]:
    """The page's prose (fenced blocks blanked out, line numbers kept) and the lines of its fenced blocks."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            prose.append("")
        elif fenced:
            code.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), code


def spans(prose: str) -> list[str]:
    """The inline code spans, each on one line (a span may wrap; none crosses a paragraph)."""
    return [" ".join(m.group(2).split()) for paragraph in re.split(r"\n\s*\n", prose)
            for m in SPAN.finditer(paragraph)]


def shell_commands(line: str) -> list[str]:
    return [part.strip() for part in SHELL_END.split(line) if part.strip()]


def tool_of(command: str) -> str | None:
    """The program a shell command runs (env assignments and sudo skipped), when the docs check its options."""
    for word in command.split():
        if "=" in word or word == "sudo":
            continue
        if word in tool_options():
            return word
        return Path(word).name if Path(word).name in EXTERNAL_OPTIONS else None
    return None


# -- the checks --------------------------------------------------------------------------------------------------


def command_problems(text: str, continues: tuple[str, ...] = ()) -> tuple[list[str], tuple[str, ...]]:
    """Problems of the shell commands in ``text`` (a code line or span), and the bench commands a continuation
    line after it would belong to (``continues``: those of the line before, for a line that goes on with options)."""
    problems: list[str] = []
    if continues and re.match(r"\s+(\[|--)", text):
        return option_problems(OPTION.findall(text), continues, text), continues
    named: tuple[str, ...] = ()
    for command in shell_commands(text):
        found = BENCH.search(command)
        before = command[:found.start()] if found else command
        if (tool := tool_of(before)) is not None:
            problems += [f"{option!r} is not an option of {tool} (in {command!r})"
                         for option in OPTION.findall(before) if option not in tool_options()[tool]]
        if found is None:
            continue
        named = tuple(found.group(1).split("|"))
        unknown = [name for name in named if name not in bench_options()]
        if unknown:
            problems += [f"'bench {name}' is not a command of bench (in {command!r})" for name in unknown]
            continue
        problems += option_problems(OPTION.findall(command[found.end():]), named, command)
    return problems, named


def option_problems(options: list[str], commands: tuple[str, ...], where: str) -> list[str]:
    return [f"{option!r} is not an option of 'bench {name}' (in {where.strip()!r})"
            for option in options for name in commands if option not in bench_options()[name]]


def table_row_problems(line: str) -> list[str]:
    """A table row whose first cell is ``bench CMD``: every option in its code spans is an option of CMD."""
    cells = line.strip().strip("|").split("|")
    first = re.fullmatch(r"\s*`bench ([a-z]+)`\s*", cells[0]) if cells else None
    if first is None or first.group(1) not in bench_options():
        return []
    options = [option for span in spans(line) for option in OPTION.findall(span)]
    return option_problems(options, (first.group(1),), line)


def path_problems(token: str) -> list[str]:
    """A repository path named in code that does not exist, or that leaves the repository."""
    token = token.lstrip("'\"([{$").rstrip("'\"()[]{},;:.")
    if not PATH.fullmatch(token) or token.startswith(("/", "~")) or re.fullmatch(r"[\d./]+", token):
        return []
    if token.startswith(MADE_ELSEWHERE) or token.rstrip("/") in {p.rstrip("/") for p in MADE_ELSEWHERE}:
        return []
    top = token.split("/")[0]
    if not ((ROOT / top).exists() or token.endswith("/") or re.search(r"\.\w+$", token)):
        return []  # words with a slash ("batches/s"), not a path: a path starts in the repository or names a file
    target = (ROOT / token).resolve()
    if not target.is_relative_to(ROOT):
        return [f"{token!r} points outside the repository"]
    return [] if target.exists() else [f"{token!r} does not exist in the repository"]


def link_problems(target: str, base: Path, source: Path) -> list[str]:
    """A link of page ``source`` whose target (relative to ``base``) is missing or outside the repository."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target):
        return [] if target in ALLOWED_URLS else [f"link {target!r} leaves the repository"]
    path, _, anchor = target.partition("#")
    page = (base / path).resolve() if path else source
    if not page.is_relative_to(ROOT) and path:
        return [f"link {target!r} points outside the repository"]
    if not page.exists():
        return [f"link {target!r}: {path} does not exist"]
    if anchor and page.suffix == ".md" and anchor not in anchors(page):
        return [f"link {target!r}: no heading #{anchor} there"]
    return []


def problems(page: Path, base: Path | None = None) -> list[str]:
    """Everything ``page`` names that does not exist; links resolve from ``base`` (default: the page's folder)."""
    base = base or page.parent
    text = page.read_text()
    prose, code = split_code(text)
    inline = spans(prose)
    found: list[str] = []
    continues: tuple[str, ...] = ()
    for line in code:
        line_problems, continues = command_problems(line, continues)
        found += line_problems
    for span in inline:
        found += command_problems(span)[0]
    for line in prose.splitlines():
        if line.lstrip().startswith("|"):
            found += table_row_problems(line)
    found += [f"{option!r} is an option of no bench command and no tool the docs use"
              for option in OPTION.findall(LINK.sub("", text)) if option not in any_option()]
    for piece in [*code, *inline]:
        for token in piece.split():
            found += path_problems(token)
        found += [f"{name!r} does not import" for name in DOTTED.findall(piece)
                  if not resolves(name.removesuffix("()"))]
    without_spans = SPAN.sub("", prose)
    for target in LINK.findall(without_spans):
        found += link_problems(target, base, page)
    found += [f"URL {url!r} leaves the repository" for url in URL.findall(text) if url not in ALLOWED_URLS]
    found += ["names ../shared, which a clone does not have" for _ in re.findall(r"\.\./shared", text)]
    return list(dict.fromkeys(found))


# -- the tests -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_command_option_path_and_module_a_page_names_exists(page):
    assert problems(page) == []


def test_the_readme_starts_with_the_two_anchor_commands_and_stays_short():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert blocks[:2] == [
        "python3 -m venv .venv && .venv/bin/pip install -e '.[models,mpi]' && .venv/bin/bench micro\n",
        "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest -q\n",
    ]
    assert len(text.splitlines()) <= 200


def test_every_docs_page_is_in_the_index_and_the_readme():
    index = (ROOT / "docs" / "README.md").read_text()
    readme = (ROOT / "README.md").read_text()
    pages = [page.name for page in PAGES if page.parent.name == "docs" and page.name != "README.md"]
    assert pages and all(f"]({name})" in index and f"](docs/{name})" in readme for name in pages)


def test_the_checker_finds_a_made_up_option_a_made_up_path_and_a_link_outside(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    with readme.open("a") as out:
        out.write("\n```\nbench micro --sizes 1KB --frobnicate\n```\n\n"
                  "The protocol is in `transports/nowhere/transport.py`; see [the map](../shared/DESIGN.md).\n")
    assert problems(readme, base=ROOT) == [
        "'--frobnicate' is not an option of 'bench micro' (in 'bench micro --sizes 1KB --frobnicate')",
        "'--frobnicate' is an option of no bench command and no tool the docs use",
        "'transports/nowhere/transport.py' does not exist in the repository",
        "link '../shared/DESIGN.md' points outside the repository",
        "names ../shared, which a clone does not have",
    ]


def test_the_checker_tells_bench_options_from_other_tools_options():
    assert command_problems("mpirun -np 4 --oversubscribe bench model fcn5 --steps 5")[0] == []
    assert command_problems("mpirun --frobnicate bench model fcn5")[0] == [
        "'--frobnicate' is not an option of mpirun (in 'mpirun --frobnicate bench model fcn5')"]
    assert command_problems("tools/softroce --share results .venv/bin/bench micro --share x")[0] == [
        "'--share' is not an option of 'bench micro' (in 'tools/softroce --share results .venv/bin/bench micro "
        "--share x')"]
    assert command_problems("bench micro|model --sizes 1KB")[0] == [
        "'--sizes' is not an option of 'bench model' (in 'bench micro|model --sizes 1KB')"]
    assert command_problems("bench frob --out x")[0] == [
        "'bench frob' is not a command of bench (in 'bench frob --out x')"]
    assert command_problems("bench micro --sizes 1KB && pip install --no-deps nixl")[0] == []
    assert resolves("bench.experiments.micro.MicroLine") and not resolves("bench.experiments.micro.NoSuchLine")


def test_every_module_over_600_lines_says_why_in_its_docstring():
    """Files split by role: a module that grows past ~600 lines is split, or its docstring says why it is one."""
    import ast

    long = []
    for path in sorted([*ROOT.glob("bench/**/*.py"), *ROOT.glob("transports/**/*.py"), *ROOT.glob("tools/*.py")]):
        text = path.read_text()
        if text.count("\n") > 600 and "Why one module" not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(str(path.relative_to(ROOT)))
    assert long == []


# -- the pages' Python examples run --------------------------------------------------------------------------------

#: a Python example's first line naming the packages it needs beyond the install (``# needs: torch``)
NEEDS = re.compile(r"^#\s*needs:\s*(.+)$")


def python_examples() -> list[tuple[Path, int, str]]:
    """Every ```python block of every page: (page, the line its code starts on, the code)."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        start = None
        for number, line in enumerate(lines, 1):
            if start is None and line.strip() == "```python":
                start = number
            elif start is not None and FENCE.match(line):
                found.append((page, start + 1, "\n".join(lines[start:number - 1]) + "\n"))
                start = None
    return found


@pytest.mark.parametrize(("page", "line", "code"), python_examples(),
                         ids=lambda value: None if isinstance(value, Path | str) else str(value))
def test_every_python_example_of_the_docs_runs(page, line, code, tmp_path):
    """Each example as a reader would run it: a script of its own, in a fresh interpreter, in an empty directory."""
    import importlib.util
    import os
    import subprocess
    import sys

    first = code.splitlines()[0]
    if match := NEEDS.match(first):
        missing = [name.strip() for name in match.group(1).split(",")
                   if importlib.util.find_spec(name.strip()) is None]
        if missing:
            pytest.skip(f"{page.name} line {line}: needs {', '.join(missing)}, not installed here")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, f"{page.name} line {line}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_the_python_page_has_examples_of_each_part():
    """The page the issue asked for: create, start, plan, send/recv, persistent transfers, each framework through
    DLPack, timeouts and errors, each in a block that runs."""
    code = "\n".join(code for page, _, code in python_examples() if page.name == "python.md")
    for part in ("transports.create(", ".start(cluster", ".placement.plan(", ".send_async(", ".recv(", ".outbound(",
                 ".inbound(", 'as_framework(received, "torch")', 'as_framework(received, "tensorflow")',
                 'as_framework(received, "jax")', "TransportTimeout", "PeerError", "multiprocessing"):
        assert part in code, part
