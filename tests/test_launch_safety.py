"""Nobody in through the launch path: the Slurm rendezvous another user could plant, the messages of the hub and
of the job's channel (data, never code), and which of several deaths a failed run names (the first)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.launch import wire
from bench.launch.context import connect
from bench.launch.hub import Hub, _died_first, _RankState
from bench.launch.job import channel_decode
from bench.launch.messages import LaunchError, RankSpec, Report
from bench.launch.rendezvous import RENDEZVOUS_VARIABLE
from bench.launch.slurm import SlurmChannel
from bench.launch.slurm_step import SlurmStep
from bench.launch.wire import WireError, decode_message, encode_message, receive_message
from tests import launch_jobs as jobs
from tests.test_wire_format import frame, instance, items, partial, ref, string, text

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534
STEP = SlurmStep(job_id="41", step_id="0", task=1, tasks=2, nodes=("localhost",), node="localhost")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting a file as another user needs root")


# -- the rendezvous ------------------------------------------------------------------------------------------------


@pytest.fixture
def planted_listener():
    """A listener another user set up: what connects to it is counted."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(0.5)
        yield listener


def _plant(folder: Path, listener: socket.socket, owner: int | None) -> Path:
    path = folder / f"slurm-{STEP.name}"
    path.write_text(json.dumps({"address": list(listener.getsockname()), "token": "planted"}))
    path.chmod(0o600)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def _nobody_connected(listener: socket.socket) -> bool:
    try:
        listener.accept()[0].close()
    except TimeoutError:
        return True
    return False


def _join_refused(folder: Path, monkeypatch) -> str:
    monkeypatch.setenv(RENDEZVOUS_VARIABLE, str(folder))
    monkeypatch.delenv("TENSOR_BENCH_TOKEN", raising=False)
    with pytest.raises(LaunchError) as refused:
        SlurmChannel(STEP)
    assert "\n" not in str(refused.value)
    return str(refused.value)


@needs_root
def test_a_rendezvous_file_another_user_planted_is_refused_before_any_connection(tmp_path, planted_listener,
                                                                                  monkeypatch):
    folder = tmp_path / "rendezvous"
    folder.mkdir(mode=0o700)
    path = _plant(folder, planted_listener, NOBODY)
    said = _join_refused(folder, monkeypatch)
    assert said.startswith(f"refusing {path}: owned by uid {NOBODY}")
    assert f"set {RENDEZVOUS_VARIABLE} to a directory only you can write (chmod 700)" in said
    assert _nobody_connected(planted_listener)


@needs_root
def test_a_file_planted_in_a_shared_scratch_directory_is_refused(request, planted_listener, monkeypatch):
    # a 1777 directory, as scratch directories on clusters are; the file made by another user's process
    folder = Path(tempfile.mkdtemp(prefix="bench-test-scratch-", dir="/tmp"))  # nobody can reach it there
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    folder.chmod(0o1777)
    path = folder / f"slurm-{STEP.name}"
    code = (f"import os, json; os.setgid({NOBODY}); os.setuid({NOBODY}); "
            f"fd = os.open({str(path)!r}, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600); "
            f"os.write(fd, json.dumps({{'address': {list(planted_listener.getsockname())!r}, 'token': 'x'}}).encode())")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    said = _join_refused(folder, monkeypatch)
    assert said.startswith(f"refusing {folder}: ")  # the directory is refused first: others may write it
    assert "writable by group or others (mode 1777)" in said
    assert _nobody_connected(planted_listener)


def test_a_group_writable_directory_is_refused_even_with_our_own_file(tmp_path, planted_listener, monkeypatch):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o770)
    _plant(folder, planted_listener, None)
    said = _join_refused(folder, monkeypatch)
    assert said.startswith(f"refusing {folder}: writable by group or others (mode 770)")
    assert _nobody_connected(planted_listener)


def test_a_rendezvous_file_that_is_a_link_is_refused(tmp_path, planted_listener, monkeypatch):
    folder = tmp_path / "rendezvous"
    folder.mkdir(mode=0o700)
    real = _plant(tmp_path, planted_listener, None)
    (folder / real.name).symlink_to(real)
    said = _join_refused(folder, monkeypatch)
    assert said.startswith(f"refusing {folder / real.name}: a symbolic link")
    assert _nobody_connected(planted_listener)


