"""The ``ucx`` fabric's progress threads: a UCP worker each, and the thread that drives it (the paper's CQ-polling
threads). A thread progresses its worker while operations are outstanding, then arms the worker and sleeps on its
event descriptor, so an idle device burns no core. ``library.py`` hands the loaded library to this module
(:func:`bind`) before a device is opened."""

from __future__ import annotations

import select
import threading
import time
from concurrent.futures import Future
from typing import Any

from transports.common import done_future, settle
from transports.fabric.base import Device, FabricError
from transports.fabric.ucx.channel import _check, _reason

_SPINS_BEFORE_SLEEP = 20
#: empty progress calls (in C) that end a burst of traffic
_IDLE_ROUNDS = 64

_ffi = _lib = None
_COMPLETED = done_future()  # shared by every operation that completed at once


def bind(ffi: Any, lib: Any) -> None:
    """Use the loaded UCX binding (``library.load`` calls this)."""
    global _ffi, _lib
    _ffi, _lib = ffi, lib


class Worker:
    """A UCP worker and the progress thread that drives it."""

    def __init__(self, device: Device, index: int) -> None:
        """A worker of ``device`` (the UCX device: its ``context``, ``_notify_activity``; typed as the base, so that
        this module does not import the device's, which imports it)."""
        self.device = device
        handle = _ffi.new("ucp_worker_h *")
        _check(_lib.tt_worker_create(device.context, handle), "creating a worker")
        self.handle = handle[0]
        address, length = _ffi.new("ucp_address_t **"), _ffi.new("size_t *")
        _check(_lib.ucp_worker_get_address(self.handle, address, length), "getting the worker address")
        self.address = bytes(_ffi.buffer(address[0], length[0]))
        _lib.ucp_worker_release_address(self.handle, address[0])
        fd = _ffi.new("int *")
        _check(_lib.ucp_worker_get_efd(self.handle, fd), "getting the worker's event descriptor")
        self._poller = select.epoll()
        self._poller.register(fd[0], select.EPOLLIN)
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, Future, str, object]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"ucx-progress-{index}", daemon=True)
        self._thread.start()

    def complete(self, status_ptr, what: str, keep_alive: object = None) -> Future:
        """A future for the outcome of a UCP ``*_nbx`` call."""
        if status_ptr == _ffi.NULL:
            return _COMPLETED
        if not _lib.tt_is_request(status_ptr):
            future: Future = Future()
            future.set_exception(FabricError(f"ucx: {what} failed: {_reason(_lib.tt_status(status_ptr))}"))
            return future
        future = Future()
        with self._lock:
            self._pending.append((status_ptr, future, what, keep_alive))
        _lib.ucp_worker_signal(self.handle)
        return future

    def _finish_completed(self) -> None:
        with self._lock:
            pending = self._pending
            still = []
            for entry in pending:
                request, future, what, _ = entry
                status = _lib.ucp_request_check_status(request)
                if status == _lib.UCS_INPROGRESS:
                    still.append(entry)
                    continue
                _lib.ucp_request_free(request)
                if status == _lib.UCS_OK:
                    settle(future)
                else:
                    settle(future, error=FabricError(f"ucx: {what} failed: {_reason(status)}"))
            self._pending = still

    def _run(self) -> None:
        _lib.tt_cuda_enter()  # (a CUDA context for UCX's CUDA transports, where the device uses one: tt_cuda_use)
        spins = 0
        while not self._stop:
            progressed = _lib.tt_progress_burst(self.handle, _IDLE_ROUNDS)
            if self._pending:
                self._finish_completed()
            if progressed:
                self.device._notify_activity()
                spins = 0
                continue
            # spin only while operations are outstanding; otherwise sleep until an event
            spins += 1
            if self._pending and spins < _SPINS_BEFORE_SLEEP:
                continue
            if _lib.ucp_worker_arm(self.handle) == _lib.UCS_OK:
                self._poller.poll(0.01 if self._pending else 1.0)
            spins = 0

    def wait(self, future: Future, timeout: float | None, spin_s: float = 0.0005):
        """The result of ``future``, progressing from the calling thread first.

        Small operations finish within microseconds; progressing here for a moment
        saves the hand-off to the progress thread and back.
        """
        deadline = time.perf_counter() + spin_s
        _lib.tt_cuda_enter()
        while not future.done() and time.perf_counter() < deadline:
            _lib.ucp_worker_progress(self.handle)
            if self._pending:
                self._finish_completed()
        return future.result(timeout)

    def drain(self, future: Future, timeout: float = 5.0) -> None:
        """Progress from the calling thread until ``future`` is done (used while closing)."""
        _lib.tt_cuda_enter()
        for _ in range(int(timeout / 0.001)):
            if future.done():
                return
            _lib.ucp_worker_progress(self.handle)
            self._finish_completed()
            self._poller.poll(0.001)

    def stop(self) -> None:
        self._stop = True
        _lib.ucp_worker_signal(self.handle)
        self._thread.join(timeout=5)

    def destroy(self) -> None:
        self._poller.close()
        _lib.ucp_worker_destroy(self.handle)
