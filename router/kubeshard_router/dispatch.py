"""One generation against the replicas of a model.

``stream`` yields the engine's Token messages: it waits for a ready replica (activation),
takes an admission slot (backpressure), picks a replica (prefix affinity), and retries
on another replica while no token has been produced. After the first token a failure
raises ``IncompleteGeneration`` (the SSE layer turns it into an error event). ``collect``
gathers a whole answer for non-streaming requests; since the client has seen nothing,
it may restart from scratch on another replica even after tokens arrived.

Closing the stream (client gone) cancels the gRPC call at once, which tells the leader
to free the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import grpc
from grpc import aio

from kubeshard_proto import pb
from kubeshard_router.activation import Activator
from kubeshard_router.backends.grpc_client import RETRYABLE_CODES
from kubeshard_router.backends.registry import ModelState, Registry, Replica
from kubeshard_router.balancer import Balancer
from kubeshard_router.config import RouterConfig
from kubeshard_router.engine_request import EngineRequest
from kubeshard_router.errors import (BackendFailed, IncompleteGeneration, Overloaded,
                                     ValidationFailed)
from kubeshard_router.metrics import RouterMetrics

log = logging.getLogger("kubeshard.router.dispatch")
EOF_ = aio.EOF


@dataclass(slots=True)
class RequestContext:
    """What happened to one request; filled in as it goes, read for headers and metrics."""

    request_id: str
    model: str
    start: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0
    validation_s: float = 0.0
    first_token_at: Optional[float] = None
    end_at: Optional[float] = None
    replica: Optional[str] = None
    retries: int = 0
    cache: str = "off"  # off | hit | miss | bypass
    finish: Optional[pb.FinishDetails] = None
    prompt_tokens: int = 0
    generated_tokens: int = 0


class _Flight:
    __slots__ = ("call", "last", "stalled")

    def __init__(self, call: aio.UnaryStreamCall) -> None:
        self.call = call
        self.last = time.monotonic()
        self.stalled = False


def _stall_cancelled(flight: _Flight) -> bool:
    """True when a CancelledError came from the watchdog cancelling the call (grpc.aio raises
    CancelledError for locally cancelled calls), not from this task being cancelled."""
    task = asyncio.current_task()
    return flight.stalled and (task is None or task.cancelling() == 0)


class StallWatchdog:
    """Cancels calls that produced nothing for ``timeout_s`` (a hung leader behind a live
    connection); one sweep per second for all calls, so tokens pay only a timestamp."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.flights: set[_Flight] = set()
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._sweep(), name="stall watchdog")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 2))
            limit = time.monotonic() - self.timeout_s
            for flight in list(self.flights):
                if flight.last < limit:
                    flight.stalled = True
                    flight.call.cancel()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class Dispatcher:
    def __init__(self, registry: Registry, balancer: Balancer, activator: Activator,
                 metrics: RouterMetrics, config: RouterConfig) -> None:
        self.registry = registry
        self.balancer = balancer
        self.activator = activator
        self.metrics = metrics
        self.config = config
        self.watchdog = StallWatchdog(config.stall_timeout_s)

    async def _admit(self, model: ModelState, ctx: RequestContext) -> None:
        held = await self.activator.wait_ready(model)
        if model.admission.in_flight < model.admission.capacity and not model.admission.queued:
            model.admission.in_flight += 1  # fast path of Admission.acquire
            ctx.queue_s = held
            return
        ctx.queue_s = held + await model.admission.acquire()

    def _error(self, model: ModelState, replica: Replica, exc: aio.AioRpcError) -> str:
        code = exc.code()
        self.metrics.backend_errors.labels(model.name, code.name).inc()
        detail = f"{code.name}: {exc.details()}"
        if code == grpc.StatusCode.UNAVAILABLE:
            self.registry.report_failure(replica, detail)
        return detail

    async def _open(self, model: ModelState, request: pb.GenerateRequest, key: Optional[int],
                    tried: list[Replica], ctx: RequestContext, errors: Optional[list[str]] = None
                    ) -> tuple[Replica, aio.UnaryStreamCall, pb.Token]:
        errors = [] if errors is None else errors
        exhausted = 0
        while len(tried) <= self.config.max_retries:
            replica = self.balancer.pick(model.ready_replicas, key, exclude=tried)
            if replica is None:
                if tried or errors:
                    break
                await self.activator.wait_ready(model)  # every replica vanished just now
                continue
            if tried:
                ctx.retries += 1
                self.metrics.retries.labels(model.name).inc()
            tried.append(replica)
            remaining = self.config.request_timeout_s - (time.perf_counter() - ctx.start)
            replica.outstanding += 1
            call = replica.client.generate(request, max(remaining, 0.001))
            try:
                first = await call.read()
            except aio.AioRpcError as exc:
                replica.outstanding -= 1
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    self.metrics.backend_errors.labels(model.name, code.name).inc()
                    raise ValidationFailed(exc.details() or "the engine refused the request") from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted += 1
                errors.append(f"{replica.address}: {self._error(model, replica, exc)}")
                if code not in RETRYABLE_CODES:
                    break
                continue
            except BaseException:
                replica.outstanding -= 1
                call.cancel()
                raise
            if first is EOF_:
                replica.outstanding -= 1
                errors.append(f"{replica.address}: stream ended before the first token")
                continue
            ctx.replica = replica.address
            ctx.first_token_at = time.perf_counter()
            return replica, call, first
        if exhausted and exhausted == len(errors):
            raise Overloaded(f"Model `{model.name}` is overloaded: every replica tried is at its "
                             f"request limit", retry_after_s=model.admission.retry_after_s())
        raise BackendFailed(f"no replica of model `{model.name}` could start the request: "
                            + ("; ".join(errors) or "no ready replica"))

    async def stream(self, model: ModelState, engine: EngineRequest,
                     ctx: RequestContext) -> AsyncIterator[pb.Token]:
        await self._admit(model, ctx)
        replica: Optional[Replica] = None
        flight: Optional[_Flight] = None
        try:
            request = engine.to_proto(ctx.request_id)
            key = self.balancer.prefix_key(engine.input_ids, model.block_size)
            replica, call, token = await self._open(model, request, key, [], ctx)
            flight = _Flight(call)
            self.watchdog.flights.add(flight)
            count = 1
            while True:
                if token.HasField("finish"):
                    ctx.finish = token.finish
                    ctx.generated_tokens = count
                    ctx.end_at = time.perf_counter()
                    yield token
                    return
                yield token
                try:
                    token = await call.read()
                except aio.AioRpcError as exc:
                    ctx.generated_tokens = count
                    raise IncompleteGeneration(
                        f"replica {replica.address} failed after {count} tokens "
                        f"({self._error(model, replica, exc)}); the generation is incomplete") from None
                except asyncio.CancelledError:
                    if not _stall_cancelled(flight):
                        raise
                    ctx.generated_tokens = count
                    raise IncompleteGeneration(
                        f"replica {replica.address} stalled after {count} tokens (nothing for "
                        f"{self.watchdog.timeout_s:g}s); the generation is incomplete") from None
                if token is EOF_:
                    ctx.generated_tokens = count
                    raise IncompleteGeneration(f"replica {replica.address} ended the stream after "
                                               f"{count} tokens without a finish")
                flight.last = time.monotonic()
                count += 1
        finally:
            if flight is not None:
                self.watchdog.flights.discard(flight)
                flight.call.cancel()
            if replica is not None:
                replica.outstanding -= 1
            model.admission.release(time.perf_counter() - ctx.start)

    async def collect(self, model: ModelState, engine: EngineRequest,
                      ctx: RequestContext) -> list[pb.Token]:
        await self._admit(model, ctx)
        tried: list[Replica] = []
        errors: list[str] = []
        try:
            request = engine.to_proto(ctx.request_id)
            key = self.balancer.prefix_key(engine.input_ids, model.block_size)
            while True:
                replica, call, token = await self._open(model, request, key, tried, ctx, errors)
                flight = _Flight(call)
                self.watchdog.flights.add(flight)
                tokens = [token]
                try:
                    while not token.HasField("finish"):
                        try:
                            token = await call.read()
                        except asyncio.CancelledError:
                            if not _stall_cancelled(flight):
                                raise
                            raise IncompleteGeneration(f"replica {replica.address} stalled (nothing for "
                                                       f"{self.watchdog.timeout_s:g}s)") from None
                        if token is EOF_:
                            raise IncompleteGeneration(f"replica {replica.address} ended the stream "
                                                       f"without a finish")
                        flight.last = time.monotonic()
                        tokens.append(token)
                    ctx.finish = token.finish
                    ctx.generated_tokens = len(tokens)
                    ctx.end_at = time.perf_counter()
                    return tokens
                except (aio.AioRpcError, IncompleteGeneration) as exc:
                    why = exc.message if isinstance(exc, IncompleteGeneration) else (
                        self._error(model, replica, exc))
                    errors.append(f"{replica.address}: failed after {len(tokens)} tokens ({why})")
                    if len(tried) > self.config.max_retries:
                        raise BackendFailed(f"no replica of model `{model.name}` completed the request: "
                                            + "; ".join(errors)) from None
                    log.warning("request %s: replica %s failed after %d tokens (%s); restarting on "
                                "another replica", ctx.request_id, replica.address, len(tokens), why)
                finally:
                    self.watchdog.flights.discard(flight)
                    call.cancel()
                    replica.outstanding -= 1
        finally:
            model.admission.release(time.perf_counter() - ctx.start)
