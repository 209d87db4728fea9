"""Size strings: binary units, ranges stepping x4 or :xN, lists, and clear errors."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.ground.sizes import SizeError, format_size, parse_size, parse_sizes

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1KB", KB), ("1kb", KB), ("64KiB", 64 * KB), ("1K", KB), ("512", 512), ("512B", 512), ("1.5MB", 3 * MB // 2),
     ("1GB", GB), (" 2 MB ", 2 * MB)],
)
def test_single_sizes_are_binary(text, expected):
    assert parse_size(text) == expected


def test_a_range_steps_by_four_and_includes_both_ends():
    sizes = parse_sizes("1KB-1GB")
    assert len(sizes) == 11
    assert sizes[0] == KB and sizes[-1] == GB
    assert all(b == 4 * a for a, b in itertools.pairwise(sizes))


def test_a_range_with_another_step():
    assert parse_sizes("1KB-1MB:x2") == [KB << i for i in range(11)]
    assert parse_sizes("1KB-64KB:x8") == [KB, 8 * KB, 64 * KB]


def test_a_range_whose_end_is_not_on_a_step_stops_below_it():
    assert parse_sizes("1KB-10KB") == [KB, 4 * KB]


def test_lists_mix_sizes_and_ranges_and_come_out_sorted_and_distinct():
    assert parse_sizes("1MB,1KB,64KB,1KB") == [KB, 64 * KB, MB]
    assert parse_sizes("1MB,1KB-16KB") == [KB, 4 * KB, 16 * KB, MB]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("1XB", "invalid size '1XB'"),
        ("2MB-1MB", "start 2MB is larger than the end 1MB"),
        ("0KB", "at least 1 byte"),
        ("1KB-1MB:x1", "at least :x2"),
        ("1.3B", "whole number"),
        ("1KB,,2KB", "empty item"),
        ("", "empty item"),
        ("-1KB", "invalid size"),
    ],
)
def test_bad_sizes_say_what_is_wrong(text, fragment):
    with pytest.raises(SizeError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
        parse_sizes(text)


@given(st.integers(min_value=1, max_value=1 << 50))
def test_format_then_parse_is_the_identity(nbytes):
    assert parse_size(format_size(nbytes)) == nbytes


def test_format_size_uses_the_largest_exact_unit():
    assert format_size(KB) == "1KB"
    assert format_size(3 * MB) == "3MB"
    assert format_size(1536) == "1536B"
    assert format_size(GB) == "1GB"


def test_a_size_is_checked_against_the_memory_available_now_not_the_total(monkeypatch):
    """bench micro and soak refuse, before any rank starts, a size whose two tensors (sender, receiver) the memory
    available now cannot hold, though the machine's total could (--sizes 10GB was accepted on a 24 GiB machine)."""
    from bench import options
    from bench.ground import memory

    monkeypatch.setattr(memory, "machine_memory_bytes", lambda: 24 * 2**30)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 10 * 2**30)
    assert "available now" in options.sizes_problem([6 * 2**30])
    assert options.sizes_problem([4 * 2**30]) is None
