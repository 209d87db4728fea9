"""Tensor sizes as users write them: ``64KB``, ``1KB-1GB`` (x4 steps), ``1KB-1MB:x2``, ``1KB,64KB,1MB``; and link
rates: ``10gbit``, ``500mbit``.

Units of sizes are binary: 1KB = 1024 bytes, 1MB = 1024 KB, and so on; units of rates decimal, as tc's.
"""

from __future__ import annotations

import re
from decimal import Decimal

UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
DEFAULT_STEP = 4

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$", re.IGNORECASE)
_RANGE = re.compile(r"^(?P<start>[^-:]+)-(?P<end>[^-:]+?)(?::x(?P<step>\d+))?$", re.IGNORECASE)


class SizeError(ValueError):
    """A size string that cannot be read; the message says what is expected."""


def parse_size(text: str) -> int:
    """Bytes in ``text`` such as ``1KB``, ``64MiB``, ``1.5GB`` or ``512``."""
    match = _SIZE.match(text)
    if not match:
        raise SizeError(
            f"invalid size '{text}': expected a number with a unit B, KB, MB, GB or TB "
            "(binary, 1KB = 1024 bytes), e.g. 64KB"
        )
    value = float(match.group(1)) * UNITS[match.group(2).upper()]
    if value != int(value):
        raise SizeError(f"invalid size '{text}': not a whole number of bytes")
    if value < 1:
        raise SizeError(f"invalid size '{text}': a size must be at least 1 byte")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """The sorted, distinct sizes in a comma list whose items are sizes or ranges ``A-B[:xN]``."""
    sizes: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise SizeError(f"invalid sizes '{text}': empty item in the list")
        match = _RANGE.match(item)
        if match:
            sizes.update(_expand_range(item, match))
        else:
            sizes.add(parse_size(item))
    return sorted(sizes)


def _expand_range(item: str, match: re.Match[str]) -> list[int]:
    start, end = parse_size(match["start"]), parse_size(match["end"])
    step = int(match["step"]) if match["step"] else DEFAULT_STEP
    if start > end:
        raise SizeError(
            f"invalid size range '{item}': the start {match['start']} is larger than the end {match['end']}"
        )
    if step < 2:
        raise SizeError(f"invalid size range '{item}': the step :x{step} must be at least :x2")
    out = []
    size = start
    while size <= end:
        out.append(size)
        size *= step
    return out


def format_size(nbytes: int) -> str:
    """The shortest exact binary spelling: 1024 -> '1KB', 1536 -> '1536B'."""
    for unit in ("T", "G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}B"
    return f"{nbytes}B"


def parse_rate(text: str) -> int:
    """A link rate such as ``10gbit``, ``500mbit``, ``1.5gbit``, ``800bit`` in bits per second (units of 1000)."""
    match = _RATE.match(text)
    unit = match[2].lower() if match else None
    if match is None or unit not in _RATE_UNITS:
        raise ValueError(f"bad link rate {text!r}: expected a number and one of {', '.join(_RATE_UNITS)} (e.g. 10gbit)")
    bps = Decimal(match[1]) * _RATE_UNITS[unit]
    if bps < 1 or bps != bps.to_integral_value():
        raise ValueError(f"bad link rate {text!r}: must be a whole number of bits per second, at least 1bit")
    return int(bps)
