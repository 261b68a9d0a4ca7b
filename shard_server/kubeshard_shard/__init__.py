"""kubeshard model server: continuous batching, paged KV cache, sharded groups, gRPC."""

__version__ = "0.1.0"
