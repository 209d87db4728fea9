"""The ``local`` transport: sender and receiver in one process, no communication."""

from transports.local.transport import LocalTransport as TRANSPORT

__all__ = ["TRANSPORT"]
