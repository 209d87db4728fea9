"""``bench soak``: a short soak over grpc_tcp, and the content checks that count corrupted and lost tensors.

The real soak (10 minutes of transfers, 1000 training steps per transport) is not for CI: see the README.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from bench.results import load_run
from tests.tiny_models import TinyMLP


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def test_help_says_what_the_soak_does():
    done = bench("soak", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for words in ("10 minutes", "every tensor", "corrupted", "lost", "resident memory", "1KB,4MB", "fcn5", "1000"):
        assert words in text, words


def test_a_short_soak_over_grpc_tcp(tmp_path):
    pytest.importorskip("tensorflow")
    out = tmp_path / "soak"
    done = bench("soak", "--transports", "grpc_tcp", "--sizes", "1KB,64KB", "--duration", "2", "--steps", "3",
                 "--model", "tests.tiny_models:TINY", "--timeout", "60", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert ", 0 corrupted, 0 lost" in done.stdout
    run = load_run(out)
    assert run.meta["status"] == "complete"
    assert (run.meta["corrupted"], run.meta["lost"]) == (0, 0)
    records = run.records
    micro = records[records["phase"] == "micro"]
    assert sorted(zip(micro["size_bytes"], micro["process"], strict=True)) == [
        (1024, "receiver"), (1024, "sender"), (65536, "receiver"), (65536, "sender")]
    for size in (1024, 65536):
        sent = micro[(micro["size_bytes"] == size) & (micro["process"] == "sender")]["tensors_sent"].item()
        received = micro[(micro["size_bytes"] == size) & (micro["process"] == "receiver")]["tensors_received"].item()
        assert sent == received > 10  # transfers went on for the point's second
    model = records[records["phase"] == "model"]
    assert sorted(model["process"]) == ["ps 0", "worker 0"]
    assert (model["tensors_received"] > 0).all()
    assert model["tensors_sent"].sum() == model["tensors_received"].sum()
    assert (records["corrupted"] == 0).all() and (records["lost"] == 0).all()
    assert (records["rss_start_mb"] > 0).all() and (records["rss_end_mb"] > 0).all()  # every process's memory
    assert run.meta["tensors_sent"] == records["tensors_sent"].sum()
    assert run.meta["coordinator_rss_mb"]["end"] > 0  # and the coordinator's


# -- the checks count what they must -------------------------------------------------------------------------


class Signals:
    def send(self, value) -> None:
        pass


class CorruptingTransport:
    """Delivers what the sender wrote, except one flipped byte in transfer ``bad``."""

    def __init__(self, point, bad: int) -> None:
        self.point, self.bad = point, bad

    def recv(self, key):
        from bench.experiments.micro import content, marker

        tensor = content(self.point).copy()
        tensor[-1] = marker(key.step, tensor.dtype)
        if key.step == self.bad:
            tensor.view(np.uint8)[7] ^= 0x10
        return tensor

    def inbound(self, name, src):
        from transports import Inbound

        return Inbound(self, name, src, 1)

    def stats(self):
        from transports import TransportStats

        return TransportStats()


def test_the_micro_check_counts_a_corrupted_tensor_and_goes_on():
    from bench.experiments import micro

    point = micro.Point(1024, warmup=1, iters=5, check=True)
    sides = []
    micro.receiver_loop(CorruptingTransport(point, bad=3), [point], Signals(),
                        lambda payload: sides.append(payload) if isinstance(payload, micro.Side) else None, True)
    (side,) = sides
    assert (side.transfers, side.corrupted) == (6, 1)


class Hub:
    """The launcher's messages between two ranks in one process."""

    def __init__(self) -> None:
        self.queue: list = []
        self.rank, self.name = 1, "ps 0"

    def send_to(self, rank: int, payload) -> None:
        self.queue.append(payload)

    def receive(self, timeout: float | None = None):
        if not self.queue:
            raise TimeoutError("nothing to receive")
        return self.queue.pop(0)


class Wire:
    """A transport that keeps what is sent and delivers it, corrupting the tensors named in ``corrupt``."""

    def __init__(self, corrupt: set[str]) -> None:
        self.tensors: dict = {}
        self.corrupt = corrupt

    def send(self, key, array) -> None:
        array = array.copy()
        if key.name in self.corrupt:
            array.flat[0] += 1
        self.tensors[key] = array

    def recv(self, key):
        return self.tensors.pop(key)


