"""``bench soak``: a short soak over grpc_tcp, and the content checks that count corrupted and lost tensors.

The real soak (10 minutes of transfers, 1000 training steps per transport) is not for CI: see the README.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from bench.results import load_run


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
        from bench.micro import content, marker

        tensor = content(self.point).copy()
        tensor[-1] = marker(key.step, tensor.dtype)
        if key.step == self.bad:
            tensor.view(np.uint8)[7] ^= 0x10
        return tensor

    def stats(self):
        from transports import TransportStats

        return TransportStats()


def test_the_micro_check_counts_a_corrupted_tensor_and_goes_on():
    from bench import micro

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
    from bench.runtime.ps import CheckedTransport
    from transports import Key

    hub = Hub()
    checked = CheckedTransport(Wire(corrupt={"g1"}), hub, timeout_s=1)
    for name in ("g0", "g1", "g2"):
        checked.send(Key(name, 0, 0, 1), np.arange(4, dtype=np.float32))
    checked.recv(Key("g0", 0, 0, 1))
    checked.recv(Key("g1", 0, 0, 1))  # g2 announced, never received
    assert checked.counts(drain_s=0.01) == {"tensors_sent": 3, "tensors_received": 2, "corrupted": 1, "lost": 1}
