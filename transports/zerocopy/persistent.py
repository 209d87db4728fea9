"""zerocopy's persistent transfers (:meth:`Transport.outbound` / :meth:`Transport.inbound`, as MPI's
``Send_init``/``Recv_init``): a planned static tensor's transfer through one call into C per side, with what a
key's send checks paid once.

A send of a static tensor whose slots the sender maps (shared memory) is ``tt_send_planned`` itself (the
fabric's :meth:`SendPlan.fast`): the credit's wait, the copy into the slot and the trailer. A receive is the
credit's grant (:meth:`CounterPlan.fast`) and the take (:meth:`TakePlan.fast`). What :meth:`ZeroCopyTransport.send`
and ``recv`` check per call (the key's types and ranks, the array's shape, strides and dtype, the claim) is checked
once: the name and peer when the object is made, the array when it is first sent from (an array keeps its byte
count for life, and the plan's call holds its buffer where it is: NumPy refuses to resize, and so move, the array
that owns that memory while the call lives; see ``_pin`` in ``transports/fabric/ucx/channel.py``). The counts go
into a tally of the object's own in the ledger.

Everything else goes the way ``send``/``recv`` go, which the objects call: the first transfer (it connects), a
tensor sent from another array, a plan that is not one copy into mapped memory (tcp's stream, a put over UCX:
those are watched against the peer's death), a credit that does not come within a slice, a transfer that is not
the one asked for, a step out of range. Bound measured at 1KB over shared memory, one run on a loaded machine:
the send's call took 3.8 µs through ``send`` and 0.9 through the plan's call alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transports.base import MAX_STEP, Inbound, Key, Outbound, TransportClosed
from transports.fabric.base import TakePlan
from transports.fabric_transport import LIVENESS_EVERY_S, FabricTransport

#: a planned send waits for its credit in C this long before it checks the peer (and then waits again); a
#: persistent send, before it goes the general way (which does)
CREDIT_SLICE_S = 0.05
#: what a fast take's answer means to the general path's rest of a receive (``_after_first_take``)
_TAKEN_AS = {TakePlan.TAKEN_OTHER: False, TakePlan.NOT_RAISED: None}
_TAKEN = TakePlan.TAKEN


class PlannedOutbound(Outbound):
    """zerocopy's persistent send (see the module docstring), of a ``ZeroCopyTransport`` (typed by its base here:
    the transport imports this module)."""

    __slots__ = ("__weakref__", "_array", "_call", "_nbytes", "_operation", "_outgoing", "_source", "_tally",
                 "_transport")

    def __init__(self, transport: FabricTransport, name: str, dst: int) -> None:
        super().__init__(transport, name, transport.rank, dst)
        self._transport = transport
        self._operation = transport._operation
        #: the tensor's sender-side state once it goes the planned way, the array it is sent from, the plan's
        #: call bound to that array, its size and its ledger count (a registration-cache hit or miss)
        self._outgoing: Any = None
        self._array: np.ndarray | None = None
        self._call: Any = None
        self._nbytes = 0
        self._source = ""
        self._tally = transport.ledger.tally(self)

    def _adopt(self, outgoing: Any, array: Any) -> bool:
        """Whether ``array`` goes the planned way from now on (then its call is made); ``outgoing``'s lock held, so
        that no other send finds the call of one array bound while it sends another."""
        if (type(array) is not np.ndarray or array.shape != outgoing.shape or array.strides != outgoing.strides
                or array.dtype != outgoing.dtype):
            return False
        self._call = None  # the last array's call goes before the next is made
        self._call = outgoing.plan.fast(array, CREDIT_SLICE_S, self._transport.timeout_s)
        self._array, self._nbytes = array, array.nbytes
        self._source = self._transport._source_count(outgoing, array)
        return True

    def _connected(self) -> Any:
        """The tensor's sender-side state once its sends can go the planned way (connected, static, its slots
        mapped here), kept from then on; else None."""
        outgoing = self._outgoing = self._transport._planned_outgoing(self.name, self.dst)
        return outgoing

    def _general(self, step: Any, array: Any, timeout: float | None) -> None:
        """The send the way :meth:`ZeroCopyTransport.send` takes a key that has no persistent send of its own."""
        self._transport._send_by_key(Key(self.name, step, self.src, self.dst), array, timeout)

    def send(self, step: int, array: np.ndarray, timeout: float | None = None) -> None:
        outgoing = self._outgoing or self._connected()
        if outgoing is None or type(step) is not int or not 0 <= step <= MAX_STEP:
            self._general(step, array, timeout)
            return
        lock = outgoing.lock
        if not lock.acquire(False):  # another send of this tensor is under way: after it, the general way
            self._general(step, array, timeout)
            return
        operation = self._operation
        inflight = operation.inflight
        inflight.append(None)  # (see _Operation: counted, then the close looked at)
        try:
            if operation.closed:
                raise TransportClosed(f"{self._transport.name} rank {self.src} was closed")
            written = False
            if array is self._array or self._adopt(outgoing, array):
                seq = outgoing.seq
                if not self._call(seq, step):  # else not written: no credit yet, or a failure the general way says
                    outgoing.seq = seq + 1
                    written = True
        finally:
            inflight.pop()
            lock.release()
        if not written:
            self._general(step, array, timeout)
            return
        tally = self._tally
        tally["tensors_sent"] += 1
        tally["payload_bytes_sent"] += self._nbytes
        tally[self._source] += 1


class PlannedInbound(Inbound):
    """zerocopy's persistent receive (see the module docstring)."""

    __slots__ = ("__weakref__", "_grant", "_incoming", "_operation", "_slice_ns", "_take", "_tally", "_transport")

    def __init__(self, transport: FabricTransport, name: str, src: int) -> None:
        super().__init__(transport, name, src, transport.rank)
        self._transport = transport
        self._operation = transport._operation
        #: the tensor's receiver-side state once it goes the planned way, and the plans' calls
        self._incoming: Any = None
        self._grant: Any = None
        self._take: Any = None
        #: the first slice of a wait, in ns (then the general wait's checks between slices)
        self._slice_ns = int(min(LIVENESS_EVERY_S, transport.timeout_s) * 1e9)
        self._tally = transport.ledger.tally(self)

    def _adopt(self) -> bool:
        """Whether the tensor's receives go the planned way from now on: static, its sender connected, its credit a
        store into memory mapped here."""
        incoming = self._transport._planned_incoming(self.name, self.src)
        if incoming is None:
            return False
        self._grant = incoming.credit.fast(self._transport.timeout_s)
        self._take = incoming.take.fast()
        self._incoming = incoming
        return True

    def _general(self, step: Any, timeout: float | None) -> np.ndarray:
        """The receive the way :meth:`ZeroCopyTransport.recv` takes a key that has no persistent receive of its own."""
        return self._transport._recv_by_key(Key(self.name, step, self.src, self.dst), timeout)

    def recv(self, step: int, timeout: float | None = None) -> np.ndarray:
        incoming = self._incoming
        if ((incoming is None and not self._adopt()) or type(step) is not int or not 0 <= step <= MAX_STEP
                or timeout is not None):
            return self._general(step, timeout)
        incoming = self._incoming
        lock = incoming.lock
        if not lock.acquire(False):  # another receive of this tensor is under way: after it, the general way
            return self._general(step, timeout)
        operation = self._operation
        inflight = operation.inflight
        inflight.append(None)  # (see _Operation: counted, then the close looked at)
        try:
            if operation.closed:
                raise TransportClosed(f"{self._transport.name} rank {self.dst} was closed")
            tally = self._tally
            if not incoming.waiting:  # (a receive that timed out is posted still: it holds its credit already)
                self._post(incoming)
                tally["control_messages"] += 1
            seq = incoming.seq
            # what follows the take is only its answer's check: the array and its count come before it, the count
            # taken back where the take goes another way (which counts itself)
            array = incoming.arrays[seq % incoming.slots]
            nbytes = array.nbytes
            tally["tensors_received"] += 1
            tally["payload_bytes_received"] += nbytes
            found = self._take(seq, step, self._slice_ns)
            if found != _TAKEN:
                tally["tensors_received"] -= 1
                tally["payload_bytes_received"] -= nbytes
                key = Key(self.name, step, self.src, self.dst)
                if found == TakePlan.INTERRUPTED:
                    raise self._transport._closed_during(key)
                return self._transport._after_first_take(incoming, key, _TAKEN_AS[found], timeout)
            incoming.seq = seq + 1
            incoming.waiting = False
        finally:
            inflight.pop()
            lock.release()
        return array

    def _post(self, incoming: Any) -> None:
        """One more receive posted on ``incoming`` (held), its credit granted: ``Credits.post_one`` in one call."""
        if incoming.on_device:  # (host slots, every transfer of a host tensor: not even a call)
            incoming.finish_reads()
        incoming.waiting = True
        # (no grant lock: it keeps a connect from missing a receive posted meanwhile, and this tensor's sender is
        # connected; ``posted`` changes only under the tensor's lock, held here)
        posted = incoming.posted = incoming.posted + 1
        with incoming.mirror.lock:  # no span write of the same table in between, with an older value of this entry
            if self._grant(posted):
                incoming.credit.set(posted, self._transport.timeout_s)  # says what went wrong
