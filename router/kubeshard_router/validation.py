"""What the TGI and OpenAI front ends share in validating a request.

``parse_body`` parses with orjson and validates with pydantic: malformed JSON is a 400,
a wrong type a 422 naming the field path. ``Limits`` is what a request may ask of one
model; ``check_budget``, ``check_stop``, ``check_seed`` and ``check_token_ids`` check a
request against them, in TGI's wording ("Input validation error: `inputs` must have less
than 1024 tokens"). Each API's own parameter rules live beside its request models
(``tgi_schema``, ``openai_schema``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, TypeVar

import orjson
import pydantic

from kubeshard_router.errors import MalformedRequest, ValidationFailed

M = TypeVar("M", bound=pydantic.BaseModel)

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Limits:
    """What a request may ask of one model: the engine's limits plus the router's."""

    max_input_tokens: int
    max_total_tokens: int
    vocab_size: int
    max_top_n_tokens: int = 5
    max_stop_sequences: int = 4
    # sequences one request may ask for (n, best_of): the leader's max_sequences_per_request
    max_sequences: int = 1


class RequestBody(pydantic.BaseModel):
    """A request body of one of the APIs (``GenerateRequest``, ``CompletionRequest``, ...)."""

    def requested_model(self) -> Optional[str]:
        """The model the body names; None: the route's or the router's default."""
        return None


def schema_doc(**constraints: object) -> dict:
    """JSON-schema keywords for /openapi.json only. The rules themselves are checked in
    code, so errors keep TGI's wording ("`temperature` must be strictly positive")."""
    return dict(constraints)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}


def _field_path(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
            continue
        name = str(item)
        # pydantic adds union member tags ("str", "list[int]", "function-after[...]") to loc
        if name.lower() in _TYPE_NAMES or "[" in name or "-" in name:
            continue
        parts.append(("." if parts else "") + name)
    return "".join(parts) or "body"


def describe_validation_error(exc: pydantic.ValidationError) -> tuple[str, str]:
    """Returns (message, first field path) for a pydantic error, most useful errors first."""
    seen: set[str] = set()
    messages: list[str] = []
    first_path = ""
    for err in exc.errors(include_url=False, include_context=False, include_input=False):
        path = _field_path(tuple(err.get("loc", ())))
        if path in seen:
            continue  # a union reports one error per member; one per field is enough
        seen.add(path)
        first_path = first_path or path
        messages.append(f"`{path}`: {err.get('msg', 'invalid value')}")
        if len(messages) == 3:
            break
    return "; ".join(messages), first_path


def parse_body(raw: bytes, model: type[M]) -> M:
    if not raw or not raw.strip():
        raise MalformedRequest("request body is empty: expected a JSON object")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValidationFailed(f"request body must be a JSON object, got {type(data).__name__}",
                               param="body")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        message, path = describe_validation_error(exc)
        raise ValidationFailed(message, param=path) from None


def check_budget(input_length: int, max_new_tokens: Optional[int], limits: Limits, *,
                 input_field: str, max_new_field: str) -> int:
    """Checks the prompt against the limits and returns the effective max_new_tokens."""
    if input_length == 0:
        raise ValidationFailed(f"`{input_field}` cannot be empty", param=input_field)
    if input_length > limits.max_input_tokens:
        raise ValidationFailed(
            f"`{input_field}` must have less than {limits.max_input_tokens} tokens. "
            f"Given: {input_length}", param=input_field)
    if max_new_tokens is None:
        max_new_tokens = limits.max_total_tokens - input_length
        if max_new_tokens < 1:
            raise ValidationFailed(
                f"`{input_field}` uses {input_length} tokens, leaving no room to generate within "
                f"the model's {limits.max_total_tokens} total tokens", param=input_field)
    total = input_length + max_new_tokens
    if total > limits.max_total_tokens:
        raise ValidationFailed(
            f"`{input_field}` tokens + `{max_new_field}` must be <= {limits.max_total_tokens}. "
            f"Given: {input_length} `{input_field}` tokens and {max_new_tokens} `{max_new_field}`",
            param=max_new_field)
    return max_new_tokens


def check_stop(stop: list[str], limits: Limits, field: str = "stop") -> tuple[str, ...]:
    if len(stop) > limits.max_stop_sequences:
        raise ValidationFailed(
            f"`{field}` supports up to {limits.max_stop_sequences} stop sequences. Given: {len(stop)}",
            param=field)
    for i, s in enumerate(stop):
        if not s:
            raise ValidationFailed(f"`{field}[{i}]` must not be an empty string", param=field)
    return tuple(stop)


def check_seed(seed: Optional[int], field: str = "seed") -> Optional[int]:
    if seed is not None and not (0 <= seed <= UINT64_MAX):
        raise ValidationFailed(f"`{field}` must be >= 0 and <= {UINT64_MAX}. Given: {seed}",
                               param=field)
    return seed


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    for i, t in enumerate(ids):
        if not (0 <= t < vocab_size):
            raise ValidationFailed(
                f"`{field}[{i}]` = {t} is not a token id of this model (vocabulary size {vocab_size})",
                param=field)
