"""What every generation route does around generating, whatever its API (TGI, OpenAI).

Before: authenticate, read and parse the body, resolve the model, wait until its
tokenizer and limits are known, plan the engine request, and take the rate-limit cost —
a refusal at any point counts as a failed request of that model and re-raises. After:
record the outcome, refund the tokens the request did not use, count the status.
Streaming: an error before the first token re-raises (the response becomes a plain HTTP
error); after it, the stream ends with the API's error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request

from kubeshard_proto import pb
from kubeshard_router.backends.model import ModelState
from kubeshard_router.cache import CacheControl
from kubeshard_router.dispatch import RequestContext
from kubeshard_router.errors import RouterError
from kubeshard_router.http import get_state

log = logging.getLogger("kubeshard.router.http")


@dataclass
class Intake:
    """An admitted request of one route; the API module renders its answer."""

    state: Any
    route: str
    model: ModelState
    ctx: RequestContext
    plan: Any                 # the API's plan; ``plan.engine`` is the engine request
    control: CacheControl
    key: Any
    bucket: Optional[str]

    def finish(self, error_type: Optional[str], started: bool) -> None:
        """Called once when the request ends (streams call it from their generator)."""
        state, name = self.state, self.model.name
        state.generation.record(name, self.ctx, error_type)
        state.refund(self.bucket, self.key, self.plan.engine.max_new_tokens - self.ctx.generated_tokens)
        if started or error_type is None:
            state.count(name, self.route, 200)
        elif error_type == "cancelled":
            state.count(name, self.route, 499)  # the client left before the first token

    async def events(self, render: Callable[[AsyncIterator[pb.Token]], AsyncIterator[bytes]],
                     error_event: Callable[[RouterError], bytes]) -> AsyncIterator[bytes]:
        """Streams the generation: ``render`` turns its tokens into SSE events, and
        ``error_event`` renders an error that comes after the first token."""
        received = 0

        async def tokens() -> AsyncIterator[pb.Token]:
            nonlocal received
            async for t in self.state.generation.stream(self.model, self.plan.engine, self.ctx, self.control):
                received += 1
                yield t

        error_type: Optional[str] = "cancelled"
        try:
            async for chunk in render(tokens()):
                yield chunk
            error_type = None
        except RouterError as exc:
            error_type = exc.error_type
            if not received:
                raise  # nothing sent yet: the response becomes a plain HTTP error
            yield error_event(exc)
        except Exception as exc:  # a router bug mid-stream: end with an event, never a torn stream
            log.exception("request %s: stream failed", self.ctx.request_id)
            error_type = "internal"
            if not received:
                raise
            yield error_event(RouterError(f"internal router error ({type(exc).__name__})"))
        finally:
            self.finish(error_type, received > 0)

    async def collect(self) -> list[pb.Token]:
        """Generates the whole answer (non-streaming routes)."""
        try:
            tokens = await self.state.generation.collect(self.model, self.plan.engine, self.ctx, self.control)
        except RouterError as exc:
            self.finish(exc.error_type, False)
            raise
        except asyncio.CancelledError:
            self.finish("cancelled", False)
            raise
        self.finish(None, True)
        return tokens


async def take_in(request: Request, route: str, parse: Callable[[bytes], Any],
                  model_name: Callable[[Any], Optional[str]], plan: Callable[[Any, Any, Any], Any],
                  label: str = "-") -> tuple[Any, Intake]:
    """Admits one request: returns the parsed body and its ``Intake``."""
    state = get_state(request)
    try:
        key = state.authenticate(request)
        body = await state.read_body(request)
        t0 = time.perf_counter()
        req = parse(body)
        model = state.resolve(model_name(req))
        label = request.state.kubeshard_model = model.name
        tokenizer, limits = await state.prepared(model)
        ctx = state.new_context(request, model.name)
        t1 = time.perf_counter()
        planned = plan(req, tokenizer, limits)
        ctx.validation_s = (time.perf_counter() - t1) + (t1 - t0)
        ctx.prompt_tokens = planned.prompt_tokens
        bucket = await state.check_rate(key, request, planned.prompt_tokens + planned.engine.max_new_tokens)
    except RouterError as exc:
        state.metrics.tgi_request_count.inc((label,))
        state.metrics.tgi_request_failure.inc((label, exc.error_type))
        raise
    control = CacheControl(request.headers.get("cache-control"))
    return req, Intake(state, route, model, ctx, planned, control, key, bucket)
