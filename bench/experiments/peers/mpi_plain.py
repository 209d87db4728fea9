"""The calibration of the ``mpi`` and ``mpi_rma`` peer lines (``bench micro --calibrate``): the same transfers as a
user's plain loop writes them, run in the two MPI processes in place of a link (:class:`PlainLoop`,
:class:`PlainRmaLoop`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.experiments.micro import RECEIVER, SENDER, Point
from bench.experiments.peers import PeerLineError
from bench.experiments.peers.mpi_links import CHUNK_BYTES, DATA_TAG, FLAG_BYTES, SIGNAL_TAG, library


class PlainLoop:
    """The ``mpi`` line's calibration (``mpi_plain``): what mpi4py moves in the ten lines a user would write, with
    the protocol of every line (the receiver's ready signal outside the timed interval, its reduce-max inside) and
    none of the harness: no link, no ledger, no data check beyond the marker. The distance from the ``mpi`` line to
    this one is what the harness costs MPI; the ``harness`` line, what it costs every line. :class:`PlainRmaLoop`
    is the ``mpi_rma`` line's.

    Its two processes are placed as every line's ranks are (:func:`bind_timing_thread`: the sender on the first
    CPU, the receiver on the second). Left where the kernel puts them, both often ran on one core (the woken
    process goes to its waker's), where a 1MB message moves through the core's own cache: 70-86 µs against
    146-157 µs across two cores here, a placement, not a cost of the harness. Its tensor holds data in every page,
    as the lines' do: one from ``np.zeros`` that is never written is the kernel's one zero page mapped over and
    over, which a copy reads from the cache (1MB: 67-80 µs from zeros, 98-102 from a filled tensor)."""

    #: told apart from a link class by this: an MPI process runs a plain loop, where it would make and drive a link
    plain = True
    name = "mpi_plain"

    @classmethod
    def run(cls, comm: Any, points: list[Point], report: Any) -> None:
        """Time ``points`` between the two processes of ``comm``; the receiver reports a record per point."""
        from bench.experiments.micro import bind_timing_thread, fill
        from bench.experiments.micro.sources import plain_written

        rank = comm.Get_rank()
        bind_timing_thread(rank)
        for point in points:
            if point.size_bytes > CHUNK_BYTES:  # one message carries at most CHUNK_BYTES: no longer ten lines
                continue
            tensor = np.empty(point.spec.shape, point.dtype)
            fill(tensor)  # data in every page, as a user's tensor holds (np.zeros' untouched pages are one zero page)
            written = plain_written(point, rank)
            times = cls.loop(comm, rank, tensor, point.warmup + point.iters, written)
            cls.report_point(comm, rank, point, times, report, written)

    @staticmethod
    def loop(comm: Any, rank: int, tensor: np.ndarray, total: int, written: np.ndarray | None = None) -> np.ndarray:
        """``total`` transfers of ``tensor``: the sender's clock at each send, or the receiver's once consumed; with
        ``written`` (a fresh source), the sender's whole write of the tensor before each, and when it ended."""
        from bench.experiments.micro import clock_ns, marker
        from bench.experiments.micro.sources import rewriter

        ready, times, kind = np.zeros(1, np.int64), np.zeros(total, np.int64), tensor.dtype
        rewrite = rewriter(tensor) if written is not None else None
        for i in range(total):
            if rank == RECEIVER:
                comm.Send(ready, dest=SENDER, tag=SIGNAL_TAG)
                comm.Recv(tensor, source=SENDER, tag=DATA_TAG)
                if tensor.max() != marker(i, kind):
                    raise PeerLineError(f"mpi_plain: transfer {i} of {tensor.nbytes} bytes arrived wrong")
                times[i] = clock_ns()
            else:
                comm.Recv(ready, source=RECEIVER, tag=SIGNAL_TAG)
                if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
                    rewrite()
                    written[i] = clock_ns()
                tensor[-1] = marker(i, kind)
                times[i] = clock_ns()
                comm.Send(tensor, dest=RECEIVER, tag=DATA_TAG)
        return times

    @classmethod
    def report_point(cls, comm: Any, rank: int, point: Point, times: np.ndarray, report: Any,
                     written: np.ndarray | None = None) -> None:
        """The sender's clocks (the sends', then its fresh writes' ends: zeros without) to the receiver, which
        reports the point's record."""
        from bench.experiments.micro import Measured
        from bench.experiments.micro.sources import plain_columns
        from bench.experiments.references.running import record
        from bench.results import latency_summary

        if rank == SENDER:
            comm.Send(np.stack([times, written if written is not None else np.zeros_like(times)]), dest=RECEIVER,
                      tag=SIGNAL_TAG)
            return
        clocks = np.zeros((2, len(times)), np.int64)
        comm.Recv(clocks, source=SENDER, tag=SIGNAL_TAG)
        starts, written = clocks
        summary = latency_summary((times - starts)[point.warmup:] / 1e3)
        report(Measured(point.size_bytes, record(
            cls.name, point.size_bytes, point.warmup, point.iters, **summary,
            throughput_MBps=point.size_bytes / 2**20 / (summary["mean_us"] / 1e6),
            sender_cpu_s=float("nan"), receiver_cpu_s=float("nan"), copied_bytes=0,
            fabric=f"mpi:{library()}", **plain_columns(point, starts, written))))


class PlainRmaLoop(PlainLoop):
    """The ``mpi_rma`` line's calibration (``mpi_rma_plain``): the same one-sided protocol in a plain loop (a window
    of flag and tensor on the receiver; ``Put``, ``Flush``, ``Put`` of the flag, ``Flush``; the receiver polls the
    flag with ``Win.Sync`` between reads)."""

    name = "mpi_rma_plain"

    @staticmethod
    def loop(comm: Any, rank: int, tensor: np.ndarray, total: int, written: np.ndarray | None = None) -> np.ndarray:
        from mpi4py import MPI

        from bench.experiments.micro import clock_ns, marker
        from bench.experiments.micro.sources import rewriter

        ready, times, kind = np.zeros(1, np.int64), np.zeros(total, np.int64), tensor.dtype
        rewrite = rewriter(tensor) if written is not None else None
        window = MPI.Win.Allocate(FLAG_BYTES + tensor.nbytes if rank == RECEIVER else 0, 1, comm=comm)
        try:
            if rank == RECEIVER:
                memory = np.frombuffer(window.tomemory(), dtype=np.uint8)
                flag = memory[:FLAG_BYTES].view(np.int64)
                flag[0] = 0
                data = memory[FLAG_BYTES:].view(kind)
            window.Lock_all()
            comm.Barrier()  # the receiver's flag is zero before the first put
            mark, payload = np.zeros(1, np.int64), tensor.reshape(-1).view(np.uint8)
            for i in range(total):
                if rank == RECEIVER:
                    comm.Send(ready, dest=SENDER, tag=SIGNAL_TAG)
                    while flag[0] != i + 1:
                        window.Sync()
                    if data.max() != marker(i, kind):
                        raise PeerLineError(f"mpi_rma_plain: transfer {i} of {tensor.nbytes} bytes arrived wrong")
                    times[i] = clock_ns()
                else:
                    comm.Recv(ready, source=RECEIVER, tag=SIGNAL_TAG)
                    if rewrite is not None:  # --source fresh: every line of it written, before the clock is read
                        rewrite()
                        written[i] = clock_ns()
                    tensor[-1] = marker(i, kind)
                    times[i] = clock_ns()
                    window.Put(payload, RECEIVER, target=FLAG_BYTES)
                    window.Flush(RECEIVER)
                    mark[0] = i + 1
                    window.Put(mark, RECEIVER, target=0)
                    window.Flush(RECEIVER)
            window.Unlock_all()
        finally:
            if rank == RECEIVER:
                del memory, flag, data
            window.Free()
        return times
