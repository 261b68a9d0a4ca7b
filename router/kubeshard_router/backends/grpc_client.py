"""One gRPC client per replica leader: a long-lived channel, typed stubs, timeouts."""

from __future__ import annotations

import grpc
from grpc import aio

from kubeshard_proto import pb, pb_grpc

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 512 * 1024 * 1024),  # Info carries tokenizer.json
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.enable_retries", 0),
]

# Codes that say "this replica cannot take the request now": another replica may.
RETRYABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
})


class ReplicaClient:
    def __init__(self, address: str, *, info_timeout_s: float, health_timeout_s: float) -> None:
        self.address = address
        self._info_timeout = info_timeout_s
        self._health_timeout = health_timeout_s
        self.channel = aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.stub = pb_grpc.TextGenerationStub(self.channel)

    async def info(self) -> pb.InfoResponse:
        return await self.stub.Info(pb.InfoRequest(), timeout=self._info_timeout, wait_for_ready=False)

    async def health(self) -> pb.HealthResponse:
        return await self.stub.Health(pb.HealthRequest(), timeout=self._health_timeout)

    async def stats(self) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest(), timeout=self._health_timeout)

    def generate(self, request: pb.GenerateRequest, timeout_s: float) -> aio.UnaryStreamCall:
        return self.stub.Generate(request, timeout=timeout_s)

    async def close(self) -> None:
        await self.channel.close(grace=None)
