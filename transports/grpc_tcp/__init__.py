"""The ``grpc_tcp`` transport: TensorFlow's default, gRPC over TCP with protobuf tensor messages."""

from transports.grpc_tcp.transport import GrpcTcpTransport as TRANSPORT

__all__ = ["TRANSPORT"]
