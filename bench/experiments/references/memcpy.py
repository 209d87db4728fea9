"""The ``memcpy`` reference line: one ``np.copyto`` of the tensor in one process, the cost of a single copy.

With a fresh source (``bench micro --source fresh``) the source is written whole before each copy, outside the
timed interval, as the other lines' senders write theirs (``bench.experiments.micro.sources``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench.experiments.micro import Point
from bench.experiments.micro.sources import FRESH, REUSED, rewriter, source_columns
from bench.experiments.references import running
from bench.experiments.references.lines import ReferenceLine
from bench.results import MicroRecord, latency_summary


def memcpy_records(sizes: list[int], iters_for: Callable[[int], int], source: str = REUSED) -> list[MicroRecord]:
    """Time ``np.copyto`` between two pre-touched uint8 arrays in this process; one record per size.

    One untimed copy per size, then ``iters_for(size)`` timed ones, each timed on its own, each from a source
    written whole just before it when ``source`` is fresh. ``sender_cpu_s`` is this process's CPU time over the
    timed copies (a fresh source's writes included).
    """
    records = []
    for size in sizes:
        iters = running.count(iters_for(size), "iters_for", size)
        src = np.ones(size, dtype=np.uint8)  # written, so every page is resident
        dst = np.zeros(size, dtype=np.uint8)
        dst.fill(1)  # np.zeros may hand back untouched calloc pages
        rewrite = rewriter(src) if source == FRESH else None
        if rewrite is not None:
            rewrite()
        np.copyto(dst, src)
        samples = np.empty(iters, dtype=np.int64)
        starts, written = np.empty(iters, dtype=np.int64), np.empty(iters if rewrite else 0, dtype=np.int64)
        cpu0 = time.process_time()
        for i in range(iters):
            if rewrite is not None:
                rewrite()
                written[i] = time.perf_counter_ns()
            starts[i] = t0 = time.perf_counter_ns()
            np.copyto(dst, src)
            samples[i] = time.perf_counter_ns() - t0
        cpu_s = time.process_time() - cpu0
        del src, dst
        summary = latency_summary(samples / 1e3)
        mean_us = summary["mean_us"]
        records.append(running.record(
            "memcpy", size, 1, iters, **summary,
            throughput_MBps=size / 2**20 / (mean_us / 1e6) if mean_us > 0 else math.inf,
            sender_cpu_s=cpu_s, receiver_cpu_s=0.0, copied_bytes=size, fabric="none",
            **source_columns(source, starts, written, 1 + iters if rewrite is not None else 0),
        ))
    return records


@dataclass
class Memcpy(ReferenceLine):
    """One ``np.copyto`` of the tensor in one process: the cost of a single copy."""

    name: str = "memcpy"

    def measure(self, point: Point, port: int) -> MicroRecord:
        [record] = memcpy_records([point.size_bytes], lambda size: point.iters, point.source)
        return record
