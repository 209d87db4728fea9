"""The wire: what the hub's and the job's connections carry (see the section's comment below).

Why one module: the encoder and the decoder mirror each other tag by tag, and both apply the same rules on what
may be named (the sender refuses what the receiver would); apart, a change to one side could miss the other."""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import importlib
import importlib.util
import inspect
import os
import pathlib
import socket
import struct
import sys
import types
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.launch.messages import LaunchError
from transports import peer_input
from transports.dtypes import dtype_problem, dtype_text

# -- the wire: what the hub's and the job's connections carry -----------------------------------
#
# Every message is one frame of at most MAX_MESSAGE_BYTES, read with recv_bytes(maxlength): a format byte
# (FORMAT) and one value, each value a tag byte and what the tag says follows. Nothing is pickled: the frame
# carries data and the names of classes and functions, never code or a constructor to call, and the decoder
# (Python, reading a memoryview of the frame) makes only the values below:
#
# - None, bools, ints (64-bit, or the bytes of a longer one), floats, complex, str (UTF-8), bytes, bytearray,
#   lists, tuples, dicts (keys of any of these kinds), sets, frozensets, collections.OrderedDict;
# - numpy arrays, scalars and dtypes: the dtype's text (transports.dtypes.dtype_text: its ``str``, or an ml_dtypes
#   dtype's name, so a bfloat16 arrives as one, not as raw 'V2' records), the shape and the raw bytes. Only dtypes
#   that travel as raw bytes (transports.peer_input.dtype: no object, structured or empty dtype), the shape's bytes
#   checked against what the frame holds before anything is allocated; an array arrives as a writable copy of its own;
# - pathlib's PosixPath and PurePosixPath; functools.partial (its function, arguments and keywords);
# - from the project's own modules (bench, transports, and this checkout's tests) or a module named in
#   TENSOR_BENCH_WIRE_MODULES, named "module:qualname": classes that hold data (dataclasses, enums, plain classes;
#   refused if they define __setstate__, __del__, __reduce__, __new__, __getattr__ or are exceptions: code that
#   would run on load, on collection or when used), their instances (made with object.__new__, their fields set
#   in __dict__ or their slots' own descriptors: no __init__, no __post_init__, no __setattr__, frozen or not),
#   enum members (by name), functions that are rank jobs by the project's convention (a parameter named
#   ``ctx``, the RankContext) or that their module marks with :func:`wire_value`, and public methods of those
#   data classes, bound (a workload's ``build``: :func:`_method`); anything else only when marked with
#   :func:`wire_value`.
#
# The encoder refuses what the decoder would, so a value that cannot travel fails where it is sent, naming it.
# The decoder refuses, in one line (WireError): a name outside the rules above (``refusing posix.system on the
# run's channels: ...``), a length or count beyond what is left of the frame (nothing is allocated for a claim),
# nesting deeper than MAX_DEPTH, and a message whose values would take more than MEMORY_FACTOR bytes per byte of
# the frame plus MEMORY_FLOOR (what each value takes is counted before it is made). Shared references are not
# kept (a value sent twice arrives as two equal values) and cycles cannot travel. A function that arrives runs
# only where the project calls a job or a workload's function. A user's own workload (bench/runtime/workload.py)
# travels the same way: a dataclass in a module listed in TENSOR_BENCH_WIRE_MODULES (every rank inherits the
# variable), or marked with ``@wire_value``.
#
# Why a format of its own rather than msgpack or JSON: JSON has no bytes, tuples, sets or keys other than text;
# msgpack's C unpacker makes a container of the size a header claims before it reads the items (a frame of 136 KB
# of nested array headers made it allocate 81 MB), its nesting limit is fixed when it is built, and its hooks would
# need a pass in Python over every value anyway. This decoder is Python, as the unpickler before it was. A new kind
# of value is a new tag: a writer in _WRITERS, a reader in _READERS (a framework's tensor travels as an array).

#: the most one message may hold (a rank's result or report, an assignment with its workload)
MAX_MESSAGE_BYTES = 1 << 30
#: names the modules, beyond the project's, whose data classes and marked functions may travel (comma-separated)
WIRE_MODULES_VARIABLE = "TENSOR_BENCH_WIRE_MODULES"
#: the first byte of every frame: the format's version
FORMAT = 1
#: the deepest a value may nest (containers, objects' fields, a partial's arguments)
MAX_DEPTH = 64
#: a message's values may take at most this many bytes per byte of its frame, plus MEMORY_FLOOR
MEMORY_FACTOR = 8
MEMORY_FLOOR = 1 << 20
_WIRE_MARK = "__tensor_bench_wire__"
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