def test_the_training_check_counts_corrupted_and_lost_tensors():
    from bench.experiments.soak import CheckedTransport
    from transports import Key

    hub = Hub()
    checked = CheckedTransport(Wire(corrupt={"g1"}), hub, timeout_s=1)
    for name in ("g0", "g1", "g2"):
        checked.send(Key(name, 0, 0, 1), np.arange(4, dtype=np.float32))
    checked.recv(Key("g0", 0, 0, 1))
    checked.recv(Key("g1", 0, 0, 1))  # g2 announced, never received
    assert checked.counts(drain_s=0.01) == {"tensors_sent": 3, "tensors_received": 2, "corrupted": 1, "lost": 1}


# -- streaming statistics: constant memory, numpy's percentiles within the histogram's error --------------------


@pytest.mark.parametrize("name", ["lognormal", "uniform", "bimodal", "few", "constant"])
def test_streaming_percentiles_match_numpy_within_the_stated_error(name):
    from bench.ground.stats import RELATIVE_ERROR, StreamingStats

    rng = np.random.default_rng(7)
    values = {
        "lognormal": rng.lognormal(3, 1.5, 20_000),  # µs-like latencies with a long tail
        "uniform": rng.uniform(0.5, 5e6, 5_000),
        "bimodal": np.concatenate([rng.normal(40, 2, 3_000), rng.normal(9_000, 300, 300)]),
        "few": np.array([3.0, 1e4, 17.5]),
        "constant": np.full(1_000, 42.0),
    }[name]
    stats = StreamingStats()
    for value in values:
        stats.add(float(value))
    assert stats.count == len(values)
    assert (stats.min, stats.max) == (values.min(), values.max())
    assert stats.mean == pytest.approx(values.mean(), rel=1e-12)
    for q in (0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100):
        want = np.percentile(values, q)
        assert abs(stats.percentile(q) - want) <= RELATIVE_ERROR * want * (1 + 1e-9), q
    assert RELATIVE_ERROR < 0.01


def test_streaming_stats_take_the_same_memory_however_many_values_and_merge():
    from bench.ground.stats import StreamingStats
    from bench.launch.wire import decode_message, encode_message

    few, many = StreamingStats(), StreamingStats()
    few.add(5.0)
    for value in np.random.default_rng(1).exponential(100, 100_000):
        many.add(float(value))
    # what a rank reports on the run's channels: a fixed size
    assert abs(len(encode_message(few)) - len(encode_message(many))) <= 16
    both = decode_message(encode_message(many))
    both.merge(few)
    assert (both.count, both.min, both.total) == (many.count + 1, many.min, many.total + 5.0)
    assert StreamingStats().summary()["p50_us"] != StreamingStats().summary()["p50_us"]  # NaN when empty


def test_the_rss_trace_is_bounded_and_judges_a_trend_not_noise():
    from bench.ground.stats import LeakCriterion, RssTrace

    now = [0.0]
    memory = iter(())
    trace = RssTrace(capacity=16, interval_s=1.0, read=lambda: next(memory), clock=lambda: now[0])
    rng = np.random.default_rng(3)
    # flat with noise (a temporary buffer alive at some samples), 600 s
    memory = iter(100 + rng.choice([0.0, 0.0, 0.0, 1.5], 10_000))
    for second in range(600):
        now[0] = float(second)
        trace.sample()
    times, _ = trace.samples()
    assert len(times) <= 16 and times[0] == 0 and times[-1] > 500  # it spans the whole run, coarser
    assert np.allclose(np.diff(times), np.diff(times)[0])  # evenly
    flat = trace.judge(LeakCriterion())
    assert flat.leak is False and flat.range_mb == pytest.approx(1.5)

    leaking = RssTrace(capacity=16, interval_s=1.0, read=lambda: 100 + now[0] * 0.01, clock=lambda: now[0])
    for second in range(600):  # 0.6 MB a minute
        now[0] = float(second)
        leaking.sample()
    verdict = leaking.judge(LeakCriterion())
    assert verdict.leak is True and verdict.growth_mb == pytest.approx(0.01 * (600 - 60), rel=0.1)
    short = RssTrace(read=lambda: 100.0, clock=lambda: now[0])
    short.sample()
    assert short.judge().leak is None  # too short to judge