def test_task_0_publishes_into_a_directory_only_it_may_write(tmp_path, monkeypatch):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv(RENDEZVOUS_VARIABLE, str(folder))
    with pytest.raises(LaunchError, match=rf"refusing {folder}: writable by group or others \(mode 777\)"):
        SlurmChannel(SlurmStep("41", "0", 0, 2, ("localhost",), "localhost"))
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_task_0_stopped_while_it_waits_removes_its_rendezvous_file(tmp_path, signum):
    folder = tmp_path / "rendezvous"
    # SIGINT as a terminal gives it: a test run in the background of a shell (CI) has it ignored, which a child
    # inherits (Python then installs no KeyboardInterrupt for it). Set in the child's own code, not in preexec_fn:
    # that forks this process, and gRPC's fork handlers can abort the child before its exec
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from bench.launch.slurm import SlurmChannel; from bench.launch.slurm_step import SlurmStep; "
            "SlurmChannel(SlurmStep('41', '0', 0, 2, ('localhost',), 'localhost'))")
    env = {**os.environ, RENDEZVOUS_VARIABLE: str(folder), "PYTHONPATH": str(ROOT)}
    env.pop("TENSOR_BENCH_TOKEN", None)
    task0 = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (folder / "slurm-41.0").exists():
            assert task0.poll() is None and time.monotonic() < deadline, "task 0 did not publish its file"
            time.sleep(0.05)
        task0.send_signal(getattr(signal, signum))
        task0.wait(timeout=30)
    finally:
        task0.kill()
        task0.wait()
    assert list(folder.iterdir()) == []


# -- the messages: data, never code -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """A workload whose methods travel bound (``run_tf_grpc(TINY.build, ...)``)."""

    name: str = "w"

    def build(self) -> str:
        return f"built {self.name}"

    @classmethod
    def named(cls, name: str) -> Workload:
        return cls(name)

    @property
    def touched(self) -> str:
        raise AssertionError("a property ran on load")

    def _private(self) -> None:
        raise AssertionError("a private method arrived")


def _hostile(marker: Path) -> list[bytes]:
    """What a hostile peer would send: frames of the wire's format that name code (the encoder refuses to make
    them, so they are made by hand), and pickles, which the wire never loads."""
    touch = string(f"touch {marker}")
    workload = instance("tests.test_launch_safety:Workload", name=string("w"))
    return [
        frame(partial(ref("os:system"), touch)),
        frame(partial(ref("posix:system"), touch)),
        frame(partial(ref("builtins:eval"), string(f"open({str(marker)!r}, 'w')"))),
        frame(partial(ref("builtins:exec"), string(f"open({str(marker)!r}, 'w')"))),
        frame(partial(ref("subprocess:Popen"), items(wire.LIST, string("touch"), string(str(marker))))),
        frame(instance("bench.launch.messages:Report", payload=partial(ref("os:system"), touch))),
        frame(wire.METHOD + ref("pathlib:Path") + text("home")),
        # a method only of a data class of the project's: public, a function, looked up without code
        frame(wire.METHOD + wire.PATH + text("PosixPath") + text("/") + text("unlink")),
        frame(wire.METHOD + workload + text("touched")),
        frame(wire.METHOD + workload + text("_private")),
        frame(wire.METHOD + workload + text("__class__")),
        frame(wire.METHOD + workload + text("name")),
        frame(wire.METHOD + ref("tests.test_launch_safety:Workload") + text("build")),
        frame(wire.METHOD + string("x") + text("format")),
        # a project function that writes files, as a job: not a job (no ctx), not data
        frame(instance("bench.launch.messages:RankSpec", name=string("x"), job=partial(
            ref("bench.results.files:replace_file"), string(str(marker)), wire.BYTES + text("x")))),
        # an exception of the project's: not data
        frame(instance("bench.launch.messages:LaunchError")),
        # pickles: never loaded, whatever they hold
        pickle.dumps(Report(functools.partial(os.system, f"touch {marker}"))),
        b"cos\nsystem\n(S'" + f"touch {marker}".encode() + b"'\ntR.",  # protocol 0, by hand
        b"\x80\x04\x95\x20\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x8c\x06system\x93\x8c\x04true\x85R.",
    ]


