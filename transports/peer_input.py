"""What another process sends us, checked in one place, against one set of limits.

Every wire format (grpc_tcp's chunks, grpc_rdma's records and ``link`` call, zerocopy's ``connect``
and meta-data records, the fabric transports' ``hello``) hands what a peer sent to the function here
for its kind, before anything is allocated or written for it:

* :func:`device_address`: a fabric device address (a list of hex worker addresses);
* :func:`remote_region` and :func:`remote_key`: where the peer lets us read or write;
* :func:`dtype`: a dtype string, which must name a dtype that travels as raw bytes (no object or
  structured dtype: :func:`transports.dtypes.dtype_problem`, the rule a sender's arrays meet);
* :func:`shape`: its dimensions;
* :func:`size`: the bytes a dtype and shape span, multiplied in Python integers and stopping past the
  bound (nothing wraps, nothing is allocated): what numpy can build, at most this machine's memory
  (:func:`transports.base.memory_bytes`) or a format's lower limit, and what the peer announced.

Each raises :class:`PeerInputError`, a :class:`~transports.base.PeerError` whose message names the peer
and what was wrong. It is a ValueError too, what the parsers of the wire formats raise for malformed
input: their own error classes derive from it, and a parser passes its class as ``error``.

This is the transport layer: the fabric below does not import it. A verbs connect request carries the
device address the requester's control server already gave (checked here), and is checked against
that address's fixed size; a region descriptor's form and key size are the fabric's
(:meth:`RemoteRegion.from_json`, :data:`MAX_RKEY_BYTES`), which :func:`remote_region` applies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transports.base import PeerError, memory_bytes
from transports.dtypes import dtype_named, dtype_problem
from transports.fabric.base import MAX_RKEY_BYTES, RemoteRegion

#: a device address is at most this many worker addresses (UCX: one per worker), each of at most
#: MAX_ADDRESS_BYTES (UCX's are a few hundred bytes; a verbs device address is 43)
MAX_WORKERS = 64
MAX_ADDRESS_BYTES = 16 << 10
#: (MAX_RKEY_BYTES, imported: the fabric's bound on a remote key, the size of the records' key fields)
#: a dtype string: longer than the ``dtype.str`` of any dtype that travels (the longest, a datetime with a
#: unit multiplier such as ``<m8[1000000000ns]``, has 17 characters; the records' dtype fields hold 16)
MAX_DTYPE_CHARS = 32
#: the most dimensions a shape may have: what this numpy can build (NPY_MAXDIMS)
MAX_DIMS = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32
#: the dimensions a fixed-size record carries (grpc_rdma's message, zerocopy's meta-data record)
RECORD_DIMS = 8
#: the largest size an array can have: no limit passed to :func:`size` goes beyond it
MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)

#: who sent it, when a parser is not told
THE_PEER = "the peer"


class PeerInputError(PeerError, ValueError):
    """What a peer sent is malformed or beyond a limit; the message names the peer and what was wrong."""


def device_address(value: Any, peer: str = THE_PEER, *, error: type[PeerInputError] = PeerInputError) -> list[bytes]:
    """A device address from the control path: a list of 1 to :data:`MAX_WORKERS` hex strings, each of 1 to
    :data:`MAX_ADDRESS_BYTES` bytes. Only the form is checked: whether its backend can use each address, the
    device checks before it connects (:meth:`Device.channel`)."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_WORKERS:
        raise error(f"{peer} sent a device address that is not a list of 1 to {MAX_WORKERS} worker addresses")
    return [_hex(item, "a worker address", MAX_ADDRESS_BYTES, peer, error) for item in value]


def remote_region(value: Any, peer: str = THE_PEER, *, what: str = "a region", length: int | None = None,
                  error: type[PeerInputError] = PeerInputError) -> RemoteRegion:
    """A region the peer described (:meth:`RemoteRegion.to_json`: address, length, hex remote key) for us to
    write into or read from: integers of the fabric's 64-bit range that do not wrap, a key of 1 to
    :data:`MAX_RKEY_BYTES` bytes, and exactly ``length`` bytes when given. ``what`` names it in the message."""
    try:
        region = RemoteRegion.from_json(value)
    except ValueError as exc:
        raise error(f"{peer} sent {what} that is not a region: {exc}") from None
    if length is not None and region.length != length:
        raise error(f"{peer} sent {what} of {region.length} bytes, where {length} are expected")
    return region


