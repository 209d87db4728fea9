"""The tensor rendezvous interface every transport implements.

A transport moves numpy arrays between the ranks of a cluster. Tensors are
matched by a :class:`Key` (name, step, source rank, destination rank), in
whichever order the sender and the receiver arrive, as TensorFlow's
rendezvous does. Each transport keeps a :class:`Ledger` of the payload bytes
it copies in user space, so that experiments report copies, not just time.

Tensors of any framework go in (NumPy, or anything with ``__dlpack__`` or ``__cuda_array_interface__``: TensorFlow,
PyTorch, JAX, CuPy) over their own memory, without a copy (``transports/tensors.py``). *Device to device*: a
transport that moves device memory itself (:attr:`Transport.device_memory`: zerocopy, rdma_cp and grpc_rdma's direct
mode, where the fabric registers GPU memory) puts a tensor planned on a device at both ends from the sender's GPU
into the receiver's (:meth:`Transport.moves_device`). *Staging*: every other transfer of a device tensor (on the
other transports, a side planned in host memory, a tensor without a planned shape) is copied to host memory before
it is sent and to the device its plan names (``TensorSpec.dst_memory``) after it arrives, as TensorFlow's GPU
RecvTensor does over gRPC; the ledger counts each crossing of the bus apart from host copies.
"""

from __future__ import annotations

import os
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, as_completed
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NamedTuple

import numpy as np

from transports.common import Availability
from transports.dtypes import PLAIN_DTYPES, dtype_problem
from transports.ledger import Ledger, TransportStats
from transports.memory import Memory
from transports.placement import Placement, TensorSpec
from transports.ports import free_port
from transports.tensors import adopt, ready, to_device, to_host

DEFAULT_TIMEOUT_S = 120.0
#: the longest tensor name a key may carry, in bytes of UTF-8 (grpc_rdma's message field holds this many)
MAX_NAME_BYTES = 512
#: steps are signed 64-bit on the wire (protobuf int64, the grpc_rdma record): 0 <= step <= MAX_STEP
MAX_STEP = 2**63 - 1


def memory_bytes() -> int:
    """The bytes of memory this process's host gives it: physical memory, or its cgroup's limit when lower.

    What a rank can hold, the one bound every transport puts on what a peer may make it allocate: a tensor
    it is asked to place or receive beyond this is refused before any allocation (the kernel's overcommit
    would grant the mapping and kill the process when it is touched).
    """
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 1 << 40
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as limit:
                text = limit.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


class TransportError(RuntimeError):
    """A transfer failed; the message names the key or the peer involved."""


class TransportClosed(TransportError):
    """The transport was closed while an operation was waiting on it."""


class PeerError(TransportError):
    """A peer failed, vanished or answered with something we cannot accept."""


class TransportTimeout(TransportError, TimeoutError):
    """An operation did not complete within its timeout."""


class Key(NamedTuple):
    """Identifies one transfer: tensor ``name`` at ``step`` from rank ``src`` to rank ``dst``."""

    name: str
    step: int
    src: int
    dst: int

    def __str__(self) -> str:
        return f"{self.name}@{self.step} ({self.src}->{self.dst})"


