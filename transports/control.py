"""The control path: a small RPC over gRPC for setup, not for tensor data.

The paper distributes remote memory addresses "over a vanilla RPC"; so do we.
Each rank serves named operations that take and return JSON objects. Only
descriptors (addresses, lengths, remote keys, shapes) travel here, and only
between ranks of one run: the server refuses a call without the run's token
(``transports/auth.py``) before it parses the request.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from transports.auth import LISTENER_OPTIONS, TokenCheck, call_metadata
from transports.base import PeerError, TransportError
from transports.ports import release_port

log = logging.getLogger(__name__)

METHOD = "/tensor_transport.Control/Call"
#: threads serving control calls; a handler may call the caller's peer back once (``verify``)
CONTROL_THREADS = 16
_OPTIONS = [("grpc.so_reuseport", 0), ("grpc.max_reconnect_backoff_ms", 1_000)]

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class ControlServer:
    """Serves ``handlers[op](request) -> reply`` at ``address`` to callers that present ``token``."""

    def __init__(self, address: str, handlers: dict[str, Handler], owner: str, token: str) -> None:
        self._handlers = handlers
        self._owner = owner
        self._pool = futures.ThreadPoolExecutor(max_workers=CONTROL_THREADS, thread_name_prefix="control")
        # a call without the token is refused as soon as its headers are in (transports/auth.py): it holds none of
        # these threads, whatever it sends or does not send after them
        self._server = grpc.server(self._pool, interceptors=(TokenCheck(token, owner),),
                                   options=_OPTIONS + LISTENER_OPTIONS)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(
                "tensor_transport.Control", {"Call": grpc.unary_unary_rpc_method_handler(self._call)}),)
        )
        try:
            port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise TransportError(f"{owner}: cannot listen on {address} ({exc}); is the port in use?") from None
        if port == 0:
            raise TransportError(f"{owner}: cannot listen on {address}; is the port in use?")
        self._server.start()
        release_port(address)  # our listener holds the port now: free_port's reservation goes

    def _call(self, payload: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            request = json.loads(payload)
            handler = self._handlers[request.pop("op")]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self._owner}: malformed control request")
        try:
            return json.dumps(handler(request)).encode()
        except (TransportError, ValueError, KeyError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self._owner}: {exc}")
        except Exception as exc:  # a request no check foresaw: refused, never a crash or a hung caller
            log.warning("%s: control request refused: %r", self._owner, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{self._owner}: malformed control request ({type(exc).__name__})")

    def stop(self) -> None:
        # until gRPC says the server is down (its listener and connections closed): calls still running are
        # cancelled after the grace, so this ends; a bounded wait returned early on a busy machine, with the
        # server's sockets still open after close() (tests/test_zerocopy.py's open-close cycles counted them)
        self._server.stop(grace=0.2).wait()
        self._pool.shutdown(wait=False, cancel_futures=True)  # gRPC leaves its threads to the caller


class ControlClient:
    """Calls a peer's :class:`ControlServer` with the run's ``token``; failures name the peer."""

    def __init__(self, address: str, peer: str, token: str) -> None:
        self.peer = peer
        self.address = address
        self._metadata = call_metadata(token)
        self._channel = grpc.insecure_channel(address, options=_OPTIONS)
        self._call = self._channel.unary_unary(METHOD)
        #: the peer has answered a call: from then on one whose port refuses connections is gone, not starting
        self.heard = False

    def call(self, op: str, timeout: float, wait_for_ready: bool = True, **request: Any) -> dict[str, Any]:
        """The peer's reply to ``op``; PeerError naming the peer when it fails or is gone.

        A peer not heard from yet may still be starting: the call waits for it (``wait_for_ready``) up to
        ``timeout``. Once it has answered, the call does not wait for a connection: a peer whose port then
        refuses connections is gone and the call fails at once; one that holds its port is alive, however slowly
        it accepts, and the call waits for it after all.
        """
        payload = json.dumps({"op": op, **request}).encode()
        deadline = time.monotonic() + timeout
        ready = wait_for_ready and not self.heard
        while True:
            # a failure is raised outside the except clause: gRPC's error holds its call (and the call the channel's
            # socket), which the PeerError would otherwise keep as its context for as long as anyone holds it
            failure: str | None = None
            try:
                reply = self._call(payload, timeout=max(deadline - time.monotonic(), 0.001), metadata=self._metadata,
                                   wait_for_ready=ready)
                break
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()
            if code == grpc.StatusCode.UNAVAILABLE and wait_for_ready and not ready:
                if not port_is_held(self.address):
                    failure = (f"the peer is gone (it answered before and its port {self.address} now refuses "
                               "connections)")
                else:
                    ready = True  # alive: wait for its connection as for a starting peer
                    continue
            raise PeerError(f"{self.peer}: control call '{op}' failed: {failure or f'{code.name}: {details}'}")
        self.heard = True
        try:
            answer = json.loads(reply)
        except (ValueError, RecursionError):
            answer = None
        if not isinstance(answer, dict):
            raise PeerError(f"{self.peer}: control call '{op}' got a malformed reply")
        return answer

    def alive(self, timeout: float = 1.0) -> bool:
        """Whether the peer is still there: a dead process refuses the connection at once.

        A ping that fails (runs out of time: a busy machine, or every control thread busy; or gRPC's
        channel still backing off from an earlier failure, or reconnecting slowly on a busy machine) is
        settled by the port: a process that holds its listening port is alive, however slow it answers,
        and the deadline of whatever waits for the peer bounds how long it is waited for. A ping's own
        deadline never decides: on a busy machine a refused connection can take longer to be reported.
        """
        try:
            self._call(json.dumps({"op": "ping"}).encode(), timeout=timeout, metadata=self._metadata,
                       wait_for_ready=False)
        except grpc.RpcError:
            return port_is_held(self.address, timeout)
        return True

    def close(self) -> None:
        self._channel.close()


#: what connecting to a port says when nothing holds it: refused (its host answers), or its host unreachable
_NOTHING_THERE = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)


def port_is_held(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``host:port``: no only when the connection is refused or the
    host unreachable. Anything else cannot tell: a kernel too busy to answer in time, or this process out of
    descriptors, ports or buffers (EMFILE, EADDRNOTAVAIL, ENOBUFS on a busy machine) says nothing of the peer, and
    whatever waits for it is bounded by its own deadline."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except ValueError:
        return False  # not an address at all
    except OSError as exc:
        return exc.errno not in _NOTHING_THERE
