"""The verbs device's channels: a :class:`VerbsChannel` per peer (its RC queue pairs, their lanes and the
send-queue slots), the progress threads that poll the completion queues (:class:`_Poller`, one per CQ), and the
completion channel's descriptor. ``device.py`` opens the device, registers memory and makes these."""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from transports.common import done_future, settle
from transports.fabric import waits
from transports.fabric.base import (
    Channel,
    Device,
    FabricError,
    FabricInterrupted,
    MemRegion,
    RemoteRegion,
)
from transports.fabric.verbs.decide import (
    LaneEndpoint,
    new_psn,
)

#: completions taken from a CQ per poll
POLL_BATCH = 32
#: the wr_id of every receive work request (sends count from 1)
RECV_WR_ID = 0
#: CQ entries per queue pair: a send and a receive queue of ``queue_depth`` each
CQES_PER_QP = 2
#: a blocked caller re-checks interrupts and its deadline this often
WAIT_SLICE_S = 0.05
#: the most bytes one work request moves: a scatter-gather entry's length is 32 bits and a port takes
#: messages of at most its max_msg_sz (2 GiB on InfiniBand and RoCE), so a larger transfer is posted as
#: several work requests of at most this many bytes, in order on one queue pair
MAX_WR_BYTES = 1 << 30


_CHANNEL_LOCK = threading.Lock()
#: what /proc/self/fd shows for a completion channel's descriptor
EVENT_FD_TARGET = "anon_inode:[infinibandevent]"


