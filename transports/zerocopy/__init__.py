"""The ``zerocopy`` transport: the paper's RDMA.zerocp over the fabric."""

from transports.zerocopy.transport import ZeroCopyTransport as TRANSPORT

__all__ = ["TRANSPORT"]