def test_buffers_in_flight_more_often_late_in_a_phase_are_no_leak():
    from bench.ground.stats import LeakCriterion, RssTrace

    # a 200 MB model's weights on their way at a sample: rarely at first, at most samples by the end (the
    # parameter server of a training run); memory always comes back to its floor of 900 MB
    now = [0.0]
    rng = np.random.default_rng(5)
    in_flight = lambda: 200.0 * float(rng.random() < now[0] / 600)  # noqa: E731
    trace = RssTrace(interval_s=1.0, read=lambda: 900 + in_flight(), clock=lambda: now[0])
    for second in range(600):
        now[0] = float(second)
        trace.sample()
    times, mb = trace.samples()
    judged = times >= 60
    assert np.polyfit(times[judged], mb[judged], 1)[0] * 540 > 100  # a line through the samples would say LEAK
    verdict = trace.judge(LeakCriterion())
    assert verdict.leak is False and verdict.growth_mb == pytest.approx(0.0, abs=0.5)
    assert verdict.range_mb == pytest.approx(200.0)


# -- the soak's own verdict: a deliberate leak is reported, a clean run is flat ---------------------------------


class Keeping:
    """A job that keeps what it received: a copy of a received tensor every ``every_s`` (``local`` hands over
    the sender's one array, so keeping the reference alone would keep nothing new), each in new memory."""

    def __init__(self, transport, every_s: float) -> None:
        import time

        self._transport, self.every_s, self._clock = transport, every_s, time.monotonic
        self.kept: list[np.ndarray] = []
        self._last = 0.0

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def recv(self, key):
        tensor = self._transport.recv(key)
        if self.every_s and self._clock() - self._last >= self.every_s:
            # into fresh pages of their own: a copy from the heap could land in space the allocator already
            # holds resident (freed buffers of the transfers), and leak without a trace in RSS
            pages = mmap.mmap(-1, tensor.nbytes)
            copy = np.frombuffer(pages, tensor.dtype).reshape(tensor.shape)
            copy[...] = tensor
            self.kept.append(copy)
            self._last = self._clock()
        return tensor


