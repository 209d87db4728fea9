"""zerocopy's credits (the module docstring of ``transport.py`` says why): a slot holds one transfer, so the sender
writes transfer ``n`` only once the receiver granted the credit for it, the number of receives it posted.

- The sender's side, :class:`CreditTables`: a table per destination, one entry (two counters) per tensor it sends
  there, in its registered memory; the receiver writes them.
- The receiver's side, :class:`Credits`: a mirror of each sender's table (:class:`CreditMirror`), receives posted
  and their credits granted, a span of entries in one write (``recv_many``: a step's weights, one message per
  peer), or one entry in one call through the tensor's counter plan; grants for receives posted before their sender
  connected go out on a thread of their own.

Both act for a :class:`~transports.zerocopy.transport.ZeroCopyTransport` (its pool, lock, ledger, and its way of
running a blocking fabric transfer against a peer that may die).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import numpy as np

from transports.base import TransportError
from transports.fabric.base import Channel, CounterPlan, FabricError, RemoteRegion
from transports.fabric.pool import Block
from transports.zerocopy.protocol import COUNTERS_BYTES, CREDIT_TABLE_BYTES, CREDIT_TABLE_ENTRIES, ConnectRequest

if TYPE_CHECKING:
    from transports.fabric_transport import FabricTransport


class Incoming(Protocol):
    """What credits read and write of a receiver's state of one tensor from one sender (the transport's
    ``Incoming``)."""

    #: the mirror of its sender's table, and its entry there (set when the sender connects)
    mirror: CreditMirror | None
    index: int
    #: its credit set through one call, where the fabric can
    credit: CounterPlan | None
    #: receives posted so far, and whether one is posted and its transfer not yet taken
    posted: int
    waiting: bool
    #: a dynamically allocated tensor handed out, freed at the next receive
    lent: Block | None
    grant_lock: threading.Lock

    def finish_reads(self) -> None:
        """Wait for the receiver's work queued on what its slots hold (device memory), before a credit lets the
        sender overwrite one."""


class CreditTables:
    """A sender's credit tables: per destination, entries handed out one per tensor (a new table when the last is
    full), each written by that destination."""

    def __init__(self, transport: FabricTransport) -> None:
        self.transport = transport
        self._tables: dict[int, list[Block]] = {}
        self._entries: dict[int, int] = {}

    def entry(self, dst: int) -> tuple[Block, int]:
        """A fresh entry of this rank's credit table towards ``dst``: the table and the entry's index in it."""
        with self.transport._lock:
            used = self._entries.get(dst, 0)
            tables = self._tables.setdefault(dst, [])
            if used == len(tables) * CREDIT_TABLE_ENTRIES:
                tables.append(self.transport.pool.alloc(CREDIT_TABLE_BYTES, peer=dst))  # dst writes it
            self._entries[dst] = used + 1
            return tables[-1], used % CREDIT_TABLE_ENTRIES


class CreditMirror:
    """A receiver's copy of one sender's credit table, written to the sender in spans."""

    def __init__(self, src: int, channel: Channel, table: RemoteRegion, block: Block) -> None:
        self.src = src
        self.channel = channel
        self.table = table
        self.block = block
        block.array[:] = 0
        self.values = block.view(np.uint64, (CREDIT_TABLE_ENTRIES, 2))
        self.lock = threading.Lock()


class Credits:
    """A receiver's credits: the mirrors of its senders' tables, receives posted and their credits granted."""

    def __init__(self, transport: FabricTransport) -> None:
        self.transport = transport
        #: the mirrors of the senders' credit tables, by (src, table address)
        self._mirrors: dict[tuple[int, int, bytes], CreditMirror] = {}
        #: credits for receives posted before their sender connected go out on a thread of their own: on the
        #: transport's pool they could queue behind sends that wait for the peer, which waits for these credits
        self.granter: ThreadPoolExecutor | None = None

    def mirror(self, connect: ConnectRequest, channel: Channel) -> CreditMirror:
        """The mirror of the table ``connect`` names (one per table, however many tensors it connects).

        One table has one mirror: a span write sets every entry it covers to the mirror's values, so a second
        mirror of the same table would set the first's entries back. A connect naming a known table with
        another remote key is refused (ValueError)."""
        table = connect.table
        key = (connect.src, table.addr)
        with self.transport._lock:
            mirror = self._mirrors.get(key)
            if mirror is None:
                block = self.transport.pool.alloc(CREDIT_TABLE_BYTES)
                mirror = self._mirrors[key] = CreditMirror(connect.src, channel, table, block)
            elif mirror.table != table:
                raise ValueError(f"its credit table at {table.addr:#x} was named before with another remote key "
                                 "or length (a table has one)")
            return mirror

    @staticmethod
    def plan(incoming: Incoming) -> CounterPlan | None:
        """The one-call grant of ``incoming``'s credit: its entry's first word, in the mirror and at the sender."""
        mirror = incoming.mirror
        try:
            return mirror.channel.counter_plan(mirror.values[incoming.index, 0:1],
                                               mirror.table.at(COUNTERS_BYTES * incoming.index, 8))
        except (FabricError, ValueError):
            return None  # the span write of grant says what is wrong

    def submit(self, incoming: Incoming) -> None:
        """Grant ``incoming``'s receives posted so far on the credit thread (a connect that found them posted)."""
        transport = self.transport

        def grant() -> None:
            # a failure here is found by the receiver, which waits for this peer and checks it
            with contextlib.suppress(TransportError):
                self.grant(incoming.mirror, [incoming])

        with transport._lock:
            if transport._closed.is_set():
                return
            if self.granter is None:
                self.granter = ThreadPoolExecutor(1, thread_name_prefix=f"{transport.name}-{transport.rank}-credits")
            self.granter.submit(grant)

    def close(self) -> None:
        """Wait for the credit thread's grants (the transport is closing)."""
        with self.transport._lock:
            granter = self.granter
        if granter is not None:
            granter.shutdown(wait=True, cancel_futures=True)

    def post(self, incomings: list[Incoming]) -> None:
        """Post a receive on each slot (held by the caller): its last transfer is consumed; credits go out."""
        grants: dict[int, tuple[CreditMirror, list[Incoming]]] = {}
        for incoming in incomings:
            if incoming.lent is not None:  # the previous transfer is consumed: its buffer is free again
                self.transport.pool.free(incoming.lent)
                incoming.lent = None
            if incoming.waiting:  # posted before (a receive that timed out): it holds its credit already
                continue
            mirror = self._posted(incoming)
            if mirror is not None:
                grants.setdefault(id(mirror), (mirror, []))[1].append(incoming)
        for mirror, granted in grants.values():
            self.grant(mirror, granted)

    def post_one(self, incoming: Incoming) -> None:
        """:meth:`post` of one static slot not posted yet (held by the caller)."""
        mirror = self._posted(incoming)
        if mirror is not None:
            self.grant(mirror, [incoming])  # (through the credit plan where it has one: _grant_one)

    @staticmethod
    def _posted(incoming: Incoming) -> CreditMirror | None:
        """One more receive posted on ``incoming`` (held by the caller): the mirror to grant its credit through,
        or None before its sender connected (the connect grants it)."""
        incoming.finish_reads()
        incoming.waiting = True
        with incoming.grant_lock:
            incoming.posted += 1
            return incoming.mirror

    def grant(self, mirror: CreditMirror, incomings: list[Incoming], reads_done: int | None = None) -> None:
        """Tell the sender ``mirror.src``: receives posted on ``incomings``, or (``reads_done``) that the
        one of them read its buffer. One write of the span of table entries that changed (one call through the
        tensor's credit plan when it is one receive posted: :meth:`_grant_one`)."""
        if reads_done is None and len(incomings) == 1 and incomings[0].credit is not None:
            self._grant_one(incomings[0])
            return
        transport = self.transport
        with mirror.lock:
            for incoming in incomings:
                if reads_done is None:
                    mirror.values[incoming.index, 0] = incoming.posted
                else:
                    mirror.values[incoming.index, 1] = reads_done
            low = min(incoming.index for incoming in incomings)
            high = max(incoming.index for incoming in incomings) + 1
            span = mirror.block.array[COUNTERS_BYTES * low: COUNTERS_BYTES * high]
            target = mirror.table.at(COUNTERS_BYTES * low, COUNTERS_BYTES * (high - low))
            # counted before it is written: once written, the sender may go on, and a step the receiver's main thread
            # begins then must not find this message counted in it (this thread can be held off the cores that long)
            transport.ledger.add(control_messages=1)
            transport._blocking("granting credits", mirror.src, mirror.channel, mirror.channel.write_flagged, span,
                                target)

    def _grant_one(self, incoming: Incoming) -> None:
        """:meth:`grant` of one receive posted, through the tensor's credit plan (one call)."""
        transport = self.transport
        mirror, credit = incoming.mirror, incoming.credit
        transport.ledger.count("control_messages")  # before it is written (see grant)
        with mirror.lock:  # no span write of the same table in between, with an older value of this entry
            if credit.mapped:  # a store into memory mapped here: no peer to watch (see _blocking), called direct
                try:
                    credit.set(incoming.posted, transport.timeout_s)
                except FabricError as exc:
                    raise transport._failure("granting credits", mirror.src, exc) from None
            else:
                transport._blocking("granting credits", mirror.src, mirror.channel, credit.set, incoming.posted)
