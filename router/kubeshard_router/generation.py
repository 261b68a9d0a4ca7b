"""Cache in front of the dispatcher, and the per-request bookkeeping both APIs share."""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Optional

from kubeshard_proto import pb
from kubeshard_router.backends.registry import ModelState
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

    async def stream(self, model: ModelState, engine: EngineRequest, ctx: RequestContext,
                     control: CacheControl) -> AsyncIterator[pb.Token]:
        key, cached = await self._lookup(model, engine, ctx, control)
        if cached is not None:
            for token in cached:
                yield token
            return
        record: Optional[list[pb.Token]] = [] if key is not None and control.write else None
        async for token in self.dispatcher.stream(model, engine, ctx):
            if record is not None:
                record.append(token)
            yield token
        if record and self.cache is not None:
            self.cache.put(key, record)

    async def collect(self, model: ModelState, engine: EngineRequest, ctx: RequestContext,
                      control: CacheControl) -> list[pb.Token]:
        key, cached = await self._lookup(model, engine, ctx, control)
        if cached is not None:
            return cached
        tokens = await self.dispatcher.collect(model, engine, ctx)
        if key is not None and control.write and self.cache is not None:
            self.cache.put(key, tokens)
        return tokens

    def record(self, model: str, ctx: RequestContext, error_type: Optional[str]) -> None:
        """Counts one finished request (success or the TGI error type it failed with)."""
        m = self.metrics
        labels = (model,)
        m.tgi_request_count.inc(labels)
        now = time.perf_counter()
        if error_type is not None:
            m.tgi_request_failure.inc((model, error_type))
            return
        m.tgi_request_success.inc(labels)
        total = (ctx.end_at or now) - ctx.start
        m.tgi_request_duration.labels(model).observe(total)
        m.e2e.labels(model, ctx.cache).observe(total)
        m.tgi_request_input_length.labels(model).observe(ctx.prompt_tokens)
        m.tgi_request_generated_tokens.labels(model).observe(ctx.generated_tokens)
        m.prompt_tokens.labels(model).inc(ctx.prompt_tokens)
        if ctx.cache == "hit":
            return  # engine timings describe the engine; a replay has none
        m.generation_tokens.labels(model).inc(ctx.generated_tokens)
        finish = ctx.finish
        engine_queue_s = finish.queue_time_ns / 1e9 if finish is not None else 0.0
        m.tgi_request_queue_duration.labels(model).observe(ctx.queue_s + engine_queue_s)
        if finish is not None and finish.inference_time_ns:
            m.tgi_request_inference_duration.labels(model).observe(finish.inference_time_ns / 1e9)
        if ctx.first_token_at is not None:
            m.ttft.labels(model).observe(ctx.first_token_at - ctx.start)
            if ctx.end_at is not None and ctx.generated_tokens > 1:
                tpot = (ctx.end_at - ctx.first_token_at) / (ctx.generated_tokens - 1)
                m.tpot.labels(model).observe(tpot)
                m.tgi_request_mean_time_per_token_duration.labels(model).observe(tpot)
