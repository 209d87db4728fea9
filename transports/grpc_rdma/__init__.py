"""The ``grpc_rdma`` transport: TensorFlow's gRPC+verbs design (the paper's gRPC.RDMA) on the fabric."""

from transports.grpc_rdma.transport import GrpcRdmaTransport as TRANSPORT

__all__ = ["TRANSPORT"]
