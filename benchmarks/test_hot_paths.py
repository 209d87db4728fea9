"""In-process timings of hot paths with pytest-benchmark (``tox -e perf``); not part of the tests."""

from __future__ import annotations

import numpy as np
import pytest

from bench.ground.sizes import parse_sizes
from transports.base import Ledger
from transports.grpc_tcp.wire import TensorAssembler, decode_chunk, encode_chunks


@pytest.mark.parametrize("nbytes", [1 << 10, 1 << 20, 16 << 20], ids=["1KB", "1MB", "16MB"])
def test_encode_chunks(benchmark, nbytes):
    array = np.ones(nbytes // 4, dtype=np.float32)
    benchmark(lambda: list(encode_chunks(array, Ledger())))


@pytest.mark.parametrize("nbytes", [1 << 10, 1 << 20, 16 << 20], ids=["1KB", "1MB", "16MB"])
def test_decode_and_assemble(benchmark, nbytes):
    (message,) = encode_chunks(np.ones(nbytes // 4, dtype=np.float32), Ledger())

    def receive():
        assembler = TensorAssembler(Ledger())
        assembler.add(message)
        return assembler.result()

    benchmark(receive)


def test_decode_header_only(benchmark):
    (message,) = encode_chunks(np.ones(256, dtype=np.float32), Ledger())
    benchmark(decode_chunk, message)


def test_parse_sizes(benchmark):
    benchmark(parse_sizes, "1KB-1GB,3MB,5MB-9MB:x2")
