"""Where a training run's steps end, agreed by every rank (``warmup + steps``, or sooner when it trains for a time).
"""

from __future__ import annotations

from typing import Any

from bench.runtime.config import TrainConfig

#: what each parameter server tells each worker once it has every update of the run (:meth:`Stopping.finish`)
RUN_DONE = "run_done"


class Stopping:
    """Where a run's steps end: ``warmup + steps``, or sooner when it trains for a time (``time_s``).

    Synchronous training stops at one step for every rank. Worker 0 decides: once it has trained
    ``time_s`` seconds it picks an end :data:`MARGIN_STEPS` steps ahead and tells every other rank
    through the launcher, going on only once each has the word in its inbox (``tell``: their hub threads
    confirm it, whatever their loops are doing); they look for it at every step (``poll``). No rank can
    begin a step past the one worker 0 is in before the word is there: each step waits for worker 0's
    gradients (a word merely sent could still be on its way, on a busy machine, when a PS begins the
    step after the end and waits for gradients that never come).
    """

    #: how many steps after worker 0's decision the run ends
    MARGIN_STEPS = 3

    def __init__(self, config: TrainConfig, ctx=None) -> None:
        self.end = config.warmup + config.steps
        self.time_s = config.time_s
        self.timeout_s = config.timeout_s
        self._ctx = ctx
        self._done: set[int] = set()  # the parameter servers that said they have every update (finish)

    def poll(self) -> int:
        """The end as far as this rank knows it now (reading worker 0's word if it came)."""
        if self._ctx is not None and self.time_s is not None:
            while (message := self._ctx.poll()) is not None:
                self._take(message)
        return self.end

    def _take(self, message: Any) -> None:
        if isinstance(message, tuple) and message[:1] == ("stop",):
            self.end = min(self.end, int(message[1]))
        elif isinstance(message, tuple) and message[:1] == (RUN_DONE,):
            self._done.add(int(message[1]))

    def finish(self, layout) -> None:
        """The run's end, after the last step: each PS tells every worker once it has received all their updates,
        and a worker waits to hear it from every PS before it closes its transport. A transport's send can be done
        before its bytes arrive (grpc_tcp's once they are handed to gRPC): a worker that closed and exited at once
        took its last stream with it (fcn5 over grpc_tcp, 4 servers on 1 Gbit/s links: 'Connection reset by peer'
        at its parameter server). Through the launcher, not the transport: a transport's last message has the same
        problem (its sender gone before its receiver asks for it, over grpc_rdma); ``tell`` returns once the word
        is in every worker's inbox."""
        if self._ctx is None:
            return
        workers = [layout.worker(s) for s in range(layout.servers)]
        if self._ctx.rank not in workers:
            self._ctx.tell(workers, (RUN_DONE, self._ctx.rank), self.timeout_s)
            return
        while not {layout.ps(s) for s in range(layout.servers)} <= self._done:
            self._take(self._ctx.receive(self.timeout_s))

    def decide(self, step: int, trained_s: float) -> None:
        """Worker 0, as step ``step`` begins after ``trained_s`` seconds of training: end soon if the time is up."""
        if self.time_s is None or trained_s < self.time_s or self.end <= step + self.MARGIN_STEPS:
            return
        self.end = step + self.MARGIN_STEPS
        if self._ctx is not None:
            others = [rank for rank in range(self._ctx.size) if rank != self._ctx.rank]
            self._ctx.tell(others, ("stop", self.end), self.timeout_s)
