"""The ranks of a run, how they reach the coordinator, and what they tell it.

A *run* is a list of :class:`RankSpec`: what each rank runs (a picklable callable
``job(ctx) -> result``), a name for messages (``sender``, ``ps 1``), the server (host) it
belongs to, and whether it is a service that runs until it is stopped (a
``tf.distribute.Server``). A :class:`Launcher` starts the ranks its own way (processes here,
in network namespaces, under ``mpirun``) and hands every rank the run's :class:`Cluster`: one
address per rank and the run's token.

Every launcher then uses the same *hub*: the coordinator listens on one socket (a Unix socket in
a private directory when every rank runs on this machine, TCP on the bind address under MPI).
A rank connects, both sides prove they know the run's token (an HMAC challenge each way, before
anything is read; a stranger is logged with its address and dropped), the rank says which
rank it is and receives its :class:`Assignment`. Every message is data, never code (see "the wire" below:
a restricted decoder, bounded frames, types checked). From then on they exchange typed messages:
reports (progress, measurements), relayed messages between ranks, and at the end the rank's
result and its peak memory, or its error. The connection is also how each side learns that the
other is gone: a rank whose coordinator vanished exits at once, and a rank whose connection ends
before its result is reported as dead, by name. A run also ends, naming the ranks that have not
finished, when no rank has said anything for ``timeout_s``; every rank's process sends a heartbeat
meanwhile (which is not progress), so the one that stopped answering (stopped, or stuck holding
Python's lock) is named as the silent one, not the healthy ranks waiting on it.

When several ranks fail, one is the cause: a rank that died (its process ended without a word) before
any that failed, and of several deaths the one that came first (:func:`_died_first`);
then the first failure that is the rank's own, not a peer's that vanished or a wait that ran out; the others
follow it in the message ("; then ...").
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import importlib
import importlib.util
import inspect
import io
import logging
import os
import pathlib
import pickle
import queue
import secrets
import socket
import struct
import sys
import threading
import time
import traceback
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError, Pipe
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from pathlib import Path
from typing import Any, ClassVar

from bench.ground.memory import peak_rss_mb, reset_peak_rss
from transports import Cluster
from transports.common import Availability

log = logging.getLogger(__name__)

#: overrides the token a run generates (every rank of a run must use the same one)
TOKEN_VARIABLE = "TENSOR_BENCH_TOKEN"
#: seconds a connecting peer gets to prove it knows the token and say who it is
HANDSHAKE_S = 20.0
#: how often the coordinator looks at its ranks' processes while nothing is said
_POLL_S = 0.2
#: seconds services get to report their peak memory once the others are done
_STOP_GRACE_S = 30.0
#: seconds a rank's failure waits for another rank's death to show, which would be its cause
CAUSE_GRACE_S = 3.0
#: seconds between a rank process's heartbeats
HEARTBEAT_S = 1.0
#: characters of a rank's error the coordinator keeps
_ERROR_CHARS = 20_000
#: the most a caller's first message (its Hello) may hold
_HELLO_BYTES = 4096


class LaunchError(RuntimeError):
    """A run could not start or did not end well; the message names the rank and what to do."""


class RankFailed(LaunchError):
    """A rank failed (its job raised), died (its process ended first) or the run fell silent."""

    def __init__(self, rank: int, name: str, message: str, kind: str = "failed") -> None:
        super().__init__(f"rank {rank} ({name}) {message}")
        self.rank = rank
        self.name = name
        self.kind = kind
        self.waited = False  # a failure that followed from another rank's (see Failed)

    def with_log(self, tail: str) -> RankFailed:
        """The same failure, ending with the end of the rank's log."""
        if not tail:
            return self
        failed = RankFailed(self.rank, self.name, "", self.kind)
        failed.args = (f"{self}\n--- the end of rank {self.rank}'s log ---\n{tail}",)
        return failed


def run_token() -> str:
    """The run's token: ``TENSOR_BENCH_TOKEN`` when set, else a fresh random one."""
    return os.environ.get(TOKEN_VARIABLE) or secrets.token_hex(16)


