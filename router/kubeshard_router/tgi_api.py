"""TGI's HTTP API: ``/`` (compat), ``/generate``, ``/generate_stream``, ``/info``, ``/health``,
the same under ``/models/{name}/``, and ``/metrics``."""

from __future__ import annotations

import time
from typing import AsyncIterator, Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kubeshard_proto import pb
from kubeshard_router import __version__
from kubeshard_router.backends.model import ModelState
from kubeshard_router.dispatch import RequestContext
from kubeshard_router.http import ORJSONResponse, error_response, get_intake, get_state, json_body_doc
from kubeshard_router.openai_render import split_sequences
from kubeshard_router.sse import EventStreamResponse, sse_event
from kubeshard_router.tgi_schema import CompatGenerateRequest, GenerateRequest, TgiPlan, plan_tgi
from kubeshard_router.tokenization import ModelTokenizer
from kubeshard_router.validation import Limits

router = APIRouter(tags=["TGI"])

FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_EOS_TOKEN: "eos_token",
                  pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence", pb.FINISH_REASON_STOP_TOKEN: "stop_sequence"}


def _token(t: pb.Token) -> dict:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def _top(t: pb.TopToken) -> dict:
    return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}


def _details(tokens: list[pb.Token], plan: TgiPlan, first: pb.Token) -> dict:
    finish = tokens[-1].finish
    details = {
        "finish_reason": FINISH_REASONS.get(finish.reason, "length"),
        "generated_tokens": finish.generated_tokens or len(tokens),
        "seed": finish.seed if finish.HasField("seed") else None,
        "prefill": [{"id": p.id, "text": p.text, "logprob": p.logprob if p.HasField("logprob") else None}
                    for p in first.prefill] if plan.decoder_input_details else [],
        "tokens": [_token(t) for t in tokens],
    }
    if plan.engine.top_n_tokens:
        details["top_tokens"] = [[_top(a) for a in t.top_tokens] for t in tokens]
    return details


def timing_headers(ctx: RequestContext, model: ModelState, compute_chars: int) -> dict[str, str]:
    now = time.perf_counter()
    end = ctx.end_at or now
    total = end - ctx.start
    finish = ctx.finish
    engine_queue = finish.queue_time_ns / 1e9 if finish is not None and ctx.cache != "hit" else 0.0
    if finish is not None and finish.inference_time_ns and ctx.cache != "hit":
        inference = finish.inference_time_ns / 1e9
    else:
        inference = end - (ctx.first_token_at or end)
    per_token = inference / max(1, ctx.generated_tokens)
    device = model.info.device_type if model.info is not None else "unknown"
    return {
        "x-compute-type": "cache" if ctx.cache == "hit" else device,
        "x-compute-time": f"{total:.6f}",
        "x-compute-characters": str(compute_chars),
        "x-total-time": str(int(total * 1000)),
        "x-validation-time": str(int(ctx.validation_s * 1000)),
        "x-queue-time": str(int((ctx.queue_s + engine_queue) * 1000)),
        "x-inference-time": str(int(inference * 1000)),
        "x-time-per-token": str(int(per_token * 1000)),
        "x-prompt-tokens": str(ctx.prompt_tokens),
        "x-generated-tokens": str(ctx.generated_tokens),
        "x-kubeshard-cache": ctx.cache,
        "x-kubeshard-model": model.name,
        "x-request-id": ctx.request_id,
    }


async def _events(tokens: AsyncIterator[pb.Token], req: GenerateRequest, plan: TgiPlan,
                  ctx: RequestContext) -> AsyncIterator[bytes]:
    parts: list[str] = []
    index = 0
    top_n = plan.engine.top_n_tokens
    async for t in tokens:
        index += 1
        if not t.special:
            parts.append(t.text)
        event = {"index": index, "token": _token(t),
                 "top_tokens": [_top(a) for a in t.top_tokens] if top_n else [],
                 "generated_text": None, "details": None}
        if t.HasField("finish"):
            text = "".join(parts)
            event["generated_text"] = req.inputs + text if plan.return_full_text else text
            if plan.details:
                f = t.finish
                event["details"] = {"finish_reason": FINISH_REASONS.get(f.reason, "length"),
                                    "generated_tokens": f.generated_tokens or index,
                                    "seed": f.seed if f.HasField("seed") else None,
                                    "input_length": ctx.prompt_tokens}
        yield sse_event(event)


