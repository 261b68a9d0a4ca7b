"""Tokenizing without generating, with the tokenizer and chat template that prompt a
generation (so the ids are the ones the model would see):

- TGI's ``POST /tokenize`` (``{"inputs", "add_special_tokens"?}``) answers each token as
  ``{"id", "text", "start", "stop"}``: the characters of ``inputs`` it stands for; TGI's
  ``POST /chat_tokenize`` (a chat request) answers ``{"tokenize_response": [...],
  "templated_text"}``, the offsets into the templated text;
- vLLM's ``POST /tokenize`` with ``prompt`` (``add_special_tokens`` true by default) or
  ``messages`` (``add_generation_prompt`` true, ``add_special_tokens`` false by default,
  ``tools`` rendered as a chat completion renders them) answers ``{"count",
  "max_model_len", "tokens", "token_strs"}`` (``return_token_strs``); vLLM's ``POST
  /detokenize`` (``{"tokens"}``) answers ``{"prompt"}``.

Both projects call their route ``/tokenize``: a body with ``inputs`` is TGI's (its errors
in TGI's shape), any other vLLM's (errors in OpenAI's). ``model`` names the model (or one
of its adapters, which share its tokenizer); a model scaled to zero is woken as for a
generation, since only its replicas hold its tokenizer. API keys apply, as on every route.
"""

from __future__ import annotations

from typing import Any, Optional

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from kubeshard_router.errors import RouterError, ValidationFailed
from kubeshard_router.http import ORJSONResponse, error_response, get_state, json_body_doc
from kubeshard_router.openai_schema import ChatCompletionRequest, chat_prompt
from kubeshard_router.tokenization import ModelTokenizer
from kubeshard_router.validation import Limits, check_token_ids, parse_body, schema_doc as _doc

router = APIRouter(tags=["Tokenize"])


class TgiTokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    inputs: str = Field(..., description="The text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS).")
    model: Optional[str] = Field(None, description="Extension: the model (default: the router's default).")


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: str = Field(..., description="The text to tokenize.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS).")
    return_token_strs: bool = Field(False, description="Also answer each token's string.")


class TokenizeChatRequest(ChatCompletionRequest):
    add_generation_prompt: bool = Field(True, description="End with the template's assistant prompt.")
    add_special_tokens: bool = Field(False, description="Add special tokens beyond the template's.")
    return_token_strs: bool = Field(False, description="Also answer each token's string.")
    continue_final_message: bool = Field(False, description="Not supported; must be false.",
                                         json_schema_extra=_doc(enum=[False]))


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[int] = Field(..., description="Token ids.")


async def _tokenizer(request: Request, name: Optional[str]) -> tuple[ModelTokenizer, Limits]:
    intake = get_state(request).intake
    model, _ = intake.resolve_adapter(name)
    return await intake.prepared(model)


def _spans(tokenizer: ModelTokenizer, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
    return [{"id": i, "text": text[start:stop], "start": start, "stop": stop}
            for i, start, stop in tokenizer.encode_spans(text, add_special_tokens)]


async def _tgi_tokenize(request: Request, raw: bytes) -> list[dict[str, Any]]:
    body = parse_body(raw, TgiTokenizeRequest)
    tokenizer, _ = await _tokenizer(request, body.model)
    return _spans(tokenizer, body.inputs, body.add_special_tokens)


async def _tgi_chat_tokenize(request: Request, raw: bytes) -> dict[str, Any]:
    body = parse_body(raw, ChatCompletionRequest)
    tokenizer, _ = await _tokenizer(request, body.model)
    text, _ = chat_prompt(body, tokenizer)
    return {"tokenize_response": _spans(tokenizer, text, False), "templated_text": text}


async def _vllm_tokenize(request: Request, raw: bytes, chat: bool) -> dict[str, Any]:
    body = parse_body(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest)
    tokenizer, limits = await _tokenizer(request, body.model)
    if isinstance(body, TokenizeChatRequest):
        if body.continue_final_message:
            raise ValidationFailed("`continue_final_message` is not supported by kubeshard",
                                   param="continue_final_message")
        text, _ = chat_prompt(body, tokenizer, add_generation_prompt=body.add_generation_prompt)
    else:
        text = body.prompt
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    strs = [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": limits.max_total_tokens, "tokens": ids, "token_strs": strs}


async def _vllm_detokenize(request: Request, raw: bytes) -> dict[str, Any]:
    body = parse_body(raw, DetokenizeRequest)
    tokenizer, limits = await _tokenizer(request, body.model)
    check_token_ids(body.tokens, limits.vocab_size, "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


def _keys(raw: bytes) -> set[str]:
    """The top-level keys of a JSON object body (none when it is not one: parse_body then
    says what is wrong)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return set()
    return set(data) if isinstance(data, dict) else set()


async def _answer(request: Request, route, api: str) -> Response:
    """Authenticates, reads the body, and answers ``route(raw)`` → (api, JSON coroutine)
    as JSON, or its error in that API's shape; ``api``: the shape of an error before the
    body says which (a missing key, a body too large)."""
    state = get_state(request)
    try:
        state.intake.authenticate(request)
        raw = await state.intake.read_body(request)
        api, answer = route(raw)
        return ORJSONResponse(await answer)
    except RouterError as exc:
        return error_response(exc, api, state.metrics, exc.model, request.url.path)


@router.post("/tokenize", summary="Tokenize a text or a chat: TGI's body (`inputs`) or vLLM's (`prompt` or `messages`)",
             openapi_extra=json_body_doc(TgiTokenizeRequest, TokenizeCompletionRequest, TokenizeChatRequest))
async def tokenize(request: Request) -> Response:
    def route(raw: bytes):
        keys = _keys(raw)
        if "inputs" in keys:
            return "tgi", _tgi_tokenize(request, raw)
        return "openai", _vllm_tokenize(request, raw, chat="messages" in keys and "prompt" not in keys)
    return await _answer(request, route, "tgi")  # TGI's route first: its shape until a body says otherwise


@router.post("/chat_tokenize", summary="The chat's templated text and its tokens (TGI's)",
             openapi_extra=json_body_doc(ChatCompletionRequest))
async def chat_tokenize(request: Request) -> Response:
    return await _answer(request, lambda raw: ("tgi", _tgi_chat_tokenize(request, raw)), "tgi")


@router.post("/detokenize", summary="The text of token ids (vLLM's)",
             openapi_extra=json_body_doc(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    return await _answer(request, lambda raw: ("openai", _vllm_detokenize(request, raw)), "openai")
