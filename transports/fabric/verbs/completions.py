"""The verbs device's completions: signaled work requests tracked by ``wr_id`` until their completion settles the
caller's Future, receives (immediates) re-posted, a failed completion failing its channel, a caller's wait that
polls the CQ itself for a moment, and the waits interrupted. A mixin of ``device.py``'s ``VerbsDevice``, which
holds the state it reads (declared below)."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

from transports.common import settle
from transports.fabric.base import FabricError, FabricInterrupted, FabricTimeout
from transports.fabric.verbs.channel import RECV_WR_ID, WAIT_SLICE_S, VerbsChannel, _Pending, _Poller
from transports.fabric.verbs.hardware import _status_text


class Completions:
    """What a verbs device does with its completion queues' entries, and the waits on them."""

    _pv: SimpleNamespace
    _lock: threading.Lock
    _activity: threading.Condition
    _pending: dict[int, _Pending]
    _by_qp: dict[int, VerbsChannel]
    _immediates: list[tuple[tuple[bytes, ...], int]]
    interrupted: threading.Event
    spin_s: float

    def _track(self, wr_id: int, pending: _Pending) -> None:
        with self._lock:
            self._pending[wr_id] = pending
            pending.channel.poller.outstanding += 1
            for region in pending.regions:
                region.busy += 1

    def _untrack(self, wr_id: int) -> _Pending | None:
        with self._lock:
            entry = self._pending.pop(wr_id, None)
            if entry is not None:
                entry.channel.poller.outstanding -= 1
                for region in entry.regions:
                    region.busy -= 1
        if entry is not None:
            for _ in range(entry.slots):
                entry.channel._slots.release()
        return entry

    def _completed(self, wc) -> None:
        """Handle one work completion (called by whoever polls the CQ, under its lock)."""
        success = wc.status == self._pv.enums.IBV_WC_SUCCESS
        if wc.wr_id == RECV_WR_ID:
            self._received(wc, success)
            return
        entry = self._untrack(wc.wr_id)
        if entry is None:
            if not success:  # an unsignaled write failed: the connection is broken
                with self._lock:
                    channel = self._by_qp.get(wc.qp_num)
                if channel is not None:
                    self._fail_channel(channel, _status_text(self._pv, wc.status, wc.vendor_err))
            return
        if success:
            settle(entry.future)
            return
        reason = _status_text(self._pv, wc.status, wc.vendor_err)
        self._fail_channel(entry.channel, reason)
        settle(entry.future, error=FabricError(f"verbs: {entry.what} failed: {reason}"))

    def _received(self, wc, success: bool) -> None:
        """A receive completed: an immediate arrived (re-post the receive), or the queue pair failed."""
        with self._lock:
            channel = self._by_qp.get(wc.qp_num)
        if channel is None or channel.closed:
            return
        if not success:
            self._fail_channel(channel, _status_text(self._pv, wc.status, wc.vendor_err))
            return
        try:
            channel.qp.post_recv(channel.recv_wr)
        except self._pv.pyverbs_error.PyverbsError as exc:
            self._fail_channel(channel, f"re-posting a receive failed: {exc}")
        if wc.opcode == self._pv.enums.IBV_WC_RECV_RDMA_WITH_IMM:
            with self._activity:
                self._immediates.append(((channel.peer,), wc.imm_data & 0xFFFFFFFF))
                self._activity.notify_all()

    def _fail_channel(self, channel: VerbsChannel, reason: str) -> None:
        """Mark ``channel`` failed: its transfers in flight fail now, its queue pair goes to the error state
        (the NIC flushes what is left, and the buffers stay referenced until then)."""
        with self._lock:
            if channel._error is not None:
                return
            channel._error = reason
            doomed = [(entry.future, entry.what) for entry in self._pending.values() if entry.channel is channel]
        for future, what in doomed:
            settle(future, error=FabricError(f"verbs: {what} failed: {reason}"))
        if not channel.closed:
            attr = self._pv.qp.QPAttr(qp_state=self._pv.enums.IBV_QPS_ERR)
            with contextlib.suppress(self._pv.pyverbs_error.PyverbsError):  # already in the error state
                channel.qp.modify(attr, self._pv.enums.IBV_QP_STATE)
        with self._activity:
            self._activity.notify_all()

    def _poller_failed(self, poller: _Poller, reason: str) -> None:
        with self._lock:
            lanes = [channel for channel in self._by_qp.values() if channel.poller is poller]
        for channel in lanes:
            self._fail_channel(channel, reason)

    def _await(self, future: Future, deadline: float | None, poller: _Poller, what: str):
        """``future``'s result; polls the CQ from this thread for a moment first. FabricTimeout at ``deadline``,
        FabricInterrupted after :meth:`interrupt_waits`."""
        spin_until = time.monotonic() + self.spin_s
        while not future.done() and time.monotonic() < spin_until:
            if not poller.poll_once(wait=False):
                time.sleep(0)
        while True:
            if future.done():
                return future.result()
            if self.interrupted.is_set():
                raise FabricInterrupted(f"verbs: {what} was interrupted (the device is closing)")
            remaining = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise FabricTimeout(f"verbs: {what} did not complete in time")
            try:
                return future.result(min(remaining, WAIT_SLICE_S))
            except TimeoutError:
                continue

    def take_immediates(self) -> list[tuple[tuple[bytes, ...], int]]:
        with self._activity:
            taken, self._immediates = self._immediates, []
        return taken

    def wait_for_activity(self, timeout: float) -> None:
        with self._activity:
            if not self._immediates:
                self._activity.wait(timeout)

    def interrupt_waits(self) -> None:
        """Every wait returns: memory waits and blocked transfers raise FabricInterrupted, and so do the
        futures of transfers in flight (their buffers stay referenced until the NIC completes them)."""
        super().interrupt_waits()
        with self._lock:
            futures = [entry.future for entry in self._pending.values()]
        for future in futures:
            settle(future, error=FabricInterrupted("verbs: the transfer was interrupted (the device is closing)"))
        with self._activity:
            self._activity.notify_all()
