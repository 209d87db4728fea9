"""The control path: a small RPC over gRPC for setup, not for tensor data.

The paper distributes remote memory addresses "over a vanilla RPC"; so do we.
Each rank serves named operations that take and return JSON objects. Only
descriptors (addresses, lengths, remote keys, shapes) travel here, and only
between ranks of one run: the server refuses a call without the run's token
(``transports/auth.py``) before it parses the request.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from transports.auth import TokenCheck, call_metadata
from transports.base import PeerError, TransportError

METHOD = "/tensor_transport.Control/Call"
_OPTIONS = [("grpc.so_reuseport", 0), ("grpc.max_reconnect_backoff_ms", 1_000)]

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class ControlServer:
    """Serves ``handlers[op](request) -> reply`` at ``address`` to callers that present ``token``."""

    def __init__(self, address: str, handlers: dict[str, Handler], owner: str, token: str) -> None:
        self._handlers = handlers
        self._owner = owner
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="control"),
                                   interceptors=(TokenCheck(token, owner),), options=_OPTIONS)
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

    def _call(self, payload: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            request = json.loads(payload)
            handler = self._handlers[request.pop("op")]
        except (ValueError, KeyError, TypeError, AttributeError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self._owner}: malformed control request")
        try:
            return json.dumps(handler(request)).encode()
        except (TransportError, ValueError, KeyError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self._owner}: {exc}")

    def stop(self) -> None:
        self._server.stop(grace=0.2).wait(2)


class ControlClient:
    """Calls a peer's :class:`ControlServer` with the run's ``token``; failures name the peer."""

    def __init__(self, address: str, peer: str, token: str) -> None:
        self.peer = peer
        self._metadata = call_metadata(token)
        self._channel = grpc.insecure_channel(address, options=_OPTIONS)
        self._call = self._channel.unary_unary(METHOD)

    def call(self, op: str, timeout: float, wait_for_ready: bool = True, **request: Any) -> dict[str, Any]:
        try:
            reply = self._call(json.dumps({"op": op, **request}).encode(), timeout=timeout,
                               metadata=self._metadata, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise PeerError(f"{self.peer}: control call '{op}' failed: {exc.code().name}: {exc.details()}") from None
        return json.loads(reply)

    def alive(self, timeout: float = 1.0) -> bool:
        """Whether the peer is still there: a dead process refuses the connection at once.

        A ping that runs out of time is a slow peer (a busy machine), not a dead one: it counts as
        alive, and the deadline of whatever waits for the peer bounds how long it is waited for.
        """
        try:
            self._call(json.dumps({"op": "ping"}).encode(), timeout=timeout, metadata=self._metadata,
                       wait_for_ready=False)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return True

    def close(self) -> None:
        self._channel.close()
