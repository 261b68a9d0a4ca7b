"""One generation against the replicas of a model.

Both ``stream`` and ``collect`` wait for a ready replica (activation), take an admission
slot (backpressure), pick a replica (prefix affinity) and open a flight on it, retrying
on another replica while no token has been produced; then one relay reads the flight's
tokens up to the finish, cutting off a stalled or broken replica.

``stream`` yields the tokens as they come: after the first token a failure raises
``IncompleteGeneration`` (the SSE layer turns it into an error event). ``collect``
gathers a whole answer for non-streaming requests; since the client has seen nothing,
it may restart from scratch on another replica even after tokens arrived.

Closing the stream (client gone) cancels the replica's generation at once (a gRPC call
or an HTTP engine's request, ``backends.engine``), which tells it to free the request's
KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import grpc

from kubeshard_proto import pb
from kubeshard_router.activation import Activator
from kubeshard_router.backends.engine import BackendError
from kubeshard_router.backends.grpc_client import RETRYABLE_CODES
from kubeshard_router.backends.model import ModelState, Replica
from kubeshard_router.backends.registry import Registry
from kubeshard_router.balancer import Balancer
from kubeshard_router.config import RouterConfig
from kubeshard_router.engine_request import EngineRequest
from kubeshard_router.errors import (BackendFailed, IncompleteGeneration, Overloaded,
                                     ValidationFailed)
from kubeshard_router.flight import Flight, StallWatchdog
from kubeshard_router.metrics import RouterMetrics

log = logging.getLogger("kubeshard.router.dispatch")


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
    # the request field a grammar came from (a grammar the engine refuses names it)
    grammar_field: Optional[str] = None


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
        if model.admission.try_acquire():
            ctx.queue_s = held
            return
        ctx.queue_s = held + await model.admission.acquire()

    def _error(self, model: ModelState, replica: Replica, exc: BackendError) -> str:
        code = exc.code()
        self.metrics.backend_errors.labels(model.name, code.name).inc()
        detail = f"{code.name}: {exc.details()}"
        if code == grpc.StatusCode.UNAVAILABLE:
            self.registry.report_failure(replica, detail)
        return detail

    async def _open(self, model: ModelState, request: pb.GenerateRequest, key: Optional[int],
                    tried: list[Replica], ctx: RequestContext, errors: list[str]
                    ) -> tuple[Flight, pb.Token]:
        """A flight that produced its first token, on a replica not yet ``tried``."""
        exhausted = missing = 0
        while len(tried) <= self.config.max_retries:
            # a LoRA request goes only where its adapter is loaded (replicas may differ)
            replicas = model.replicas_for(request.adapter)
            if not replicas and model.ready_replicas and not (tried or errors):
                raise ValidationFailed(f"adapter `{request.adapter}` is not loaded on any ready replica of model "
                                       f"`{model.name}`")
            replica = self.balancer.pick(replicas, key, exclude=tried)
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
            flight = Flight(replica, request, max(remaining, 0.001))
            try:
                first = await flight.read()
            except BackendError as exc:
                flight.close()
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    self.metrics.backend_errors.labels(model.name, code.name).inc()
                    details = exc.details() or "the engine refused the request"
                    field = ctx.grammar_field if details.startswith("grammar") else None
                    raise ValidationFailed(f"`{field}`: {details}" if field else details, param=field) from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted += 1
                if code == grpc.StatusCode.NOT_FOUND and request.adapter:
                    # the replica lacks the adapter its Info listed (it restarted between
                    # probes): take it out until its probe loads the adapter again; try another
                    missing += 1
                    self.metrics.backend_errors.labels(model.name, code.name).inc()
                    errors.append(f"{replica.address}: {exc.details()}")
                    self.registry.report_failure(replica, exc.details() or "adapter not loaded")
                    continue
                errors.append(f"{replica.address}: {self._error(model, replica, exc)}")
                if code not in RETRYABLE_CODES:
                    break
                continue
            except BaseException:
                flight.close()
                raise
            if first is None:
                flight.close()
                errors.append(f"{replica.address}: stream ended before the first token")
                continue
            ctx.replica = replica.address
            ctx.first_token_at = time.perf_counter()
            return flight, first
        if missing and missing == len(errors):
            raise ValidationFailed(f"adapter `{request.adapter}` is not loaded on any replica of model "
                                   f"`{model.name}` (" + "; ".join(errors) + ")")
        if exhausted and exhausted == len(errors):
            raise Overloaded(f"Model `{model.name}` is overloaded: every replica tried is at its "
                             f"request limit", retry_after_s=model.admission.retry_after_s())
        raise BackendFailed(f"no replica of model `{model.name}` could start the request: "
                            + ("; ".join(errors) or "no ready replica"))

    async def _relay(self, model: ModelState, flight: Flight, first: pb.Token,
                     ctx: RequestContext, sequences: int) -> AsyncIterator[pb.Token]:
        """The flight's tokens, ``first`` included, up to the last finish of its
        ``sequences`` (which fills in ``ctx``); raises ``IncompleteGeneration`` when the
        replica fails, stalls or ends the stream before then. Closes the flight when done."""
        address = flight.replica.address
        self.watchdog.watch(flight)
        try:
            token, count, finished = first, 1, 0
            while True:
                if token.HasField("finish"):
                    finished += 1
                if finished == sequences:
                    ctx.finish = token.finish
                    ctx.generated_tokens = count
                    ctx.end_at = time.perf_counter()
                    yield token
                    return
                yield token
                try:
                    following = await flight.read()
                except BackendError as exc:
                    raise IncompleteGeneration(f"replica {address} failed after {count} tokens "
                                               f"({self._error(model, flight.replica, exc)})") from None
                except asyncio.CancelledError:
                    if not flight.cut_off():
                        raise
                    raise IncompleteGeneration(f"replica {address} stalled after {count} tokens "
                                               f"(nothing for {self.watchdog.timeout_s:g}s)") from None
                if following is None:
                    raise IncompleteGeneration(f"replica {address} ended the stream after {count} "
                                               f"tokens without a finish")
                token, count = following, count + 1
        finally:
            self.watchdog.forget(flight)
            flight.close()

    async def stream(self, model: ModelState, engine: EngineRequest,
                     ctx: RequestContext) -> AsyncIterator[pb.Token]:
        await self._admit(model, ctx)
        try:
            request = engine.to_proto(ctx.request_id)
            key = self.balancer.prefix_key(engine.input_ids, model.block_size, engine.adapter)
            flight, first = await self._open(model, request, key, [], ctx, [])
            sent = 0
            try:
                async with aclosing(self._relay(model, flight, first, ctx, engine.n)) as tokens:
                    async for token in tokens:
                        sent += 1
                        yield token
            except IncompleteGeneration as exc:
                ctx.generated_tokens = sent
                raise IncompleteGeneration(f"{exc.message}; the generation is incomplete") from None
        finally:
            model.admission.release(time.perf_counter() - ctx.start)

    async def collect(self, model: ModelState, engine: EngineRequest,
                      ctx: RequestContext) -> list[pb.Token]:
        await self._admit(model, ctx)
        tried: list[Replica] = []
        errors: list[str] = []
        try:
            request = engine.to_proto(ctx.request_id)
            key = self.balancer.prefix_key(engine.input_ids, model.block_size, engine.adapter)
            while True:
                flight, first = await self._open(model, request, key, tried, ctx, errors)
                try:
                    async with aclosing(self._relay(model, flight, first, ctx, engine.n)) as tokens:
                        return [token async for token in tokens]
                except IncompleteGeneration as exc:
                    errors.append(exc.message)
                    if len(tried) > self.config.max_retries:
                        raise BackendFailed(f"no replica of model `{model.name}` completed the request: "
                                            + "; ".join(errors)) from None
                    log.warning("request %s: %s; restarting on another replica", ctx.request_id,
                                exc.message)
        finally:
            model.admission.release(time.perf_counter() - ctx.start)