def test_a_message_that_would_run_code_is_one_line_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    for data in _hostile(marker):
        with pytest.raises(WireError) as refused:
            decode_message(data)
        assert "\n" not in str(refused.value) and str(refused.value).startswith(("refus", "refused"))
    assert not marker.exists()
    with pytest.raises(WireError, match=r"^refusing posix\.system on the run's channels"):
        decode_message(frame(partial(ref("posix:system"), string("true"))))


def test_what_runs_send_comes_through():
    import functools

    import numpy as np

    from transports import Cluster

    spec = RankSpec(functools.partial(jobs.fail, wait_for_go=True), "ps 0", host=1)
    for message in [spec, Cluster(("127.0.0.1:5000",), "token"), {"a": np.arange(6.0).reshape(2, 3)[:, 1]},
                    (np.float32(1.5), np.int64(-3), 2j, {1, 2}, frozenset({"x"}), b"\0" * 10, bytearray(b"ab")),
                    Path("/tmp/x")]:
        back = decode_message(encode_message(message))
        assert repr(back) == repr(message)
    # a workload's methods, bound (tf_grpc's build_model, make_batch, loss_fn), and a classmethod
    build, named = decode_message(encode_message((Workload("m").build, Workload.named)))
    assert build() == "built m" and named("n") == Workload("n")


def test_a_frame_claiming_more_than_the_limit_is_refused_unread():
    ours, theirs = socket.socketpair()
    conn = Connection(ours.detach())
    with theirs:
        theirs.sendall(struct.pack("!i", -1) + struct.pack("!Q", 1 << 40))  # a frame of a TiB, announced
        with pytest.raises(WireError, match="over 1073741824 bytes"):
            receive_message(conn)
    # inside a small frame, a bytes object claiming 4 GiB: the decoder reads what the frame holds, no more
    with pytest.raises(WireError, match="claims 4294967295 bytes"):
        decode_message(frame(wire.BYTES + struct.pack("<I", (1 << 32) - 1) + b"abc"))


def test_a_hostile_hello_is_dropped_by_the_hub_and_runs_nothing(tmp_path, caplog):
    marker = tmp_path / "pwned"
    hub = Hub(str(tmp_path / "hub"), "token", 2)
    try:
        conn = connect(hub.address, "token")
        conn.send_bytes(frame(partial(ref("posix:system"), string(f"touch {marker}"))))
        assert conn.poll(10)
        with pytest.raises(EOFError):
            conn.recv_bytes()
    finally:
        hub.close()
    assert not marker.exists() and hub.arrivals.empty()
    assert "refusing posix.system" in caplog.text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048) | st.builds(lambda head, tail: frame(head, tail),
                                            st.sampled_from([ref("posix:system"), partial(ref("builtins:eval")),
                                                             wire.BYTES + struct.pack("<I", (1 << 32) - 1),
                                                             wire.LIST + struct.pack("<I", 1 << 20),
                                                             instance("numpy:dtype"), wire.DTYPE + text("<f8")]),
                                            st.binary(max_size=256)))
def test_any_bytes_on_the_hub_are_a_message_or_one_line(data):
    try:
        decode_message(data)
    except WireError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_any_bytes_on_the_jobs_channel_are_json_or_one_line(data):
    try:
        channel_decode(data)
    except LaunchError as exc:
        assert "\n" not in str(exc)


# -- one failure, one true cause --------------------------------------------------------------------------------


def _tf_states() -> list[_RankState]:
    names = ["chief", "ps 0", "ps 1", "worker 0", "worker 1"]
    return [_RankState(RankSpec(jobs.hello, name, service=name != "chief")) for name in names]


