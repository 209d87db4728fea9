"""A failure a resource limit causes names the limit, its value and the fix, in the one error line; a rank that dies
gives its fatal cause (the line of its log that says why) in that line too, not only in its log.

Each run gets its limit as ``ulimit`` in a shell gives it: a small Python sets it, then execs bench in its place;
the ranks inherit it. Not in ``preexec_fn``: that forks this process, which has run gRPC, and gRPC's fork handlers
start its poller in the child; closing the child's descriptors before the exec pulls its epoll out from under it,
and the child aborts (``epoll_wait error: Bad file descriptor``) before bench starts: 3 children in 200 here.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from bench.launch.local import explained, fatal_cause, limit_hint
from bench.launch.messages import RankFailed

ROOT = Path(__file__).resolve().parent.parent


def bench_with_limit(limit: int, value: int, *args: str, stack: int | None = None,
                     env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``bench *args`` with the soft limit ``limit`` at ``value`` (and the stack limit at ``stack`` bytes, if given)
    in the child, as ``ulimit`` gives them: its ranks inherit them."""
    limits = ",".join(f"{which}={soft}" for which, soft in ((limit, value), (resource.RLIMIT_STACK, stack))
                      if soft is not None)
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    return subprocess.run([sys.executable, "-c", _UNDER_LIMITS, limits, "-m", "bench.cli", *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)


#: ``python -c _UNDER_LIMITS WHICH=SOFT[,WHICH=SOFT] ARGS...``: lowers those soft limits, then runs ``python ARGS...``
#: in its own place
_UNDER_LIMITS = """
import os, resource, sys
for pair in sys.argv[1].split(","):
    which, soft = map(int, pair.split("="))
    resource.setrlimit(which, (soft, resource.getrlimit(which)[1]))
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def micro(out: Path, transport: str) -> list[str]:
    return ["micro", "--sizes", "1KB", "--iters", "10", "--warmup", "1", "--transports", transport,
            "--no-references", "--no-peers", "--no-plot", "--timeout", "60", "--out", str(out)]


def error_line(stderr: str) -> str:
    [line] = [line for line in stderr.splitlines() if line.startswith("bench micro: error:")]
    return line


def test_too_few_open_files_for_bench_itself_is_one_line_naming_the_limit(tmp_path):
    """``ulimit -n 10``: bench cannot open its ranks' logs; one line with the limit and the fix, no traceback."""
    done = bench_with_limit(resource.RLIMIT_NOFILE, 10, *micro(tmp_path / "run", "zerocopy"))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    line = error_line(done.stderr)
    assert "Too many open files" in line
    assert "the limit on open files (ulimit -n, RLIMIT_NOFILE) is 10: raise it with ulimit -n 4096" in line


def test_too_few_open_files_for_a_rank_names_the_limit(tmp_path):
    """``ulimit -n 24``: bench starts, a rank runs out of descriptors; the run's error line names the limit."""
    done = bench_with_limit(resource.RLIMIT_NOFILE, 24, *micro(tmp_path / "run", "zerocopy"))
    assert done.returncode == 1, done.stderr[-3000:]
    line = error_line(done.stderr)
    assert re.search(r"rank \d \(\w+\) failed: OSError: \[Errno 24\] Too many open files", line), line
    assert "ulimit -n, RLIMIT_NOFILE) is 24: raise it with ulimit -n 4096" in line


#: each thread's stack under the address-space test: the stack limit is glibc's default size of a thread's stack
_THREAD_STACK = 512 << 20


def test_a_rank_that_dies_under_an_address_space_limit_gives_its_cause_and_the_limit(tmp_path):
    """``ulimit -s 524288 -v 3932160``: gRPC's threads cannot start and it aborts; the error line says why (its log's
    ``pthread_create failed``), not only ``killed by SIGABRT``, and names the limit and the fix.

    The limit must fall between threads, not inside the libraries' layout, or the rank fails anywhere (a library
    that cannot map, glibc's thread-local data) or not at all, as it did on a machine whose mappings were a little
    smaller: with every thread's stack 512 MiB and malloc's arenas kept to one, a rank holds 7.5 stacks' worth
    (imports, the run's threads and gRPC's first) and gRPC's pool, about ten threads, cannot start."""
    hard_stack = resource.getrlimit(resource.RLIMIT_STACK)[1]
    if hard_stack != resource.RLIM_INFINITY and hard_stack < _THREAD_STACK:
        pytest.skip("the hard stack limit is below 512 MiB: ulimit -Hs unlimited lets this run")
    space_kb = (_THREAD_STACK * 15 // 2) >> 10
    done = bench_with_limit(resource.RLIMIT_AS, space_kb << 10, *micro(tmp_path / "run", "grpc_tcp"),
                            stack=_THREAD_STACK, env={"MALLOC_ARENA_MAX": "1", "OPENBLAS_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stderr[-3000:]
    line = error_line(done.stderr)
    assert re.search(r"died \(killed by SIGABRT\): pthread_create failed: Resource temporarily unavailable", line), \
        line
    assert f"the limit on address space (ulimit -v, RLIMIT_AS) is {space_kb} KB" in line
    assert "raise it with ulimit -v unlimited" in line


# -- the parts, without a run ---------------------------------------------------------------------------------

_CRASHED_LOG = """\
E1126 12:01:37.663139   18505 thd.cc:157] pthread_create failed: Resource temporarily unavailable
E1126 12:01:48.560841   18505 work_stealing_thread_pool.cc:412] Failed to start lifeguard thread
Fatal Python error: Aborted

Thread 0x00007f56908b66c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/work/main/bench/launch/base.py", line 368 in beat_error_handler

Current thread 0x00007f569c3c6b80 (most recent call first):
  File "/work/main/transports/grpc_tcp/transport.py", line 211 in _run

Extension modules: numpy._core._multiarray_umath, grpc._cython.cygrpc (total: 2)
"""


def test_the_fatal_cause_is_the_logs_last_operating_system_error_without_faulthandlers_lines(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_text(_CRASHED_LOG)
    assert fatal_cause(log) == "pthread_create failed: Resource temporarily unavailable"
    log.write_text("starting\nsomething went wrong: the peer failed to answer\nFatal Python error: Aborted\n")
    assert fatal_cause(log) == "something went wrong: the peer failed to answer"
    log.write_text("Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n")
    assert fatal_cause(log) is None
    log.write_text("x" * 10 + " error " + "y" * 1000 + "\n")
    assert len(fatal_cause(log)) <= 240
    assert fatal_cause(tmp_path / "missing.log") is None


def test_a_death_gets_its_cause_in_its_first_line_before_what_followed(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_text(_CRASHED_LOG)
    failed = RankFailed(0, "sender", "died (killed by SIGABRT); then rank 1 (receiver) died (killed by SIGABRT)",
                        "died")
    text = str(explained(failed, log)).splitlines()[0]
    assert text.startswith("rank 0 (sender) died (killed by SIGABRT): pthread_create failed: Resource temporarily "
                           "unavailable; then rank 1 (receiver) died"), text
    quiet = RankFailed(1, "receiver", "died (exit code 1)", "died")
    assert str(explained(quiet, tmp_path / "missing.log")) == "rank 1 (receiver) died (exit code 1)"
    killed = RankFailed(0, "sender", "died (killed by SIGKILL)", "died")  # from outside: its log cannot say why
    assert str(explained(killed, log)) == "rank 0 (sender) died (killed by SIGKILL)"


@pytest.mark.parametrize(("text", "limit", "value", "named"), [
    ("OSError: [Errno 24] Too many open files", resource.RLIMIT_NOFILE, 64, "ulimit -n, RLIMIT_NOFILE) is 64"),
    ("RuntimeError: can't start new thread", resource.RLIMIT_AS, 512 << 20, "ulimit -v, RLIMIT_AS) is 524288 KB"),
    ("MemoryError", resource.RLIMIT_AS, 1 << 30, "ulimit -v"),
    ("ImportError: cygrpc.so: failed to map segment from shared object", resource.RLIMIT_AS, 1 << 30, "ulimit -v"),
])
def test_a_limit_is_named_only_when_it_is_set(monkeypatch, text, limit, value, named):
    unlimited = resource.RLIM_INFINITY
    monkeypatch.setattr(resource, "getrlimit", lambda which: (unlimited, unlimited))
    assert limit_hint(text) is None
    monkeypatch.setattr(resource, "getrlimit",
                        lambda which: (value, unlimited) if which == limit else (unlimited, unlimited))
    assert named in limit_hint(text)
    assert limit_hint("ValueError: not a size") is None


# -- bench scale: the ranks of its most servers against the memory available ---------------------------------------


class _NoRanks:
    """A launcher that starts every rank here (as local and netns do), and fails the test if anything asks it to."""

    name = "local"
    starts_processes = True

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __getattr__(self, attribute):
        self.asked.append(attribute)
        raise AssertionError(f"a rank was about to start ({attribute})")


def _training_args(command: str, *argv: str):
    import argparse
    import importlib

    parser = argparse.ArgumentParser(prog=f"bench {command}")
    importlib.import_module(f"bench.commands.{command}").add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("command", ["scale", "model"])
def test_training_beyond_the_memory_available_is_refused_before_any_rank_with_the_most_servers_that_fit(
        command, tmp_path, monkeypatch, capsys):
    """bench scale --servers 64 ran until the OOM killer struck, leaving UCX's segments in /dev/shm (bench model
    --servers 64 alike)."""
    import importlib

    from bench.experiments import training_memory
    from bench.ground import memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 8 * 2**30)
    launcher = _NoRanks()
    servers = "1,64" if command == "scale" else "64"
    status = importlib.import_module(f"bench.commands.{command}").run(_training_args(
        command, "fcn5", "--servers", servers, "--compute", "replay", "--transports", "zerocopy,grpc_tcp", "--out",
        str(tmp_path / "run")),
        launcher)
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"bench {command}: error: --servers 64: training fcn5 (204 MB of parameters) on 64 servers "
                          "holds about 97.5 GB at once (about 1.5 GB a server: "), err
    assert err.rstrip().endswith("but 8.0 GB of memory is available now (MemAvailable); at most --servers 5 fits "
                                 "(or free memory)"), err
    fcn5 = int(204.47 * 2**20)  # Table 2's size: the model is not built to learn it
    assert training_memory.run_bytes(fcn5, 5, False) <= 8 * 2**30 < training_memory.run_bytes(fcn5, 6, False)
    assert not (tmp_path / "run").exists() and not launcher.asked


def test_scale_says_when_not_even_one_server_fits(monkeypatch):
    from bench.experiments import training_memory
    from bench.ground import memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 2**30)
    problem = training_memory.memory_problem(["fcn5", "vgg16"], [1, 2], "real", _NoRanks())
    assert problem.startswith("--servers 2: training vgg16 (512 MB of parameters)"), problem  # the largest model
    assert problem.endswith("not even 1 server fits: choose a smaller model (or free memory)"), problem


def test_what_scale_holds_grows_with_servers_and_real_compute_and_fits_when_it_fits(monkeypatch):
    from bench.experiments import training_memory
    from bench.ground import memory

    mb = 2**20
    one = training_memory.run_bytes(100 * mb, 1, False)
    assert one == training_memory.HELD_PER_SERVER * 100 * mb + 2 * training_memory.RANK_BASELINE_BYTES
    assert training_memory.run_bytes(100 * mb, 4, False) == 4 * one
    assert training_memory.run_bytes(100 * mb, 4, True) - 4 * one == 4 * (100 * mb + training_memory.TENSORFLOW_BYTES)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 64 * 2**30)
    assert training_memory.memory_problem(["vgg16"], [1, 2, 4], "replay", _NoRanks()) is None
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 2**20)
    # not checked: ranks a job's launcher started (on hosts of their own), a model of the user's (size unknown here)
    job = type("Job", (), {"starts_processes": False})()
    assert training_memory.memory_problem(["vgg16"], [64], "replay", job) is None
    assert training_memory.memory_problem(["tests.tiny_models:TINY"], [64], "replay", _NoRanks()) is None
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: None)
    assert training_memory.memory_problem(["vgg16"], [64], "replay", _NoRanks()) is None
