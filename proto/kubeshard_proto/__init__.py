"""Generated gRPC stubs for kubeshard's router <-> shard-leader contract.

The source of truth is ``proto/kubeshard.proto``; regenerate with ``make proto``.
"""

from kubeshard_proto import kubeshard_pb2 as pb
from kubeshard_proto import kubeshard_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
