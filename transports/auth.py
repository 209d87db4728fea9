"""The run's token: every listener of a run refuses a caller that does not present it.

A run's ranks share a secret, :attr:`transports.base.Cluster.token`. Clients
send it as gRPC call metadata under :data:`TOKEN_METADATA_KEY`; servers check it
in an interceptor, before the method handler is looked up and before the request
is parsed, so a refused call never reaches a tensor or a remote key. A refusal is
logged (caller's address and method, never a token) and the call ends with
``UNAUTHENTICATED``.

Written once for every listener: the sync gRPC server of the control path
(:class:`TokenCheck`) and the asyncio server of ``grpc_tcp`` (:class:`AioTokenCheck`).
An interceptor, rather than a check in each handler, also because it is the
cheaper of the two per call (about 1 us against 2 us here): it reads the metadata
gRPC has already converted for the handler lookup, where a handler's
``context.invocation_metadata()`` converts it again.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

#: the call metadata that carries the token (gRPC wants metadata keys in lower case)
TOKEN_METADATA_KEY = "x-tensor-bench-token"

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


def _log_refusal(owner: str, peer: str, method: str, problem: str) -> None:
    log.warning("%s: refused %s from %s: the call %s", owner, method, peer, problem)


class _Check:
    """What both interceptors share: the expected token, and what to tell a refused caller."""

    def __init__(self, token: str, owner: str) -> None:
        self._expected = token.encode()
        self._owner = owner

    def _refusal(self, problem: str) -> str:
        return (
            f"{self._owner}: call {problem} (metadata '{TOKEN_METADATA_KEY}'); every rank of a run must use the "
            "same token: the one in the run's Cluster, or TENSOR_BENCH_TOKEN set alike for every rank"
        )


class TokenCheck(_Check, grpc.ServerInterceptor):
    """Interceptor for a sync ``grpc.server``: calls without the run's token are refused."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        problem = token_problem(handler_call_details.invocation_metadata, self._expected)
        if problem is None:
            return continuation(handler_call_details)
        method = handler_call_details.method

        def refuse(request: bytes, context: grpc.ServicerContext) -> None:
            _log_refusal(self._owner, context.peer(), method, problem)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refusal(problem))

        # no deserializer: the request stays unparsed bytes
        return grpc.unary_unary_rpc_method_handler(refuse)


class AioTokenCheck(_Check, grpc.aio.ServerInterceptor):
    """Interceptor for a ``grpc.aio.server``: calls without the run's token are refused."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        problem = token_problem(handler_call_details.invocation_metadata, self._expected)
        if problem is None:
            return await continuation(handler_call_details)
        method = handler_call_details.method

        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
            _log_refusal(self._owner, context.peer(), method, problem)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refusal(problem))

        # no deserializer: the request stays unparsed bytes
        return grpc.unary_unary_rpc_method_handler(refuse)
