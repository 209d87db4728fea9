"""How a dtype travels between ranks: which dtypes can (:func:`dtype_problem`), the text a sender writes for one
(:func:`dtype_text`) and the dtype a receiver reads back from it (:func:`dtype_named`)."""

from __future__ import annotations

import numpy as np

#: dtypes that travel as raw bytes: numbers and booleans (dtype_problem() is None for each)
PLAIN_DTYPES = frozenset(np.dtype(code) for code in "?bBhHiIlLqQefdgFDG")


def dtype_text(dtype: np.dtype) -> str:
    """How ``dtype`` travels between ranks: its ``str`` (``'<f4'``: kind, size and byte order), or, for a dtype of
    ml_dtypes (bfloat16), whose ``str`` is an anonymous ``'<V2'`` that would arrive as raw records, its name, which
    :func:`dtype_named` reads back."""
    if dtype.kind == "V" and dtype.type is not np.void:
        return dtype.name
    return dtype.str


def dtype_named(text: str) -> np.dtype:
    """The dtype :func:`dtype_text` wrote as ``text`` (TypeError or ValueError when there is none): NumPy's reading,
    or a dtype of ml_dtypes by name (imported only for one: NumPy knows its names once it is)."""
    try:
        return np.dtype(text)
    except TypeError:
        if not text.isidentifier():
            raise
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"data type {text!r} not understood (ml_dtypes, which may name it, is not installed)") \
                from None
        found = getattr(ml_dtypes, text, None)
        if not isinstance(found, type) or not issubclass(found, np.generic):
            raise
        return np.dtype(found)


def dtype_problem(dtype: np.dtype) -> str | None:
    """Why ``dtype`` cannot travel as raw bytes (None if it can).

    Object dtypes hold pointers into this process. Structured dtypes are refused rather than sent as
    anonymous ``|V<n>`` records that arrive without their fields (the wire carries ``dtype.str``);
    send ``array.view(np.uint8)`` or each field on its own instead.
    """
    if dtype.hasobject:
        return f"dtype {dtype} holds Python objects, which cannot be sent; convert to a numeric or string dtype"
    if dtype.names is not None or dtype.subdtype is not None:
        return (f"structured dtype {dtype} is not supported (its fields would not survive the wire); "
                "send array.view(np.uint8) or each field separately")
    if dtype.itemsize == 0:
        return f"dtype {dtype.str} has no size; give it one (e.g. 'S8', 'U4')"
    return None
