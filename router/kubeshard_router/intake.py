"""What every generation route does around generating, whatever its API (TGI, OpenAI).

``Intake`` is built once from the router's wired parts. Before generating, ``admit``
authenticates, reads and parses the body, resolves the model, waits until its tokenizer
and limits are known, plans the engine request with the API's own plan function, and
takes the rate-limit cost; a refusal at any point counts as a failed request of that
model and re-raises, naming the model on the error once it is known. It returns an
``Admitted`` record. ``events`` (streaming) and ``collect`` then generate, record the
outcome, refund the tokens the request did not use and count the status. Streaming: an
error before the first token re-raises (the response becomes a plain HTTP error); after
it, the stream ends with the API's error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Generic, Optional, Protocol, TypeVar

from fastapi import Request

from kubeshard_proto import pb
from kubeshard_router.activation import Activator
from kubeshard_router.auth import ApiKey, ApiKeys
from kubeshard_router.backends.model import ModelState
from kubeshard_router.backends.registry import Registry
from kubeshard_router.cache import CacheControl
from kubeshard_router.config import RouterConfig
from kubeshard_router.dispatch import RequestContext
from kubeshard_router.engine_request import EngineRequest
from kubeshard_router.errors import ModelNotFound, NoBackend, PayloadTooLarge, RouterError, ValidationFailed
from kubeshard_router.generation import GenerationService
from kubeshard_router.metrics import RouterMetrics
from kubeshard_router.ratelimit import RateLimiter
from kubeshard_router.tokenization import ModelTokenizer
from kubeshard_router.validation import Limits, RequestBody, parse_body

log = logging.getLogger("kubeshard.router.http")

DEFAULT_ALIAS = "tgi"  # the `model` the text-generation client's chat() sends
# generations of one request of several (a completion's prompts) running at once: the rest
# wait their turn inside the request, so that a long list neither fills the model's
# admission queue (a 429 for all of it) nor crowds out other callers
GENERATIONS_AT_ONCE = 64


class Plan(Protocol):
    """What the intake reads of an API's plan (``TgiPlan``, ``OpenAIPlan``)."""

    @property
    def engine(self) -> EngineRequest: ...

    @property
    def engines(self) -> tuple[EngineRequest, ...]:
        """Every generation the request asks for: its engine, or one per prompt of a
        completion that holds several (generated side by side, their sequences numbered
        one prompt after another)."""

    @property
    def prompt_tokens(self) -> int: ...


def _budget(plan: Plan) -> int:
    return sum(engine.token_budget for engine in plan.engines)


B = TypeVar("B", bound=RequestBody)
P = TypeVar("P", bound=Plan)


@dataclass(slots=True)
class Admitted(Generic[B, P]):
    """One admitted request of one route; the API module renders its answer."""

    route: str
    body: B
    plan: P
    model: ModelState
    ctx: RequestContext
    control: CacheControl
    key: Optional[ApiKey]
    bucket: Optional[str]  # the rate-limit bucket charged, None when no limit applies


