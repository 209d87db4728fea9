"""The fabric's optional fast paths: a static tensor's send, receive and counter planned once, and flags waited on
together.

A backend writes none of these to run (``Device``'s defaults in ``base.py`` answer None for a plan, and its
``flag_set`` polls from Python, ``waits.py``): one that moves a whole transfer in one call into C (UCX) subclasses
them for speed, and then writes the abstract methods here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from transports.fabric.errors import FabricInterrupted

#: a planned slot's bell, in the receiver's registered memory beside its trailer (8-byte aligned): the doorbell a
#: waiting receiver sleeps on, and a sender's ask that the waiting receiver pull a large transfer itself (see
#: :meth:`Channel.send_plan`)
BELL_BYTES = 40


class SendPlan(ABC):
    """A static tensor's sends towards one peer through one call each (:meth:`Channel.send_plan`)."""

    #: every target is mapped here: a send is this process's own copy, which never waits on the peer
    mapped: bool = False
    #: the times a send found the peer asleep on its doorbell and woke it
    rung: int = 0
    #: the transfers the peer pulled itself (see :meth:`Channel.send_plan`)
    pulled: int = 0

    @abstractmethod
    def send(self, data: np.ndarray, seq: int, step: int, credit_wait: float, timeout: float = 60.0) -> bool:
        """Transfer ``seq`` (of ``data``, the planned size): wait up to ``credit_wait`` seconds for its credit
        (receives posted > seq + 1 - slots), write it into slot ``seq % slots``, then the trailer (``step``, the
        flag ``1 + seq % 255``). False: no credit yet, nothing written. Errors as :meth:`Channel.write_flagged`."""

    def fast(self, data: np.ndarray, credit_wait: float, timeout: float = 60.0) -> Callable[[int, int], int]:
        """:meth:`send` of ``data`` made once, for a persistent send: a call of ``(seq, step)`` answering 0 once
        transfer ``seq`` is written, anything else when it is not (no credit within ``credit_wait``, or a failure):
        the caller then calls :meth:`send` for it, which waits again or says what is wrong. A backend whose send is
        one call into C gives that call itself."""
        send = self.send
        return lambda seq, step: 0 if send(data, seq, step, credit_wait, timeout) else 1


class CounterPlan(ABC):
    """A counter the peer reads, set through one call each time (:meth:`Channel.counter_plan`)."""

    #: the peer's counter is mapped here: setting it is a store, which never waits on the peer
    mapped: bool = False

    @abstractmethod
    def set(self, value: int, timeout: float = 60.0) -> None:
        """Set the counter here and at the peer; returns once the peer can read it (errors as
        :meth:`Channel.write_flagged`)."""

    def fast(self, timeout: float = 60.0) -> Callable[[int], int]:
        """:meth:`set` made once (see :meth:`SendPlan.fast`): a call of ``value`` answering 0 once set, anything
        else when not (the caller then calls :meth:`set`, which says what is wrong)."""
        set_ = self.set

        def set_value(value: int) -> int:
            set_(value, timeout)
            return 0

        return set_value


class TakePlan(ABC):
    """A static tensor's receives through one call each (:meth:`Device.take_plan`): the wait for a transfer's
    trailer and its take."""

    @abstractmethod
    def take(self, seq: int, step: int, timeout: float) -> bool | None:
        """Transfer ``seq``: wait up to ``timeout`` seconds for the flag of its slot (``seq % slots``); once
        raised, lower it and say whether the trailer is transfer ``seq``'s (its flag ``1 + seq % 255``) of
        ``step``: True, or False (:attr:`last` has what came). None while not raised; FabricInterrupted when
        the device's waits are interrupted."""

    #: what a :meth:`fast` take answers: the transfer asked for, another transfer's trailer (:attr:`last`), not
    #: raised within the time; the device's waits interrupted
    TAKEN, TAKEN_OTHER, NOT_RAISED, INTERRUPTED = 1, 0, -1, -2

    def fast(self) -> Callable[[int, int, int], int]:
        """:meth:`take` made once, for a persistent receive: a call of ``(seq, step, timeout_ns)`` answering
        :attr:`TAKEN`, :attr:`TAKEN_OTHER`, :attr:`NOT_RAISED` or :attr:`INTERRUPTED`."""
        take, answers = self.take, {True: self.TAKEN, False: self.TAKEN_OTHER, None: self.NOT_RAISED}

        def take_fast(seq: int, step: int, timeout_ns: int) -> int:
            try:
                return answers[take(seq, step, timeout_ns / 1e9)]
            except FabricInterrupted:
                return self.INTERRUPTED

        return take_fast

    @property
    @abstractmethod
    def last(self) -> tuple[int, int]:
        """``(flag, step)`` of the trailer last taken."""

    #: the transfers this plan pulled itself, asked by the sender (see :meth:`Channel.send_plan`)
    pulls: int = 0

    @abstractmethod
    def use_bells(self, on: bool) -> None:
        """Whether the peer maps this memory (:meth:`Channel.send_plan`): a wait past its spin then sleeps on the
        slot's doorbell rather than as the device's waits sleep, and serves the sender's asks to pull a transfer
        into its slot; where the plan has no bells, nothing changes."""


class FlagSet(ABC):
    """Flag bytes (each a one-byte view of registered memory) waited on together; see :meth:`Device.flag_set`."""

    @abstractmethod
    def wait_any(self, timeout: float) -> int | None:
        """The index of a raised flag not yet :meth:`done`, or None after ``timeout`` seconds.

        FabricInterrupted when the device's waits are interrupted.
        """

    @abstractmethod
    def done(self, index: int) -> None:
        """Stop watching flag ``index``."""

    @abstractmethod
    def reset(self) -> None:
        """Watch every flag again."""
