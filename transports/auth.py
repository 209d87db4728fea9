"""The run's token: every listener of a run refuses a caller that does not present it.

A run's ranks share a secret, :attr:`transports.base.Cluster.token`. Clients
send it as gRPC call metadata under :data:`TOKEN_METADATA_KEY`; servers check it
in an interceptor, before the method handler is looked up and before the request
is parsed, so a refused call never reaches a tensor or a remote key. A refusal is
logged (caller's address and method, never a token) and the call ends with
``UNAUTHENTICATED``.

A refused call costs the listener nothing it could hold on to: its handler takes the
request as a stream it never reads, so gRPC runs it as soon as the call's headers are
in and the call ends there, without waiting for a request body that a stranger may
never send (a handler of a single request waits for it, on one of the control server's
16 threads, until the caller gives up: 16 such callers stalled a rank). The log is
bounded as well (:class:`RefusalLog`, also the fabric's tcp stream listener's).

Written once for every listener: the sync gRPC server of the control path
(:class:`TokenCheck`) and the asyncio server of ``grpc_tcp`` (:class:`AioTokenCheck`).
An interceptor, rather than a check in each handler, also because it is the
cheaper of the two per call (about 1 us against 2 us here): it reads the metadata
gRPC has already converted for the handler lookup, where a handler's
``context.invocation_metadata()`` converts it again.
"""

from __future__ import annotations

import hmac
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc

#: the call metadata that carries the token (gRPC wants metadata keys in lower case)
TOKEN_METADATA_KEY = "x-tensor-bench-token"
#: refusals a listener logs one a line; past these, only every power of ten's, as a tally naming the latest
LOGGED_REFUSALS = 100
#: options of every gRPC server of a run: a connection that has not begun HTTP/2 within 10 s is closed (gRPC's own
#: default waits 120 s), as the fabric's stream listener closes one that has not proved the token by then
LISTENER_OPTIONS = [("grpc.server_handshake_timeout_ms", 10_000)]

log = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str], ...]


def call_metadata(token: str) -> Metadata:
    """The metadata a client passes with every call to a listener of the run whose token is ``token``."""
    return ((TOKEN_METADATA_KEY, token),)


def token_problem(metadata: Sequence[tuple[str, Any]] | None, expected: bytes) -> str | None:
    """None when ``metadata`` carries the ``expected`` token, else what is wrong (without any token)."""
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            presented = value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogateescape")
            if hmac.compare_digest(presented, expected):
                return None
            return "carries a token that is not this run's"
    return "lacks the run's token"


class RefusalLog:
    """A listener's refusals in the log: who was refused what, and why; never a token.

    The first :data:`LOGGED_REFUSALS` get a line each; later ones only a tally at every power of ten (1000,
    10000, ...) that names the latest, so a caller refused over and over cannot fill the disk with the log.
    Safe from any thread.
    """

    def __init__(self, owner: str, logger: logging.Logger = log) -> None:
        self.owner = owner
        self._log = logger  # (the listener's own module's, where its readers look)
        self._count = itertools.count(1)  # next() is atomic under the GIL

    def refused(self, what: str, peer: str, why: str) -> None:
        """Log that ``what`` (a call, a connection) from ``peer`` (its address) was refused because ``why``."""
        count = next(self._count)
        if count <= LOGGED_REFUSALS:
            later = "; later refusals are tallied at every power of ten" if count == LOGGED_REFUSALS else ""
            self._log.warning("%s: refused %s from %s: %s%s", self.owner, what, peer, why, later)
        elif _power_of_ten(count):
            self._log.warning("%s: %d refusals so far; the latest: %s from %s: %s", self.owner, count, what, peer, why)


def _power_of_ten(count: int) -> bool:
    while count % 10 == 0:
        count //= 10
    return count == 1


class _Check:
    """What both interceptors share: the expected token, what to tell a refused caller, and the refusals' log."""

    def __init__(self, token: str, owner: str) -> None:
        self._expected = token.encode()
        self._owner = owner
        self._log = RefusalLog(owner)

    def _refusal(self, problem: str) -> str:
        return (
            f"{self._owner}: call {problem} (metadata '{TOKEN_METADATA_KEY}'); every rank of a run must use the "
            "same token: the one in the run's Cluster, or TENSOR_BENCH_TOKEN set alike for every rank"
        )


class TokenCheck(_Check, grpc.ServerInterceptor):
    """Interceptor for a sync ``grpc.server``: calls without the run's token are refused at once."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        problem = token_problem(handler_call_details.invocation_metadata, self._expected)
        if problem is None:
            return continuation(handler_call_details)
        method = handler_call_details.method

        def refuse(requests: Iterator[bytes], context: grpc.ServicerContext) -> None:
            # ``requests`` is never read: the thread goes back to the pool now, whether or not a body ever comes
            self._log.refused(method, context.peer(), f"the call {problem}")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refusal(problem))

        # a handler of a request stream runs once the headers are in; no deserializer: nothing is parsed
        return grpc.stream_unary_rpc_method_handler(refuse)


class AioTokenCheck(_Check, grpc.aio.ServerInterceptor):
    """Interceptor for a ``grpc.aio.server``: calls without the run's token are refused at once."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        problem = token_problem(handler_call_details.invocation_metadata, self._expected)
        if problem is None:
            return await continuation(handler_call_details)
        method = handler_call_details.method

        async def refuse(requests: object, context: grpc.aio.ServicerContext) -> None:
            # ``requests`` is never read: the call ends now, whether or not a body ever comes
            self._log.refused(method, context.peer(), f"the call {problem}")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refusal(problem))

        # a handler of a request stream runs once the headers are in; no deserializer: nothing is parsed
        return grpc.stream_unary_rpc_method_handler(refuse)
