"""The ``rdma_cp`` transport: the paper's RDMA.cp, zero-copy RDMA with the graph analysis off."""

from transports.rdma_cp.transport import RdmaCopyTransport as TRANSPORT

__all__ = ["TRANSPORT"]