def _descriptors() -> dict[str, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return found


def _event_fd(pv: SimpleNamespace, context):
    """A completion channel of ``context`` and its file descriptor (None if it cannot be found).

    pyverbs does not expose the descriptor, and its ``get_cq_event`` blocks holding the GIL (every
    thread of the process stops until an event comes), so the progress thread waits with ``select``
    on the descriptor and takes the event only once one is there. The descriptor is the one the
    channel's creation opened, found in ``/proc/self/fd``.
    """
    with _CHANNEL_LOCK:
        before = _descriptors()
        channel = pv.cq.CompChannel(context)
        opened = [int(fd) for fd, target in _descriptors().items() if fd not in before and target == EVENT_FD_TARGET]
    return channel, opened[0] if len(opened) == 1 else None


class _Poller:
    """One completion queue and the progress thread that handles its completions (one of the paper's ``num_cqs``).

    The thread sleeps on the CQ's completion channel (armed with ``req_notify``, waited for with
    ``select`` beside a pipe that :meth:`stop` writes); a caller blocked on a transfer polls the CQ
    itself for a moment first (:meth:`VerbsDevice._await`), which saves the wake-up for small transfers.
    """

    def __init__(self, device: Device, index: int, cqes: int) -> None:
        pv = device._pv
        self.device = device
        self.events, self.event_fd = _event_fd(pv, device.context)
        self.cq = pv.cq.CQ(device.context, cqes, None, self.events, 0)
        self.cqes = self.cq.cqe
        self.lock = threading.Lock()  # one poller of the CQ at a time (the thread or a blocked caller)
        self.closed = False
        self.outstanding = 0  # send work requests in flight on this CQ (under the device's lock)
        self.queue_pairs = 0
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name=f"verbs-progress-{index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def poll_once(self, wait: bool = True) -> int:
        """Take up to :data:`POLL_BATCH` completions and handle them; 0 if none (or the CQ is busy and not ``wait``)."""
        if not self.lock.acquire(blocking=wait):
            return 0
        try:
            if self.closed:
                return 0
            found, completions = self.cq.poll(POLL_BATCH)
            for completion in completions[:found]:
                self.device._completed(completion)
            return found
        finally:
            self.lock.release()

    def reserve(self, queue_depth: int, max_cqe: int) -> None:
        """Grow the CQ for one more queue pair (its send and receive queues complete here)."""
        needed = (self.queue_pairs + 1) * CQES_PER_QP * queue_depth
        if needed > max_cqe:
            raise FabricError(f"verbs: {self.queue_pairs + 1} queue pairs of depth {queue_depth} need {needed} "
                              f"completion queue entries, the device allows {max_cqe}: lower RDMA_QP_QUEUE_DEPTH, "
                              f"or use more progress threads or fewer lanes per peer")
        with self.lock:
            if needed > self.cqes:
                try:
                    self.cq.resize(needed)
                except self.device._pv.pyverbs_error.PyverbsError as exc:
                    raise FabricError(f"verbs: growing a completion queue to {needed} entries failed: {exc}") from None
                self.cqes = self.cq.cqe
            self.queue_pairs += 1

    def _sleep(self) -> None:
        """Until the CQ raises an event (a completion after arming) or :meth:`stop`; a nap where there is no
        descriptor to wait on."""
        watched = [self._wake_read] + ([self.event_fd] if self.event_fd is not None else [])
        ready, _, _ = select.select(watched, [], [], None if self.event_fd is not None else waits.MAX_NAP_S)
        if self.event_fd in ready:
            self.events.get_cq_event(self.cq)  # one is there: this returns at once
            self.cq.ack_events(1)

    def _run(self) -> None:
        stopping = self.device._stopping
        pv = self.device._pv
        while not stopping.is_set():
            try:
                if self.poll_once():
                    continue
                self.cq.req_notify()
                if self.poll_once():  # completions that came before the CQ was armed raise no event
                    continue
                self._sleep()
            except pv.pyverbs_error.PyverbsError as exc:
                self.device._poller_failed(self, f"waiting for completions failed: {exc}")
                return

    def stop(self) -> None:
        os.write(self._wake_write, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self.lock:
            self.closed = True

    def close(self) -> None:
        """Destroy the CQ and its completion channel (after :meth:`stop` and the queue pairs)."""
        self.cq.close()
        self.events.close()
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)


@dataclass
class _Pending:
    """A signaled work request in flight: who waits for it, and what the NIC may still use."""

    future: Future
    channel: VerbsChannel
    what: str
    #: the local buffers of it and of an unsignaled write before it (kept alive until the NIC is done)
    buffers: tuple[np.ndarray, ...]
    #: their regions (not evicted from the cache while busy)
    regions: tuple[MemRegion, ...]
    #: the send queue entries its completion frees: its own and the unsignaled write's
    slots: int


class VerbsChannel(Channel):
    """One RC queue pair to a peer (one lane), on the CQ of progress thread ``lane % progress_threads``."""

    def __init__(self, device: Device, peer: bytes, poller: _Poller) -> None:
        pv = device._pv
        self.device = device
        self.peer = peer
        self.poller = poller
        depth = device.settings.queue_depth
        cap = pv.qp.QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=pv.enums.IBV_QPT_RC, scq=poller.cq, rcq=poller.cq, cap=cap)
        self.qp = pv.qp.QP(device.pd, init)
        self.qp_num = self.qp.qp_num
        self.psn = new_psn()
        self.recv_wr = pv.wr.RecvWR(wr_id=RECV_WR_ID, num_sge=1, sg=[device._empty_sge()])
        self.depth = depth
        self._slots = threading.BoundedSemaphore(depth)  # free send queue entries
        self._post_lock = threading.Lock()
        self._last: Future | None = None  # the future of the last work request posted
        self._error: str | None = None
        self.closed = False

    @property
    def endpoint(self) -> LaneEndpoint:
        return LaneEndpoint(self.qp_num, self.psn)

    def _rkey(self, remote: RemoteRegion, nbytes: int, what: str) -> int:
        if nbytes > remote.length:
            raise remote.too_small(nbytes, what)
        if len(remote.rkey) != 4:
            raise FabricError(f"verbs: a remote key of {len(remote.rkey)} bytes is malformed (verbs keys have 4 "
                              f"bytes: is the peer on another fabric?)")
        return int.from_bytes(remote.rkey, "little")

    def _pieces(self, local: np.ndarray, remote: RemoteRegion, what: str) -> list[tuple[np.ndarray, RemoteRegion]]:
        """``local`` and its target cut into pieces of at most ``MAX_WR_BYTES``, in order (itself when it fits)."""
        limit = MAX_WR_BYTES
        if local.nbytes <= limit:
            return [(local, remote)]
        if local.nbytes > remote.length:
            raise remote.too_small(local.nbytes, what)
        if not local.flags.c_contiguous:
            raise ValueError("verbs transfers need C-contiguous memory")
        flat = local.reshape(-1).view(np.uint8)
        return [(flat[offset : offset + limit], remote.at(offset, min(limit, local.nbytes - offset)))
                for offset in range(0, local.nbytes, limit)]

    def _work(self, opcode: int, local: np.ndarray, remote: RemoteRegion, what: str, signaled: bool = True,
              imm: int = 0):
        """A work request of ``local`` to (or from) ``remote``, and the region of ``local``."""
        device = self.device
        rkey = self._rkey(remote, local.nbytes, what) if local.nbytes else 0
        sge, region = device._sge(local)
        flags = device._pv.enums.IBV_SEND_SIGNALED if signaled else 0
        work = device._pv.wr.SendWR(wr_id=next(device._wr_ids), opcode=opcode, num_sge=1, sg=[sge],
                                    send_flags=flags, imm_data=imm)
        work.set_wr_rdma(rkey, remote.addr)
        return work, region

    def _take_slots(self, count: int, what: str) -> None:
        """``count`` free send queue entries, waited for while the queue is full."""
        taken = 0
        try:
            while taken < count:
                if self._slots.acquire(timeout=WAIT_SLICE_S):
                    taken += 1
                    continue
                self.device._check_open()
                if self.device.interrupted.is_set():
                    raise FabricInterrupted(f"verbs: {what} was interrupted (the device is closing)")
        except BaseException:
            for _ in range(taken):
                self._slots.release()
            raise

    def _post(self, opcode: int, local: np.ndarray, remote: RemoteRegion, what: str, imm: int = 0,
              lead: tuple[np.ndarray, RemoteRegion] | None = None) -> Future:
        """Post one signaled work request; its future completes with the work completion.

        ``lead``: the data and target of an RDMA write posted unsignaled right before it on this queue pair:
        the send queue completes in order, so this request's completion is the lead's too (an error of the
        lead's fails the connection, and this request with it).

        A transfer of more than ``MAX_WR_BYTES`` (lead or request) is posted as several work requests of at
        most that size, in order (a write with immediate: plain writes, the immediate on the last), all
        unsignaled but the last; when they are more than the send queue holds, in batches of at most its
        depth, each ending with a signaled request that frees the batch's entries. The returned future is
        the last request's, whose completion is every earlier one's too.
        """
        device = self.device
        enums = device._pv.enums
        future: Future = Future()
        try:
            device._check_open()
            if self._error is not None:
                raise FabricError(f"verbs: {what} on a failed connection: {self._error}")
            steps = []  # (opcode, buffer, target, immediate): the unsignaled lead first
            if lead is not None and lead[0].nbytes:
                steps += [(enums.IBV_WR_RDMA_WRITE, piece, target, 0) for piece, target in self._pieces(*lead, what)]
            pieces = self._pieces(local, remote, what)
            plain = enums.IBV_WR_RDMA_WRITE if opcode == enums.IBV_WR_RDMA_WRITE_WITH_IMM else opcode
            steps += [(plain, piece, target, 0) for piece, target in pieces[:-1]]
            steps.append((opcode, *pieces[-1], imm))
        except FabricError as exc:
            future.set_exception(exc)
            return future
        batches = [steps[start : start + self.depth] for start in range(0, len(steps), self.depth)]
        for number, batch in enumerate(batches):
            last = number == len(batches) - 1
            batch_future = future if last else Future()
            try:
                if number and self._error is not None:  # an earlier batch failed
                    raise FabricError(f"verbs: {what} on a failed connection: {self._error}")
                parts = [(*self._work(code, buffer, target, what, signaled=n == len(batch) - 1, imm=value), buffer)
                         for n, (code, buffer, target, value) in enumerate(batch)]
                self._take_slots(len(parts), what)
            except FabricError as exc:
                if number:  # the batches before are in flight, this transfer will not complete
                    device._fail_channel(self, f"posting {what} failed: {exc}")
                settle(future, error=exc)
                return future
            if not self._post_batch(parts, batch_future, what, first=number == 0):
                if not last:
                    settle(future, error=batch_future.exception())
                return future
        return future

    def _post_batch(self, parts: list, future: Future, what: str, first: bool) -> bool:
        """Post ``parts`` ((work request, region, buffer), all unsignaled but the last), whose last completes
        ``future``; False when posting failed (``future`` then holds the error)."""
        device = self.device
        works = [work for work, _, _ in parts]
        work = works[-1]
        device._track(work.wr_id, _Pending(future, self, what, tuple(buffer for _, _, buffer in parts),
                                           tuple(region for _, region, _ in parts if region), len(works)))
        try:
            with self._post_lock:
                for posting in works:
                    self.qp.post_send(posting)
                self._last = future
        except device._pv.pyverbs_error.PyverbsError as exc:
            device._untrack(work.wr_id)
            if len(works) > 1 or not first:  # an unsignaled write may be in the queue with nothing to complete it
                device._fail_channel(self, f"posting {what} failed: {exc}")
            settle(future, error=FabricError(f"verbs: posting {what} failed: {exc}"))
            return False
        return True

    def write(self, local: np.ndarray, remote: RemoteRegion) -> Future:
        return self._post(self.device._pv.enums.IBV_WR_RDMA_WRITE, local, remote, "RDMA write")

    def read(self, local: np.ndarray, remote: RemoteRegion) -> Future:
        if not local.flags.writeable:
            raise ValueError("an RDMA read needs a writable destination")
        return self._post(self.device._pv.enums.IBV_WR_RDMA_READ, local, remote, "RDMA read")

    def flush(self) -> Future:
        """Done when the last work request posted before it completed: an RC send queue completes in order."""
        with self._post_lock:
            last = self._last
        if last is None or last.done():
            return done_future() if last is None or last.exception() is None else last
        flushed: Future = Future()
        last.add_done_callback(lambda done: settle(flushed, error=done.exception()))
        return flushed

    def notify(self) -> Future:
        """Nothing to do: an RDMA write raises no event at the peer (an immediate does, see write_with_imm)."""
        return done_future()

    def wait(self, future: Future, timeout: float | None = None):
        return self.device._await(future, None if timeout is None else time.monotonic() + timeout, self.poller,
                                  "the operation")

    def _blocking(self, future: Future, deadline: float, what: str) -> None:
        self.device._await(future, deadline, self.poller, what)

    def write_flagged(self, data: np.ndarray, remote: RemoteRegion, trailer: np.ndarray | None = None,
                      trailer_remote: RemoteRegion | None = None, timeout: float = 60.0) -> None:
        """The data write unsignaled, the trailer's signaled behind it, one completion waited for (see the module
        docstring: a peer that sees the flag sees the data)."""
        deadline = time.monotonic() + timeout
        write = self.device._pv.enums.IBV_WR_RDMA_WRITE
        if trailer is None:
            if data.nbytes:
                self._blocking(self._post(write, data, remote, "RDMA write"), deadline, "RDMA write")
            return
        what = "RDMA write of data and its flag" if data.nbytes else "RDMA write of a flag"
        self._blocking(self._post(write, trailer, trailer_remote, what, lead=(data, remote)), deadline, what)

    def read_now(self, local: np.ndarray, remote: RemoteRegion, timeout: float = 60.0) -> None:
        if local.nbytes:
            self._blocking(self.read(local, remote), time.monotonic() + timeout, "RDMA read")

    def write_with_imm(self, data: np.ndarray, remote: RemoteRegion, imm: int, timeout: float = 60.0) -> None:
        """RDMA WRITE_WITH_IMM: the peer's receive completion carries ``imm`` once ``data`` is in place."""
        if type(imm) is not int or not 0 <= imm < 2**32:
            raise ValueError(f"an immediate is a 32-bit unsigned integer, not {imm!r:.40}")
        what = "RDMA write with immediate"
        future = self._post(self.device._pv.enums.IBV_WR_RDMA_WRITE_WITH_IMM, data, remote, what, imm)
        self._blocking(future, time.monotonic() + timeout, what)

    def failed(self) -> str | None:
        return self._error

    def fail(self) -> None:
        self.device._fail_channel(self, "the connection was marked failed (the peer is gone)")

    def close(self) -> None:
        self.closed = True
        self.qp.close()
