"""How a dtype travels between ranks (``transports.dtypes.dtype_text`` / ``dtype_named``): NumPy's ``dtype.str``, or
the name of one of ml_dtypes' (bfloat16's ``str`` is an anonymous ``<V2``); a peer's text is parsed into a dtype or
refused, never anything else."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from transports import peer_input
from transports.dtypes import PLAIN_DTYPES, dtype_named, dtype_text
from transports.tensors import bfloat16

TRAVELLING = [*sorted(PLAIN_DTYPES, key=str), np.dtype("<U3"), np.dtype("S5"), np.dtype("<m8[ns]")]


@pytest.mark.parametrize("dtype", TRAVELLING, ids=str)
def test_a_numpy_dtype_travels_as_its_str(dtype):
    assert dtype_text(dtype) == dtype.str and dtype_named(dtype_text(dtype)) == dtype


def test_bfloat16_travels_by_name_and_is_read_back_as_itself():
    dtype = bfloat16()
    if dtype is None:
        pytest.skip("ml_dtypes is not installed here")
    assert dtype.str == "<V2"  # what travelled before: raw 2-byte records at the receiver
    assert dtype_text(dtype) == "bfloat16"
    assert dtype_named("bfloat16") == dtype == peer_input.dtype(b"bfloat16") == peer_input.dtype("bfloat16")


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=24) | st.sampled_from(["bfloat16", "float8_e4m3fn", "finfo", "__class__", "__name__",
                                                "int4", "V2", "<V2", "ml_dtypes"]))
@example("bfloat16")
@example("__loader__")
def test_a_peer_s_dtype_text_is_a_dtype_or_refused(text):
    try:
        parsed = dtype_named(text)
    except (TypeError, ValueError, SyntaxError):  # (the errors peer_input.dtype turns into the peer's)
        return
    assert isinstance(parsed, np.dtype)
