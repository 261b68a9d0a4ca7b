"""OpenAI's HTTP API: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, AsyncIterator, Optional

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from kubeshard_proto import pb
from kubeshard_router import __version__
from kubeshard_router.backends.model import ModelState
from kubeshard_router.dispatch import RequestContext
from kubeshard_router.http import ORJSONResponse, error_response, get_intake, get_state, json_body_doc
from kubeshard_router.openai_render import (FINISH, CompletionLogprobs, StopTrimmer, best_sequences,
                                            chat_logprob, prompt_logprobs, stop_reason, trim_stop, usage)
from kubeshard_router.openai_schema import (ChatCompletionRequest, CompletionRequest, OpenAIPlan,
                                            plan_chat, plan_completion)
from kubeshard_router.errors import Forbidden, NoBackend, ValidationFailed
from kubeshard_router.sse import SSE_DONE, EventStreamResponse, sse_event
from kubeshard_router.tool_formats import FORMATS
from kubeshard_router.tools import ToolStream, parse_calls
from kubeshard_router.validation import parse_body

if TYPE_CHECKING:
    from kubeshard_router.state import RouterState

router = APIRouter(prefix="/v1", tags=["OpenAI"])


def _fingerprint(model: ModelState) -> str:
    return f"kubeshard-{__version__}-{model.revision}"


def _answered_by(model: ModelState, plan: OpenAIPlan) -> str:
    """The response's ``model``: the LoRA adapter a request used, else the model (as vLLM)."""
    return plan.engine.adapter or model.name


class _Shapes:
    """Chunk and response builders for one request (chat or text completion)."""

    def __init__(self, chat: bool, model: ModelState, ctx: RequestContext, plan: OpenAIPlan) -> None:
        self.chat = chat
        self.plan = plan
        self.base = {"id": ("chatcmpl-" if chat else "cmpl-") + ctx.request_id,
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": _answered_by(model, plan),
                     "system_fingerprint": _fingerprint(model)}
        if plan.include_usage:
            self.base["usage"] = None

    def chunk(self, text: str, finish_reason: Optional[str], logprobs: Optional[dict],
              index: int = 0, extra: Optional[dict] = None) -> bytes:
        if self.chat:
            delta: dict = {"role": "assistant", "content": text, "tool_calls": None}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if extra:
            choice.update(extra)
        return sse_event({**self.base, "choices": [choice]})

    def tool_chunk(self, items: list[dict], index: int) -> bytes:
        """One delta with tool-call items (ToolStream's); TGI's shape (model "tgi") is one
        object per delta."""
        out = b""
        for group in ([[item] for item in items] if self.plan.tgi_shapes else [items]):
            delta = {"role": "assistant", "content": None,
                     "tool_calls": group[0] if self.plan.tgi_shapes else group}
            out += sse_event({**self.base, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                        "finish_reason": None}]})
        return out

    def token_logprobs(self, t: pb.Token) -> Optional[dict]:
        if self.plan.logprobs is None:
            return None
        if self.chat:
            return {"content": [chat_logprob(t)]}
        lp = CompletionLogprobs()
        lp.add_token(t)
        return lp.as_dict()


def _text(t: pb.Token, plan: OpenAIPlan) -> str:
    if t.special and plan.skip_special_tokens and t.text not in plan.special_kept:
        return ""
    return t.text


