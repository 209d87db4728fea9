"""The parameter server's side of parameter-server training (the overview: ``bench/runtime/__init__.py``).

Each PS serves its variables: it sends their current values to every worker, takes the workers' updates and
applies them (:mod:`bench.runtime.update`). It overlaps what the paper's dataflow graph overlaps: it takes a
step's gradients as they arrive (``Transport.recv_each``), and as soon as one variable has the gradients of every
worker it applies SGD to that variable and sends its next weights on, while the gradients of other variables are
still on their way. With ``asynchronous`` the PS serves each worker on its own, applying every gradient as it
arrives, so workers never wait for each other.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bench.runtime.analyzer import Plan, Variable, update_keys, weight_key
from bench.runtime.config import StepTimes, TrainConfig, host_copy, initial_weights
from bench.runtime.stopping import Stopping
from bench.runtime.update import apply_update
from transports import Key
from transports.memory import memory_of
from transports.tensors import to_device


def placed(target: Any, value: np.ndarray, ledger: Any) -> Any:
    """``target`` (memory a transport gave: host or device) holding ``value`` (host memory); a copy onto a device
    is counted in ``ledger``."""
    if type(target) is np.ndarray:
        target[...] = value
        return target
    return to_device(np.ascontiguousarray(value, target.dtype), memory_of(target), ledger, out=target)


def run_ps(config: TrainConfig, transport, plan: Plan, server: int, stopping: Stopping | None = None) -> StepTimes:
    """A parameter server's loop: serve its variables, gather updates, apply them (until ``stopping``'s end)."""
    layout = plan.layout
    rank = layout.ps(server)
    mine = [v for v in plan.variables if layout.ps_of(v) == rank]
    initial = initial_weights(config, mine)
    weights: dict[int, np.ndarray] = {}
    for variable in mine:  # the initial values, in memory the transport can send from without copies
        spec = plan.transfer(weight_key(variable), rank, layout.worker(0)).spec(config.memory)
        weights[variable.index] = placed(transport.placement.allocate(spec), initial.pop(variable.index),
                                         transport.ledger)
    workers = [layout.worker(s) for s in range(layout.servers)]
    update = threading.Lock()
    if config.asynchronous:  # one loop per worker, each applying its own gradients at once
        before = transport.stats()
        with ThreadPoolExecutor(len(workers)) as pool:
            loops = [pool.submit(_serve, config, transport, rank, mine, weights, [w], update) for w in workers]
            times = _merge([loop.result() for loop in loops])
        # the loops overlap, so the ledger is taken over the whole run and scaled to the timed steps (every step
        # sends and receives the same); not the CPU, which the first connects dominate in a small model's warm-up
        whole = (transport.stats() - before).as_dict()
        share = config.steps / (config.steps + config.warmup)
        times.extra["stats"] = {name: value * share for name, value in whole.items()}
    else:
        times = _serve(config, transport, rank, mine, weights, workers, update, stopping)
    if not config.constant_memory:  # a soak compares no weights: no copy of them (fcn5's: 220 MB) in its memory
        times.extra["final_weights"] = {index: host_copy(w) for index, w in weights.items()}
    return times


def _serve(config: TrainConfig, transport, rank: int, mine: list[Variable], weights: dict[int, np.ndarray],
           workers: list[int], update: threading.Lock, stopping: Stopping | None = None) -> StepTimes:
    """Serve ``mine`` to ``workers``: send values, gather updates, apply them (under ``update``), overlapped.

    The values of step 0 go out first. Then in every step ``s`` the updates of all variables and
    workers are received together (``recv_each``); as soon as one variable has the updates of every
    worker (a sparse gradient: both its parts), the PS waits for that variable's step-``s`` sends to
    finish (the transport may read the array until then, and the update writes it in place), applies
    the update (:func:`apply_update`: SGD, or the workers' mean of a state) and sends its step-``s + 1``
    value to every worker at once, while other variables' updates are still arriving. Updates of one
    variable are applied in the order of ``workers``, whatever order they arrive in, so the result is
    the same as local training's.

    One exception: the last warm-up step sends nothing early; the first timed step begins by sending
    all its values, so the ledger of the timed steps holds exactly ``steps`` steps of sends and of
    receives (``extra["stats"]``).

    Timings of a step: ``total`` runs from waiting for its updates (or from sending its values,
    when the step begins with that) to the last variable applied and its next value posted;
    ``apply`` is the time applying updates alone (including waiting for ``update``); ``comm``
    is the rest, nearly all of it waiting for updates, plus waiting for a variable's previous
    sends to finish and posting the next ones.

    With ``asynchronous`` one such loop runs per worker over shared ``weights`` and no lock is held
    around the sends: asynchronous SGD reads weights while other workers' updates land (as
    TensorFlow's PS does by default); holding ``update`` while a send waits for its receiver could
    deadlock across parameter servers.
    """
    stopping = stopping or Stopping(config)
    times = StepTimes()
    stats0, cpu0 = transport.stats(), time.process_time()
    sending: dict[int, list] = {}  # variable index -> the sends of its value for the current step
    parts = {v.index: len(update_keys(v)) * len(workers) for v in mine}

    def send_weights(variable: Variable, step: int) -> None:
        sending[variable.index] = [transport.send_async(Key(weight_key(variable), step, rank, worker),
                                                        weights[variable.index]) for worker in workers]

    step = 0
    while step < stopping.poll():
        if step == config.warmup:
            times = StepTimes()
            stats0, cpu0 = transport.stats(), time.process_time()
        started = time.perf_counter()
        if step in (0, config.warmup):  # no step before this one sent its values
            for variable in mine:
                send_weights(variable, step)
        keys = {Key(name, step, worker, rank): v for v in mine for worker in workers for name in update_keys(v)}
        arrived: dict[int, dict[tuple[int, str], np.ndarray]] = {v.index: {} for v in mine}
        applying = 0.0
        for key, tensor in transport.recv_each(list(keys)):
            variable = keys[key]
            arrived[variable.index][(key.src, key.name)] = tensor
            if len(arrived[variable.index]) < parts[variable.index]:
                continue
            for sent in sending.pop(variable.index):
                sent.result(config.timeout_s)
            got = arrived.pop(variable.index)
            updates = [[got[(worker, name)] for name in update_keys(variable)] for worker in workers]
            begun = time.perf_counter()
            with update:
                apply_update(variable, weights[variable.index], updates, config.learning_rate)
            applying += time.perf_counter() - begun
            if step + 1 < stopping.poll() and step + 1 != config.warmup:
                send_weights(variable, step + 1)
        done = time.perf_counter()
        times.extra["gradients_applied"] = times.extra.get("gradients_applied", 0) + len(mine) * len(workers)
        times.total += done - started
        times.apply += applying
        times.comm += done - started - applying
        step += 1
    times.extra["stats"] = (transport.stats() - stats0).as_dict()
    times.extra["cpu_s"] = time.process_time() - cpu0  # every thread of the process, in the timed steps
    return times


def _merge(loops: list[StepTimes]) -> StepTimes:
    """The per-worker loops of an asynchronous PS, as one: times averaged, gradients applied summed."""
    merged = StepTimes()
    for part in loops:
        merged.total += part.total / len(loops)
        merged.comm += part.comm / len(loops)
        merged.apply += part.apply / len(loops)
    merged.extra["gradients_applied"] = sum(part.extra["gradients_applied"] for part in loops)
    # each loop's is the whole process's over that loop's timed steps (all loops' work while it timed them)
    merged.extra["cpu_s"] = sum(part.extra["cpu_s"] for part in loops) / len(loops)
    return merged
