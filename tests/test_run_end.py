"""The end of a training run: a worker closes its transport only once every parameter server has its updates."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

from bench.runtime.analyzer import Layout
from bench.runtime.stopping import Stopping


class Inboxes:
    """Two ranks' launcher lines in one process: what one tells, the other receives (``RankContext``'s calls)."""

    def __init__(self) -> None:
        self.inbox = {0: queue.Queue(), 1: queue.Queue()}

    def of(self, rank: int):
        inboxes = self

        class Context:
            def __init__(self) -> None:
                self.rank, self.size = rank, 2

            def tell(self, ranks, payload, timeout):
                for other in ranks:
                    inboxes.inbox[other].put(payload)

            def receive(self, timeout=None):
                return inboxes.inbox[rank].get(timeout=timeout)

            def poll(self):
                return None if inboxes.inbox[rank].empty() else inboxes.inbox[rank].get_nowait()

        return Context()


def test_a_worker_ends_its_run_only_once_every_parameter_server_has_all_its_updates():
    lines = Inboxes()  # rank 0 the worker, rank 1 the parameter server of one server
    config = SimpleNamespace(steps=1, warmup=0, timeout_s=60, time_s=None)  # what Stopping reads of a run
    worker, ps = Stopping(config, lines.of(0)), Stopping(config, lines.of(1))
    lines.inbox[0].put(("stop", 5))  # a stop decided for the steps, still in the inbox: not the end's word
    ended = threading.Event()
    thread = threading.Thread(target=lambda: (worker.finish(Layout(1)), ended.set()), daemon=True)
    thread.start()
    assert not ended.wait(0.5)  # the PS has not said it has every update: the worker waits (it never closes early)
    ps.finish(Layout(1))
    assert ended.wait(60)
    thread.join(60)


def test_a_word_of_the_end_read_while_polling_for_a_stop_is_kept():
    lines = Inboxes()
    config = SimpleNamespace(steps=1, warmup=0, timeout_s=60, time_s=10.0)  # a run for a time: it polls
    worker, ps = Stopping(config, lines.of(0)), Stopping(config, lines.of(1))
    ps.finish(Layout(1))
    worker.poll()  # the worker's last look for a stop takes the PS's word from the inbox
    worker.finish(Layout(1))  # and still ends: it was kept, not dropped
