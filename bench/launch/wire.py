"""The wire: what the hub's and the job's connections carry (see the section's comment below)."""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import importlib
import importlib.util
import inspect
import io
import os
import pathlib
import pickle
import socket
import struct
import sys
import types
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

from bench.launch.messages import LaunchError

# -- the wire: what the hub's and the job's connections carry -----------------------------------
#
# Every message is one pickle (protocol 5) in one length-prefixed frame of at most MAX_MESSAGE_BYTES, read
# with recv_bytes(maxlength) and loaded by _WireUnpickler, which admits data and nothing that runs on load:
#
# - the types pickle has opcodes for (None, bools, numbers, str, bytes, bytearray, tuples, lists, dicts, sets);
# - numpy arrays, dtypes and scalars (numpy's own reconstructors, wrapped: no object arrays, no allocation
#   beyond what the message holds), complex, pathlib's paths, collections.OrderedDict, functools.partial;
# - from the project's own modules (bench, transports, and this checkout's tests): classes defined there that
#   hold data (dataclasses, enums, plain classes; made with NEWOBJ, their state set as a dict: no __init__, no
#   __post_init__; refused if they define __setstate__, __del__, __reduce__, __new__, __getattr__ or are
#   exceptions: code that would run on load or on collection), and functions
#   that are rank jobs by the project's convention (a parameter
#   named ``ctx``, the RankContext) or that their module marks with :func:`wire_value`; public methods of those
#   data classes (a workload's ``build``, passed bound: ``getattr`` made safe, see :func:`_method`);
# - anything else only when marked with :func:`wire_value` in a module the decoder may import (the project's,
#   or one named in TENSOR_BENCH_WIRE_MODULES).
#
# Everything else is refused with one line naming it (``refusing os.system on the run's channels: ...``). REDUCE
# may call only value constructors (above); BUILD may set the state only of an object made by this message, never
# of a function, class or module it names. So no message runs code on load, and a function that arrives runs
# only where the project calls a job or a workload's function. A user's own workload (bench/runtime/workload.py)
# travels the same way: a dataclass in a module listed in TENSOR_BENCH_WIRE_MODULES (every rank inherits the
# variable), or marked with ``@wire_value``.

#: the most one message may hold (a rank's result or report, an assignment with its workload)
MAX_MESSAGE_BYTES = 1 << 30
#: names the modules, beyond the project's, whose data classes and marked functions may travel (comma-separated)
WIRE_MODULES_VARIABLE = "TENSOR_BENCH_WIRE_MODULES"
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
    """``message`` as the bytes of one frame on the run's channels."""
    return pickle.dumps(message, protocol=5)


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


def decode_message(data: bytes) -> Any:
    """The message in ``data``: data only (see the section's comment), else WireError naming what was refused."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"refused a message over {MAX_MESSAGE_BYTES} bytes (the limit of the run's channels)")
    try:
        return _WireUnpickler(io.BytesIO(data)).load()
    except WireError:
        raise
    except RecursionError:
        raise WireError("refused a message: nested too deep") from None
    except MemoryError:
        raise WireError("refused a message: it would not fit in memory") from None
    except Exception as exc:  # whatever the bytes are: one line
        text = " ".join(str(exc).split())[:200]
        raise WireError(f"refused a message that is not one of the run's ({type(exc).__name__}: {text})") from None


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


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
    """numpy's ``_reconstruct`` for what numpy's pickles make: an empty ndarray its BUILD then fills."""
    import numpy as np

    if subtype is not _NDARRAY or tuple(shape) != (0,):
        raise WireError("refusing numpy's _reconstruct of anything but an empty ndarray")
    return np.ndarray.__new__(np.ndarray, (0,), np.dtype(dtype))


def _frombuffer(buffer: Any, dtype: Any, shape: Any, order: Any) -> Any:
    import numpy as np

    if not isinstance(buffer, bytes | bytearray) or not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise WireError("refusing numpy's _frombuffer of anything but bytes of plain values")
    return np.frombuffer(buffer, dtype).reshape(shape, order=order)


def _scalar(dtype: Any, data: Any = None) -> Any:
    import numpy as np

    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
        raise WireError("refusing a numpy scalar of anything but bytes of a plain dtype")
    return np.frombuffer(data, dtype, count=1)[0] if dtype.itemsize else np.zeros((), dtype)[()]


def _rebuild_partial(func: Any, args: Any, keywords: Any) -> Any:
    """How ``multiprocessing.reduction`` pickles a ``functools.partial`` once it is imported (copyreg)."""
    if not isinstance(args, tuple) or not isinstance(keywords, dict) or not all(isinstance(k, str) for k in keywords):
        raise WireError("refusing a functools.partial whose arguments are not a tuple and a dict")
    return functools.partial(func, *args, **keywords)


def _method(owner: Any, name: Any) -> Any:
    """``getattr`` as a pickle of a method uses it (``owner.name``), for one value only: a method of a data class
    the message may name (an instance's, or a class's classmethod), found without running anything.

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


def _dtype(obj: Any, align: Any = False, copy: Any = True) -> Any:
    """``numpy.dtype``, always a copy of its own (BUILD then sets its state: never a dtype numpy shares)."""
    import numpy as np

    return np.dtype(obj, bool(align), True)