class WireError(LaunchError):
    """A message that is not one the run's channels carry (not data, too big, malformed); one line."""


def wire_value(obj: Any) -> Any:
    """Mark a class or module-level function as one that may travel on the run's channels (a decorator).

    For what the project's convention does not admit: a workload class that is not a dataclass, a function
    passed as a value (a model builder) that is not a rank job. The module must be one the ranks may import
    (the project's, or listed in ``TENSOR_BENCH_WIRE_MODULES``)."""
    setattr(obj, _WIRE_MARK, True)
    return obj


def encode_message(message: Any) -> bytes:
    """``message`` as the bytes of one frame on the run's channels; WireError (one line) naming a value that
    cannot travel (see the section's comment)."""
    writer = _Writer()
    try:
        writer.value(message, 0)
    except WireError as exc:
        raise WireError(_line(str(exc))) from None
    return b"".join(writer.parts)


def send_message(conn: Connection, message: Any) -> None:
    """Send ``message`` as one frame (see :func:`decode_message` for what arrives)."""
    data = encode_message(message)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {len(data) / 2**20:.0f} MiB ({type(message).__name__}) is over the run's "
                        f"limit of {MAX_MESSAGE_BYTES / 2**20:.0f} MiB per message: return or report less at once")
    conn.send_bytes(data)


def receive_message(conn: Connection, limit: int | None = None) -> Any:
    """The next message on ``conn``, decoded as data; WireError (one line) for one too big or not data.

    EOFError or OSError when the connection ends. A frame over ``limit`` (``MAX_MESSAGE_BYTES``) is not read:
    the connection is useless after it, and closed."""
    limit = MAX_MESSAGE_BYTES if limit is None else limit
    return decode_message(receive_frame(conn, limit, "the run's channels", WireError))


def receive_frame(conn: Any, limit: int, channel: str, error: type[LaunchError]) -> bytes:
    """The next frame on ``conn``; one over ``limit`` bytes is not read: the connection is closed (it is useless
    after it) and ``error`` raised, naming ``channel``'s limit. EOFError or OSError when the connection ends."""
    try:
        return conn.recv_bytes(limit)
    except OSError as exc:
        if "bad message length" not in str(exc):
            raise
        conn.close()
        raise error(f"refused a message over {limit} bytes (the limit of {channel})") from None


