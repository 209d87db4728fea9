"""Reference lines that ``bench micro`` draws beside the transports: what the machine and the fabric library can do
at best, a module per tool (as ``bench.experiments.peers`` has a module per library).

- ``ucx_perftest`` and ``ucx_perftest_lat``: UCX's own put bandwidth and put latency tests
  (:mod:`.ucx_perftest`, which says what each column of each line means);
- ``ib_write_bw`` and ``ib_write_lat``: perftest's RDMA write tests on the verbs fabric (:mod:`.ib_write`);
- ``memcpy``: one ``np.copyto`` of the tensor in one process, the cost of a single copy (:mod:`.memcpy`).

:func:`reference_lines` gives the lines of a run (:data:`REGISTRY`): the two perftest lines of its fabric,
then memcpy; each is a ``MicroLine`` of the harness (``bench.experiments.micro``) measured in one rank of the
launch layer, the perftest lines on private hosts (:func:`bench.launch.private.private_hosts`). The programs
come from the fabric backends (``fabric.backend(name).tool``): the libucx-cu12 wheel's ``ucx_perftest``,
perftest's tools on PATH. For all four perftest lines the CPU columns are empty (both processes busy-poll for their
whole life, not only the timed loop) and no payload is copied in user space. All return records
with the columns of ``bench.experiments.micro.make_record``, in the same order, so they can go into the
same ``records.csv``.
"""

from bench.experiments.references.lines import REGISTRY, PerftestLine, ReferenceLine, reference_lines
from bench.experiments.references.running import LATENCY_MAX_SIZE, ReferenceUnavailable

__all__ = ["LATENCY_MAX_SIZE", "REGISTRY", "PerftestLine", "ReferenceLine", "ReferenceUnavailable", "reference_lines"]
