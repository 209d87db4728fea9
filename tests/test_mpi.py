"""--launcher mpi: every rank runs the same command under mpirun; rank 0 coordinates and writes the results."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.results import load_run
from tests.mpirun import MPIRUN, NO_MPIRUN, mpirun

pytest.importorskip("mpi4py")
pytest.importorskip("tensorflow")

if MPIRUN is None:  # pragma: no cover
    pytest.skip(NO_MPIRUN, allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent


def bench(ranks: int, *args: str) -> subprocess.CompletedProcess:
    """``mpirun -np RANKS bench ARGS...``"""
    return mpirun(ranks, "-m", "bench.cli", *args, cwd=ROOT)


def test_four_mpi_ranks_run_a_short_model_job_to_the_end(tmp_path):
    out = tmp_path / "run"
    done = bench(4, "model", "tests.tiny_models:TINY", "--transport", "zerocopy,grpc_tcp", "--launcher", "mpi",
                 "--steps", "3", "--warmup", "1", "--fabric-transport", "shm", "--no-plot", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = load_run(out)
    assert run.meta["status"] == "complete"
    assert run.meta["launcher"]["launcher"] == "mpi" and run.meta["launcher"]["world_size"] == 4
    records = run.records
    assert list(records["transport"]) == ["zerocopy", "grpc_tcp"]
    assert (records["servers"] == 2).all() and (records["launcher"] == "mpi").all()  # 4 ranks: 2 workers, 2 PS
    assert (records["throughput_batches_per_s"] > 0).all()
    assert records.set_index("transport").loc["zerocopy", "copied_bytes_per_step"] == 0
    # only rank 0 wrote: one results directory, one header line
    assert (out / "records.csv").read_text().count("transport,model") == 1


def test_a_run_needing_more_ranks_than_the_job_has_is_refused_by_name(tmp_path):
    out = tmp_path / "run"
    done = bench(2, "model", "tests.tiny_models:TINY", "--servers", "2", "--launcher", "mpi", "--steps", "1",
                 "--no-plot", "--out", str(out))
    assert done.returncode != 0
    assert "this run needs 4 ranks (worker 0, worker 1, ps 0, ps 1), but the MPI job has 2: start it with " \
           "mpirun -np 4" in done.stderr  # a run's error lines go to stderr