@dataclass(frozen=True)
class RankSpec:
    """What one rank runs: ``job(ctx)`` in the rank's process; its result goes to the coordinator."""

    job: Callable[[RankContext], Any]
    name: str
    #: the server this rank belongs to: ranks of one server share an emulated host (netns)
    host: int = 0
    #: runs until stopped; the run ends when every other rank has finished
    service: bool = False


@dataclass(frozen=True)
class RankResult:
    """What one rank returned, and its process's peak resident memory over the run."""

    rank: int
    name: str
    result: Any
    peak_rss_mb: float


# -- messages on the hub --------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """rank -> coordinator, first: which rank is calling."""

    rank: int


@dataclass(frozen=True)
class Assignment:
    """coordinator -> rank: what to run, and the cluster it runs in."""

    rank: int
    spec: RankSpec
    cluster: Cluster
    #: the rank's network interface whose byte counters tell the traffic on its link (netns), if any
    link_interface: str | None = None


@dataclass(frozen=True)
class Report:
    """rank -> coordinator: a typed payload of the experiment's (progress, a measurement)."""

    payload: Any


@dataclass(frozen=True)
class Relay:
    """rank -> coordinator -> rank ``dst``: a payload for another rank (a ready signal)."""

    src: int
    dst: int
    payload: Any


@dataclass(frozen=True)
class Confirm:
    """A relayed payload whose arrival the receiving rank's hub thread confirms at once (:class:`Confirmed`),
    whatever its job is doing (:meth:`RankContext.tell`)."""

    payload: Any
    ticket: int


@dataclass(frozen=True)
class Confirmed:
    """The answer to :class:`Confirm`: ``ticket``'s payload is in this rank's inbox."""

    ticket: int


@dataclass(frozen=True)
class Finished:
    """rank -> coordinator, last: the job's result and the process's peak memory."""

    result: Any
    peak_rss_mb: float


@dataclass(frozen=True)
class Failed:
    """rank -> coordinator, last: the job raised.

    ``waited``: the error is a consequence of another rank (a peer that vanished or refused, a wait that ran
    out), so another rank's own failure, if there is one, is the cause.
    """

    error: str
    waited: bool = False


@dataclass(frozen=True)
class Alive:
    """rank -> coordinator, every HEARTBEAT_S: the rank's process is running (not progress)."""


@dataclass(frozen=True)
class Stop:
    """coordinator -> service rank: report your peak memory and exit."""


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
           "bench.launch.base.wire_value")
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


# -- process helpers --------------------------------------------------------------------------


def waited_on_others(exc: BaseException) -> bool:
    """Whether a job's error is a consequence of another rank: a peer that failed, vanished or timed out."""
    from transports import PeerError, TransportClosed, TransportTimeout

    return isinstance(exc, PeerError | TransportTimeout | TransportClosed | TimeoutError) or (
        isinstance(exc, LaunchError) and not isinstance(exc, RankFailed))


def describe_error(exc: BaseException) -> str:
    """``Type: message (at file:line)`` of the innermost frame."""
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel send/receive timeouts on a blocking socket (0: none); a Connection over it then cannot hang."""
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


# -- the rank's side ----------------------------------------------------------------------------


def connect(address: str | tuple[str, int], token: str) -> Connection:
    """A connection to the coordinator's hub, authenticated both ways with ``token``."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(address)
            _timeouts(sock, HANDSHAKE_S)
            conn = Connection(os.dup(sock.fileno()))  # socket options belong to the socket, shared by the dup
            answer_challenge(conn, token.encode())
            deliver_challenge(conn, token.encode())
            _timeouts(sock, 0)
        except (OSError, EOFError, AuthenticationError) as exc:
            raise LaunchError(f"cannot join the run's coordinator at {address}: {exc}; is it running, "
                              f"and do both use the same {TOKEN_VARIABLE}?") from None
    return conn


