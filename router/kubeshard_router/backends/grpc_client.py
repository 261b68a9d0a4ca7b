"""One gRPC client per replica leader: a long-lived channel, typed stubs, timeouts.

It is also the ``grpc`` kind of generator (``backends.engine``): ``generate`` returns a
``GrpcStream`` that reads the Generate call and turns its errors into ``BackendError``.
"""

from __future__ import annotations

from typing import Optional

import grpc
from grpc import aio

from kubeshard_proto import pb, pb_grpc
from kubeshard_router.backends.engine import BackendError

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


class GrpcStream:
    """One Generate call: ``read`` gives tokens, then None; errors are ``BackendError``;
    cancelling makes a waiting ``read`` raise ``CancelledError`` (grpc.aio's behaviour)."""

    __slots__ = ("call",)

    def __init__(self, call: aio.UnaryStreamCall) -> None:
        self.call = call

    async def read(self) -> Optional[pb.Token]:
        try:
            token = await self.call.read()
        except aio.AioRpcError as exc:
            raise BackendError(exc.code(), exc.details() or "") from None
        return None if token is aio.EOF else token

    def cancel(self) -> None:
        self.call.cancel()


class ReplicaClient:
    kind = "grpc"

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

    def generate(self, request: pb.GenerateRequest, timeout_s: float) -> GrpcStream:
        return GrpcStream(self.stub.Generate(request, timeout=timeout_s))

    async def load_adapter(self, name: str, source: str) -> pb.AdapterInfo:
        return await self.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source=source),
                                           timeout=self._info_timeout * 6)

    async def unload_adapter(self, name: str) -> None:
        await self.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=self._info_timeout)

    async def close(self) -> None:
        await self.channel.close(grace=None)