@dataclass(eq=False)
class Intake:
    config: RouterConfig
    registry: Registry
    activator: Activator
    generation: GenerationService
    ratelimiter: RateLimiter
    metrics: RouterMetrics
    api_keys: Optional[ApiKeys]

    # before: steps ------------------------------------------------------------------------

    def authenticate(self, request: Request) -> Optional[ApiKey]:
        if self.api_keys is None:
            return None
        return self.api_keys.authenticate(request.headers.get("authorization"))

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes is over the {limit}-byte limit")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body is over the {limit}-byte limit")
            chunks.append(chunk)
        return b"".join(chunks)

    def default_model(self) -> Optional[str]:
        if self.config.default_model:
            return self.config.default_model
        if len(self.registry.models) == 1:
            return next(iter(self.registry.models))
        return None

    def resolve_adapter(self, name: Optional[str]) -> tuple[ModelState, Optional[str]]:
        """The model and LoRA adapter a ``model`` field names: a model, or an adapter one
        of the models serves (OpenAI/vLLM: ``model: "<adapter>"``)."""
        if name and name not in self.registry.models and name != DEFAULT_ALIAS:
            for model in self.registry.models.values():
                if name in model.adapters:
                    return model, name
        return self.resolve(name), None

    def resolve(self, name: Optional[str]) -> ModelState:
        models = self.registry.models
        if name and name in models:
            return models[name]
        if not name or name == DEFAULT_ALIAS:
            default = self.default_model()
            if default is None:
                raise ValidationFailed("`model` is required: this router serves "
                                       + ", ".join(f"`{m}`" for m in sorted(models)), param="model")
            model = models.get(default)
            if model is None:
                raise ModelNotFound(default, list(models))
            return model
        raise ModelNotFound(name, list(models))

    async def prepared(self, model: ModelState) -> tuple[ModelTokenizer, Limits]:
        """The model's tokenizer and limits, waiting for a first replica if none was seen yet."""
        if model.tokenizer is None or model.limits is None:
            await self.activator.wait_ready(model)
        if model.tokenizer is None or model.limits is None:
            raise NoBackend(f"model `{model.name}` has no tokenizer yet: no replica answered Info")
        return model.tokenizer, model.limits

    @staticmethod
    def _adapter(engine: EngineRequest, adapter: Optional[str], model: ModelState) -> None:
        """The request's LoRA adapter: the one its model field named, or TGI's adapter_id."""
        if adapter is not None:
            engine.adapter = adapter
        elif engine.adapter is not None and engine.adapter not in model.adapters:
            served = ", ".join(f"`{a}`" for a in sorted(model.adapters)) or "none"
            raise ValidationFailed(f"`adapter_id` {engine.adapter!r} is not an adapter of model `{model.name}` "
                                   f"(adapters: {served})", param="adapter_id")

    async def _charge(self, key: Optional[ApiKey], request: Request, cost_tokens: int) -> Optional[str]:
        """Charges the caller's rate limits; returns the bucket name used (for refunds)."""
        rpm = self.config.rate_limit_rpm
        tpm = self.config.rate_limit_tpm
        if key is not None:
            rpm = key.rpm if key.rpm is not None else rpm
            tpm = key.tpm if key.tpm is not None else tpm
            bucket = key.name
        else:
            bucket = f"ip:{request.client.host if request.client else 'unknown'}"
        if rpm <= 0 and tpm <= 0:
            return None
        try:
            await self.ratelimiter.check(bucket, rpm, tpm, cost_tokens)
        except RouterError:
            self.metrics.rate_limited.labels(bucket).inc()
            raise
        return bucket

    async def admit(self, request: Request, route: str, body_type: type[B],
                    plan: Callable[[B, ModelTokenizer, Limits], P],
                    model_name: Optional[str] = None) -> Admitted[B, P]:
        """Admits one request: ``model_name`` (from the path) or else the body names the model;
        ``plan`` is the API's validation, a pure function of the body, tokenizer and limits."""
        label = model_name or "-"
        model: Optional[ModelState] = None
        try:
            key = self.authenticate(request)
            raw = await self.read_body(request)
            t0 = time.perf_counter()
            body = parse_body(raw, body_type)
            model, adapter = self.resolve_adapter(model_name or body.requested_model())
            label = model.name
            tokenizer, limits = await self.prepared(model)
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            ctx = RequestContext(request_id=request_id[:128], model=model.name)
            t1 = time.perf_counter()
            planned = plan(body, tokenizer, limits)
            for engine in planned.engines:
                self._adapter(engine, adapter, model)
            ctx.validation_s = (time.perf_counter() - t1) + (t1 - t0)
            ctx.prompt_tokens = planned.prompt_tokens
            ctx.grammar_field = planned.engine.grammar.field if planned.engine.grammar is not None else None
            bucket = await self._charge(key, request, planned.prompt_tokens + _budget(planned))
        except RouterError as exc:
            self.metrics.tgi_request_count.inc((label,))
            self.metrics.tgi_request_failure.inc((label, exc.error_type))
            if model is not None:
                exc.for_model(model.name)
            raise
        control = CacheControl(request.headers.get("cache-control"))
        return Admitted(route, body, planned, model, ctx, control, key, bucket)

    # after: generate, then account ---------------------------------------------------------

    def finish(self, admitted: Admitted[B, P], error_type: Optional[str], started: bool) -> None:
        """Called once when the request ends (streams call it from their generator)."""
        name, ctx, route = admitted.model.name, admitted.ctx, admitted.route
        self.generation.record(name, ctx, error_type)
        if admitted.bucket is not None:
            key = admitted.key
            tpm = key.tpm if key is not None and key.tpm is not None else self.config.rate_limit_tpm
            self.ratelimiter.refund(admitted.bucket, tpm, _budget(admitted.plan) - ctx.generated_tokens)
        if started or error_type is None:
            self.metrics.count_request(name, route, 200)
        elif error_type == "cancelled":
            self.metrics.count_request(name, route, 499)  # the client left before the first token

    async def events(self, admitted: Admitted[B, P],
                     render: Callable[[AsyncIterator[pb.Token]], AsyncIterator[bytes]],
                     error_event: Callable[[RouterError], bytes]) -> AsyncIterator[bytes]:
        """Streams the generation: ``render`` turns its tokens into SSE events, and
        ``error_event`` renders an error that comes after the first token."""
        received = 0

        async def tokens() -> AsyncIterator[pb.Token]:
            nonlocal received
            async for t in self._stream(admitted):
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
            log.exception("request %s: stream failed", admitted.ctx.request_id)
            error_type = "internal"
            if not received:
                raise
            yield error_event(RouterError(f"internal router error ({type(exc).__name__})"))
        finally:
            self.finish(admitted, error_type, received > 0)

    async def collect(self, admitted: Admitted[B, P]) -> list[pb.Token]:
        """Generates the whole answer (non-streaming routes)."""
        try:
            tokens = await self._collect(admitted)
        except RouterError as exc:
            self.finish(admitted, exc.error_type, False)
            exc.for_model(admitted.model.name)
            raise
        except asyncio.CancelledError:
            self.finish(admitted, "cancelled", False)
            raise
        self.finish(admitted, None, True)
        return tokens

    # several prompts in one request ---------------------------------------------------------

    def _parts(self, admitted: Admitted[B, P]) -> list[tuple[EngineRequest, RequestContext, int]]:
        """Each generation of a request of several: its engine, its own context (the
        request's is their sum, see ``merge_contexts``) and the first sequence number of
        its tokens."""
        parts, offset = [], 0
        for k, engine in enumerate(admitted.plan.engines):
            ctx = RequestContext(request_id=f"{admitted.ctx.request_id}-{k}", model=admitted.ctx.model,
                                 start=admitted.ctx.start, validation_s=admitted.ctx.validation_s,
                                 prompt_tokens=len(engine.input_ids), grammar_field=admitted.ctx.grammar_field)
            parts.append((engine, ctx, offset))
            offset += engine.n
        return parts

    async def _stream(self, admitted: Admitted[B, P]) -> AsyncIterator[pb.Token]:
        model, control = admitted.model, admitted.control
        if len(admitted.plan.engines) == 1:
            async for t in self.generation.stream(model, admitted.plan.engine, admitted.ctx, control):
                yield t
            return
        parts = self._parts(admitted)
        queue: asyncio.Queue = asyncio.Queue()
        turns = asyncio.Semaphore(GENERATIONS_AT_ONCE)

        async def run(engine: EngineRequest, ctx: RequestContext, offset: int) -> None:
            finished = 0
            try:
                async with turns:
                    async for t in self.generation.stream(model, engine, ctx, control):
                        if t.HasField("finish"):
                            finished += 1
                            if finished == engine.n:  # its last: the counts a final usage chunk reads
                                add_finished(admitted.ctx, ctx)
                        await queue.put(renumbered(t, offset))
                await queue.put(None)
            except BaseException as exc:  # handed to the reader, which raises it
                await queue.put(exc)
                raise

        tasks = [asyncio.create_task(run(*part)) for part in parts]
        try:
            done = 0
            while done < len(tasks):
                item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            merge_contexts(admitted.ctx, [ctx for _, ctx, _ in parts])

    async def _collect(self, admitted: Admitted[B, P]) -> list[pb.Token]:
        model, control = admitted.model, admitted.control
        if len(admitted.plan.engines) == 1:
            return await self.generation.collect(model, admitted.plan.engine, admitted.ctx, control)
        parts = self._parts(admitted)
        turns = asyncio.Semaphore(GENERATIONS_AT_ONCE)

        async def run(engine: EngineRequest, ctx: RequestContext) -> list[pb.Token]:
            async with turns:
                return await self.generation.collect(model, engine, ctx, control)

        tasks = [asyncio.create_task(run(engine, ctx)) for engine, ctx, _ in parts]
        try:
            answers = await asyncio.gather(*tasks)
        finally:  # one failed (or the client left): the others stop too
            for task in tasks:
                task.cancel()
            merge_contexts(admitted.ctx, [ctx for _, ctx, _ in parts])
        return [renumbered(t, offset) for (_, _, offset), tokens in zip(parts, answers) for t in tokens]