class RankContext:
    """What a rank's job sees of the run: who it is, the cluster, and its line to the coordinator."""

    def __init__(self, conn: Connection, assignment: Assignment) -> None:
        self.rank = assignment.rank
        self.name = assignment.spec.name
        self.host = assignment.spec.host
        self.cluster = assignment.cluster
        self.size = assignment.cluster.size
        self.link_interface = assignment.link_interface
        self._conn = conn
        self._send_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._unconfirmed: dict[int, set[int]] = {}  # ticket -> the ranks that have not confirmed it yet
        self._confirmations = threading.Condition()
        self._tickets = 0

    def report(self, payload: Any) -> None:
        """Send a typed payload to the coordinator (it reaches the experiment's ``on_report``)."""
        self._send(Report(payload))

    def send_to(self, rank: int, payload: Any) -> None:
        """Send a payload to another rank of the run (through the coordinator)."""
        self._send(Relay(self.rank, rank, payload))

    def tell(self, ranks: list[int], payload: Any, timeout: float) -> None:
        """Send ``payload`` to each of ``ranks`` and return once it is in every one's inbox (their :meth:`poll` or
        :meth:`receive` then has it): what a rank does after this, the others know of before they next look.
        Their hub threads confirm it whatever their jobs are doing. Raises LaunchError naming the ranks that
        did not confirm within ``timeout``."""
        with self._confirmations:
            self._tickets += 1
            ticket = self._tickets
            self._unconfirmed[ticket] = set(ranks)
        for rank in ranks:
            self._send(Relay(self.rank, rank, Confirm(payload, ticket)))
        with self._confirmations:
            done = self._confirmations.wait_for(lambda: not self._unconfirmed[ticket], timeout)
            missing = sorted(self._unconfirmed.pop(ticket))
        if not done:
            raise LaunchError(f"rank {self.rank} ({self.name}): rank(s) {', '.join(map(str, missing))} did not "
                              f"confirm a message within {timeout:g} s")

    def _confirmed(self, ticket: int, rank: int) -> None:
        with self._confirmations:
            self._unconfirmed.get(ticket, set()).discard(rank)
            self._confirmations.notify_all()

    def receive(self, timeout: float | None = None) -> Any:
        """The next payload another rank sent here."""
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise LaunchError(f"rank {self.rank} ({self.name}) heard nothing from the other ranks "
                              f"within {timeout:g} s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def poll(self) -> Any | None:
        """The next payload another rank sent here, or None when none is waiting (never blocks)."""
        try:
            item = self._inbox.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def link_bytes(self) -> tuple[int, int] | None:
        """(tx, rx) bytes so far on this rank's link to the other hosts; None when it has no link of its own."""
        if self.link_interface is None:
            return None
        stats = f"/sys/class/net/{self.link_interface}/statistics"
        with open(f"{stats}/tx_bytes") as tx, open(f"{stats}/rx_bytes") as rx:
            return int(tx.read()), int(rx.read())

    def _send(self, message: Any) -> None:
        with self._send_lock:
            send_message(self._conn, message)


def serve_rank(conn: Connection, rank: int, in_own_process: bool) -> None:
    """A rank's life: say hello, take the assignment, run the job, report how it ended.

    ``in_own_process``: the process exists for this rank alone (local, netns), so it exits as soon
    as the coordinator is gone or asks a service to stop. Under MPI one process serves a rank of
    every run in turn, and the job runs in the calling thread.
    """
    send_message(conn, Hello(rank))
    try:
        assignment = receive_message(conn)
        if not isinstance(assignment, Assignment) or assignment.rank != rank \
                or not isinstance(assignment.spec, RankSpec) or not callable(assignment.spec.job) \
                or not isinstance(assignment.cluster, Cluster):
            raise WireError("the coordinator's first message is not this rank's assignment")
    except WireError as exc:  # said, so that the run names it rather than a death
        with contextlib.suppress(OSError):
            send_message(conn, Failed(describe_error(exc)))
        raise
    ctx = RankContext(conn, assignment)
    done = threading.Event()

    def listen() -> None:
        while True:
            try:
                message = receive_message(conn)
            except (EOFError, OSError, WireError):
                if not done.is_set():
                    if in_own_process:
                        os._exit(3)  # the coordinator is gone: nobody is left to report to
                    ctx._inbox.put(LaunchError(f"rank {rank}: the coordinator closed the run"))
                return
            if isinstance(message, Relay):
                payload = message.payload
                if isinstance(payload, Confirmed):
                    ctx._confirmed(payload.ticket, message.src)
                    continue
                if isinstance(payload, Confirm):
                    ctx._inbox.put(payload.payload)
                    with contextlib.suppress(OSError):
                        ctx._send(Relay(rank, message.src, Confirmed(payload.ticket)))
                    continue
                ctx._inbox.put(payload)
            elif isinstance(message, Stop):
                done.set()
                with contextlib.suppress(OSError):
                    ctx._send(Finished(None, peak_rss_mb()))
                if in_own_process:
                    os._exit(0)
                return

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            try:
                ctx._send(Alive())
            except OSError:
                return

    threading.Thread(target=listen, name=f"rank-{rank}-hub", daemon=True).start()
    threading.Thread(target=beat, name=f"rank-{rank}-heartbeat", daemon=True).start()
    reset_peak_rss()
    try:
        result = assignment.spec.job(ctx)
    except BaseException as exc:  # the coordinator decides what a failure means
        done.set()
        with contextlib.suppress(OSError):
            ctx._send(Failed(describe_error(exc), waited_on_others(exc)))
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return
    done.set()
    ctx._send(Finished(result, peak_rss_mb()))


# -- the coordinator's side ---------------------------------------------------------------------


class Hub:
    """The coordinator's listener: authenticates callers and hands over one connection per rank."""

    def __init__(self, address: str | tuple[str, int], token: str, ranks: int) -> None:
        self._token = token.encode()
        self._ranks = ranks
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind(address)
            self._listener.listen(max(16, ranks))
        except OSError as exc:
            self._listener.close()
            raise LaunchError(f"the coordinator cannot listen on {address}: {exc}") from None
        self.address = self._listener.getsockname()
        self.arrivals: queue.Queue[tuple[int, Connection]] = queue.Queue()
        self._wake_reader, self._wake_writer = Pipe(duplex=False)
        self._closed = False
        self._accepting = threading.Thread(target=self._accept, name="hub-accept", daemon=True)
        self._accepting.start()

    @property
    def wake(self) -> Connection:
        """Readable whenever a rank has arrived (for ``multiprocessing.connection.wait``)."""
        return self._wake_reader

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(sock, peer), name="hub-greet", daemon=True).start()

    def _greet(self, sock: socket.socket, peer: Any) -> None:
        who = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a local process"
        try:
            _timeouts(sock, HANDSHAKE_S)
            conn = Connection(os.dup(sock.fileno()))
            try:
                deliver_challenge(conn, self._token)
                answer_challenge(conn, self._token)
            except (AuthenticationError, EOFError, OSError) as exc:
                log.warning("refused a connection to the run's coordinator from %s: it did not prove it knows "
                            "the run's token (%s)", who, type(exc).__name__)
                conn.close()
                return
            try:
                hello = receive_message(conn, limit=_HELLO_BYTES)
            except WireError as exc:
                log.warning("dropped a connection from %s: %s", who, exc)
                conn.close()
                return
            if not isinstance(hello, Hello) or type(hello.rank) is not int or not 0 <= hello.rank < self._ranks:
                log.warning("dropped a connection from %s: it did not introduce itself as a rank of the run", who)
                conn.close()
                return
            _timeouts(sock, 0)
        except (OSError, EOFError):
            return
        finally:
            sock.close()  # the Connection holds its own descriptor
        self.arrivals.put((hello.rank, conn))
        with contextlib.suppress(OSError):
            self._wake_writer.send_bytes(b"!")

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if isinstance(self.address, str):
            with contextlib.suppress(OSError):
                os.unlink(self.address)
        self._wake_reader.close()
        self._wake_writer.close()