def new_token() -> str:
    """A fresh random secret for one run (128 bits, hex)."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class Cluster:
    """The address (``host:port``) of every rank and the run's secret ``token``.

    Rank ``i`` listens on ``addresses[i]`` and refuses every call that does not
    carry ``token`` (``transports/auth.py``), so all ranks of a run must be given
    the same Cluster. The token is random unless given; it is left out of
    ``repr`` so that it never lands in logs or results.
    """

    addresses: tuple[str, ...]
    token: str = field(default_factory=new_token, repr=False)

    def __post_init__(self) -> None:
        # the token travels as gRPC metadata; the errors never show it
        if not isinstance(self.token, str) or not self.token:
            raise ValueError("Cluster token must be a non-empty string; leave it out to get a random one")
        if not all("!" <= c <= "~" for c in self.token):
            raise ValueError(
                f"Cluster token ({len(self.token)} characters) must be printable ASCII without spaces, "
                "since it travels as gRPC metadata; use e.g. secrets.token_hex(16)"
            )

    @property
    def size(self) -> int:
        return len(self.addresses)

    @classmethod
    def on_loopback(cls, n: int, host: str = "127.0.0.1", *, token: str | None = None) -> Cluster:
        """``n`` ranks on this machine, each on a port the kernel had free; a fresh token unless one is given."""
        addresses = tuple(f"{host}:{free_port(host)}" for _ in range(n))
        return cls(addresses) if token is None else cls(addresses, token)


#: keys a message names before it counts the rest
KEYS_NAMED = 5


class Outbound:
    """A persistent send (:meth:`Transport.outbound`): one tensor's sends from ``src`` to ``dst``, set up once, as
    MPI's ``Send_init``. ``send(step, array)`` is ``link.send(Key(name, step, src, dst), array)``; a transport with a
    faster way for its planned tensors gives its own (zerocopy: one call into the fabric per transfer, the checks
    made once per array). Used by one thread at a time."""

    __slots__ = ("dst", "link", "name", "src")

    def __init__(self, link: Any, name: str, src: int, dst: int) -> None:
        self.link, self.name, self.src, self.dst = link, name, src, dst

    def send(self, step: int, array: np.ndarray, timeout: float | None = None) -> None:
        """Send ``array`` as transfer ``step`` and wait until it may be reused (as :meth:`Transport.send`)."""
        key = Key(self.name, step, self.src, self.dst)
        if timeout is None:
            self.link.send(key, array)
        else:
            self.link.send(key, array, timeout)


class Inbound:
    """A persistent receive (:meth:`Transport.inbound`): one tensor's receives at ``dst`` from ``src``, set up once,
    as MPI's ``Recv_init``; see :class:`Outbound`."""

    __slots__ = ("dst", "link", "name", "src")

    def __init__(self, link: Any, name: str, src: int, dst: int) -> None:
        self.link, self.name, self.src, self.dst = link, name, src, dst

    def recv(self, step: int, timeout: float | None = None) -> np.ndarray:
        """Transfer ``step`` of the tensor (as :meth:`Transport.recv`: valid until the next receive of it)."""
        key = Key(self.name, step, self.src, self.dst)
        return self.link.recv(key) if timeout is None else self.link.recv(key, timeout)


class StagedOutbound(Outbound):
    """The persistent send of a tensor planned in device memory over a transport that moves host memory: each send
    copies the device tensor into one host buffer (where the transport's placement puts a tensor it sends: its
    registered pool on the fabric), counted, then sends that through the transport's own persistent send."""

    __slots__ = ("_host", "_inner", "_ledger")

    def __init__(self, inner: Outbound, host: np.ndarray, ledger: Ledger) -> None:
        super().__init__(inner.link, inner.name, inner.src, inner.dst)
        self._inner, self._host, self._ledger = inner, host, ledger

    def send(self, step: int, array: Any, timeout: float | None = None) -> None:
        if type(array) is not np.ndarray:
            array = adopt(array)
            if type(array) is not np.ndarray:
                host = self._host
                if array.shape == host.shape and array.dtype == host.dtype:
                    array = to_host(array, self._ledger, out=host)
        self._inner.send(step, array, timeout)


class StagedInbound(Inbound):
    """The persistent receive of a tensor planned in device memory over a transport that moves host memory: each
    tensor received into host memory is copied to its device, counted (:class:`StagedOutbound`'s mirror), into memory
    of its own, as TensorFlow's GPU receive allocates its output (and as :meth:`Transport.recv` stages: a device
    buffer reused would be overwritten under kernels still reading the last transfer)."""

    __slots__ = ("_inner", "_ledger", "_memory")

    def __init__(self, inner: Inbound, memory: Memory, ledger: Ledger) -> None:
        super().__init__(inner.link, inner.name, inner.src, inner.dst)
        self._inner, self._memory, self._ledger = inner, memory, ledger

    def recv(self, step: int, timeout: float | None = None) -> Any:
        array = self._inner.recv(step, timeout)
        if type(array) is not np.ndarray:  # on the device already (the transport's recv staged it)
            return array
        return to_device(array, self._memory, self._ledger)


