"""``mpirun`` for the tests: the one beside our Python (Open MPI's wheel brings it), and a job under it.

Used by the MPI tests (``tests/test_mpi.py``) and the launcher conformance suite's mpi case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.launch.mpi import mpirun_path

#: None where there is no mpirun (pip install -e '.[mpi]' brings Open MPI's)
MPIRUN = mpirun_path()
#: what a test says when it skips for want of mpirun
NO_MPIRUN = "no mpirun here: pip install -e '.[mpi]' brings Open MPI's"


def mpirun(ranks: int, *argv: str, cwd: Path, env: dict[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """``mpirun -np RANKS python ARGV...`` to its end, its output captured; ``env`` adds to ours."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
           # Open MPI refuses root unless told twice; CI runs as root
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(env or {})}
    return subprocess.run([MPIRUN, "-np", str(ranks), "--oversubscribe", sys.executable, *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
