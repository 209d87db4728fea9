"""The send/receive micro-benchmark of the paper's section 5.1 (its Figure 8): the harness whole.

A sender and a receiver run in separate processes (the paper's two servers;
the ``local`` line runs both in one thread, :func:`solo_loop`: the floor). For every
size, after warm-up transfers, each timed transfer goes like this:

1. the receiver tells the sender, outside the transport (over a TCP stream of
   their own, :class:`DirectSignals`), that it is ready for transfer ``i`` and calls ``recv``;
2. with a fresh source (``--source fresh``, the default: :mod:`.sources`), the sender writes its whole tensor, as
   a backward pass writes a gradient every step, values kept; then it writes the marker (and a checked transfer's
   stamps), all outside the timed interval (``reused``: the marker and stamps alone, as OSU and nccl-tests);
3. the sender reads the clock (``t_send``) and calls ``send``;
4. the receiver gets the tensor, consumes it with a reduce-max (as in the
   paper) and reads the clock (``t_done``); then, outside the timed interval,
   it checks what arrived (see *the data check*).

*Time per transfer* is ``t_done - t_send``: from the sender handing the
tensor over to the receiver having consumed it. The receiver also reads the
clock when ``recv`` returns, which splits each transfer into moving the
tensor (``transfer_p50_us``) and consuming it (``consume_p50_us``). Both ends read
``CLOCK_MONOTONIC``, which Linux keeps system-wide, so the difference is
exact for processes on one host (every launcher here, and ``mpi`` on one node). The ready signal keeps transfers from
overlapping, so the time is a latency, not a pipelined rate. Throughput is
``size / mean time per transfer`` in MB/s with MB = 2**20 bytes. CPU seconds
are those of each side's process (all its threads) over the timed transfers.
Copied bytes come from the transports' ledgers (both sides, per transfer).

*The data check.* The sender fills its tensor with a known pattern (:func:`fill`: random values below 1
that repeat every ``PERIOD`` elements, a prime, so that no piece moved by a power-of-two offset matches),
and writes into the last element a marker that the reduce-max must find. A transfer of
``FULL_CHECK_BYTES`` or more, which transports move in pieces (lanes, chunks, work requests) where a marker
shows only that the last piece landed, is also checked byte for byte, one transfer in ``CHECK_EVERY``: before
it the sender stamps every 4 KiB of the tensor with a value of that transfer (so that a piece left over from an
earlier transfer is caught too), and the receiver compares every byte with the pattern, chunk by chunk (no second
copy of the tensor in memory), after reading the clock. As nccl-tests' check, a checked transfer is not timed,
nor is the one after it: the stamps are the sender's stores just before it, and the comparison reads the
whole tensor and the pattern, leaving the next transfer's caches cold (at 1MB, an MPI loop that checked every
transfer took 189-200 µs a transfer against 147-157 without the check, p50, quiet). Smaller transfers are
checked by the marker, and every byte of every transfer with ``Point.check`` (the soak, which times its transfers
checked). Python's cyclic collector is off while a side's transfers run (as ``timeit`` keeps it off); each point
begins with a collection.

*The package.* :mod:`.points` holds the points and the data check; :mod:`.loops` the two sides' loops, what they
drive (:class:`TimedLink`, which a transport and a peer library's link both satisfy) and the ready signals;
:mod:`.sources` the sender's fresh or reused tensor; :mod:`.lines` what the harness asks of a line
(:class:`MicroLine`), the transports' line and :func:`run_line`; :mod:`.sweep` a run's lines at every size, in
rounds, each record written as it is measured. The lines that are not ours live beside it:
``bench.experiments.references`` (a module per tool) and ``bench.experiments.peers`` (a module per library).
"""

from bench.experiments.micro.lines import (
    SILENCE_SLACK_S,
    Measured,
    MicroError,
    MicroLine,
    TransportLine,
    make_record,
    run_line,
    transfer_times,
)
from bench.experiments.micro.loops import (
    PROGRESS_EVERY_S,
    STARTUP_S,
    CoordinatorSignals,
    DirectSignals,
    Progress,
    ReadySignals,
    Side,
    TimedLink,
    bind_timing_thread,
    clock_ns,
    receiver_loop,
    run_pair,
    sender_loop,
    solo_loop,
)
from bench.experiments.micro.points import (
    CHECK_EVERY,
    CHUNK,
    FULL_CHECK_BYTES,
    RECEIVER,
    SENDER,
    Point,
    content,
    fill,
    first_wrong,
    marker,
    plan_points,
    prepare,
)

__all__ = [
    "CHECK_EVERY", "CHUNK", "FULL_CHECK_BYTES", "PROGRESS_EVERY_S", "RECEIVER", "SENDER", "SILENCE_SLACK_S",
    "STARTUP_S",
    "CoordinatorSignals", "DirectSignals", "Measured", "MicroError", "MicroLine", "Point", "Progress", "ReadySignals",
    "Side", "TimedLink", "TransportLine", "bind_timing_thread", "clock_ns", "content", "fill", "first_wrong",
    "make_record", "marker", "plan_points", "prepare", "receiver_loop", "run_line", "run_pair", "sender_loop",
    "solo_loop", "transfer_times",
]