@dataclass
class _RankState:
    spec: RankSpec
    conn: Connection | None = None
    result: RankResult | None = None
    pending: list[Relay] = field(default_factory=list)  # relayed before the rank connected
    heard_at: float | None = None  # time.monotonic() of its last message, heartbeats included
    failure: RankFailed | None = None  # its job raised (the run ends; one failure is named the cause)


def coordinate(hub: Hub, ranks: list[RankSpec], cluster: Cluster, timeout_s: float,
               on_report: Callable[[int, Any], None], exited: Callable[[], dict[int, Any]],
               link_interface: Callable[[RankSpec], str | None] = lambda spec: None,
               startup_s: float = 0.0) -> list[RankResult]:
    """Serve the run's ranks until every non-service rank has finished; returns every rank's result.

    ``exited()`` names the ranks whose process has ended (rank -> how, e.g. "exit code 1", or ``(how, when)``
    with the ``time.monotonic()`` it ended at, where the launcher knows it), as far as the launcher can tell.
    Raises :class:`RankFailed` naming the rank when one fails, dies before its result, or when no rank has
    said anything for ``timeout_s`` (``timeout_s + startup_s`` until the
    first report of the run: start-up, imports and connecting, may take longer than any later silence).
    """
    states = [_RankState(spec) for spec in ranks]
    by_conn: dict[Connection, int] = {}
    silence_s = timeout_s + startup_s
    deadline = time.monotonic() + silence_s
    try:
        while not all(s.result for s in states if not s.spec.service):
            for conn in wait([hub.wake, *by_conn], timeout=_POLL_S):
                if conn is hub.wake:  # a rank that joins has said something too
                    _admit(hub, states, by_conn, cluster, link_interface)
                    deadline = time.monotonic() + silence_s
                    continue
                rank = by_conn[conn]
                try:
                    message = receive_message(conn)
                except WireError as exc:
                    raise RankFailed(rank, states[rank].spec.name, f"sent what the coordinator refuses: {exc}"
                                     ) from None
                except (EOFError, OSError):
                    del by_conn[conn]
                    conn.close()
                    if states[rank].result is None:
                        raise _died_first(rank, states, exited, on_report) from None
                    continue
                if isinstance(message, Report):
                    silence_s = timeout_s  # the run is under way
                if not isinstance(message, Alive):
                    deadline = time.monotonic() + silence_s
                _handle(rank, message, states, on_report)
                if states[rank].failure is not None:
                    raise _root_cause(states[rank].failure, states, exited, on_report) from None
            for rank in _exits(exited):
                if states[rank].result is None and not _has_unread(states[rank]):
                    raise _died_first(rank, states, exited, on_report)
            if time.monotonic() > deadline:
                raise _fell_silent(states, silence_s)
        _stop_services(hub, states, by_conn, cluster, on_report, link_interface)
    finally:
        for conn in list(by_conn):
            conn.close()
    return [s.result for s in states]