class _NdarrayName:
    """``numpy.ndarray`` as a message names it: an argument of ``_reconstruct``, not a class to call."""


_NDARRAY = _NdarrayName()

#: (module, name) -> what a message may name outside the project's modules; callables among them construct values
_ADMITTED: dict[tuple[str, str], Any] = {
    ("builtins", "complex"): complex,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "getattr"): _method,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("functools", "partial"): functools.partial,
    ("multiprocessing.reduction", "_rebuild_partial"): _rebuild_partial,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "Path"): pathlib.Path,
    **{(module, "_reconstruct"): _reconstruct for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(module, "_frombuffer"): _frombuffer for module in ("numpy.core.numeric", "numpy._core.numeric")},
    **{(module, "scalar"): _scalar for module in ("numpy.core.multiarray", "numpy._core.multiarray")},
    ("numpy", "dtype"): _dtype,
    ("numpy", "ndarray"): _NDARRAY,
}
_CONSTRUCTORS = {id(v) for v in _ADMITTED.values() if callable(v)}


def _own_setstate(cls: type) -> bool:
    """Whether instances of ``cls`` set their state with code of their own (dataclasses' slots helper excepted)."""
    setstate = getattr(cls, "__setstate__", None)
    return setstate is not None and getattr(setstate, "__qualname__", "") != "_dataclass_setstate"


#: what a class may not define to travel unmarked: code that would run on load, on collection or when it is used
#: as a key (a plain class of the project's, made with object.__new__ and its __dict__ set, runs none of its own)
_HOOKS = ("__del__", "__reduce__", "__reduce_ex__", "__getattr__", "__getattribute__", "__new__",
          "__init_subclass__", "__class_getitem__")


def _hooks(cls: type) -> list[str]:
    """The hooks of :data:`_HOOKS` that ``cls`` or a base other than ``object`` defines (enums' own excepted)."""
    if issubclass(cls, BaseException):
        return ["an exception"]
    bases = [c for c in cls.__mro__ if c is not object and not (issubclass(cls, enum.Enum) and c.__module__ == "enum")]
    return [hook for hook in _HOOKS for c in bases if hook in vars(c)]


def _admit_global(module: str, name: str) -> Any:
    """What a message may name as ``module.name``, or WireError (one line) naming it."""
    where = f"{module}.{name}"
    if (module, name) in _ADMITTED:
        return _ADMITTED[(module, name)]
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
    if isinstance(obj, type):
        if marked or (not _own_setstate(obj) and not _hooks(obj)):
            return obj
    elif isinstance(obj, types.FunctionType):
        with contextlib.suppress(TypeError, ValueError):
            if marked or "ctx" in inspect.signature(obj).parameters:
                return obj
    raise WireError(f"refusing {where} on the run's channels: {fix}")


class _WireUnpickler(pickle._Unpickler):  # the Python one: its reads are bounded by what the frame holds
    """Loads data only (see the section's comment)."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._fresh: set[int] = set()  # objects made by this message: the only ones BUILD may fill

    def find_class(self, module: str, name: str) -> Any:
        return _admit_global(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise WireError("refusing a persistent id on the run's channels")

    def _made(self, obj: Any) -> Any:
        if not isinstance(obj, enum.Enum):  # an enum's member is the class's own, shared
            self._fresh.add(id(obj))
        return obj

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        constructor = id(func) in _CONSTRUCTORS or isinstance(func, enum.EnumMeta)
        if not constructor or not isinstance(args, tuple):
            raise WireError(f"refusing a call of {getattr(func, '__qualname__', type(func).__name__)} on the run's "
                            "channels: only values are made there")
        self.stack[-1] = self._made(func(*args))

    dispatch[pickle.REDUCE[0]] = load_reduce

    def _new(self, cls: Any, args: Any, kwargs: Any) -> None:
        data_class = isinstance(cls, type) and (not _hooks(cls) or vars(cls).get(_WIRE_MARK, False))
        if not isinstance(cls, type) or isinstance(cls, enum.EnumMeta) or not isinstance(args, tuple) \
                or not isinstance(kwargs, dict) or (id(cls) not in _CONSTRUCTORS and (
                    not data_class or cls.__new__ is not object.__new__)):
            raise WireError(f"refusing to make a {getattr(cls, '__qualname__', type(cls).__name__)} on the run's "
                            "channels")
        self.append(self._made(cls.__new__(cls, *args, **kwargs)))

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self._new(self.stack.pop(), args, {})

    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self._new(self.stack.pop(), args, kwargs)

    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def load_build(self) -> None:
        state = self.stack[-1]
        inst = self.stack[-2]
        if id(inst) not in self._fresh or isinstance(inst, type | types.FunctionType | types.MethodType
                                                      | types.ModuleType):
            raise WireError(f"refusing to change a {type(inst).__name__} the message did not make")
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict) and any(not isinstance(k, str) or k.startswith("__") for k in part):
                raise WireError(f"refusing a state of {type(inst).__name__} that names a special attribute")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def _refuse(self) -> None:
        raise WireError("refusing an opcode of old pickles (INST, OBJ, EXT) on the run's channels")

    for _code in (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_code[0]] = _refuse
    del _code


def socket_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel send/receive timeouts on a blocking socket (0: none); a Connection over it then cannot hang."""
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


