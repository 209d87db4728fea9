"""Bad input to bench, and broken results directories: one line naming the problem and the fix, exit 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.results import RunWriter, load_run
from tests.processes import unprivileged


def bench(*args: str, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)


def one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert fragment in result.stderr, result.stderr


QUICK = ["--sizes", "1KB", "--iters", "1", "--transports", "local", "--no-references", "--no-peers", "--no-plot"]

#: options that keep a run small, given before each case's own
SAFE = {
    "micro": [*QUICK, "--warmup", "0", "--timeout", "60"],
    "model": ["--transport", "local", "--steps", "1", "--warmup", "0", "--no-plot", "--timeout", "60"],
    "scale": ["--transport", "local", "--steps", "1", "--warmup", "0", "--no-plot", "--timeout", "60"],
    "soak": ["--transports", "local", "--sizes", "1KB", "--duration", "1", "--steps", "0", "--timeout", "60"],
    "models": ["--steps", "1"],
}


@pytest.mark.parametrize(("args", "fragment"), [
    # results directories that cannot be made
    (["micro", *QUICK, "--out", "/proc/nope"], "cannot create the results directory /proc/nope"),
    (["micro", *QUICK, "--out", "/etc/passwd/x"], "cannot create the results directory /etc/passwd/x: Not a directory"),
    # empty lists: an error, not an empty "complete" run
    (["model", "fcn5", "--batch-size", ","], "--batch-size: expected a whole number or a comma list"),
    (["model", ","], "MODEL: expected a model name or a comma list"),
    (["model", "fcn5", "--transport", ","], "--transports: expected a comma list of transport names"),
    (["micro", "--transports", ","], "--transports: expected a comma list of transport names"),
    (["scale", "fcn5", "--servers", ","], "--servers: expected a whole number or a comma list"),
    # numbers
    (["micro", "--timeout", "nan"], "--timeout: expected a positive number of seconds, got 'nan'"),
    (["micro", "--timeout", "inf"], "--timeout: expected a positive number of seconds, got 'inf'"),
    (["micro", "--timeout=-inf"], "--timeout: expected a positive number of seconds"),
    (["micro", "--timeout", "1e300"], "--timeout: expected at most 604800 seconds"),
    (["model", "fcn5", "--timeout", "nan"], "--timeout: expected a positive number of seconds"),
    (["micro", "--warmup", "-1"], "--warmup: expected a number of at least 0, got -1"),
    (["model", "fcn5", "--warmup", "-1"], "--warmup: expected a number of at least 0, got -1"),
    (["micro", "--iters", "1.5"], "--iters: expected a whole number, got '1.5'"),
    (["model", "fcn5", "--steps", "0"], "--steps: expected a number of at least 1, got 0"),
    (["model", "fcn5", "--servers", "-2"], "--servers: expected a number of at least 1, got -2"),
    (["model", "fcn5", "--learning-rate", "nan"], "--learning-rate: expected a positive number, got 'nan'"),
    (["model", "fcn5", "--learning-rate", "-0.1"], "--learning-rate: expected a positive number"),
    (["model", "fcn5", "--learning-rate", "fast"], "--learning-rate: expected a number, got 'fast'"),
    (["models", "--batch-size", "0"], "--batch-size: expected a number of at least 1"),
    (["micro", "--sizes", "1TB"], "--sizes: a 1TB transfer holds about"),
    (["soak", "--sizes", "1TB"], "--sizes: 1TB does not fit twice"),
    (["soak", "--duration", "0"], "--duration: expected a positive duration, got '0'"),
    (["soak", "--duration", "10y"], "--duration: expected a duration such as 600, 90s, 10m, 1h or 1m30s, got '10y'"),
    (["soak", "--duration", "nan"], "--duration: expected a duration such as"),
    (["soak", "--duration", "1m30"], "--duration: give every part of '1m30' its unit (h, m, s), e.g. 1m30s"),
    # an address not on this host (TEST-NET-2): probed by binding (which sends nothing), before any run starts
    (["micro", "--bind", "198.51.100.77"], "--bind 198.51.100.77: cannot listen there"),
    # a batch whose input alone is beyond the machine's memory
    (["model", "fcn5", "--batch-size", "99999999999"], "--batch-size 99999999999: one batch of fcn5's input alone"),
    (["soak", "--steps", "-1"], "--steps: expected a number of at least 0"),
    (["soak", "--transports", "nope"], "unknown transport 'nope'"),
    # where tensors live
    (["micro", "--memory", "gpu"], "--memory: memory 'gpu' is not one of host, cuda, cuda:N"),
    (["micro", "--memory", "cuda,host,host"], "sender's and receiver's, joined by a comma"),
    # calibrating the peer lines while measuring none (SAFE's --no-peers comes first)
    (["micro", "--calibrate"], "--calibrate with --no-peers: --calibrate measures each peer line beside its library's "
                               "plain loop, and --no-peers measures no peer line; drop one of them"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, fragment):
    # should the check under test be missing, the command runs: make that run tiny (a default micro run measures
    # every transport up to 1GB, more than this shared machine can spare); the case's own options come last and win
    command, *rest = args
    one_line_error(bench(command, *SAFE[command], *(["--out", str(tmp_path / "out")] if command != "models" else []),
                         *rest), fragment)


@pytest.mark.parametrize(("text", "seconds"), [("600", 600), ("90s", 90), ("10m", 600), ("1h", 3600),
                                               ("1m30s", 90), ("1h 30m", 5400), ("2.5m", 150), ("1min", 60)])
def test_durations_take_units_and_parts_of_them(text, seconds):
    from bench.options import duration

    assert duration(text) == seconds


def test_no_run_directory_is_left_by_a_bind_address_not_here(tmp_path):
    one_line_error(bench("micro", *SAFE["micro"], "--out", str(tmp_path / "out"), "--bind", "198.51.100.77"),
                   "it is not an address of this host")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("memory", ["cuda", "cuda:0,host", "host,cuda:7"])
def test_device_memory_without_a_gpu_is_one_line_exit_2_and_no_run(tmp_path, memory):
    """``--memory cuda`` on a machine without a GPU (or without that device, or without CuPy): refused in one line
    before any rank starts, and no results directory is made. Where the device is usable, it skips saying so."""
    from transports.memory import Memory, cuda_problem, parse_sides

    problems = [cuda_problem(side) for side in parse_sides(memory)]
    if not any(problems):
        pytest.skip(f"--memory {memory} can run here: a GPU and CuPy are present")
    result = bench("micro", *SAFE["micro"], "--out", str(tmp_path / "out"), "--memory", memory)
    one_line_error(result, f"--memory {','.join(dict.fromkeys(str(Memory.parse(side)) for side in memory.split(',')))}")
    assert next(p for p in problems if p) in result.stderr and "--memory host" in result.stderr
    assert not (tmp_path / "out").exists()


def test_calibrate_with_no_peers_is_refused_in_either_order_before_any_run(tmp_path):
    for order in (["--calibrate", "--no-peers"], ["--no-peers", "--calibrate"]):
        result = bench("micro", *order, "--sizes", "1KB", "--iters", "1", "--transports", "local", "--no-references",
                       "--no-plot", "--out", str(tmp_path / "out"))
        one_line_error(result, "--calibrate with --no-peers")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["missing", "read-only", "a-directory"])
def test_analyze_refuses_a_json_path_it_cannot_write_before_the_analysis(tmp_path, where):
    """``bench analyze --json PATH``: a path whose directory is missing or cannot be written into, or that is a
    directory, is one line before the model is built and analysed (nothing on stdout), and no run is made."""
    prefix = []
    if where == "missing":
        path = tmp_path / "nowhere" / "plan.json"
        fragment = f"the directory {tmp_path / 'nowhere'} does not exist; create it or choose another --json"
    elif where == "read-only":
        prefix = unprivileged()
        (tmp_path / "locked").mkdir()
        (tmp_path / "locked").chmod(0o555)
        path = tmp_path / "locked" / "plan.json"
        fragment = f"cannot write into {tmp_path / 'locked'} (no permission to write there); choose another --json"
    else:
        path, fragment = tmp_path, f"is a directory, not a file; give the file's path, e.g. {tmp_path / 'plan.json'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([*prefix, sys.executable, "-m", "bench.cli", "analyze", "fcn5", "--json", str(path),
                             "--out", str(tmp_path / "run"), "--no-plot"], capture_output=True, text=True,
                            timeout=300, env=env)
    one_line_error(result, f"bench analyze: error: --json {path}: ")
    assert fragment in result.stderr
    assert result.stdout == "" and not (tmp_path / "run").exists()


def test_the_default_results_directory_in_a_read_only_directory(tmp_path):
    if os.geteuid() == 0:
        where = Path("/proc")  # root writes anywhere else; nobody creates a directory here
    else:
        where = tmp_path / "read-only"
        where.mkdir()
        where.chmod(0o555)
    result = bench("micro", *QUICK, cwd=where)
    one_line_error(result, "cannot create the results directory results/micro-")
    assert "run bench from a writable directory or give --out DIR" in result.stderr


def test_empty_lists_start_no_run(tmp_path):
    out = tmp_path / "run"
    one_line_error(bench("model", "fcn5", "--batch-size", ",", "--out", str(out)), "--batch-size")
    assert not out.exists()


# -- bench plot on what is not a good run -------------------------------------------------------------------------


def a_run(path: Path) -> Path:
    writer = RunWriter(path, "micro", {})
    writer.add({"transport": "local", "size_bytes": 1024, "iters": 2, "p50_us": 1.0, "p99_us": 2.0, "mean_us": 1.5,
                "throughput_MBps": 600.0, "sender_cpu_s": 0.1, "receiver_cpu_s": 0.1, "copied_bytes_per_transfer": 0})
    writer.finish()
    return path


BREAKAGES = {
    "meta.json that is not JSON": ("meta.json", '{"schema', "meta.json cannot be read"),
    "meta.json that is a list": ("meta.json", "[1, 2]", "is not a meta.json written by bench"),
    "meta.json without an experiment": ("meta.json", '{"schema_version": 1}', "is not a meta.json written by bench"),
    "meta.json of binary bytes": ("meta.json", b"\xff\xfe\x00", "meta.json cannot be read"),
    "empty records.csv": ("records.csv", "", "records.csv is empty"),
    "records.csv with a header only": ("records.csv", None, "the run has no records to draw"),
    "records.csv with words for numbers": ("records.csv", "garbage", "not a number"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_plot_of_a_broken_run_is_one_line(tmp_path, breakage):
    run = a_run(tmp_path / "run")
    name, content, fragment = BREAKAGES[breakage]
    target = run / name
    if content is None:
        content = target.read_text().splitlines()[0] + "\n"
    elif content == "garbage":
        header = target.read_text().splitlines()[0]
        content = header + "\n" + ",".join(["local", "abc"] + ["zz"] * (header.count(",") - 1)) + "\n"
    if isinstance(content, bytes):
        target.write_bytes(content)
    else:
        target.write_text(content)
    one_line_error(bench("plot", str(run)), fragment)


def test_plot_of_a_good_run_still_draws(tmp_path):
    run = a_run(tmp_path / "run")
    result = bench("plot", str(run))
    assert result.returncode == 0, result.stderr
    assert (run / "micro_time.png").is_file()


def test_a_run_left_running_by_a_dead_process_reads_as_killed(tmp_path):
    run = a_run(tmp_path / "run")
    meta = json.loads((run / "meta.json").read_text())
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    meta.update(status="running", end_time=None, pid=int(done.stdout))  # a process that has ended
    (run / "meta.json").write_text(json.dumps(meta))
    assert load_run(run).meta["status"] == "killed"
    meta["pid"] = os.getpid()  # alive: still running
    (run / "meta.json").write_text(json.dumps(meta))
    assert load_run(run).meta["status"] == "running"