async def _generate(request: Request, model_name: Optional[str], stream: Optional[bool],
                    route: str) -> Response:
    """``stream`` None: the compat route, where the body's ``stream`` decides."""
    def streaming(req: GenerateRequest) -> bool:
        return stream if stream is not None else isinstance(req, CompatGenerateRequest) and req.stream

    def plan_request(req: GenerateRequest, tokenizer: ModelTokenizer, limits: Limits) -> TgiPlan:
        return plan_tgi(req, tokenizer, limits, stream=streaming(req))

    intake = get_intake(request)
    admitted = await intake.admit(request, route, CompatGenerateRequest if stream is None else GenerateRequest,
                                  plan_request, model_name)
    req, plan, model, ctx = admitted.body, admitted.plan, admitted.model, admitted.ctx
    metrics = intake.metrics
    if streaming(req):
        headers = {"x-compute-type": model.info.device_type if model.info else "unknown",
                   "x-request-id": ctx.request_id, "x-kubeshard-model": model.name}
        return EventStreamResponse(
            intake.events(admitted, lambda tokens: _events(tokens, req, plan, ctx),
                          lambda exc: sse_event(exc.tgi_body())),
            render_error=lambda exc: error_response(exc, "tgi", metrics, model.name, route),
            headers=headers,
            late_headers=lambda: {"x-kubeshard-cache": ctx.cache},
            on_disconnect=lambda: metrics.client_disconnects.labels(model.name).inc())
    everything = await intake.collect(admitted)
    first = everything[0]
    likeliest = sorted(split_sequences(everything), key=lambda s: -s[-1].finish.cumulative_logprob)
    best, others = (likeliest[0], likeliest[1:]) if plan.engine.n > 1 else (everything, [])

    def generated(tokens: list[pb.Token]) -> str:
        text = "".join(t.text for t in tokens if not t.special)
        return req.inputs + text if plan.return_full_text else text

    answer: dict = {"generated_text": generated(best)}
    if plan.details:
        answer["details"] = _details(best, plan, first)
        if plan.engine.n > 1:  # TGI's best_of: the other sequences, likeliest first
            answer["details"]["best_of_sequences"] = [
                {"generated_text": generated(s), **{k: v for k, v in _details(s, plan, first).items()
                                                    if k != "top_tokens"}} for s in others]
    headers = timing_headers(ctx, model, len(req.inputs))
    return ORJSONResponse([answer] if route == "/" else answer, headers=headers)


_GEN_DOC = json_body_doc(GenerateRequest)
_COMPAT_DOC = json_body_doc(CompatGenerateRequest)


@router.post("/", openapi_extra=_COMPAT_DOC, summary="Generate (stream or not), as TGI's compat route")
async def compat_generate(request: Request) -> Response:
    return await _generate(request, None, None, "/")


@router.post("/generate", openapi_extra=_GEN_DOC, summary="Generate a completion (JSON)")
async def generate(request: Request) -> Response:
    return await _generate(request, None, False, "/generate")


@router.post("/generate_stream", openapi_extra=_GEN_DOC, summary="Generate a completion (SSE)")
async def generate_stream(request: Request) -> Response:
    return await _generate(request, None, True, "/generate_stream")


@router.post("/models/{model:path}/generate", openapi_extra=_GEN_DOC, summary="Generate with a named model")
async def model_generate(request: Request, model: str) -> Response:
    return await _generate(request, model, False, "/generate")


@router.post("/models/{model:path}/generate_stream", openapi_extra=_GEN_DOC,
             summary="Generate with a named model (SSE)")
async def model_generate_stream(request: Request, model: str) -> Response:
    return await _generate(request, model, True, "/generate_stream")


def _info(request: Request, model_name: Optional[str]) -> Response:
    state = get_state(request)
    model = state.intake.resolve(model_name)
    info = model.info
    limits = model.limits
    return ORJSONResponse({
        "model_id": model.name,
        "model_sha": info.revision if info else None,
        "model_dtype": info.dtype if info else None,
        "model_device_type": info.device_type if info else None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": (sum(r.info.max_concurrent_requests for r in model.ready_replicas
                                        if r.info is not None) or None),
        "max_best_of": limits.max_sequences if limits else 1,
        "max_stop_sequences": state.config.max_stop_sequences,
        "max_input_tokens": limits.max_input_tokens if limits else None,
        "max_total_tokens": limits.max_total_tokens if limits else None,
        "max_batch_total_tokens": info.max_batch_tokens if info else None,
        "max_top_n_tokens": state.config.max_top_n_tokens,
        "served_model_id": info.model_id if info else None,
        "architecture": info.architecture if info else None,
        "strategy": info.strategy if info else None,
        "shards": info.shards if info else None,
        "replicas": len(model.replicas),
        "ready_replicas": len(model.ready_replicas),
        "router": "kubeshard-router",
        "version": __version__,
        "sha": None,
        "docker_label": None,
    })


def _health(request: Request, model_name: Optional[str]) -> Response:
    state = get_state(request)
    if state.draining:
        return ORJSONResponse({"error": "router is shutting down", "error_type": "unhealthy"}, status_code=503)
    models = [state.intake.resolve(model_name)] if model_name else list(state.registry.models.values())
    down = [m.name for m in models if not m.ready_replicas]
    if down:
        return ORJSONResponse({"error": "no ready replica for model(s): " + ", ".join(down),
                               "error_type": "unhealthy"}, status_code=503)
    return Response(status_code=200)


def _get_default_and_named(name: str, answer: Callable[[Request, Optional[str]], Response],
                           default_summary: str, named_summary: str) -> None:
    """GET ``/<name>`` answers for the default model (``answer(request, None)``), GET
    ``/models/<model>/<name>`` for a named one."""

    async def default_model(request: Request) -> Response:
        return answer(request, None)

    async def named_model(request: Request, model: str) -> Response:
        return answer(request, model)

    router.add_api_route(f"/{name}", default_model, methods=["GET"], name=name,
                         summary=default_summary)
    router.add_api_route(f"/models/{{model:path}}/{name}", named_model, methods=["GET"],
                         name=f"model_{name}", summary=named_summary)


_get_default_and_named("info", _info, "Model and limits of the default model",
                       "Model and limits of a named model")
_get_default_and_named("health", _health, "200 when every model has a ready replica",
                       "200 when the model has a ready replica")


@router.post("/models/{model:path}", openapi_extra=_COMPAT_DOC,
             summary="TGI compat route of a named model (client base_url = /models/{model})")
async def model_compat_generate(request: Request, model: str) -> Response:
    return await _generate(request, model, None, "/")


@router.get("/metrics", summary="Prometheus metrics", tags=["Observability"])
async def metrics(request: Request) -> Response:
    state = get_state(request)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
