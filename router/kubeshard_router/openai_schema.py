"""OpenAI's request models (/v1/completions, /v1/chat/completions) and their rules."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import orjson
from pydantic import BaseModel, ConfigDict, Field

from kubeshard_router.engine_request import EngineRequest, GrammarRequest
from kubeshard_router.errors import ValidationFailed
from kubeshard_router.tokenization import ChatTemplateError, ModelTokenizer
from kubeshard_router.tool_formats import FORMATS, ToolFormat
from kubeshard_router.tools import (ToolPlan, call_text, parse_tools, template_renders_tools, tool_grammar,
                                    with_tool_prompt)
from kubeshard_router.validation import (UINT32_MAX, UINT64_MAX, Limits, RequestBody, check_budget,
                                         check_seed, check_stop, check_token_ids, schema_doc as _doc)

_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    model_config = ConfigDict(extra="ignore")
    json_: Union[str, dict[str, Any], None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Union[str, dict[str, Any], None] = None


class _Common(RequestBody):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Optional[str] = Field(None, description="Model name; default: the router's default model.")
    frequency_penalty: Optional[float] = Field(None, description="In [-2, 2].", json_schema_extra=_doc(minimum=-2, maximum=2))
    presence_penalty: Optional[float] = Field(None, description="In [-2, 2].", json_schema_extra=_doc(minimum=-2, maximum=2))
    logit_bias: Optional[dict[str, float]] = Field(None, description="Token id (a string) -> bias in [-100, 100].")
    n: Optional[int] = Field(None, description="Choices to generate, up to the server's max sequences per request.",
                             json_schema_extra=_doc(minimum=1))
    seed: Optional[int] = Field(None, json_schema_extra=_doc(minimum=0, maximum=UINT64_MAX))
    stop: Union[str, list[str], None] = Field(None, description="Up to the server's max stop sequences.",
                                              json_schema_extra=_doc(maxItems=4))
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, description="In [0, 2]; 0 is greedy. Default 1.",
                                         json_schema_extra=_doc(minimum=0, maximum=2))
    top_p: Optional[float] = Field(None, description="In (0, 1].", json_schema_extra=_doc(exclusiveMinimum=0, maximum=1))
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # Extensions (as vLLM and TGI accept them).
    top_k: Optional[int] = Field(None, description="Extension: > 0; -1 or 0 (vLLM): no top-k filter.",
                                 json_schema_extra=_doc(minimum=-1))
    repetition_penalty: Optional[float] = Field(None, description="Extension: > 0.",
                                                json_schema_extra=_doc(exclusiveMinimum=0))
    min_p: Optional[float] = Field(None, description="Extension: in [0, 1].", json_schema_extra=_doc(minimum=0, maximum=1))
    ignore_eos: bool = Field(False, description="Extension: keep generating after end-of-sequence.")
    speculative: bool = Field(True, description="Extension: speculative decoding for this request, when the "
                                                 "server has it on; false decodes one token per step.")
    min_tokens: Optional[int] = Field(None, description="Extension: tokens before EOS or a stop may end the output.",
                                      json_schema_extra=_doc(minimum=0))
    stop_token_ids: Optional[list[int]] = Field(None, description="Extension: token ids that end the output.")
    include_stop_str_in_output: bool = Field(False, description="Extension: keep a matched stop string.")
    skip_special_tokens: bool = Field(True, description="Extension: leave special tokens out of the text.")
    spaces_between_special_tokens: bool = Field(True, description="Extension: a space around special tokens' "
                                                                   "text (with skip_special_tokens false).")
    prompt_logprobs: Optional[int] = Field(None, description="Extension: logprobs (and this many alternatives) "
                                                             "of each prompt token.", json_schema_extra=_doc(minimum=0))
    guided_json: Union[str, dict[str, Any], None] = Field(None, description="Extension: a JSON schema the output follows.")
    guided_regex: Optional[str] = Field(None, description="Extension: a regex the output matches.")
    guided_choice: Optional[list[str]] = Field(None, description="Extension: the output is one of these.")
    guided_grammar: Optional[str] = Field(None, description="Extension: an EBNF (GBNF) grammar the output follows.")
    structured_outputs: Optional[StructuredOutputs] = Field(None, description="Extension (vLLM): one constraint.")

    def requested_model(self) -> Optional[str]:
        return self.model


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="A prompt (a string or a list of token ids), or a list of prompts: each gets `n` "
                         "choices, prompt k's at indexes k*n .. k*n+n-1.")
    max_tokens: Optional[int] = Field(16, description="Default 16, as OpenAI's.", json_schema_extra=_doc(minimum=1))
    echo: bool = False
    logprobs: Optional[int] = Field(None, description="Alternatives per token, <= the server max.",
                                    json_schema_extra=_doc(minimum=0, maximum=5))
    best_of: Optional[int] = Field(None, description="Generate this many (>= n) and return the n likeliest.",
                                   json_schema_extra=_doc(minimum=1))
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
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., json_schema_extra=_doc(minItems=1))
    max_tokens: Optional[int] = Field(None, description="Default: what the total-token limit leaves.",
                                      json_schema_extra=_doc(minimum=1))
    max_completion_tokens: Optional[int] = Field(None, description="Alias of max_tokens.",
                                                 json_schema_extra=_doc(minimum=1))
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, json_schema_extra=_doc(minimum=0, maximum=5))
    tools: Optional[list[Any]] = Field(None, description="Functions the model may call (OpenAI's shape).")
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(
        None, description="auto (default with tools), none, required, or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}} (TGI: the name alone).")


@dataclass(slots=True)
class OpenAIPlan:
    engine: EngineRequest
    prompt_tokens: int
    prompt_text: str
    stop: tuple[str, ...]    # stop strings: trimmed from the text, or kept (include_stop_str_in_output)
    logprobs: Optional[int]  # None: no logprobs; k: chosen token + k alternatives
    echo: bool
    include_usage: bool
    n: int = 1               # choices returned; the engine generates engine.n >= n (best_of)
    tools: Optional[ToolPlan] = None
    tgi_shapes: bool = False  # TGI's stream shapes (model "tgi"): one tool_calls object per delta
    keep_stop: bool = False  # include_stop_str_in_output
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    # special tokens whose text stays even when skipped: the tool-call format's markers
    special_kept: frozenset[str] = frozenset()
    # a completion's further prompts (prompt: [...]), each generated on its own; prompt_tokens
    # above then counts every prompt's tokens
    more: tuple["OpenAIPlan", ...] = ()

    @property
    def prompts(self) -> tuple["OpenAIPlan", ...]:
        """This plan and its further prompts' plans, in the request's order."""
        return (self, *self.more)

    @property
    def engines(self) -> tuple[EngineRequest, ...]:
        return tuple(p.engine for p in self.prompts)


def _grammar(req: "_Common") -> Optional[GrammarRequest]:
    """The one structured-output constraint of a request, from whichever field holds it."""
    found: list[tuple[str, GrammarRequest]] = []

    def schema(value: Any, field: str) -> GrammarRequest:
        if isinstance(value, str):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise ValidationFailed(f"`{field}` is not valid JSON: {exc}", param=field) from None
        if not isinstance(value, (dict, bool)):
            raise ValidationFailed(f"`{field}` must be a JSON schema (an object)", param=field)
        return GrammarRequest("json_schema", orjson.dumps(value).decode(), field)

    def text(value: str, field: str, kind: str) -> GrammarRequest:
        if not value:
            raise ValidationFailed(f"`{field}` must not be empty", param=field)
        return GrammarRequest(kind, value, field)

    def choice(value: list[str], field: str) -> GrammarRequest:
        if not value or any(not c for c in value):
            raise ValidationFailed(f"`{field}` must be a non-empty list of non-empty strings", param=field)
        return GrammarRequest("choice", tuple(value), field)

    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", GrammarRequest("json_schema", '{"type":"object"}', "response_format")))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValidationFailed("`response_format.json_schema.schema` is required with type 'json_schema'",
                                       param="response_format")
            found.append(("response_format", schema(rf.json_schema.schema_, "response_format.json_schema.schema")))
        else:
            raise ValidationFailed(f"`response_format.type` {rf.type!r} is not supported; one of 'text', "
                                   f"'json_object', 'json_schema'", param="response_format")
    if req.guided_json is not None:
        found.append(("guided_json", schema(req.guided_json, "guided_json")))
    if req.guided_regex is not None:
        found.append(("guided_regex", text(req.guided_regex, "guided_regex", "regex")))
    if req.guided_choice is not None:
        found.append(("guided_choice", choice(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", text(req.guided_grammar, "guided_grammar", "ebnf")))
    so = req.structured_outputs
    if so is not None:
        inner = [(name, value) for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                   ("grammar", so.grammar), ("structural_tag", so.structural_tag))
                 if value is not None] + ([("json_object", True)] if so.json_object else [])
        if len(inner) != 1:
            raise ValidationFailed("`structured_outputs` must hold exactly one of json, regex, choice, grammar, "
                                   "json_object, structural_tag", param="structured_outputs")
        name, value = inner[0]
        field = f"structured_outputs.{name}"
        if name == "json":
            found.append((field, schema(value, field)))
        elif name == "regex":
            found.append((field, text(value, field, "regex")))
        elif name == "choice":
            found.append((field, choice(value, field)))
        elif name == "grammar":
            found.append((field, text(value, field, "ebnf")))
        elif name == "json_object":
            found.append((field, GrammarRequest("json_schema", '{"type":"object"}', field)))
        else:
            tag = value if isinstance(value, str) else orjson.dumps(value).decode()
            found.append((field, text(tag, field, "structural_tag")))
    if len(found) > 1:
        raise ValidationFailed("only one structured-output constraint may be given; got "
                               + ", ".join(f"`{name}`" for name, _ in found), param=found[1][0])
    return found[0][1] if found else None


def _sequences(req: "_Common", best_of: Optional[int], limits: Limits) -> tuple[int, int]:
    """(choices returned, sequences generated)."""
    n = 1 if req.n is None else req.n
    most = limits.max_sequences
    if not 1 <= n <= most:
        raise ValidationFailed(f"`n` must be >= 1 and <= {most} (this model's max sequences per request). "
                               f"Given: {n}", param="n")
    if best_of is None:
        return n, n
    if not n <= best_of <= most:
        raise ValidationFailed(f"`best_of` must be >= `n` ({n}) and <= {most}. Given: {best_of}", param="best_of")
    if best_of > n and req.stream:
        raise ValidationFailed("`best_of` > `n` cannot stream: the best sequences are known only at the end",
                               param="best_of")
    return n, best_of


def _token_ids(ids: Optional[list[int]], field: str, limits: Limits) -> tuple[int, ...]:
    if not ids:
        return ()
    check_token_ids(ids, limits.vocab_size, field)
    return tuple(ids)


def _logit_bias(bias: Optional[dict[str, float]], limits: Limits) -> Optional[dict[int, float]]:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ValidationFailed(f"`logit_bias` keys must be token ids; got {key!r}", param="logit_bias") from None
        if not 0 <= token < limits.vocab_size:
            raise ValidationFailed(f"`logit_bias[{key}]`: {token} is not a token id of this model (vocabulary size "
                                   f"{limits.vocab_size})", param="logit_bias")
        if not -100 <= value <= 100:
            raise ValidationFailed(f"`logit_bias[{key}]` must be in [-100, 100]. Given: {value}", param="logit_bias")
        out[token] = float(value)
    return out


def _range(value: Optional[float], name: str, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    if value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise ValidationFailed(f"`{name}` must be in {bracket}{lo}, {hi}]. Given: {value}", param=name)


def _common(req: _Common, limits: Limits) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:
        raise ValidationFailed("`stream_options` is only allowed when `stream` is true",
                               param="stream_options")
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0, lo_open=True)
    _range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    if req.top_k is not None and req.top_k < -1:
        raise ValidationFailed(f"`top_k` must be -1 or 0 (no filter) or strictly positive. Given: {req.top_k}",
                               param="top_k")
    _range(req.min_p, "min_p", 0.0, 1.0)
    if req.min_tokens is not None and req.min_tokens < 0:
        raise ValidationFailed(f"`min_tokens` must be >= 0. Given: {req.min_tokens}", param="min_tokens")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= limits.max_top_n_tokens:
        raise ValidationFailed(f"`prompt_logprobs` must be >= 0 and <= {limits.max_top_n_tokens}. "
                               f"Given: {req.prompt_logprobs}", param="prompt_logprobs")
    if req.repetition_penalty is not None and req.repetition_penalty <= 0:
        raise ValidationFailed("`repetition_penalty` must be strictly positive", param="repetition_penalty")
    stop_list = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    temperature = 1.0 if req.temperature is None else req.temperature
    do_sample = temperature > 0.0
    return dict(
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_p=req.top_p if req.top_p is not None and req.top_p < 1.0 else None,
        top_k=min(req.top_k, limits.vocab_size, UINT32_MAX) if req.top_k is not None and req.top_k > 0 else None,
        repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty or None,
        presence_penalty=req.presence_penalty or None,
        seed=check_seed(req.seed),
        stop=check_stop(stop_list, limits),
        min_p=req.min_p or None,
        logit_bias=_logit_bias(req.logit_bias, limits),
        ignore_eos=req.ignore_eos,
        stop_token_ids=_token_ids(req.stop_token_ids, "stop_token_ids", limits),
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        grammar=_grammar(req),
        speculative=req.speculative,
    )


def _min_tokens(req: _Common, max_new: int) -> int:
    if req.min_tokens and req.min_tokens > max_new:
        raise ValidationFailed(f"`min_tokens` ({req.min_tokens}) must be <= the maximum number of new tokens "
                               f"({max_new})", param="min_tokens")
    return req.min_tokens or 0


def _plan(req: _Common, engine: EngineRequest, prompt_tokens: int, text: str, logprobs: Optional[int],
          echo: bool, n: int) -> OpenAIPlan:
    return OpenAIPlan(engine=engine, prompt_tokens=prompt_tokens, prompt_text=text,
                      stop=engine.stop, keep_stop=req.include_stop_str_in_output, logprobs=logprobs, echo=echo,
                      include_usage=bool(req.stream_options and req.stream_options.include_usage),
                      n=n, skip_special_tokens=req.skip_special_tokens, prompt_logprobs=req.prompt_logprobs)


def _max_tokens(value: Optional[int], name: str) -> Optional[int]:
    if value is not None and value <= 0:
        raise ValidationFailed(f"`{name}` must be strictly positive. Given: {value}", param=name)
    return value


# prompts one completion may hold: each is a generation of its own, all run side by side
MAX_PROMPTS = 2048


def plan_completion(req: CompletionRequest, tokenizer: ModelTokenizer, limits: Limits) -> OpenAIPlan:
    n, sequences = _sequences(req, req.best_of, limits)
    if req.suffix:
        raise ValidationFailed("`suffix` is not supported by kubeshard", param="suffix")
    if req.logprobs is not None and not (0 <= req.logprobs <= limits.max_top_n_tokens):
        raise ValidationFailed(f"`logprobs` must be >= 0 and <= {limits.max_top_n_tokens}. "
                               f"Given: {req.logprobs}", param="logprobs")
    params = _common(req, limits)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_PROMPTS:
            raise ValidationFailed(f"`prompt` holds {len(prompt)} prompts; at most {MAX_PROMPTS}", param="prompt")
        plans = [_plan_prompt(req, one, f"prompt[{k}]", params, sequences, n, tokenizer, limits)
                 for k, one in enumerate(prompt)]
        if len(plans) == 1:
            return plans[0]
        return replace(plans[0], prompt_tokens=sum(p.prompt_tokens for p in plans), more=tuple(plans[1:]))
    return _plan_prompt(req, prompt, "prompt", params, sequences, n, tokenizer, limits)


def _plan_prompt(req: CompletionRequest, prompt: Union[str, list[int]], field: str, params: dict,
                 sequences: int, n: int, tokenizer: ModelTokenizer, limits: Limits) -> OpenAIPlan:
    if isinstance(prompt, str):
        if not prompt:
            raise ValidationFailed(f"`{field}` cannot be empty", param=field)
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        text = prompt
    else:
        ids = list(prompt)
        check_token_ids(ids, limits.vocab_size, field)
        text = tokenizer.decode(ids) if req.echo else ""
    max_new = check_budget(len(ids), _max_tokens(req.max_tokens, "max_tokens"), limits,
                           input_field=field, max_new_field="max_tokens")
    logprobs = req.logprobs
    prompt_logprobs = req.prompt_logprobs
    engine = EngineRequest(input_ids=ids, max_new_tokens=max_new, top_n_tokens=logprobs or 0,
                           prefill_details=bool(req.echo and logprobs is not None) or prompt_logprobs is not None,
                           prefill_top_n_tokens=prompt_logprobs or 0, min_new_tokens=_min_tokens(req, max_new),
                           n=sequences, **params)
    return _plan(req, engine, len(ids), text, logprobs, req.echo, n)


def _message_dicts(messages: list[ChatMessage], template_source: str = "",
                   fmt: ToolFormat = FORMATS["hermes"]) -> list[dict[str, Any]]:
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
        calls = _tool_calls(m.tool_calls, i) if m.role == "assistant" and m.tool_calls else []
        if content is None and not calls:
            raise ValidationFailed(f"`messages[{i}].content` must be a string or a list of text parts",
                                   param=f"messages[{i}].content")
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                 "content": content or ""}
        if calls:
            if "tool_calls" in template_source:  # the template renders earlier calls itself
                entry["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": c["function"]}
                                       for c in calls]
            else:
                entry["content"] = "\n".join([content or ""] + [call_text(fmt, c["function"]["name"],
                                                                            c["function"]["arguments"])
                                                                  for c in calls]).strip()
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def _tool_calls(calls: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValidationFailed(f"`messages[{i}].tool_calls[{j}]` must hold a function with a name",
                                   param=f"messages[{i}].tool_calls")
        if isinstance(fn.get("arguments"), str):
            try:
                fn = {**fn, "arguments": orjson.loads(fn["arguments"])}
            except orjson.JSONDecodeError:
                raise ValidationFailed(f"`messages[{i}].tool_calls[{j}].function.arguments` is not JSON",
                                       param=f"messages[{i}].tool_calls") from None
            calls[j] = {**c, "function": fn}
    return calls


def chat_prompt(req: ChatCompletionRequest, tokenizer: ModelTokenizer,
                add_generation_prompt: bool = True) -> tuple[str, Optional[ToolPlan]]:
    """The chat as the model's template renders it (its tools too: by the template, or in
    a system message), and the request's tool plan."""
    tools = parse_tools(req.tools, req.tool_choice)
    fmt = tokenizer.tool_format
    source = tokenizer.template_source
    messages = _message_dicts(req.messages, source, fmt)
    tool_dicts = None
    if tools is not None:
        tools.format = fmt
        if template_renders_tools(source):
            tool_dicts = [f.as_tool() for f in tools.functions]
        else:
            messages = with_tool_prompt(messages, tools.functions, fmt)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tool_dicts)
    except ChatTemplateError as exc:
        raise ValidationFailed(f"`messages`: {exc}", param="messages") from None
    return text, tools


