"""TGI's request models (``/``, ``/generate``, ``/generate_stream``) and its parameter rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

import orjson

from kubeshard_router.engine_request import EngineRequest, GrammarRequest
from kubeshard_router.errors import ValidationFailed
from kubeshard_router.tokenization import ModelTokenizer
from kubeshard_router.validation import (UINT32_MAX, UINT64_MAX, Limits, RequestBody, check_budget,
                                         check_seed, check_stop, schema_doc as _doc)


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    best_of: Optional[int] = Field(None, description="Generate this many sequences (sampling) and return the "
                                   "likeliest; the others in details.best_of_sequences.",
                                   json_schema_extra=_doc(minimum=1))
    decoder_input_details: bool = Field(False, description="Return the prompt tokens with logprobs.")
    details: bool = Field(False, description="Return generation details.")
    do_sample: bool = Field(False, description="Sample instead of greedy decoding.")
    frequency_penalty: Optional[float] = Field(None, description="In [-2, 2].", json_schema_extra=_doc(minimum=-2, maximum=2))
    grammar: Optional[Any] = Field(None, description='Constrain the output: {"type": "json", "value": schema}, '
                                   '{"type": "regex", "value": "..."} or {"type": "json_schema", "value": '
                                   '{"name": ..., "schema": schema}}.')
    max_new_tokens: Optional[int] = Field(None, description="Default: what the total-token limit leaves.",
                                          json_schema_extra=_doc(minimum=1))
    repetition_penalty: Optional[float] = Field(None, description="> 0; 1 means no penalty.",
                                                json_schema_extra=_doc(exclusiveMinimum=0))
    return_full_text: Optional[bool] = Field(None, description="Prepend the prompt to generated_text.")
    seed: Optional[int] = Field(None, description="Random seed for sampling.",
                                json_schema_extra=_doc(minimum=0, maximum=UINT64_MAX))
    stop: list[str] = Field(default_factory=list, description="Stop sequences (kept in the text).",
                            json_schema_extra=_doc(maxItems=4))
    temperature: Optional[float] = Field(None, description="> 0; implies sampling unless 1.0.",
                                         json_schema_extra=_doc(exclusiveMinimum=0))
    top_k: Optional[int] = Field(None, description="> 0; implies sampling.", json_schema_extra=_doc(minimum=1))
    top_n_tokens: Optional[int] = Field(None, description="Alternatives per token, <= the server max.",
                                        json_schema_extra=_doc(minimum=0, maximum=5))
    top_p: Optional[float] = Field(None, description="In (0, 1]; implies sampling below 1.",
                                   json_schema_extra=_doc(exclusiveMinimum=0, maximum=1))
    truncate: Optional[int] = Field(None, description="Keep only the last N prompt tokens.",
                                    json_schema_extra=_doc(minimum=1))
    typical_p: Optional[float] = Field(None, description="In (0, 1]; implies sampling below 1.",
                                       json_schema_extra=_doc(exclusiveMinimum=0, maximum=1))
    watermark: bool = Field(False, description="Not supported; must be false.", json_schema_extra=_doc(enum=[False]))
    adapter_id: Optional[str] = Field(None, description="A LoRA adapter the model serves (see /v1/models).")
    speculative: bool = Field(True, description="Extension: speculative decoding for this request, when the "
                                                 "server has it on; false decodes one token per step.")


class GenerateRequest(RequestBody):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    inputs: str = Field(..., description="The prompt.", json_schema_extra=_doc(minLength=1))
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS).")


class CompatGenerateRequest(GenerateRequest):
    """``POST /``: /generate or /generate_stream, chosen by ``stream``."""

    stream: bool = False


@dataclass(slots=True)
class TgiPlan:
    """A validated TGI request: what to send and how to render the answer."""

    engine: EngineRequest
    prompt_tokens: int
    return_full_text: bool
    details: bool
    decoder_input_details: bool

    @property
    def engines(self) -> tuple[EngineRequest, ...]:
        return (self.engine,)


def _positive(value: Optional[float], name: str) -> None:
    if value is not None and value <= 0:
        raise ValidationFailed(f"`{name}` must be strictly positive", param=name)


def _unit_interval(value: Optional[float], name: str) -> Optional[float]:
    if value is None:
        return None
    if value <= 0.0 or value > 1.0:
        raise ValidationFailed(f"`{name}` must be > 0.0 and < 1.0", param=name)
    return None if value == 1.0 else value


def tgi_grammar(grammar: Any) -> Optional[GrammarRequest]:
    """TGI's ``grammar`` parameter as the engine's constraint."""
    if grammar is None:
        return None
    if not isinstance(grammar, dict) or "type" not in grammar or "value" not in grammar:
        raise ValidationFailed('`grammar` must be {"type": "json" | "regex" | "json_schema", "value": ...}',
                               param="grammar")
    kind, value = grammar["type"], grammar["value"]
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValidationFailed("`grammar.value` must be a regular expression (a string)", param="grammar")
        return GrammarRequest("regex", value, "grammar")
    if kind in ("json", "json_schema"):
        if kind == "json_schema":
            if not isinstance(value, dict) or "schema" not in value:
                raise ValidationFailed('`grammar.value` must be {"name": ..., "schema": {...}} with type '
                                       '"json_schema"', param="grammar")
            value = value["schema"]
        if isinstance(value, str):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise ValidationFailed(f"`grammar.value` is not valid JSON: {exc}", param="grammar") from None
        if not isinstance(value, (dict, bool)):
            raise ValidationFailed("`grammar.value` must be a JSON schema (an object)", param="grammar")
        return GrammarRequest("json_schema", orjson.dumps(value).decode(), "grammar")
    raise ValidationFailed(f"`grammar.type` must be json, regex or json_schema. Given: {kind!r}", param="grammar")


def plan_tgi(req: GenerateRequest, tokenizer: ModelTokenizer, limits: Limits, *,
             stream: bool) -> TgiPlan:
    p = req.parameters
    best_of = 1 if p.best_of is None else p.best_of
    if not 0 < best_of <= limits.max_sequences:
        raise ValidationFailed(f"`best_of` must be > 0 and <= {limits.max_sequences}. Given: {p.best_of}",
                               param="best_of")
    if best_of > 1 and stream:
        raise ValidationFailed("`best_of` != 1 is not supported when streaming tokens", param="best_of")
    if p.watermark:
        raise ValidationFailed("`watermark` is not supported by kubeshard", param="watermark")
    grammar = tgi_grammar(p.grammar)
    if stream and p.decoder_input_details:
        raise ValidationFailed("`decoder_input_details` == true is not supported when streaming tokens",
                               param="decoder_input_details")
    _positive(p.temperature, "temperature")
    _positive(p.repetition_penalty, "repetition_penalty")
    _positive(p.top_k, "top_k")
    if p.frequency_penalty is not None and not (-2.0 <= p.frequency_penalty <= 2.0):
        raise ValidationFailed("`frequency_penalty` must be >= -2.0 and <= 2.0", param="frequency_penalty")
    top_p = _unit_interval(p.top_p, "top_p")
    typical_p = _unit_interval(p.typical_p, "typical_p")
    if p.max_new_tokens is not None and p.max_new_tokens <= 0:
        raise ValidationFailed("`max_new_tokens` must be strictly positive", param="max_new_tokens")
    top_n = p.top_n_tokens or 0
    if top_n < 0 or top_n > limits.max_top_n_tokens:
        raise ValidationFailed(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. "
                               f"Given: {top_n}", param="top_n_tokens")
    stop = check_stop(p.stop, limits)
    seed = check_seed(p.seed)
    if p.truncate is not None and (p.truncate <= 0 or p.truncate > limits.max_input_tokens):
        raise ValidationFailed(f"`truncate` must be strictly positive and less than "
                               f"{limits.max_input_tokens}. Given: {p.truncate}", param="truncate")
    if not req.inputs:
        raise ValidationFailed("`inputs` cannot be empty", param="inputs")

    ids = tokenizer.encode(req.inputs, add_special_tokens=req.add_special_tokens)
    if p.truncate is not None and len(ids) > p.truncate:
        ids = ids[-p.truncate:]
    max_new = check_budget(len(ids), p.max_new_tokens, limits,
                           input_field="inputs", max_new_field="max_new_tokens")
    temperature = p.temperature
    # TGI samples whenever a warper is set, even without do_sample.
    do_sample = (p.do_sample or (temperature is not None and temperature != 1.0)
                 or p.top_k is not None or top_p is not None or typical_p is not None)
    if best_of > 1 and not do_sample:
        raise ValidationFailed("you must use sampling when `best_of` is > 1", param="best_of")
    engine = EngineRequest(
        input_ids=ids, max_new_tokens=max_new, do_sample=do_sample, n=best_of, grammar=grammar,
        adapter=p.adapter_id or None,
        temperature=temperature,
        top_k=min(p.top_k, limits.vocab_size, UINT32_MAX) if p.top_k is not None else None,
        top_p=top_p, typical_p=typical_p, repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty, seed=seed, stop=stop, top_n_tokens=top_n,
        prefill_details=p.decoder_input_details, speculative=p.speculative,
    )
    return TgiPlan(engine=engine, prompt_tokens=len(ids),
                   return_full_text=bool(p.return_full_text), details=p.details,
                   decoder_input_details=p.decoder_input_details)
