"""--launcher mpi: every rank runs the same command under mpirun; rank 0 coordinates and writes the results."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.results import ModelRecord, load_run
from tests.mpirun import mpirun

pytest.importorskip("mpi4py")
pytest.importorskip("tensorflow")

pytestmark = pytest.mark.system("mpirun")

ROOT = Path(__file__).resolve().parent.parent


def bench(ranks: int, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``mpirun -np RANKS bench ARGS...``"""
    return mpirun(ranks, "-m", "bench.cli", *args, cwd=ROOT, env=env)


def test_four_mpi_ranks_run_a_short_model_job_to_the_end(tmp_path):
    out = tmp_path / "run"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = bench(4, "model", "tests.tiny_models:TINY", "--transport", "zerocopy,grpc_tcp", "--launcher", "mpi",
                 "--steps", "3", "--warmup", "1", "--fabric-transport", "shm", "--no-plot", "--out", str(out),
                 env={"TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the job's processes end with os._exit, past TensorFlow's atexit handlers: its autograph modules
    # (__autograph_generated_file*.py) stayed in the temporary directory, one set per process
    assert sorted(p.name for p in scratch.iterdir()) == []
    run = load_run(out)
    assert run.meta["status"] == "complete"
    assert run.meta["launcher"]["launcher"] == "mpi" and run.meta["launcher"]["world_size"] == 4
    records = run.records
    assert list(records["transport"]) == ["zerocopy", "grpc_tcp"]
    assert (records["servers"] == 2).all() and (records["launcher"] == "mpi").all()  # 4 ranks: 2 workers, 2 PS
    assert (records["throughput_batches_per_s"] > 0).all()
    assert records.set_index("transport").loc["zerocopy", "copied_bytes_per_step"] == 0
    # only rank 0 wrote: one results directory, one header line
    header = ",".join(ModelRecord.columns())
    assert (out / "records.csv").read_text().splitlines().count(header) == 1


@pytest.mark.parametrize(("ranks", "command", "said"), [
    (2, ["model", "tests.tiny_models:TINY", "--servers", "2", "--steps", "1"],
     "bench model: error: this run needs 4 ranks (a worker and a parameter server for each of 2 servers), but the "
     "MPI job has 2: start it with mpirun -np 4"),
    (1, ["micro", "--sizes", "1KB", "--transports", "zerocopy", "--no-peers", "--no-references"],
     "bench micro: error: this run needs 2 ranks (sender, receiver), but the MPI job has 1: start it with "
     "mpirun -np 2")])
def test_a_run_needing_more_ranks_than_the_job_has_is_refused_before_its_results_directory(tmp_path, ranks, command,
                                                                                          said):
    """It used to make its results directory, then fail each line for want of ranks."""
    out = tmp_path / "run"
    done = bench(ranks, *command, "--launcher", "mpi", "--no-plot", "--out", str(out))
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert said in done.stderr.splitlines()
    assert not out.exists()


#: every process of a job of 3 makes MPI's channel with mpi4py's pickle refusing to work, then announces, gathers
#: and ends the job as a run does
CHANNEL_WITHOUT_PICKLE = """
from transports import load_fabric
load_fabric()
from mpi4py import MPI

def refuse(*args, **kwargs):
    raise AssertionError("the job's channel pickled")

MPI.pickle.__init__(refuse, refuse)
try:
    MPI.pickle.dumps(None)
    raise SystemExit("mpi4py's pickle still works")
except AssertionError:
    pass
from bench.launch.mpi import MpiChannel

channel = MpiChannel()
assert channel.hostnames == [channel.hostnames[0]] * 3
announced = {"ranks": 2, "hub": ["127.0.0.1", 5000], "token": "t" * 32}
if channel.process == 0:
    channel.announce(announced)
else:
    assert channel.announcement() == announced
assert channel.gather(f"127.0.0.1:{1000 + channel.process}") == [f"127.0.0.1:{1000 + p}" for p in range(3)]
if channel.process == 0:
    channel.announce(None)
else:
    assert channel.announcement() is None
print("channel ok", channel.process, flush=True)
channel.finalize()
"""


def test_the_mpi_job_channel_carries_json_bytes_not_pickles(tmp_path):
    done = mpirun(3, "-c", CHANNEL_WITHOUT_PICKLE, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("channel ok")) == [
        "channel ok 0", "channel ok 1", "channel ok 2"]


#: process 1 sends more than the job's channel carries: every process refuses it in one line, none hangs
CHANNEL_OVER_LIMIT = """
from bench.launch.messages import LaunchError
from bench.launch.job import CHANNEL_BYTES
from bench.launch.mpi import MpiChannel

channel = MpiChannel()
try:
    channel.gather("x" * (CHANNEL_BYTES if channel.process == 1 else 10))
except LaunchError as exc:
    print("refused", channel.process, exc, flush=True)
channel.finalize()
"""


def test_a_message_over_the_mpi_channels_limit_is_refused_by_every_process(tmp_path):
    done = mpirun(3, "-c", CHANNEL_OVER_LIMIT, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    refused = sorted(line for line in done.stdout.splitlines() if line.startswith("refused"))
    assert [line.split()[1] for line in refused] == ["0", "1", "2"]
    assert all("process 1 of the MPI job sent " in line and "which carries 1 to 65536" in line for line in refused)