def _fell_silent(states: list[_RankState], silence_s: float) -> RankFailed:
    """No progress for ``silence_s``: name the rank whose process stopped answering, else the first still running.

    A rank whose heartbeats stopped too (stopped, or stuck holding Python's lock) is what the others wait on;
    when every process still beats, nobody is at fault alone (a deadlock, or a wait longer than the timeout).
    """
    now = time.monotonic()
    running = [i for i, s in enumerate(states) if s.result is None and not s.spec.service]
    still = ", ".join(f"rank {i} ({states[i].spec.name})" for i in running)
    quiet = [(now - s.heard_at, i) for i, s in enumerate(states)
             if s.result is None and s.heard_at is not None and now - s.heard_at > max(3 * HEARTBEAT_S, silence_s / 2)]
    if quiet:
        age, rank = max(quiet)
        return RankFailed(rank, states[rank].spec.name,
                          f"stopped answering: nothing from its process for {age:.0f} s (stopped, or hung "
                          f"holding Python's lock?), and no rank made progress for {silence_s:g} s "
                          f"(still running: {still})", "silent")
    return RankFailed(running[0], states[running[0]].spec.name,
                      f"did not finish: no rank said anything for {silence_s:g} s (still running: {still})",
                      "silent")


def _root_cause(failed: RankFailed, states: list[_RankState], exited: Callable[[], dict[int, Any]],
                on_report: Callable[[int, Any], None] = lambda rank, payload: None,
                grace_s: float = CAUSE_GRACE_S) -> RankFailed:
    """One failure, one cause: a rank that died, else the first failure that is a rank's own; the rest follow.

    A rank that died is the cause of the others' failures (they fail when their peer is gone). A killed process
    closes its sockets before the kernel reports it dead (its memory, then its files, then its exit), and a big
    process on a busy machine takes a while over it: its peers can fail and say so before it is seen to be
    gone (and a failure that looks like a rank's own, a library's "connection reset", may be one). So every
    failure waits up to ``grace_s`` for a death to show, reading meanwhile what the others say. A rank whose
    process ended after it said it failed (exit code 0) did not die: what it said is read first.
    """
    failures = [failed]
    end = time.monotonic() + grace_s
    while True:
        for state in states:  # what the others said before they went: their failures
            while state.failure is None and state.result is None and _has_unread(state):
                try:
                    _handle(states.index(state), receive_message(state.conn), states, on_report)
                except (EOFError, OSError, WireError):  # its end closed (a connection at its end reads as ready): gone
                    state.conn.close()
                    break
            if state.failure is not None and state.failure not in failures:
                failures.append(state.failure)
        for rank in _exits(exited):
            state = states[rank]
            if rank != failed.rank and state.result is None and state.failure is None and not _has_unread(state):
                died = _died_first(rank, states, exited, on_report)
                named = RankFailed(died.rank, died.name, "", "died")
                named.args = (f"{died}; then {failed}",)
                return named
        if time.monotonic() > end:  # no death showed: the first failure of a rank's own, else the first
            own = [f for f in failures if not f.waited]
            cause = (own or failures)[0]
            then = "".join(f"; then {f}" for f in failures if f is not cause)
            if not then:
                return cause
            named = RankFailed(cause.rank, cause.name, "", cause.kind)
            named.args = (f"{cause}{then}",)
            named.waited = cause.waited
            return named
        time.sleep(0.05)