def soak_in_process(leak_every_s: float):
    """One 64KB point of the soak's transfers (bench.experiments.soak's loops, both sides in one process over
    ``local``) for 4 s, the receiver wrapped in :class:`Keeping`; both sides' accounts and how many copies
    the receiver kept.

    The process is a fresh interpreter of its own: the verdict judges the whole process's memory, and in
    pytest's process the threads and caches earlier tests left (TensorFlow's, gRPC's) grow it as they like
    (a clean soak read as a 4.8 MB leak there, in CI)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_soak_here, leak_every_s).result(timeout=300)


def _soak_here(leak_every_s: float):
    """:func:`soak_in_process`'s body, in the process that calls it."""
    import multiprocessing as mp
    import threading

    import transports
    from bench.experiments import soak
    from bench.experiments.micro import Point
    from bench.ground.stats import LeakCriterion
    from transports import Cluster

    point = Point(65536, warmup=10, iters=0, seconds=4.0, check=True)
    criterion = LeakCriterion(settle_s=1.0)
    sides: list = []
    pair = [transports.create("local") for _ in range(2)]
    cluster = Cluster.on_loopback(2)
    for rank, transport in enumerate(pair):
        transport.start(cluster, rank)
    receiver = Keeping(pair[1], leak_every_s)
    ctrl_send, ctrl_recv = mp.Pipe()
    threads = [threading.Thread(target=soak.sender_loop, args=(pair[0], [point], ctrl_send, sides.append, criterion)),
               threading.Thread(target=soak.receiver_loop, args=(receiver, [point], ctrl_recv, sides.append,
                                                                 criterion))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        for transport in pair:
            transport.close()
    accounts = {side.role: side for side in sides if isinstance(side, soak.SoakSide)}
    return point, accounts["sender"], accounts["receiver"], len(receiver.kept)


_FREED_BLOCKS = """
import sys
import numpy as np
from bench.ground.memory import private_mb, return_large_frees
if sys.argv[1] == "returned":
    assert return_large_frees()
before = private_mb()
for _ in range(3):
    block = np.ones(4 << 20, dtype=np.uint8)  # a 4 MiB buffer, every page touched, as one transfer's
    del block
print(private_mb() - before)
"""


@pytest.mark.parametrize(("setting", "kept_mb"), [("default", (3.5, 4.5)), ("returned", (-1.0, 0.5))])
def test_freed_large_buffers_go_back_to_the_system_in_the_soaks_processes(setting, kept_mb):
    # glibc by default keeps a freed 4 MiB buffer in its heap (a step in resident memory that is no leak)
    kept = float(subprocess.run([sys.executable, "-c", _FREED_BLOCKS, setting], capture_output=True, text=True,
                                check=True).stdout)
    assert kept_mb[0] <= kept <= kept_mb[1]


def test_a_job_that_keeps_received_tensors_is_reported_as_a_leak():
    from bench.experiments import soak

    point, sender, receiver, kept = soak_in_process(leak_every_s=0.005)  # up to 12 MB a second of copies
    assert kept > 100
    assert receiver.memory.leak is True
    assert receiver.memory.growth_mb > 2
    rows = soak.soak_records("local", point, sender, receiver)
    assert rows[1].process == "receiver" and rows[1].rss_growth_mb == receiver.memory.growth_mb
    assert (rows[1].corrupted, rows[1].lost) == (0, 0)


def test_a_clean_soak_is_flat_and_keeps_no_per_transfer_lists():
    point, sender, receiver, kept = soak_in_process(leak_every_s=0)
    assert kept == 0
    assert receiver.memory.leak is False and sender.memory.leak is False
    assert sender.transfers == receiver.transfers > point.warmup and receiver.corrupted == 0
    # the sender timed every transfer after warm-up from the readings the receiver sent back, in a fixed histogram
    assert sender.time_us.count == sender.transfers - point.warmup
    assert 0 < sender.time_us.percentile(50) <= sender.time_us.max
    assert sender.transfer_us.max <= sender.time_us.max


#: what LEAKY's worker keeps (in the rank's process)
_kept: list[np.ndarray] = []


@dataclass(frozen=True)
class LeakyMLP(TinyMLP):
    """The tiny MLP, whose every batch leaves 64 KB behind: a job that keeps what it no longer needs."""

    name: str = "leaky_mlp"

    def make_batch(self, batch_size: int, seed: int):
        _kept.append(np.ones(1 << 14, np.float32))
        return super().make_batch(batch_size, seed)


LEAKY = LeakyMLP()


@pytest.mark.parametrize("model", ["tests.tiny_models:TINY", "tests.test_soak:LEAKY"])
def test_bench_soak_reports_the_training_process_that_leaks_and_only_it(tmp_path, model):
    pytest.importorskip("tensorflow")
    out = tmp_path / "soak"
    done = bench("soak", "--transports", "grpc_tcp", "--sizes", "1KB", "--duration", "1", "--steps", "600",
                 "--model", model, "--timeout", "60", "--out", str(out))
    run = load_run(out)
    verdicts = {(m["phase"], m["process"]): m for m in run.meta["memory"]}
    assert (run.meta["corrupted"], run.meta["lost"]) == (0, 0)
    assert verdicts[("model", "worker 0")]["judged_s"] > 0
    if model.endswith("LEAKY"):
        assert done.returncode == 1, done.stdout + done.stderr
        assert run.meta["leaks"] == [f"grpc_tcp model {model} worker 0"]
        assert f"leak: grpc_tcp model {model} worker 0" in done.stdout
        assert verdicts[("model", "worker 0")]["leak"] is True
        assert verdicts[("model", "worker 0")]["growth_mb"] > 2
        records = run.records
        assert records[records["process"] == "worker 0"]["rss_growth_mb"].item() > 2
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert run.meta["leaks"] == [] and ", 0 process(es) leaking" in done.stdout
        assert verdicts[("model", "worker 0")]["leak"] is False and verdicts[("model", "ps 0")]["leak"] is False
