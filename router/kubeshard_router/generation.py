"""Cache in front of the dispatcher, and the per-request bookkeeping both APIs share.

Every request also counts in its model's ``LoadTracker`` (``ModelState.load``): its
arrival, and from the cache miss to its end the tokens it reserves (prompt plus
``max_new_tokens``), of which each streamed token frees one.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Optional

from kubeshard_proto import pb
from kubeshard_router.backends.model import ModelState
from kubeshard_router.cache import CacheControl, ResponseCache, cache_key
from kubeshard_router.dispatch import Dispatcher, RequestContext
from kubeshard_router.engine_request import EngineRequest
from kubeshard_router.metrics import RouterMetrics

log = logging.getLogger("kubeshard.router.generation")


class GenerationService:
    def __init__(self, dispatcher: Dispatcher, cache: Optional[ResponseCache],
                 metrics: RouterMetrics) -> None:
        self.dispatcher = dispatcher
        self.cache = cache
        self.metrics = metrics

    async def _lookup(self, model: ModelState, engine: EngineRequest, ctx: RequestContext,
                      control: CacheControl) -> tuple[Optional[str], Optional[list[pb.Token]]]:
        if self.cache is None or not engine.deterministic:
            return None, None
        key = cache_key(model.name, model.revision, engine)
        if not control.read:
            ctx.cache = "bypass"
            return (key if control.write else None), None
        cached = await self.cache.get(key)
        if cached is not None:
            ctx.cache = "hit"
            self.metrics.cache_hits.labels(model.name).inc()
            now = time.perf_counter()
            ctx.first_token_at = ctx.end_at = now
            ctx.finish = cached[-1].finish
            ctx.generated_tokens = len(cached)
            return key, cached
        ctx.cache = "miss"
        self.metrics.cache_misses.labels(model.name).inc()
        return key, None

    async def _open(self, model: ModelState, engine: EngineRequest, ctx: RequestContext,
                    control: CacheControl) -> tuple[Optional[str], Optional[list[pb.Token]], int]:
        """A request's start, for both APIs: counted as arrived and looked up in the cache;
        on a miss, the tokens it may hold (prompt plus budget) are reserved in the load.
        Returns the key to write its answer under (None: not cached), the cached tokens on
        a hit, and the tokens reserved."""
        model.load.arrived()
        key, cached = await self._lookup(model, engine, ctx, control)
        reserved = 0
        if cached is None:
            reserved = len(engine.input_ids) + engine.token_budget
            model.load.begin(reserved)
        return (key if control.write else None), cached, reserved

    def _store(self, key: Optional[str], tokens: Optional[list[pb.Token]]) -> None:
        if key is not None and tokens and self.cache is not None:
            self.cache.put(key, tokens)

    async def stream(self, model: ModelState, engine: EngineRequest, ctx: RequestContext,
                     control: CacheControl) -> AsyncIterator[pb.Token]:
        key, cached, reserved = await self._open(model, engine, ctx, control)
        if cached is not None:
            for token in cached:
                yield token
            return
        record: Optional[list[pb.Token]] = [] if key is not None else None
        streamed = 0
        try:
            async for token in self.dispatcher.stream(model, engine, ctx):
                if record is not None:
                    record.append(token)
                streamed += 1
                model.load.produced()
                yield token
        finally:
            model.load.end(reserved - streamed)
        self._store(key, record)

    async def collect(self, model: ModelState, engine: EngineRequest, ctx: RequestContext,
                      control: CacheControl) -> list[pb.Token]:
        key, cached, reserved = await self._open(model, engine, ctx, control)
        if cached is not None:
            return cached
        tokens: list[pb.Token] = []
        try:
            tokens = await self.dispatcher.collect(model, engine, ctx)
        finally:
            model.load.produced(len(tokens))
            model.load.end(reserved - len(tokens))
        self._store(key, tokens)
        return tokens

    def record(self, model: str, ctx: RequestContext, error_type: Optional[str]) -> None:
        """Counts one finished request (success or the TGI error type it failed with)."""
        m = self.metrics
        bound = m.model(model)
        labels = bound.labels
        m.tgi_request_count.inc(labels)
        if error_type is not None:
            m.tgi_request_failure.inc((model, error_type))
            return
        m.tgi_request_success.inc(labels)
        total = (ctx.end_at or time.perf_counter()) - ctx.start
        bound.duration.observe(total)
        bound.e2e(ctx.cache).observe(total)
        bound.input_length.observe(ctx.prompt_tokens)
        bound.generated_tokens.observe(ctx.generated_tokens)
        bound.prompt_tokens.inc(ctx.prompt_tokens)
        if ctx.cache == "hit":
            return  # engine timings describe the engine; a replay has none
        bound.generation_tokens.inc(ctx.generated_tokens)
        finish = ctx.finish
        engine_queue_s = finish.queue_time_ns / 1e9 if finish is not None else 0.0
        bound.queue_duration.observe(ctx.queue_s + engine_queue_s)
        if finish is not None and finish.inference_time_ns:
            bound.inference_duration.observe(finish.inference_time_ns / 1e9)
        if ctx.first_token_at is not None:
            bound.ttft.observe(ctx.first_token_at - ctx.start)
            if ctx.end_at is not None and ctx.generated_tokens > 1:
                tpot = (ctx.end_at - ctx.first_token_at) / (ctx.generated_tokens - 1)
                bound.tpot.observe(tpot)
                bound.time_per_token.observe(tpot)