def test_the_death_that_came_first_is_named_though_the_later_one_was_seen_first():
    # worker 0 was killed; the chief crashed after it, and its end was seen first (a killed big process takes a
    # while to end): the launcher tells when each process ended
    states = _tf_states()
    now = time.monotonic()
    exited = lambda: {0: ("killed by SIGSEGV", now - 0.2), 3: ("killed by SIGKILL", now - 0.5)}  # noqa: E731
    cause = _died_first(0, states, exited, grace_s=0.2)
    assert (cause.rank, cause.kind) == (3, "died")
    assert str(cause) == "rank 3 (worker 0) died (killed by SIGKILL); then rank 0 (chief) died (killed by SIGSEGV)"


def test_deaths_seen_together_are_ordered_by_who_was_last_heard_from():
    # no times from the launcher, both seen gone at once: the chief still spoke after worker 0 fell silent
    states = _tf_states()
    now = time.monotonic()
    states[0].heard_at, states[3].heard_at = now - 0.05, now - 0.9
    exited = lambda: {0: "killed by SIGSEGV", 3: "killed by SIGKILL"}  # noqa: E731
    cause = _died_first(0, states, exited, grace_s=0.2)
    assert str(cause) == "rank 3 (worker 0) died (killed by SIGKILL); then rank 0 (chief) died (killed by SIGSEGV)"


def test_a_death_seen_later_than_a_poll_after_the_first_follows_it():
    states = _tf_states()
    states[3].heard_at = time.monotonic()  # heard from last, and yet seen gone well after the chief
    start = time.monotonic()
    exited = lambda: {0: "killed by SIGSEGV", **({3: "killed by SIGKILL"} if time.monotonic() > start + 0.6 else {})}  # noqa: E731
    cause = _died_first(0, states, exited, grace_s=1.0)
    assert str(cause) == "rank 0 (chief) died (killed by SIGSEGV); then rank 3 (worker 0) died (killed by SIGKILL)"


# -- a job's launcher outside its job -----------------------------------------------------------------------------

#: bench's main in a child, saying at its end whether MPI was imported there (importing mpi4py.MPI initialises MPI,
#: which makes a singleton's shared-memory segment in /dev/shm: its name holds no pid, so it is not compared)
_MAIN_THEN_MPI = ("import sys; from bench.cli import main; status = main(sys.argv[1:]); "
                  "print('mpi4py.MPI imported' if 'mpi4py.MPI' in sys.modules else 'MPI never imported'); "
                  "sys.exit(status)")


def _outside_any_job(*args: str) -> subprocess.CompletedProcess:
    """``bench ARGS`` in a child that no launcher started (mpirun's, PMI's and Slurm's variables left out)."""
    launchers = ("OMPI_", "PMI", "PRTE_", "SLURM_")
    env = {name: value for name, value in os.environ.items() if not name.startswith(launchers)}
    return subprocess.run([sys.executable, "-c", _MAIN_THEN_MPI, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**env, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("command", [["micro", "--sizes", "1KB", "--transports", "zerocopy", "--no-peers",
                                      "--no-references"],
                                     ["scale", "tests.tiny_models:TINY", "--servers", "1", "--steps", "1"]])
def test_launcher_mpi_outside_mpirun_is_refused_before_mpi_starts_or_a_results_directory(tmp_path, command):
    """Outside mpirun MPI made a job of one: the run failed for want of ranks once its directory was made, and
    Open MPI's segment stayed in /dev/shm."""
    out = tmp_path / "run"
    done = _outside_any_job(*command, "--launcher", "mpi", "--no-plot", "--out", str(out))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"bench {command[0]}: error: --launcher mpi: no MPI launcher started this process (none of "
        "OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK, PMI_SIZE is set): run every rank under mpirun (mpirun -np N "
        "bench ... --launcher mpi, N the ranks the run needs: 2 for micro), or leave --launcher mpi out"]
    assert done.stdout.strip() == "MPI never imported"
    assert not out.exists()


def test_a_bind_that_names_nothing_is_refused_before_mpi_starts(tmp_path):
    """A --bind refused for a reason of this host alone is refused before MPI starts (it said so after)."""
    done = _outside_any_job("micro", "--launcher", "mpi", "--bind", "nowhere0", "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and "--bind nowhere0: no such address or network interface" in done.stderr
    assert done.stdout.strip() == "MPI never imported" and not (tmp_path / "run").exists()