async def _events(tokens: AsyncIterator[pb.Token], model: ModelState, plan: OpenAIPlan, ctx: RequestContext,
                  chat: bool) -> AsyncIterator[bytes]:
    """SSE chunks; with n > 1 the choices' chunks interleave, each with its index."""
    shapes = _Shapes(chat, model, ctx, plan)
    trimmers: dict[int, StopTrimmer] = {}
    texts: dict[int, str] = {}
    calls: dict[int, ToolStream] = {}
    parse = chat and plan.tools is not None and plan.tools.parses
    left = sum(engine.n for engine in plan.engines)
    per = plan.engine.n  # sequences per prompt: sequence i is prompt i // per's

    def content(i: int, emit: str, final: bool = False) -> tuple[str, bytes]:
        """Text to stream as content, and the tool-call deltas that came with it."""
        if not parse:
            return emit, b""
        stream = calls[i]
        text, items = stream.feed(emit)
        if final:
            rest, late = stream.finish()
            text, items = text + rest, items + late
        return text, shapes.tool_chunk(items, i) if items else b""
    async for t in tokens:
        i = t.sequence
        out = b""
        if i not in trimmers:
            trimmers[i], texts[i] = StopTrimmer(plan.stop, plan.keep_stop), ""
            calls[i] = ToolStream(f"call_{ctx.request_id[:16]}-{i}", plan.tools.format if parse else FORMATS["hermes"],
                                  incremental=not plan.tgi_shapes)
            extra = ({"prompt_logprobs": prompt_logprobs(t)} if plan.prompt_logprobs is not None and i % per == 0
                     and t.prefill else None)
            if chat:
                out += shapes.chunk("", None, None, i, extra)
            elif plan.echo:
                out += shapes.chunk(plan.prompts[i // per].prompt_text, None, None, i, extra)
            elif extra:
                out += shapes.chunk("", None, None, i, extra)
        text = _text(t, plan)
        texts[i] += text
        logprobs = shapes.token_logprobs(t)
        if t.HasField("finish"):
            left -= 1
            stopped = t.finish.reason == pb.FINISH_REASON_STOP_SEQUENCE
            reason = stop_reason(t.finish, t, texts[i], plan.stop)
            rest, tool_delta = content(i, trimmers[i].finish(text, stopped), final=True)
            out += tool_delta
            finish = "tool_calls" if parse and calls[i].calls else FINISH.get(t.finish.reason, "stop")
            out += shapes.chunk(rest, finish, logprobs, i, {"stop_reason": reason} if reason is not None else None)
            if left == 0:
                if plan.include_usage:
                    out += sse_event({**shapes.base, "choices": [],
                                      "usage": usage(ctx.prompt_tokens, ctx.generated_tokens, ctx.finish)})
                if not plan.tgi_shapes:  # the text-generation client cannot parse "[DONE]"
                    out += SSE_DONE
        else:
            emit, tool_delta = content(i, trimmers[i].feed(text))
            if emit or logprobs is not None:
                out += shapes.chunk(emit, None, logprobs, i)
            out += tool_delta
        if out:
            yield out


def _choice(chat: bool, plan: OpenAIPlan, tokens: list[pb.Token], index: int, first: pb.Token,
            call_id: str = "call") -> dict:
    finish = tokens[-1].finish
    raw = "".join(_text(t, plan) for t in tokens)
    text = trim_stop(raw, plan.stop, finish, plan.keep_stop)
    reason = FINISH.get(finish.reason, "stop")
    extra = {}
    why = stop_reason(finish, tokens[-1], raw, plan.stop)
    if why is not None:
        extra["stop_reason"] = why
    if chat:
        logprobs = ({"content": [chat_logprob(t) for t in tokens]} if plan.logprobs is not None else None)
        message: dict = {"role": "assistant", "content": text}
        if plan.tools is not None and plan.tools.parses:
            message["content"], calls = parse_calls(text, f"{call_id}-{index}", plan.tools.format)
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason, **extra}
    lp = None
    if plan.logprobs is not None:
        lp = CompletionLogprobs()
        if plan.echo:
            for p in first.prefill:
                lp.add(p.text, p.logprob if p.HasField("logprob") else None, None)
        for t in tokens:
            lp.add_token(t)
    if plan.prompt_logprobs is not None:
        extra["prompt_logprobs"] = prompt_logprobs(first)
    return {"index": index, "text": (plan.prompt_text + text) if plan.echo else text,
            "logprobs": lp.as_dict() if lp is not None else None, "finish_reason": reason, **extra}


def _response(chat: bool, model: ModelState, ctx: RequestContext, plan: OpenAIPlan,
              tokens: list[pb.Token]) -> dict:
    common = {"created": int(time.time()), "model": _answered_by(model, plan),
              "system_fingerprint": _fingerprint(model),
              "usage": usage(ctx.prompt_tokens, ctx.generated_tokens, ctx.finish)}
    call_id = f"call_{ctx.request_id[:16]}"
    per = plan.engine.n  # sequences per prompt (best_of); prompt k's n choices take indexes k*n ..
    choices = []
    for k, prompt in enumerate(plan.prompts):
        mine = [t for t in tokens if k * per <= t.sequence < (k + 1) * per]
        first = next(t for t in mine if t.sequence == k * per)
        choices += [_choice(chat, prompt, seq, k * plan.n + j, first, call_id)
                    for j, seq in enumerate(best_sequences(mine, plan.n))]
    first = next(t for t in tokens if t.sequence == 0)
    if chat:
        body = {"id": "chatcmpl-" + ctx.request_id, "object": "chat.completion", **common, "choices": choices}
        if plan.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs(first)
        return body
    return {"id": "cmpl-" + ctx.request_id, "object": "text_completion", **common, "choices": choices}


async def _serve(request: Request, chat: bool) -> Response:
    route = "/v1/chat/completions" if chat else "/v1/completions"
    intake = get_intake(request)
    admitted = (await intake.admit(request, route, ChatCompletionRequest, plan_chat) if chat
                else await intake.admit(request, route, CompletionRequest, plan_completion))
    req, plan, model, ctx = admitted.body, admitted.plan, admitted.model, admitted.ctx
    metrics = intake.metrics

    if req.stream:
        return EventStreamResponse(
            intake.events(admitted, lambda tokens: _events(tokens, model, plan, ctx, chat),
                          lambda exc: sse_event(exc.openai_body())),
            render_error=lambda exc: error_response(exc, "openai", metrics, model.name, route),
            headers={"x-request-id": ctx.request_id, "x-kubeshard-model": model.name},
            late_headers=lambda: {"x-kubeshard-cache": ctx.cache},
            on_disconnect=lambda: metrics.client_disconnects.labels(model.name).inc())
    tokens = await intake.collect(admitted)
    return ORJSONResponse(_response(chat, model, ctx, plan, tokens),
                          headers={"x-request-id": ctx.request_id, "x-kubeshard-cache": ctx.cache,
                                   "x-kubeshard-model": model.name})


@router.post("/completions", openapi_extra=json_body_doc(CompletionRequest), summary="Text completion")
async def completions(request: Request) -> Response:
    return await _serve(request, chat=False)


@router.post("/chat/completions", openapi_extra=json_body_doc(ChatCompletionRequest),
             summary="Chat completion (the model's chat template)")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, chat=True)


