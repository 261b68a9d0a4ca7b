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


class Plan(Protocol):
    """What the intake reads of an API's plan (``TgiPlan``, ``OpenAIPlan``)."""

    @property
    def engine(self) -> EngineRequest: ...

    @property
    def prompt_tokens(self) -> int: ...


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
            self._adapter(planned.engine, adapter, model)
            ctx.validation_s = (time.perf_counter() - t1) + (t1 - t0)
            ctx.prompt_tokens = planned.prompt_tokens
            ctx.grammar_field = planned.engine.grammar.field if planned.engine.grammar is not None else None
            bucket = await self._charge(key, request, planned.prompt_tokens + planned.engine.token_budget)
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
            self.ratelimiter.refund(admitted.bucket, tpm, admitted.plan.engine.token_budget - ctx.generated_tokens)
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
            async for t in self.generation.stream(admitted.model, admitted.plan.engine, admitted.ctx,
                                                  admitted.control):
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
            tokens = await self.generation.collect(admitted.model, admitted.plan.engine, admitted.ctx,
                                                   admitted.control)
        except RouterError as exc:
            self.finish(admitted, exc.error_type, False)
            exc.for_model(admitted.model.name)
            raise
        except asyncio.CancelledError:
            self.finish(admitted, "cancelled", False)
            raise
        self.finish(admitted, None, True)
        return tokens
