"""OpenAI's request models (/v1/completions, /v1/chat/completions) and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from kubeshard_router.engine_request import EngineRequest
from kubeshard_router.errors import ValidationFailed
from kubeshard_router.tokenization import ChatTemplateError, ModelTokenizer
from kubeshard_router.validation import (UINT32_MAX, UINT64_MAX, Limits, RequestBody, check_budget,
                                         check_seed, check_stop, check_token_ids, schema_doc as _doc)

_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(RequestBody):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Optional[str] = Field(None, description="Model name; default: the router's default model.")
    frequency_penalty: Optional[float] = Field(None, description="In [-2, 2].", json_schema_extra=_doc(minimum=-2, maximum=2))
    presence_penalty: Optional[float] = Field(None, description="In [-2, 2].", json_schema_extra=_doc(minimum=-2, maximum=2))
    logit_bias: Optional[dict[str, float]] = Field(None, description="Not supported; must be empty.")
    n: Optional[int] = Field(None, description="Only 1 is supported.", json_schema_extra=_doc(minimum=1, maximum=1))
    seed: Optional[int] = Field(None, json_schema_extra=_doc(minimum=0, maximum=UINT64_MAX))
    stop: Union[str, list[str], None] = Field(None, description="Up to the server's max stop sequences.",
                                              json_schema_extra=_doc(maxItems=4))
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, description="In [0, 2]; 0 is greedy. Default 1.",
                                         json_schema_extra=_doc(minimum=0, maximum=2))
    top_p: Optional[float] = Field(None, description="In (0, 1].", json_schema_extra=_doc(exclusiveMinimum=0, maximum=1))
    user: Optional[str] = None
    # Extensions (as vLLM and TGI accept them).
    top_k: Optional[int] = Field(None, description="Extension: > 0.", json_schema_extra=_doc(minimum=1))
    repetition_penalty: Optional[float] = Field(None, description="Extension: > 0.",
                                                json_schema_extra=_doc(exclusiveMinimum=0))

    def requested_model(self) -> Optional[str]:
        return self.model


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="One prompt: a string or a list of token ids.")
    max_tokens: Optional[int] = Field(16, description="Default 16, as OpenAI's.", json_schema_extra=_doc(minimum=1))
    echo: bool = False
    logprobs: Optional[int] = Field(None, description="Alternatives per token, <= the server max.",
                                    json_schema_extra=_doc(minimum=0, maximum=5))
    best_of: Optional[int] = Field(None, description="Only 1 is supported.", json_schema_extra=_doc(minimum=1, maximum=1))
    suffix: Optional[str] = Field(None, description="Not supported.")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., json_schema_extra=_doc(minItems=1))
    max_tokens: Optional[int] = Field(None, description="Default: what the total-token limit leaves.",
                                      json_schema_extra=_doc(minimum=1))
    max_completion_tokens: Optional[int] = Field(None, description="Alias of max_tokens.",
                                                 json_schema_extra=_doc(minimum=1))
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, json_schema_extra=_doc(minimum=0, maximum=5))
    tools: Optional[list[Any]] = Field(None, description="Not supported; must be empty.")
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[ResponseFormat] = None


@dataclass(slots=True)
class OpenAIPlan:
    engine: EngineRequest
    prompt_tokens: int
    prompt_text: str
    stop: tuple[str, ...]
    logprobs: Optional[int]  # None: no logprobs; k: chosen token + k alternatives
    echo: bool
    include_usage: bool


def _range(value: Optional[float], name: str, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    if value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise ValidationFailed(f"`{name}` must be in {bracket}{lo}, {hi}]. Given: {value}", param=name)


def _common(req: _Common, limits: Limits) -> dict[str, Any]:
    if req.n is not None and req.n != 1:
        raise ValidationFailed(f"`n` must be 1: kubeshard returns one choice per request. Given: {req.n}",
                               param="n")
    if req.logit_bias:
        raise ValidationFailed("`logit_bias` is not supported by kubeshard", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise ValidationFailed("`stream_options` is only allowed when `stream` is true",
                               param="stream_options")
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0, lo_open=True)
    _range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    if req.top_k is not None and req.top_k <= 0:
        raise ValidationFailed("`top_k` must be strictly positive", param="top_k")
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise ValidationFailed("`repetition_penalty` must be strictly positive", param="repetition_penalty")
    stop_list = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    temperature = 1.0 if req.temperature is None else req.temperature
    do_sample = temperature > 0.0
    return dict(
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_p=req.top_p if req.top_p is not None and req.top_p < 1.0 else None,
        top_k=min(req.top_k, limits.vocab_size, UINT32_MAX) if req.top_k is not None else None,
        repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty or None,
        presence_penalty=req.presence_penalty or None,
        seed=check_seed(req.seed),
        stop=check_stop(stop_list, limits),
    )


def _max_tokens(value: Optional[int], name: str) -> Optional[int]:
    if value is not None and value <= 0:
        raise ValidationFailed(f"`{name}` must be strictly positive. Given: {value}", param=name)
    return value


def plan_completion(req: CompletionRequest, tokenizer: ModelTokenizer, limits: Limits) -> OpenAIPlan:
    if req.best_of is not None and req.best_of != 1:
        raise ValidationFailed(f"`best_of` must be 1. Given: {req.best_of}", param="best_of")
    if req.suffix:
        raise ValidationFailed("`suffix` is not supported by kubeshard", param="suffix")
    if req.logprobs is not None and not (0 <= req.logprobs <= limits.max_top_n_tokens):
        raise ValidationFailed(f"`logprobs` must be >= 0 and <= {limits.max_top_n_tokens}. "
                               f"Given: {req.logprobs}", param="logprobs")
    params = _common(req, limits)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ValidationFailed(f"`prompt` holds {len(prompt)} prompts; kubeshard takes one prompt "
                                   f"per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ValidationFailed("`prompt` cannot be empty", param="prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        text = prompt
    else:
        ids = list(prompt)
        check_token_ids(ids, limits.vocab_size, "prompt")
        text = tokenizer.decode(ids) if req.echo else ""
    max_new = check_budget(len(ids), _max_tokens(req.max_tokens, "max_tokens"), limits,
                           input_field="prompt", max_new_field="max_tokens")
    logprobs = req.logprobs
    engine = EngineRequest(input_ids=ids, max_new_tokens=max_new, top_n_tokens=logprobs or 0,
                           prefill_details=bool(req.echo and logprobs is not None), **params)
    return OpenAIPlan(engine=engine, prompt_tokens=len(ids), prompt_text=text, stop=engine.stop,
                      logprobs=logprobs, echo=req.echo,
                      include_usage=bool(req.stream_options and req.stream_options.include_usage))


def _message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise ValidationFailed("`messages` must not be empty", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role not in _CHAT_ROLES:
            raise ValidationFailed(f"`messages[{i}].role` must be one of "
                                   f"{', '.join(sorted(_CHAT_ROLES))}. Given: {m.role!r}",
                                   param=f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ValidationFailed(f"`messages[{i}].content[{j}]` has type {part.type!r}; this "
                                           f"model takes text parts only", param=f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
        if content is None:
            raise ValidationFailed(f"`messages[{i}].content` must be a string or a list of text parts",
                                   param=f"messages[{i}].content")
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                 "content": content}
        if m.name is not None:
            entry["name"] = m.name
        out.append(entry)
    return out


def plan_chat(req: ChatCompletionRequest, tokenizer: ModelTokenizer, limits: Limits) -> OpenAIPlan:
    if req.tools:
        raise ValidationFailed("`tools` are not supported by kubeshard", param="tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise ValidationFailed("`tool_choice` is not supported by kubeshard", param="tool_choice")
    if req.response_format is not None and req.response_format.type != "text":
        raise ValidationFailed(f"`response_format.type` {req.response_format.type!r} is not supported; "
                               f"only 'text'", param="response_format")
    top_logprobs = req.top_logprobs
    if top_logprobs is not None:
        if not req.logprobs:
            raise ValidationFailed("`top_logprobs` needs `logprobs` set to true", param="top_logprobs")
        if not (0 <= top_logprobs <= limits.max_top_n_tokens):
            raise ValidationFailed(f"`top_logprobs` must be >= 0 and <= {limits.max_top_n_tokens}. "
                                   f"Given: {top_logprobs}", param="top_logprobs")
    params = _common(req, limits)
    messages = _message_dicts(req.messages)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise ValidationFailed(f"`messages`: {exc}", param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_new = check_budget(len(ids), _max_tokens(max_tokens, field), limits,
                           input_field="messages", max_new_field=field)
    logprobs = (top_logprobs or 0) if req.logprobs else None
    engine = EngineRequest(input_ids=ids, max_new_tokens=max_new, top_n_tokens=logprobs or 0, **params)
    return OpenAIPlan(engine=engine, prompt_tokens=len(ids), prompt_text=text, stop=engine.stop,
                      logprobs=logprobs, echo=False,
                      include_usage=bool(req.stream_options and req.stream_options.include_usage))