def remote_key(field: np.ndarray, size: int, peer: str = THE_PEER, *, required: bool = True,
               error: type[PeerInputError] = PeerInputError) -> bytes:
    """The first ``size`` bytes of a record's key ``field``: at most :data:`MAX_RKEY_BYTES` and the field's
    length, and at least one when ``required`` (the record points at memory to read)."""
    limit = min(MAX_RKEY_BYTES, len(field))
    if not (1 if required else 0) <= size <= limit:
        least = "1" if required else "0"
        raise error(f"{peer} sent a remote key of {size} bytes, not {least} to {limit}")
    return bytes(field[:size])


def dtype(value: Any, peer: str = THE_PEER, *, error: type[PeerInputError] = PeerInputError) -> np.dtype:
    """The dtype a peer named (``dtype.str``, as text or ASCII bytes, at most :data:`MAX_DTYPE_CHARS`
    characters): one numpy parses and that travels as raw bytes (:func:`~transports.dtypes.dtype_problem`:
    no object, structured or sub-array dtype, none of size 0)."""
    if not isinstance(value, str | bytes) or len(value) > MAX_DTYPE_CHARS:
        raise error(f"{peer} sent an unknown dtype {value!r:.40} "
                    f"(a dtype is named by a string of at most {MAX_DTYPE_CHARS} characters)")
    try:
        parsed = dtype_named(value.decode("ascii") if isinstance(value, bytes) else value)
    except (TypeError, ValueError, UnicodeDecodeError, SyntaxError):  # numpy's parser raises all but the third
        raise error(f"{peer} sent an unknown dtype {value!r:.40}") from None
    if (problem := dtype_problem(parsed)) is not None:
        raise error(f"{peer} sent a dtype this rank does not take: {problem}")
    return parsed


def shape(value: Any, peer: str = THE_PEER, *, ndim: int | None = None, max_dims: int = MAX_DIMS,
          error: type[PeerInputError] = PeerInputError) -> tuple[int, ...]:
    """A shape: at most ``max_dims`` non-negative integers (no bool, no float). From a fixed-size record,
    ``value`` is its field of dimensions and ``ndim`` how many of them the peer says are used (at most the
    field's length). Its size is :func:`size`'s to check."""
    if ndim is not None:
        max_dims = min(max_dims, len(value))
        count = ndim
    elif isinstance(value, list | tuple):
        count = len(value)
    else:
        raise error(f"{peer} sent a 'shape' that is not a list of dimensions: {value!r:.40}")
    if count > max_dims:
        raise error(f"{peer} sent a 'shape' of {count} dimensions, more than the {max_dims} allowed")
    dims = value[:count]
    for d in dims:
        if not isinstance(d, int | np.integer) or isinstance(d, bool | np.bool_):
            raise error(f"{peer} sent a 'shape' with {d!r:.40}, not an integer dimension")
        if d < 0:
            raise error(f"{peer} sent a negative dimension in 'shape': {int(d)}")
    return tuple(int(d) for d in dims)


def size(dtype: np.dtype, shape: tuple[int, ...], peer: str = THE_PEER, *, limit: int | None = None,
         announced: int | None = None, error: type[PeerInputError] = PeerInputError) -> int:
    """The bytes of a ``dtype`` tensor of ``shape`` (checked by :func:`shape`): at most ``limit`` (default:
    this machine's memory), and numpy must be able to build it, which bounds the product of the item size
    and the non-zero dimensions (even for an empty tensor) by :data:`MAX_ARRAY_BYTES`. Multiplied in Python
    integers, stopping once past that bound: no shape computes a number much larger, nothing wraps, nothing
    is allocated. ``announced``: the size the peer said, which must be this one."""
    limit = min(memory_bytes() if limit is None else limit, MAX_ARRAY_BYTES)
    extent = dtype.itemsize
    for d in shape:
        extent *= d or 1
        if extent > MAX_ARRAY_BYTES:
            break
    nbytes = 0 if 0 in shape else extent
    if nbytes > limit or extent > MAX_ARRAY_BYTES:
        raise error(f"{peer} sent 'shape' {shape} of {dtype.str}, which spans more than this rank can hold: "
                    f"it exceeds {limit if nbytes > limit else MAX_ARRAY_BYTES} bytes")
    if announced is not None and announced != nbytes:
        raise error(f"{peer} announced {announced} bytes for {dtype.str} {shape}, which does not match "
                    f"its {nbytes} bytes")
    return nbytes


def _hex(value: Any, what: str, limit: int, peer: str, error: type[PeerInputError]) -> bytes:
    if not isinstance(value, str) or not 0 < len(value) <= 2 * limit:
        raise error(f"{peer} sent {what} that is not a hex string of 1 to {limit} bytes")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise error(f"{peer} sent {what} that is not hex") from None