def renumbered(token: pb.Token, offset: int) -> pb.Token:
    """``token`` as sequence ``offset`` + its own (a copy: cached answers are shared)."""
    if offset == 0:
        return token
    out = pb.Token()
    out.CopyFrom(token)
    out.sequence += offset
    return out


def _cached_sum(finishes: list[pb.FinishDetails]) -> pb.FinishDetails:
    """The last finish, with every one's cached prompt tokens."""
    out = pb.FinishDetails()
    out.CopyFrom(finishes[-1])
    out.cached_prompt_tokens = sum(f.cached_prompt_tokens for f in finishes)
    return out


def add_finished(into: RequestContext, part: RequestContext) -> None:
    """Counts a generation of a request of several that has just ended (its tokens and
    cached prompt tokens), as it ends."""
    into.generated_tokens += part.generated_tokens
    if part.finish is not None:
        into.finish = part.finish if into.finish is None else _cached_sum([into.finish, part.finish])


def merge_contexts(into: RequestContext, parts: list[RequestContext]) -> None:
    """A request of several generations, as one: tokens and cached prompt tokens summed,
    its first token the first of any, its end the last; a cache hit only when every
    part was one."""
    into.generated_tokens = sum(p.generated_tokens for p in parts)
    into.retries = sum(p.retries for p in parts)
    into.queue_s = max(p.queue_s for p in parts)
    firsts = [p.first_token_at for p in parts if p.first_token_at is not None]
    into.first_token_at = min(firsts) if firsts else None
    ends = [p.end_at for p in parts if p.end_at is not None]
    into.end_at = max(ends) if len(ends) == len(parts) else None
    into.replica = next((p.replica for p in reversed(parts) if p.replica), into.replica)
    caches = {p.cache for p in parts}
    into.cache = caches.pop() if len(caches) == 1 else "miss" if "miss" in caches else "bypass"
    finishes = [p.finish for p in parts if p.finish is not None]
    if finishes:
        into.finish = _cached_sum(finishes)