def _has_unread(state: _RankState) -> bool:
    return state.conn is not None and not state.conn.closed and state.conn.poll()


def _exits(exited: Callable[[], dict[int, Any]]) -> dict[int, tuple[str, float | None]]:
    """``exited()`` as rank -> (how, when): a launcher may give the time.monotonic() its process ended with how
    (``(how, when)``); without it, when is None."""
    out: dict[int, tuple[str, float | None]] = {}
    for rank, said in exited().items():
        if isinstance(said, tuple) and len(said) == 2:
            out[rank] = (str(said[0]), float(said[1]))
        else:
            out[rank] = (str(said), None)
    return out


def _died_first(seen: int, states: list[_RankState], exited: Callable[[], dict[int, Any]],
                on_report: Callable[[int, Any], None] = lambda rank, payload: None,
                grace_s: float = CAUSE_GRACE_S, patience_s: float = 5.0) -> RankFailed:
    """Rank ``seen`` was seen gone: the death that came first, the others following it ("; then ...").

    One death often brings others (TensorFlow's chief crashes once a server it uses is killed), and the second may
    be seen first: a process killed with much memory takes a while to end, and several connections that close
    together are read in rank order. So every death waits ``grace_s`` for the others to show (and up to
    ``patience_s`` for how the first ended, which the launcher may learn after its connection closed), reading
    what the ranks say meanwhile. They are ordered by when each process ended, where the launcher tells it
    (``exited()`` giving ``(how, when)``); else by when each was seen gone (its connection closed, or the launcher
    saw it end), where deaths seen within one poll of each other are told apart by when each was last heard from
    (a rank that still spoke after another fell silent was alive after it)."""
    start = time.monotonic()
    seen_at: dict[int, float] = {seen: start}
    ended_at: dict[int, float] = {}
    hows: dict[int, str] = {}
    while True:
        now = time.monotonic()
        for rank, state in enumerate(states):  # what the others said before they went; their ends
            while rank not in seen_at and state.result is None and _has_unread(state):
                try:
                    _handle(rank, receive_message(state.conn), states, on_report)
                except (EOFError, OSError, WireError):
                    state.conn.close()
                    seen_at[rank] = now
        for rank, (how, when) in _exits(exited).items():
            state = states[rank]
            if state.result is None and (state.failure is None or rank == seen):
                seen_at.setdefault(rank, now)
                hows[rank] = how
                if when is not None:
                    ended_at[rank] = when
        waited = now - start
        if (waited > grace_s and all(r in hows for r in seen_at)) or waited > max(grace_s, patience_s):
            break
        time.sleep(0.05)
    dead = [r for r in seen_at if states[r].result is None and (states[r].failure is None or r == seen)]

    def order(rank: int) -> tuple[float, float, float]:
        if ended_at and all(r in ended_at for r in dead):
            return (ended_at[rank], 0.0, rank)
        heard = states[rank].heard_at
        # seen within one poll of the first seen: as good as together; then the one last heard from first
        together = seen_at[rank] - min(seen_at.values()) <= _POLL_S + 0.05
        return (0.0 if together else seen_at[rank], heard if heard is not None else float("-inf"), rank)

    dead.sort(key=order)
    said = [f"rank {r} ({states[r].spec.name}) died ({hows.get(r, 'its connection to the coordinator closed')})"
            for r in dead]
    first = dead[0]
    named = RankFailed(first, states[first].spec.name, "", "died")
    named.args = ("; then ".join(said),)
    return named