def decode_message(data: bytes | bytearray | memoryview) -> Any:
    """The message in ``data``: data only (see the section's comment), else WireError naming what was refused."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"refused a message over {MAX_MESSAGE_BYTES} bytes (the limit of the run's channels)")
    try:
        return _Reader(data).message()
    except WireError as exc:
        raise WireError(_line(str(exc))) from None
    except peer_input.PeerInputError as exc:
        raise WireError(_line(f"refused a message: {exc}")) from None
    except MemoryError:
        raise WireError("refused a message: it would not fit in memory") from None
    except Exception as exc:  # whatever the bytes are (a key that cannot be hashed, a bad UTF-8 string): one line
        raise WireError(_line(f"refused a message that is not one of the run's ({type(exc).__name__}: {exc})")) \
            from None


def _line(text: str) -> str:
    """``text`` as one line of at most 400 characters (it may quote what a peer sent)."""
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:400] + "..."


# -- what may be named on the wire: the project's data classes, rank jobs, marked values ----------------------------


def _modules_allowed() -> tuple[str, ...]:
    return tuple(m.strip() for m in os.environ.get(WIRE_MODULES_VARIABLE, "").split(",") if m.strip())


def _project_module(module: str) -> bool:
    """A module of this project: bench's, transports', or the tests beside them (a checkout's)."""
    top = module.partition(".")[0]
    if top in ("bench", "transports"):
        return True
    if top != "tests":
        return False
    found = sys.modules.get("tests")
    origin = getattr(found, "__file__", None)
    if found is None:
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec("tests")
            origin = spec.origin if spec else None
    return origin is not None and Path(origin).resolve().parent == _PROJECT_ROOT / "tests"


def _importable(module: str) -> bool:
    return _project_module(module) or any(module == m or module.startswith(m + ".") for m in _modules_allowed())


def _method(owner: Any, name: Any) -> Any:
    """``owner.name`` for one value only: a method of a data class the message may name (an instance's, or a
    class's classmethod), found without running anything.

    The name must be public, the class defining it one of the project's modules or of one named in
    TENSOR_BENCH_WIRE_MODULES, and what it defines there a plain function (or a classmethod of one): the bound
    method is made here, so no property, descriptor or ``__getattr__`` of the owner runs. What arrives runs only
    where the project calls a workload's function (``build_model()``), as a rank job does."""
    refused = f"refusing the method {str(name)[:60]} on the run's channels: only public methods of the data classes " \
              "that travel there (the project's, or of a module named in " + WIRE_MODULES_VARIABLE + ")"
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise WireError(refused)
    cls = owner if isinstance(owner, type) else type(owner)  # a function's, a str's: not a module of the project's
    for base in cls.__mro__:
        if name not in vars(base):
            continue
        found = vars(base)[name]
        if not _importable(base.__module__) or (_hooks(cls) and not vars(cls).get(_WIRE_MARK, False)):
            raise WireError(refused)
        if owner is cls and isinstance(found, classmethod) and isinstance(found.__func__, types.FunctionType):
            return types.MethodType(found.__func__, cls)
        if owner is not cls and isinstance(found, types.FunctionType):
            return types.MethodType(found, owner)
        raise WireError(refused)
    raise WireError(refused)


def _own_setstate(cls: type) -> bool:
    """Whether instances of ``cls`` set their state with code of their own (dataclasses' slots helper excepted)."""
    setstate = getattr(cls, "__setstate__", None)
    return setstate is not None and getattr(setstate, "__qualname__", "") != "_dataclass_setstate"


#: what a class may not define to travel unmarked: code that would run on load, on collection or when it is used
#: as a key (a plain class of the project's, made with object.__new__ and its fields set, runs none of its own)
_HOOKS = ("__del__", "__reduce__", "__reduce_ex__", "__getattr__", "__getattribute__", "__new__",
          "__init_subclass__", "__class_getitem__")


def _hooks(cls: type) -> list[str]:
    """The hooks of :data:`_HOOKS` that ``cls`` or a base other than ``object`` defines (enums' own excepted)."""
    if issubclass(cls, BaseException):
        return ["an exception"]
    bases = [c for c in cls.__mro__ if c is not object and not (issubclass(cls, enum.Enum) and c.__module__ == "enum")]
    return [hook for hook in _HOOKS for c in bases if hook in vars(c)]


def _admit_global(module: str, name: str) -> Any:
    """What a message may name as ``module.name`` (a class or function), or WireError (one line) naming it."""
    where = f"{str(module)[:100]}.{str(name)[:100]}"
    fix = (f"only data travels there: a dataclass or a rank job (a function taking ctx) of the "
           f"project's modules or of one named in {WIRE_MODULES_VARIABLE}, or one marked with "
           "bench.launch.wire.wire_value")
    if not isinstance(module, str) or not isinstance(name, str) or not _importable(module):
        raise WireError(f"refusing {where} on the run's channels: {fix}")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = vars(obj)[part]  # its own attribute: nothing inherited, imported names checked below
    except Exception:  # any failure to find it is a refusal
        raise WireError(f"refusing {where} on the run's channels: no such class or function there") from None
    if getattr(obj, "__module__", None) != module or getattr(obj, "__qualname__", None) != name:
        raise WireError(f"refusing {where} on the run's channels: it is not defined there ({fix})")
    marked = vars(obj).get(_WIRE_MARK, False) if hasattr(obj, "__dict__") else False
    if isinstance(obj, type):  # an enum travels by its members' names: no code of its own runs
        if marked or isinstance(obj, enum.EnumMeta) or (not _own_setstate(obj) and not _hooks(obj)):
            return obj
    elif isinstance(obj, types.FunctionType):
        with contextlib.suppress(TypeError, ValueError):
            if marked or "ctx" in inspect.signature(obj).parameters:
                return obj
    raise WireError(f"refusing {where} on the run's channels: {fix}")


def _unmade(cls: type) -> str | None:
    """Why instances of ``cls`` (a class :func:`_admit_global` admits) cannot travel as fields (None if they can)."""
    if isinstance(cls, enum.EnumMeta):
        return "an enum travels as one of its members"
    if _own_setstate(cls):
        return "it sets its state with __setstate__, which the wire never calls"
    if cls.__new__ is not object.__new__:
        return "it is not made with object.__new__"
    return None


@functools.cache  # only of classes admitted
def _slots(cls: type) -> dict[str, Any]:
    """The slots of ``cls`` and its bases: name -> the slot's own descriptor (which sets it without code)."""
    return {name: found for c in reversed(cls.__mro__) for name, found in vars(c).items()
            if isinstance(found, types.MemberDescriptorType)}


def _has_dict(cls: type) -> bool:
    return bool(getattr(cls, "__dictoffset__", 0))


def _field_name(name: Any) -> bool:
    return isinstance(name, str) and name.isidentifier() and not name.startswith("__")


# -- the format: a tag byte, then what the tag says follows (little-endian) -----------------------------------------

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_PATHS: dict[str, type] = {"PosixPath": pathlib.PosixPath, "PurePosixPath": pathlib.PurePosixPath}

# None, True, False; int64, a longer int (u32 length, signed bytes), float64, complex (two float64)
NONE, TRUE, FALSE, INT, BIG_INT, FLOAT, COMPLEX = b"N", b"T", b"F", b"i", b"I", b"d", b"c"
# text (u32 length, UTF-8), bytes and bytearray (u32 length, the bytes)
STR, BYTES, BYTEARRAY = b"s", b"b", b"B"
# containers: a u32 count, then the items (a dict's: key, value, key, value...)
LIST, TUPLE, DICT, ORDERED_DICT, SET, FROZENSET = b"l", b"t", b"D", b"O", b"S", b"Z"
# numpy: an array (dtype text, u8 ndim, int64 dims, the raw bytes), a scalar (dtype text, its bytes), a dtype
ARRAY, SCALAR, DTYPE = b"a", b"g", b"y"
# a path (class name text, path text); a class or function ("module:qualname" text); an instance of a data class
# ("module:qualname", u32 count, then name text and value for each field); an enum member ("module:qualname",
# member name); a bound method (its owner's value, the name text); functools.partial (function, args, keywords)
PATH, REF, OBJECT, ENUM, METHOD, PARTIAL = b"p", b"R", b"o", b"E", b"M", b"P"


#: what has been admitted so far, by the modules variable's value (only what is admitted is kept: a stranger's names
#: cannot grow them): (class or function, as a class of instances, variable) -> "module:qualname" for the encoder,
#: ("module:qualname", variable) -> the class or function for the decoder
_SENDABLE: dict[tuple[Any, bool, str | None], str] = {}
_ADMITTED: dict[tuple[str, str | None], Any] = {}


class _Writer:
    """One message's frame, as the parts :func:`encode_message` joins."""

    def __init__(self) -> None:
        self.parts: list[Any] = [bytes((FORMAT,))]

    def text(self, text: str) -> None:
        raw = text.encode("utf-8", "surrogatepass")
        self.parts += (_U32.pack(len(raw)), raw)

    def name(self, obj: Any, instances: bool = False) -> str:
        """``obj``'s "module:qualname", once :func:`_admit_global` admits it (and, with ``instances``, its
        instances can be made): what the decoder will find by that name."""
        key = (obj, instances, os.environ.get(WIRE_MODULES_VARIABLE))
        name = _SENDABLE.get(key)
        if name is None:
            module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if not isinstance(module, str) or not isinstance(qualname, str):
                raise WireError(f"cannot send {obj!r:.80} on the run's channels: it has no module-level name")
            if _admit_global(module, qualname) is not obj:
                raise WireError(f"cannot send {module}.{qualname} on the run's channels: that name finds another "
                                "object there")
            if instances and (why := _unmade(obj)):
                raise WireError(f"cannot send a {module}.{qualname} on the run's channels: {why}")
            name = _SENDABLE[key] = f"{module}:{qualname}"
        return name

    def value(self, obj: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise WireError(f"cannot send a value nested deeper than {MAX_DEPTH} levels (or holding itself) on the "
                            "run's channels")
        write = _WRITERS.get(type(obj))
        if write is not None:
            write(self, obj, depth)
        elif isinstance(obj, enum.Enum):
            cls = type(obj)
            if cls.__members__.get(obj.name) is not obj:
                raise WireError(f"cannot send {obj!r:.80} on the run's channels: it is not one of its enum's members")
            self.parts.append(ENUM)
            self.text(self.name(cls))
            self.text(obj.name)
        elif isinstance(obj, np.generic):
            dtype = self._dtype(obj.dtype)
            self.parts.append(SCALAR)
            self.text(dtype_text(dtype))
            self.parts.append(obj.tobytes())
        elif isinstance(obj, np.dtype):
            self.parts.append(DTYPE)
            self.text(dtype_text(self._dtype(obj)))
        elif isinstance(obj, type):
            self.parts.append(REF)
            self.text(self.name(obj))
        else:
            self._object(obj, depth)

    @staticmethod
    def _dtype(dtype: np.dtype) -> np.dtype:
        if (problem := dtype_problem(dtype)) is not None:
            raise WireError(f"cannot send a numpy value on the run's channels: {problem}")
        return dtype

    def _object(self, obj: Any, depth: int) -> None:
        cls = type(obj)
        name = self.name(cls, instances=True)
        fields = dict(obj.__dict__) if _has_dict(cls) else {}
        for slot, descriptor in _slots(cls).items():
            with contextlib.suppress(AttributeError):  # a slot never set
                fields[slot] = descriptor.__get__(obj, cls)
        for field in fields:
            if not _field_name(field):
                raise WireError(f"cannot send a {cls.__qualname__} on the run's channels: its field {field!r:.60} "
                                "is not a public or private name (no dunder)")
        self.parts.append(OBJECT)
        self.text(name)
        self.parts.append(_U32.pack(len(fields)))
        for field, value in fields.items():
            self.text(field)
            self.value(value, depth + 1)

    def items(self, tag: bytes, items: Any, depth: int) -> None:
        self.parts += (tag, _U32.pack(len(items)))
        for item in items:
            self.value(item, depth + 1)

    def pairs(self, tag: bytes, mapping: Any, depth: int) -> None:
        self.parts += (tag, _U32.pack(len(mapping)))
        for key, item in mapping.items():
            self.value(key, depth + 1)
            self.value(item, depth + 1)


def _write_int(writer: _Writer, obj: int, depth: int) -> None:
    if -(1 << 63) <= obj < 1 << 63:
        writer.parts += (INT, _I64.pack(obj))
    else:
        size = (obj.bit_length() + 8) // 8
        writer.parts += (BIG_INT, _U32.pack(size), obj.to_bytes(size, "little", signed=True))


def _write_str(writer: _Writer, obj: str, depth: int) -> None:
    writer.parts.append(STR)
    writer.text(obj)


def _write_array(writer: _Writer, obj: np.ndarray, depth: int) -> None:
    dtype = writer._dtype(obj.dtype)
    if obj.ndim > peer_input.MAX_DIMS:
        raise WireError(f"cannot send an array of {obj.ndim} dimensions on the run's channels")
    flat = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)  # a view when it is contiguous already
    writer.parts.append(ARRAY)
    writer.text(dtype_text(dtype))
    writer.parts += (bytes((obj.ndim,)), struct.pack(f"<{obj.ndim}q", *obj.shape), memoryview(flat))


def _write_path(writer: _Writer, obj: pathlib.PurePath, depth: int) -> None:
    writer.parts.append(PATH)
    writer.text(type(obj).__name__)
    writer.text(str(obj))


def _write_function(writer: _Writer, obj: types.FunctionType, depth: int) -> None:
    writer.parts.append(REF)
    writer.text(writer.name(obj))


def _write_method(writer: _Writer, obj: types.MethodType, depth: int) -> None:
    name = getattr(obj.__func__, "__name__", "")
    try:
        same = _method(obj.__self__, name).__func__ is obj.__func__
    except WireError:
        same = False
    if not same:
        raise WireError(f"cannot send the method {name[:60]} of a {type(obj.__self__).__name__} on the run's "
                        "channels: only public methods of the data classes that travel there")
    writer.parts.append(METHOD)
    writer.value(obj.__self__, depth + 1)
    writer.text(name)


def _write_partial(writer: _Writer, obj: functools.partial, depth: int) -> None:
    if vars(obj):
        raise WireError("cannot send a functools.partial with attributes of its own on the run's channels")
    writer.parts.append(PARTIAL)
    writer.value(obj.func, depth + 1)
    writer.items(TUPLE, obj.args, depth + 1)
    writer.pairs(DICT, obj.keywords, depth + 1)


_WRITERS: dict[type, Any] = {
    type(None): lambda w, obj, depth: w.parts.append(NONE),
    bool: lambda w, obj, depth: w.parts.append(TRUE if obj else FALSE),
    int: _write_int,
    float: lambda w, obj, depth: w.parts.extend((FLOAT, _F64.pack(obj))),
    complex: lambda w, obj, depth: w.parts.extend((COMPLEX, _C128.pack(obj.real, obj.imag))),
    str: _write_str,
    bytes: lambda w, obj, depth: w.parts.extend((BYTES, _U32.pack(len(obj)), obj)),
    bytearray: lambda w, obj, depth: w.parts.extend((BYTEARRAY, _U32.pack(len(obj)), obj)),
    list: lambda w, obj, depth: w.items(LIST, obj, depth),
    tuple: lambda w, obj, depth: w.items(TUPLE, obj, depth),
    set: lambda w, obj, depth: w.items(SET, obj, depth),
    frozenset: lambda w, obj, depth: w.items(FROZENSET, obj, depth),
    dict: lambda w, obj, depth: w.pairs(DICT, obj, depth),
    collections.OrderedDict: lambda w, obj, depth: w.pairs(ORDERED_DICT, obj, depth),
    np.ndarray: _write_array,
    pathlib.PosixPath: _write_path,
    pathlib.PurePosixPath: _write_path,
    types.FunctionType: _write_function,
    types.BuiltinFunctionType: _write_function,
    types.MethodType: _write_method,
    functools.partial: _write_partial,
}


class _Reader:
    """One frame's value, read from a memoryview of it: every length and count checked against what is left
    before anything is made for it, every value's memory counted before it is made (see the section's comment)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.view = memoryview(data).cast("B")
        self.pos = 0
        self.end = len(self.view)
        self.budget = MEMORY_FACTOR * self.end + MEMORY_FLOOR
        self.spent = 0

    def message(self) -> Any:
        if self.end == 0 or self.view[0] != FORMAT:
            first = f"{self.view[0]:#04x}" if self.end else "nothing"
            pickle = " (a pickle: the run's channels never unpickle)" if self.end and self.view[0] == 0x80 else ""
            raise WireError(f"refused a message of another format{pickle}: it begins with {first}, a message of "
                            f"this suite's with {FORMAT:#04x} (is the other side another version of the suite?)")
        self.pos = 1
        value = self.value(0)
        if self.pos != self.end:
            raise WireError(f"refused a message with {self.end - self.pos} bytes after its value")
        return value

    # -- the frame's bytes

    def take(self, size: int) -> memoryview:
        if size > self.end - self.pos:
            raise WireError(f"refused a message that claims {size} bytes at byte {self.pos}, where the frame has "
                            f"{self.end - self.pos} left")
        start = self.pos
        self.pos += size
        return self.view[start:self.pos]

    def unpack(self, form: struct.Struct) -> Any:
        return form.unpack(self.take(form.size))

    def count(self, least: int) -> int:
        """A u32 count of items that take at least ``least`` bytes each: no more than the frame has left."""
        count = self.unpack(_U32)[0]
        if count * least > self.end - self.pos:
            raise WireError(f"refused a message that claims {count} items at byte {self.pos}, where the frame has "
                            f"{self.end - self.pos} bytes left")
        return count

    def charge(self, size: int) -> None:
        """Count ``size`` bytes of memory the values take; WireError past the message's budget."""
        self.spent += size
        if self.spent > self.budget:
            raise WireError(f"refused a message whose values would take over {self.budget} bytes of memory "
                            f"({MEMORY_FACTOR} per byte of its frame of {self.end}, plus {MEMORY_FLOOR})")

    def text(self) -> str:
        size = self.unpack(_U32)[0]
        text = str(self.take(size), "utf-8", "surrogatepass")
        self.charge(sys.getsizeof(text))
        return text

    def shared(self, key: Any) -> Any:
        """``key`` (a dict's key, a field's name), the one copy of it when it is text: a key that repeats (the
        columns of records) takes its memory once."""
        if type(key) is not str:
            return key
        one = sys.intern(key)
        if one is not key:
            self.spent -= sys.getsizeof(key)
        return one

    def named(self) -> Any:
        """The class or function a "module:qualname" text names, admitted (:func:`_admit_global`)."""
        name = self.text()
        key = (name, os.environ.get(WIRE_MODULES_VARIABLE))
        found = _ADMITTED.get(key)
        if found is None:
            module, colon, qualname = name.partition(":")
            if not colon:
                raise WireError(f"refused a message naming {name[:100]!r}, not a module:qualname")
            found = _ADMITTED[key] = _admit_global(module, qualname)
        return found

    def dtype(self) -> np.dtype:
        return peer_input.dtype(self.text(), "the sender")

    # -- values

    def value(self, depth: int) -> Any:
        if self.pos >= self.end:
            raise WireError(f"refused a message that ends inside a value (at byte {self.pos})")
        tag = self.view[self.pos]
        self.pos += 1
        read = _READERS.get(tag)
        if read is None:
            raise WireError(f"refused a message with an unknown tag {tag:#04x} at byte {self.pos - 1}")
        return read(self, depth)

    def inner(self, depth: int) -> int:
        """The depth of a container's items; WireError past MAX_DEPTH."""
        if depth >= MAX_DEPTH:
            raise WireError(f"refused a message nested deeper than {MAX_DEPTH} levels")
        return depth + 1

    def sequence(self, depth: int, per_item: int, fixed: int) -> list[Any]:
        count = self.count(1)
        depth = self.inner(depth)
        self.charge(fixed + per_item * count)
        items = [None] * count
        for i in range(count):
            items[i] = self.value(depth)
        return items

    def pairs(self, depth: int, into: Any, per_item: int) -> Any:
        count = self.count(2)
        depth = self.inner(depth)
        self.charge(sys.getsizeof(into) + per_item * count)
        for _ in range(count):
            key = self.shared(self.value(depth))
            into[key] = self.value(depth)
        return into

    def integer(self, depth: int) -> int:
        size = self.unpack(_U32)[0]
        value = int.from_bytes(self.take(size), "little", signed=True)
        self.charge(sys.getsizeof(value))
        return value

    def array(self, depth: int) -> np.ndarray:
        dtype = self.dtype()
        ndim = self.take(1)[0]
        if ndim > peer_input.MAX_DIMS:
            raise WireError(f"refused a message with an array of {ndim} dimensions (at most {peer_input.MAX_DIMS})")
        shape = peer_input.shape(list(struct.unpack(f"<{ndim}q", self.take(8 * ndim))), "the sender")
        size = peer_input.size(dtype, shape, "the sender", limit=peer_input.MAX_ARRAY_BYTES)
        if size > self.end - self.pos:
            raise WireError(f"refused a message whose array of {shape} {dtype.str} needs {size} bytes at byte "
                            f"{self.pos}, where the frame has {self.end - self.pos} left")
        raw = self.take(size)  # its bytes are in the frame: only then is the array made
        self.charge(size + 128)
        if dtype.kind == "b":  # a bool is 0 or 1, whatever byte was sent
            return (np.frombuffer(raw, np.uint8) != 0).reshape(shape)
        return np.frombuffer(raw, dtype).reshape(shape).copy()

    def scalar(self, depth: int) -> np.generic:
        dtype = self.dtype()
        raw = self.take(dtype.itemsize)
        self.charge(dtype.itemsize + 128)
        if dtype.kind == "b":
            return np.bool_(raw[0] != 0)
        return np.frombuffer(raw, dtype, count=1)[0]

    def path(self, depth: int) -> pathlib.PurePath:
        kind = _PATHS.get(self.text())
        if kind is None:
            raise WireError("refused a message with a path that is not a PosixPath or PurePosixPath")
        path = self.text()
        self.charge(4 * len(path) + 256)
        return kind(path)

    def instance(self, depth: int) -> Any:
        cls = self.named()
        if not isinstance(cls, type) or (why := _unmade(cls)):
            raise WireError(f"refusing to make a {getattr(cls, '__qualname__', type(cls).__name__)} on the run's "
                            f"channels: {why or 'it is not a class'}")
        count = self.count(5)  # a name's length and a value's tag at least
        depth = self.inner(depth)
        self.charge(64 + _DICT_ENTRY * count)  # the instance and its __dict__
        slots = _slots(cls)
        obj = object.__new__(cls)
        fields = object.__getattribute__(obj, "__dict__") if _has_dict(cls) else None  # object's: no code of cls
        for _ in range(count):
            name = self.shared(self.text())
            value = self.value(depth)
            if not _field_name(name):
                raise WireError(f"refusing a field {name[:60]!r} of a {cls.__qualname__}: only public or private "
                                "names (no dunder)")
            if name in slots:
                slots[name].__set__(obj, value)
            elif fields is not None:
                fields[name] = value
            else:
                raise WireError(f"refusing a field {name[:60]!r} of a {cls.__qualname__}: it has no such slot")
        return obj

    def member(self, depth: int) -> enum.Enum:
        cls = self.named()
        name = self.text()
        member = cls.__members__.get(name) if isinstance(cls, enum.EnumMeta) else None
        if member is None:
            raise WireError(f"refused a message naming {name[:60]!r} of {getattr(cls, '__qualname__', '?')}, "
                            "not a member of an enum")
        return member

    def method(self, depth: int) -> Any:
        owner = self.value(self.inner(depth))
        return _method(owner, self.text())

    def partial(self, depth: int) -> functools.partial:
        inner = self.inner(depth)
        func, args, keywords = self.value(inner), self.value(inner), self.value(inner)
        if not callable(func) or not isinstance(args, tuple) or not isinstance(keywords, dict) \
                or not all(isinstance(k, str) for k in keywords):
            raise WireError("refusing a functools.partial that is not a function, a tuple and a dict of keywords")
        self.charge(256)
        return functools.partial(func, *args, **keywords)


#: what each container's items take in memory, at most: a list's pointer; a dict's or set's entry with its share of
#: the table, and of the table it leaves as it grows
_LIST_ITEM, _DICT_ENTRY, _SET_ENTRY = 8, 80, 64


def _simple(make: Any) -> Any:
    def read(reader: _Reader, depth: int) -> Any:
        value = make(reader)
        reader.charge(sys.getsizeof(value))
        return value
    return read


_READERS: dict[int, Any] = {
    NONE[0]: lambda r, depth: None,
    TRUE[0]: lambda r, depth: True,
    FALSE[0]: lambda r, depth: False,
    INT[0]: _simple(lambda r: r.unpack(_I64)[0]),
    BIG_INT[0]: _Reader.integer,
    FLOAT[0]: _simple(lambda r: r.unpack(_F64)[0]),
    COMPLEX[0]: _simple(lambda r: complex(*r.unpack(_C128))),
    STR[0]: lambda r, depth: r.text(),
    BYTES[0]: _simple(lambda r: bytes(r.take(r.unpack(_U32)[0]))),
    BYTEARRAY[0]: _simple(lambda r: bytearray(r.take(r.unpack(_U32)[0]))),
    LIST[0]: lambda r, depth: r.sequence(depth, _LIST_ITEM, 56),
    TUPLE[0]: lambda r, depth: tuple(r.sequence(depth, 2 * _LIST_ITEM, 96)),
    SET[0]: lambda r, depth: set(r.sequence(depth, _LIST_ITEM + _SET_ENTRY, 272)),
    FROZENSET[0]: lambda r, depth: frozenset(r.sequence(depth, _LIST_ITEM + _SET_ENTRY, 272)),
    DICT[0]: lambda r, depth: r.pairs(depth, {}, _DICT_ENTRY),
    ORDERED_DICT[0]: lambda r, depth: r.pairs(depth, collections.OrderedDict(), 2 * _DICT_ENTRY),
    ARRAY[0]: _Reader.array,
    SCALAR[0]: _Reader.scalar,
    DTYPE[0]: lambda r, depth: r.dtype(),
    PATH[0]: _Reader.path,
    REF[0]: lambda r, depth: r.named(),
    OBJECT[0]: _Reader.instance,
    ENUM[0]: _Reader.member,
    METHOD[0]: _Reader.method,
    PARTIAL[0]: _Reader.partial,
}


def socket_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel send/receive timeouts on a blocking socket (0: none); a Connection over it then cannot hang."""
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
