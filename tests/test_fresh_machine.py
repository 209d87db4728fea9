"""tools/fresh-machine: which README lines it runs, and which package index settings a user's machine would have.

The tool itself (a minimal Debian root, the README's commands in it) runs in .ci/run, not here: it takes minutes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_loader = SourceFileLoader("fresh_machine", str(ROOT / "tools" / "fresh-machine"))
fresh = sys.modules["fresh_machine"] = importlib.util.module_from_spec(
    importlib.util.spec_from_loader("fresh_machine", _loader))
_loader.exec_module(fresh)


def test_the_readme_commands_it_runs_are_the_readmes_first_two():
    main, tests = fresh.readme_commands(ROOT / "README.md")
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[main.number - 1] == main.text and lines[tests.number - 1] == tests.text
    assert main.number < tests.number
    steps = fresh.steps(main, tests, "1KB", ["tests/test_sizes.py"])
    # the README's line as written, only the sizes added; the tests' line with its pytest cut to the smoke tests
    assert steps[0].command == f"{main.text} --sizes 1KB" and "README.md line" in steps[0].what
    assert steps[4].command == f"{tests.text} tests/test_sizes.py" and steps[4].clone != steps[0].clone
    assert [step.command.split()[1] for step in steps[1:4]] == ["model", "plot", "report"]
    # then, in the tests' clone, every test that needs something of the system: run, or skipped saying why
    assert steps[5].command == ".venv/bin/pytest -q -rs -m system" and steps[5].clone == steps[4].clone
    assert len(steps) == 6


def test_a_readme_whose_commands_changed_shape_is_refused_naming_the_line(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n```\npython3 -m venv .venv && .venv/bin/bench micro --sizes 1KB\n```\n\n"
                      "```\npython3 -m venv .venv && .venv/bin/pytest -q\n```\n")
    with pytest.raises(fresh.Unavailable, match=r"README\.md line 4: .* should end in 'bench micro'"):
        fresh.readme_commands(readme)
    readme.write_text("```\npython3 -m venv .venv && .venv/bin/bench micro\n```\n")
    with pytest.raises(fresh.Unavailable, match="found 1"):
        fresh.readme_commands(readme)


def test_the_smoke_tests_exist():
    for test in fresh.SMOKE:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), path
        assert not name or f"def {name}(" in (ROOT / path).read_text(), test


def test_pip_settings_keep_a_users_index_and_leave_this_machines_files_out(tmp_path, monkeypatch):
    cert = tmp_path / "proxy-ca.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    config = tmp_path / "pip.conf"
    config.write_text(f"[global]\nconstraint = /etc/xdg/pip/constraints.txt\ncert = {cert}\n"
                      "extra-index-url = file:///opt/pypi/simple https://mirror.example/simple\n")
    for name in [name for name in os.environ if name.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "180")
    monkeypatch.setenv("https_proxy", "http://proxy.example:3128")
    env, dropped, kept_cert = fresh.pip_settings()
    assert env["PIP_EXTRA_INDEX_URL"] == "https://mirror.example/simple"
    assert env["PIP_DEFAULT_TIMEOUT"] == "180" and env["https_proxy"] == "http://proxy.example:3128"
    assert env["PIP_CERT"] == str(cert) and kept_cert == cert  # copied into the root at the same path
    assert "PIP_FIND_LINKS" not in env and "PIP_CONSTRAINT" not in env
    assert {"constraint=/etc/xdg/pip/constraints.txt", "find-links=/opt/wheels",
            "extra-index-url=file:///opt/pypi/simple"} <= set(dropped)


def test_it_says_why_it_cannot_run_without_root():
    if os.geteuid() == 0:
        pytest.skip("runs as root here: the refusal is for other users")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "fresh-machine")], capture_output=True, text=True)
    assert result.returncode == fresh.EXIT_UNAVAILABLE and "needs root" in result.stdout


def test_a_failed_step_shows_the_ranks_logs_that_say_anything(tmp_path, capsys):
    """A run's ranks write their errors to their logs in the clone's results, inside the root that goes when the
    run ends: the logs that say anything are kept beside the steps' output and their last lines printed."""
    fresh_dir = tmp_path / "root" / "fresh"
    fresh_dir.mkdir(parents=True)
    (fresh_dir / "step-1.log").write_text("bench model: error: rank 1 failed\n")
    ranks = tmp_path / "root" / "main" / "results" / "model-1" / "logs"
    ranks.mkdir(parents=True)
    (ranks / "fcn5-rank0.log").write_text("Traceback\nPeerError: the reason\n")
    (ranks / "fcn5-rank1.log").write_text("")
    kept = tmp_path / "kept"
    fresh._keep_logs(fresh_dir, kept)
    assert sorted(p.name for p in (kept / "ranks").iterdir()) == ["model-1-fcn5-rank0.log"]
    fresh._print_tail(kept / "step-1.log")
    printed = capsys.readouterr().out
    assert "rank 1 failed" in printed and "PeerError: the reason" in printed


def test_the_smoke_tests_hold_the_readmes_micro_run_and_the_command_line():
    """The README's test command failed on a bare root in test_cli.py's micro run, which the smoke tests left out."""
    assert "tests/test_cli.py" in fresh.SMOKE
    assert "tests/test_micro_cli.py::test_micro_end_to_end_writes_records_meta_and_figures" in fresh.SMOKE


def test_the_system_tests_skip_reasons_are_printed_one_line_each(tmp_path, capsys):
    main = fresh.ReadmeLine(6, "python3 -m venv .venv && .venv/bin/bench micro")
    tests = fresh.ReadmeLine(14, "python3 -m venv .venv && .venv/bin/pytest -q")
    plan = fresh.steps(main, tests, "1KB", ["tests/test_sizes.py"])
    (tmp_path / "step-5.log").write_text("..s.\nSKIPPED [3] tests/conftest.py:106: needs netns: `ip` not found on "
                                         "PATH: install iproute2\n3 passed, 1 skipped\n")
    fresh._print_skips(plan, tmp_path)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"fresh-machine: {fresh.SYSTEM_STEP}: 1 reason(s) to skip:",
                       "    SKIPPED [3] tests/conftest.py:106: needs netns: `ip` not found on PATH: install iproute2"]