def _admit(hub: Hub, states: list[_RankState], by_conn: dict[Connection, int], cluster: Cluster,
           link_interface: Callable[[RankSpec], str | None]) -> None:
    with contextlib.suppress(OSError):
        while hub.wake.poll():
            hub.wake.recv_bytes()
    while True:
        try:
            rank, conn = hub.arrivals.get_nowait()
        except queue.Empty:
            return
        state = states[rank]
        if state.conn is not None:
            log.warning("dropped a second connection claiming to be rank %d", rank)
            conn.close()
            continue
        state.conn = conn
        by_conn[conn] = rank
        send_message(conn, Assignment(rank, state.spec, cluster, link_interface(state.spec)))
        for relay in state.pending:
            send_message(conn, relay)
        state.pending.clear()


def _handle(rank: int, message: Any, states: list[_RankState], on_report: Callable[[int, Any], None]) -> None:
    state = states[rank]
    state.heard_at = time.monotonic()
    if isinstance(message, Alive):
        return
    if isinstance(message, Report):
        on_report(rank, message.payload)
    elif isinstance(message, Relay):
        if type(message.dst) is not int or not 0 <= message.dst < len(states) or message.src != rank:
            raise RankFailed(rank, state.spec.name, f"sent a message to rank {str(message.dst)[:40]!r} as rank "
                             f"{str(message.src)[:40]!r}, which the coordinator refuses (a run of {len(states)} ranks)")
        target = states[message.dst]
        if target.result is not None:
            return  # it has finished: nobody will read the message
        if target.conn is None:
            target.pending.append(message)
        else:
            # it may be finishing (its result not read yet) or gone (its end of the line reports that): a message
            # it will never read is dropped, and the run goes on to read what it said last
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                send_message(target.conn, message)
    elif isinstance(message, Finished):
        peak = message.peak_rss_mb if isinstance(message.peak_rss_mb, int | float) else float("nan")
        state.result = RankResult(rank, state.spec.name, message.result, float(peak))
    elif isinstance(message, Failed):
        error = message.error if isinstance(message.error, str) else repr(message.error)
        state.failure = RankFailed(rank, state.spec.name, f"failed: {error[:_ERROR_CHARS]}")
        state.failure.waited = message.waited is True
    else:
        raise RankFailed(rank, state.spec.name, f"sent a {type(message).__name__}, which is not a message of a rank")