def plan_chat(req: ChatCompletionRequest, tokenizer: ModelTokenizer, limits: Limits) -> OpenAIPlan:
    n, sequences = _sequences(req, None, limits)
    top_logprobs = req.top_logprobs
    if top_logprobs is not None:
        if not req.logprobs:
            raise ValidationFailed("`top_logprobs` needs `logprobs` set to true", param="top_logprobs")
        if not (0 <= top_logprobs <= limits.max_top_n_tokens):
            raise ValidationFailed(f"`top_logprobs` must be >= 0 and <= {limits.max_top_n_tokens}. "
                                   f"Given: {top_logprobs}", param="top_logprobs")
    params = _common(req, limits)
    text, tools = chat_prompt(req, tokenizer)
    if tools is not None:
        grammar = tool_grammar(tools)
        if grammar is not None and params["grammar"] is not None:
            raise ValidationFailed("`tools` with tool_choice other than none cannot be combined with another "
                                   "structured-output constraint", param="tools")
        params["grammar"] = params["grammar"] or grammar
    ids = tokenizer.encode(text, add_special_tokens=False)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_new = check_budget(len(ids), _max_tokens(max_tokens, field), limits,
                           input_field="messages", max_new_field=field)
    logprobs = (top_logprobs or 0) if req.logprobs else None
    prompt_logprobs = req.prompt_logprobs
    engine = EngineRequest(input_ids=ids, max_new_tokens=max_new, top_n_tokens=logprobs or 0,
                           prefill_details=prompt_logprobs is not None, prefill_top_n_tokens=prompt_logprobs or 0,
                           min_new_tokens=_min_tokens(req, max_new), n=sequences, **params)
    plan = _plan(req, engine, len(ids), text, logprobs, False, n)
    plan.tools = tools
    if tools is not None and tools.parses:
        plan.special_kept = tools.format.markers
    plan.tgi_shapes = req.model == "tgi"
    return plan