def keys_text(keys: Iterable[Key]) -> str:
    """The keys a message names: the first :data:`KEYS_NAMED` of them, then how many more."""
    keys = list(keys)
    named = ", ".join(str(key) for key in keys[:KEYS_NAMED])
    return named + (f" and {len(keys) - KEYS_NAMED} more" if len(keys) > KEYS_NAMED else "")


class Transport(ABC):
    """Moves tensors between the ranks of a cluster.

    Lifecycle: construct with options, :meth:`start` once, optionally ``placement.plan``, then any number
    of :meth:`send` / :meth:`recv`, then :meth:`close`. Where tensors live (the plan, memory for sends,
    registration) is the transport's :attr:`placement` (``transports/placement.py``), an optional part
    beside this core. A sent array must not be modified until its send has completed (the future returned
    by :meth:`send_async` is done). Received arrays belong to the caller; they may be read-only views of
    transport buffers.
    """

    name: ClassVar[str]
    #: True when sender and receiver must live in one process (the ``local`` reference).
    same_process_only: ClassVar[bool] = False
    #: True when the transport runs on the RDMA fabric and takes ``fabric_transport`` and friends
    uses_fabric: ClassVar[bool] = False
    #: True when the transport moves device memory itself; False: it stages device memory through host memory (see
    #: the module's docstring)
    device_memory: ClassVar[bool] = False
    #: True when a send completes on threads of the transport's own (gRPC's event loop, a poller that serves the
    #: receiver's requests), after :meth:`send` returned: a caller that then waits by spinning in Python holds the
    #: GIL they need and the core they could run on, so it should block (``bench micro``'s sender naps)
    completes_on_threads: ClassVar[bool] = False

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.ledger = Ledger()
        self.cluster: Cluster | None = None
        self.rank = -1
        #: where its tensors live (see transports/placement.py); a transport that places them replaces it
        self.placement = Placement()

    @classmethod
    def availability(cls) -> Availability:
        """Whether this transport can run here; the reason when it cannot."""
        return Availability(True)

    @classmethod
    def modes(cls) -> dict[str, dict[str, Any]]:
        """Named option sets a user can pick as ``<name>:<mode>`` (e.g. ``grpc_rdma:direct``)."""
        return {}

    @classmethod
    def variants(cls) -> dict[str, dict[str, Any]]:
        """Option sets worth testing separately (label -> constructor options), e.g. per fabric."""
        return {"": {}}

    @abstractmethod
    def start(self, cluster: Cluster, rank: int) -> None:
        """Join ``cluster`` as ``rank``: listen on its address and get ready to reach peers."""

    @abstractmethod
    def close(self) -> None:
        """Release everything; waiting operations fail with :class:`TransportClosed`."""

    #: modes left out of the runs that take every transport by default (``bench micro``): asked for by name only
    optional_modes: ClassVar[tuple[str, ...]] = ()
    def send_async(self, key: Key, array: Any) -> Future:
        """Offer ``array`` under ``key``; the future is done once the transport no longer reads ``array``.

        The array is taken in and checked here (:meth:`_check_outgoing`), then the transport's :meth:`_start_send`
        runs."""
        return self._start_send(key, self._check_outgoing(key, array))

    def recv_async(self, key: Key) -> Future:
        """Ask for the tensor under ``key``; the future's result is the received array (on the device its plan
        names, staged there: see the module's docstring).

        The key is checked here (:meth:`_check_key`), then the transport's :meth:`_start_recv` runs."""
        self._check_key(key, "recv")
        future = self._start_recv(key)
        if not self.placement.device_receives:
            return future
        staged: Future = Future()

        def deliver(done: Future) -> None:
            try:
                staged.set_result(self._delivered(key, done.result()))
            except BaseException as exc:  # the receive's failure, or the copy's, is the staged future's
                staged.set_exception(exc)

        future.add_done_callback(deliver)
        return staged

    @abstractmethod
    def _start_recv(self, key: Key) -> Future:
        """The transport's receive of a checked key (see :meth:`recv_async`)."""

    def send(self, key: Key, array: Any, timeout: float | None = None) -> None:
        """Send and wait until ``array`` may be reused (taken in and checked as :meth:`send_async` does)."""
        self._send_and_wait(key, self._check_outgoing(key, array), timeout)

    @abstractmethod
    def _start_send(self, key: Key, array: np.ndarray) -> Future:
        """The transport's send of a checked array (see :meth:`send_async`)."""

    def _send_and_wait(self, key: Key, array: np.ndarray, timeout: float | None) -> None:
        """The transport's send of a checked array, waiting until it may be reused: :meth:`_start_send`, then
        wait; a transport with a faster way when the caller waits anyway overrides it."""
        self._wait(self._start_send(key, array), key, "send", timeout)

    def recv(self, key: Key, timeout: float | None = None) -> np.ndarray:
        """Receive the tensor under ``key``, waiting at most ``timeout`` seconds (checked as :meth:`recv_async`
        checks)."""
        self._check_key(key, "recv")
        array = self._recv_and_wait(key, timeout)
        return self._delivered(key, array) if self.placement.device_receives else array

    def _delivered(self, key: Key, array: np.ndarray) -> Any:
        """A received ``array`` where its plan puts it: a host array of a tensor planned in device memory at this
        rank copied to that device (counted), else itself."""
        if type(array) is not np.ndarray:  # on its device already (moved there, or staged by the transport)
            return array
        spec = self.placement.spec(key.name, key.src, key.dst)
        if spec is None or not spec.dst_memory.is_device:
            return array
        return to_device(array, spec.dst_memory, self.ledger)

    def moves_device(self, spec: TensorSpec | None) -> bool:
        """Whether the planned transfer ``spec`` goes from device memory into device memory with no stop in host
        memory: both its sides planned on a device, its shape known (a static transfer) and this transport moving
        device memory itself (:attr:`device_memory`). Every other transfer of a device tensor is staged through host
        memory (see the module's docstring), counted."""
        return (self.device_memory and spec is not None and spec.shape is not None and spec.src_memory.is_device
                and spec.dst_memory.is_device)

    def _recv_and_wait(self, key: Key, timeout: float | None) -> np.ndarray:
        """The transport's receive of a checked key, waiting for it: :meth:`_start_recv`, then wait; a transport
        with a faster way when the caller waits anyway overrides it."""
        return self._wait(self._start_recv(key), key, "recv", timeout)

    def outbound(self, name: str, dst: int) -> Outbound:
        """The persistent send of tensor ``name`` to ``dst`` (:class:`Outbound`): ``send(step, array)`` per transfer,
        the fast path of a planned tensor (what a key's checks and lookups cost, paid once here)."""
        self._check_key(Key(name, 0, self.rank, dst), "send")
        outbound = self._outbound(name, dst)
        spec = self.placement.spec(name, self.rank, dst)
        if spec is None or not spec.src_memory.is_device or self.moves_device(spec) or spec.shape is None:
            return outbound
        host = self.placement.allocate(replace(spec, src_memory=Memory()))  # the transport's own send memory
        return StagedOutbound(outbound, host, self.ledger)

    def inbound(self, name: str, src: int) -> Inbound:
        """The persistent receive of tensor ``name`` from ``src`` (:class:`Inbound`): ``recv(step)`` per transfer."""
        self._check_key(Key(name, 0, src, self.rank), "recv")
        inbound = self._inbound(name, src)
        spec = self.placement.spec(name, src, self.rank)
        if spec is None or not spec.dst_memory.is_device or self.moves_device(spec):
            return inbound
        return StagedInbound(inbound, spec.dst_memory, self.ledger)

    def _outbound(self, name: str, dst: int) -> Outbound:
        """Hook: a transport's own persistent send of a checked name and peer."""
        return Outbound(self, name, self.rank, dst)

    def _inbound(self, name: str, src: int) -> Inbound:
        """Hook: a transport's own persistent receive of a checked name and peer."""
        return Inbound(self, name, src, self.rank)

    def recv_each(self, keys: Sequence[Key], timeout: float | None = None) -> Iterator[tuple[Key, np.ndarray]]:
        """Receive every key of ``keys`` (posted together) and yield ``(key, array)`` as each arrives.

        One call waits for many tensors: a step's weights, or a variable's gradients from every
        worker. All receives are posted before the first tensor is yielded, so senders may write all
        of them meanwhile (on the fabric: credits for all of them go out at once, one message per
        peer). ``timeout`` (default: the transport's) bounds the whole call; a TransportTimeout names
        the keys still missing. Keys must be distinct. Each array is valid until the next receive of
        the same name from the same peer, as with :meth:`recv`. Closing the iterator early leaves
        the remaining receives posted (each is then taken by a later receive of its key).
        """
        keys = self._check_keys(keys)
        timeout = self.timeout_s if timeout is None else timeout
        pending = {self._start_recv(key): key for key in keys}
        staging = self.placement.device_receives
        try:
            for future in as_completed(pending, timeout):
                key = pending.pop(future)
                yield key, self._delivered(key, future.result()) if staging else future.result()
        except FutureTimeout:
            raise TransportTimeout(
                f"{self.name}: recv of {keys_text(pending.values())} did not complete within {timeout:g} s "
                f"(peer {self.peer_name(next(iter(pending.values())).src)})"
            ) from None

    def recv_many(self, keys: Sequence[Key], timeout: float | None = None) -> list[np.ndarray]:
        """Every tensor of ``keys``, received together (see :meth:`recv_each`), in the order of ``keys``."""
        keys = list(keys)
        arrived = dict(self.recv_each(keys, timeout))
        return [arrived[key] for key in keys]

    def _check_keys(self, keys: Sequence[Key]) -> list[Key]:
        keys = list(keys)
        for key in keys:
            self._check_key(key, "recv")
        if len(set(keys)) != len(keys):
            seen: set[Key] = set()
            twice = next(key for key in keys if key in seen or seen.add(key))
            raise ValueError(f"{self.name}: {twice} is asked for twice in one recv_many")
        return keys

    def stats(self) -> TransportStats:
        """The copy ledger since :meth:`start`."""
        return self.ledger.snapshot()

    def describe(self) -> dict[str, Any]:
        """What carries the bytes (fabric, its transports), for results' meta-data."""
        return {"fabric": "none"}

    def share_cores(self) -> None:  # noqa: B027 (a transport with no waits of its own has nothing to change)
        """This process computes beside its transfers (training: TensorFlow's compute, a parameter server's apply):
        from now on a wait gives its core back at once rather than spinning for a transfer (``bench micro``'s
        loops, which have nothing else to run, keep spinning). Call it after :meth:`start`, before the plan."""

    def peer_name(self, rank: int) -> str:
        address = self.cluster.addresses[rank] if self.cluster else "?"
        return f"rank {rank} at {address}"

    def _wait(self, future: Future, key: Key, what: str, timeout: float | None) -> Any:
        timeout = self.timeout_s if timeout is None else timeout
        try:
            return future.result(timeout)
        except FutureTimeout:
            peer = key.dst if what == "send" else key.src
            raise TransportTimeout(
                f"{self.name}: {what} of {key} did not complete within {timeout:g} s "
                f"(peer {self.peer_name(peer)}); is the peer running and using the same key?"
            ) from None

    def _check_key(self, key: Key, role: str) -> None:
        """Refuse, on the calling side and before anything goes on the wire, a key no peer could match.

        A ValueError names the key and the problem: a name that is not a str, not encodable as UTF-8
        (a lone surrogate) or longer than :data:`MAX_NAME_BYTES`; a step that is not an integer in
        ``0..MAX_STEP`` (int64 on the wire); a src or dst that is not this rank or not in the cluster.
        """
        if self.cluster is None:
            raise TransportError(f"{self.name}: start() the transport before {role}")
        problem = key_problem(key)
        if problem is not None:
            raise ValueError(f"{self.name}: cannot {role} {_show(key)}: {problem}")
        mine = key.src if role == "send" else key.dst
        peer = key.dst if role == "send" else key.src
        if mine != self.rank:
            side = "src" if role == "send" else "dst"
            raise ValueError(f"{self.name}: cannot {role} {key}: its {side} must be this rank ({self.rank})")
        if not 0 <= peer < self.cluster.size:
            raise ValueError(f"{self.name}: cannot {role} {key}: no rank {peer} in a cluster of {self.cluster.size}")

    def _check_array(self, key: Key, array: Any) -> None:
        """Refuse an array whose dtype cannot travel as raw bytes (see :func:`dtype_problem`)."""
        if type(array) is np.ndarray and array.dtype in PLAIN_DTYPES:  # the common case, checked per transfer
            return
        dtype = getattr(array, "dtype", None)  # a NumPy array, or a device array this transport moves itself
        if not isinstance(dtype, np.dtype):
            try:
                dtype = np.asarray(array).dtype
            except Exception as exc:  # whatever the object, the answer is a clear ValueError
                raise ValueError(f"{self.name}: cannot send {_show(key)}: not an array "
                                 f"({type(exc).__name__}: {exc})") from None
        problem = dtype_problem(dtype)
        if problem is not None:
            raise ValueError(f"{self.name}: cannot send {_show(key)}: {problem}")

    def _take_in(self, key: Key, tensor: Any) -> Any:
        """A tensor that is not a NumPy array as the array this transport sends, over its memory (DLPack, the array
        interfaces: ``transports/tensors.py``); device memory staged to host memory here (counted) unless the
        transport moves it itself for this transfer (:meth:`moves_device`: then the work queued on the device is
        waited for, as a copy of it would). ValueError says why it cannot be taken."""
        try:
            array = adopt(tensor)
        except Exception as exc:  # whatever the object, the answer is a clear ValueError
            raise ValueError(f"{self.name}: cannot send {_show(key)}: not an array this can take in "
                             f"({type(exc).__name__}: {exc})") from None
        if type(array) is not np.ndarray:
            if self.moves_device(self.placement.spec(key.name, key.src, key.dst) if type(key) is Key else None):
                ready(array)
            else:
                array = to_host(array, self.ledger)
        return array

    def _check_outgoing(self, key: Key, array: Any) -> Any:
        """Every send takes in (:meth:`_take_in`) and checks its array once, here, and returns the array it sends:
        a ValueError for one that cannot travel, after telling a receiver that may wait for ``key`` already
        (:meth:`_refused`) when the key itself is sound."""
        try:
            if type(array) is not np.ndarray:
                array = self._take_in(key, array)
            self._check_array(key, array)
            return array
        except ValueError as exc:
            try:
                self._check_key(key, "send")
            except (ValueError, TransportError):
                raise exc from None
            self._refused(key, exc)
            raise

    def _refused(self, key: Key, error: BaseException) -> None:
        """Hook: a send of ``key`` was refused on this side; tell a receiver that waits for it, if the protocol can."""
        return None

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def key_problem(key: Any) -> str | None:
    """What makes ``key`` unusable (None if nothing): the name, the step or the ranks' types and ranges."""
    if type(key) is Key:  # the common case, checked in a few operations (every transfer goes through here)
        name, step, src, dst = key
        if (type(name) is str and type(step) is int and type(src) is int and type(dst) is int
                and 0 <= step <= MAX_STEP and src >= 0 and dst >= 0 and len(name) <= MAX_NAME_BYTES
                and name.isascii()):
            return None
    if not isinstance(key, tuple) or len(key) != 4:
        return f"a key is Key(name, step, src, dst), got {type(key).__name__}"
    name, step, src, dst = key
    if not isinstance(name, str):
        return f"the name must be a str, got {type(name).__name__}"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        return f"the name is not encodable as UTF-8 ({exc.reason} at character {exc.start})"
    if size > MAX_NAME_BYTES:
        return f"the name is {size} bytes of UTF-8, more than the {MAX_NAME_BYTES} allowed"
    if not _is_int(step) or not 0 <= step <= MAX_STEP:
        return f"the step must be an integer in 0..2**63-1 (int64), got {step!r}"
    for side, rank in (("src", src), ("dst", dst)):
        if not _is_int(rank) or rank < 0:
            return f"its {side} must be a non-negative integer rank, got {rank!r}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _show(key: Any) -> str:
    """``key`` for an error message, even when it is malformed."""
    try:
        text = str(key) if isinstance(key, Key) else repr(key)
        text.encode("utf-8")
    except Exception:  # a lone surrogate, a broken __str__
        text = ascii(key)
    return text if len(text) <= 200 else text[:200] + "..."