def _model_card(state: "RouterState", model: ModelState) -> dict:
    info = model.info
    return {"id": model.name, "object": "model", "created": int(state.started_at), "owned_by": "kubeshard",
            "root": info.model_id if info else None, "revision": model.revision,
            "max_model_len": model.limits.max_total_tokens if model.limits else None,
            "ready_replicas": len(model.ready_replicas)}


def _adapter_card(state: "RouterState", model: ModelState, adapter: pb.AdapterInfo) -> dict:
    return {"id": adapter.name, "object": "model", "created": int(state.started_at), "owned_by": "kubeshard",
            "root": adapter.source, "parent": model.name, "revision": model.revision,
            "max_model_len": model.limits.max_total_tokens if model.limits else None,
            "ready_replicas": len(model.ready_replicas)}


@router.get("/models", summary="Models (and their LoRA adapters) served by this router")
async def list_models(request: Request) -> Response:
    state = get_state(request)
    state.intake.authenticate(request)
    cards = []
    for m in sorted(state.registry.models.values(), key=lambda m: m.name):
        cards.append(_model_card(state, m))
        cards.extend(_adapter_card(state, m, a) for _, a in sorted(m.adapters.items()))
    return ORJSONResponse({"object": "list", "data": cards})


@router.get("/models/{model:path}", summary="One model or adapter")
async def get_model(request: Request, model: str) -> Response:
    state = get_state(request)
    state.intake.authenticate(request)
    found, adapter = state.intake.resolve_adapter(model)
    if adapter is not None:
        return ORJSONResponse(_adapter_card(state, found, found.adapters[adapter]))
    return ORJSONResponse(_model_card(state, found))


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(..., min_length=1, description="The name requests use (`model`, TGI `adapter_id`).")
    lora_path: str = Field("", description="A PEFT adapter folder as the model's shard pods see it.")
    model: Optional[str] = Field(None, description="The base model; default: the router's default model.")


async def _each_replica(model: ModelState, call) -> None:
    """Runs ``call(client)`` on every ready replica of ``model``; a refusal becomes a 4xx.
    Replicas that had the adapter already (or, unloading, had it not) are passed over, so
    a retried call converges; when every replica says so, the call is refused."""
    replicas = [r for r in model.ready_replicas if hasattr(r.client, "load_adapter")]
    if not replicas:
        raise NoBackend(f"model `{model.name}` has no ready replica that loads LoRA adapters")
    errors, converged = [], []
    for replica in replicas:
        try:
            await call(replica.client)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND):
                converged.append((exc.code(), exc.details()))
            else:
                errors.append((exc.code(), exc.details()))
    if errors or len(converged) == len(replicas):
        code, details = (errors or converged)[0]
        if code == grpc.StatusCode.PERMISSION_DENIED:  # the replica's own --lora-root is unset
            raise Forbidden(f"model `{model.name}`: {details}", code="runtime_lora_disabled")
        param = "lora_path" if code == grpc.StatusCode.INVALID_ARGUMENT else "lora_name"
        raise ValidationFailed(f"`{param}`: {details or code.name}", param=param)
    for replica in replicas:  # the adapters in each replica's Info changed: read it again
        try:
            info = await replica.client.info()
            await model.adopt_info(info)
            replica.set_info(info)
        except grpc.aio.AioRpcError:
            pass


async def _lora_change(request: Request) -> tuple["RouterState", LoadLoraRequest]:
    """The router and the body of an admin's load or unload, once allowed and parsed."""
    state = get_state(request)
    state.admin.authorize_runtime_lora(request)
    return state, parse_body(await request.body(), LoadLoraRequest)


@router.post("/load_lora_adapter", summary="Load a LoRA adapter on every replica of a model (vLLM's route; admin)")
async def load_lora_adapter(request: Request) -> Response:
    state, body = await _lora_change(request)
    path = state.admin.lora_path(body.lora_path)
    model = state.intake.resolve(body.model)
    await _each_replica(model, lambda client: client.load_adapter(body.lora_name, path))
    # replicas that start later, through whichever router, load it too
    await state.registry.runtime_adapters.loaded(model, body.lora_name, path)
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


@router.post("/unload_lora_adapter", summary="Unload a LoRA adapter from every replica of a model (admin)")
async def unload_lora_adapter(request: Request) -> Response:
    state, body = await _lora_change(request)
    model = state.intake.resolve(body.model)
    await _each_replica(model, lambda client: client.unload_adapter(body.lora_name))
    await state.registry.runtime_adapters.unloaded(model, body.lora_name)
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")