def _stop_services(hub: Hub, states: list[_RankState], by_conn: dict[Connection, int], cluster: Cluster,
                   on_report: Callable[[int, Any], None], link_interface: Callable[[RankSpec], str | None]) -> None:
    """Ask every service to report its peak memory and exit (also one that connects only now)."""
    services = [i for i, s in enumerate(states) if s.spec.service and s.result is None]
    stopped: set[int] = set()
    end = time.monotonic() + _STOP_GRACE_S
    while any(states[r].result is None for r in services) and time.monotonic() < end:
        for rank in services:
            if states[rank].conn is not None and rank not in stopped:
                stopped.add(rank)
                with contextlib.suppress(OSError):
                    send_message(states[rank].conn, Stop())
        waiting = [states[r].conn for r in services if states[r].conn is not None and states[r].result is None]
        for conn in wait([hub.wake, *waiting], timeout=_POLL_S):
            if conn is hub.wake:
                _admit(hub, states, by_conn, cluster, link_interface)
                continue
            rank = by_conn[conn]
            try:
                _handle(rank, receive_message(conn), states, on_report)
            except WireError as exc:
                raise RankFailed(rank, states[rank].spec.name, f"sent what the coordinator refuses: {exc}") from None
            except (EOFError, OSError):  # gone without a word: its peak memory is unknown
                states[rank].result = RankResult(rank, states[rank].spec.name, None, float("nan"))
            if states[rank].failure is not None:
                raise states[rank].failure
    for rank in services:
        if states[rank].result is None:
            states[rank].result = RankResult(rank, states[rank].spec.name, None, float("nan"))


# -- launchers ------------------------------------------------------------------------------------


class Launcher(ABC):
    """Starts the ranks of runs, one run at a time, and tells how it went."""

    name: ClassVar[str]
    #: whether this process coordinates (writes results); under MPI only rank 0 does
    is_coordinator: ClassVar[bool] = True
    #: whether every host of a run is private: its ranks' listeners out of the host network's reach (netns)
    private_hosts: ClassVar[bool] = False
    #: whether it starts the ranks' processes itself (local, netns), rather than finding them started (mpi)
    starts_processes: ClassVar[bool] = True

    @abstractmethod
    def run(self, ranks: list[RankSpec], timeout_s: float, on_report: Callable[[int, Any], None] | None = None,
            label: str = "run", startup_s: float = 0.0) -> list[RankResult]:
        """Run ``ranks`` to the end: every rank's result (in rank order) on the coordinator, [] elsewhere.

        ``timeout_s``: the longest the ranks may all stay silent, ``startup_s`` more until the run's
        first report. ``label`` names the run's logs.
        Raises :class:`RankFailed` naming the rank when one fails or dies; no process of the run is
        left behind either way.
        """

    @classmethod
    def availability(cls) -> Availability:
        """Whether it can run here, and if not, why, found without starting anything."""
        return Availability(True)

    def fabric_transport(self, requested: str) -> str:
        """The UCX transports the fabric must use under this launcher (netns: tcp, whatever was asked)."""
        return requested

    def describe(self) -> dict[str, Any]:
        """How ranks run, for ``meta.json``."""
        return {"launcher": self.name}

    def close(self) -> None:  # noqa: B027 (most launchers hold nothing across runs)
        """Release what the launcher holds across runs."""

    def end_process(self, status: int) -> None:  # noqa: B027 (a launcher that starts its ranks leaves it be)
        """Called once the command is over and the launcher closed: a launcher whose processes are a job's ends
        this one here with ``status``; the others return."""

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
