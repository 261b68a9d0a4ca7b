"""Validation of a generation request against the engine's limits.

Every rule raises ``RequestError`` with a message that names the field, so the gRPC
server can answer INVALID_ARGUMENT and the router can pass the message on.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kubeshard_shard.engine.sequence import GrammarSpec, SamplingParams

MAX_STOP_SEQUENCES = 16
MAX_TOP_N_TOKENS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
MAX_SEQUENCES = 16
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "choice", "structural_tag")


class RequestError(ValueError):
    """A request the engine refuses; the message names the field."""


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_total_tokens: int


def _finite(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value}")


def make_sampling_params(
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    typical_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    seed: int | None = None,
    stop_sequences: tuple[str, ...] | list[str] = (),
    ignore_eos: bool = False,
    top_n_tokens: int = 0,
    prefill_details: bool = False,
    prefill_top_n_tokens: int = 0,
    min_p: float | None = None,
    logit_bias: dict[int, float] | None = None,
    stop_token_ids: tuple[int, ...] | list[int] = (),
    min_new_tokens: int = 0,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    n: int = 1,
    grammar: GrammarSpec | None = None,
    adapter: str | None = None,
    speculative: bool = True,
) -> SamplingParams:
    for name, value in (("temperature", temperature), ("top_p", top_p), ("typical_p", typical_p),
                        ("repetition_penalty", repetition_penalty), ("frequency_penalty", frequency_penalty),
                        ("presence_penalty", presence_penalty)):
        _finite(name, value)
    if max_new_tokens is None or max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature is not None and temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        do_sample = False  # temperature 0 means greedy, as in the OpenAI API
    if top_p is not None and not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    if typical_p is not None and not 0 < typical_p <= 1:
        raise RequestError(f"typical_p must be in (0, 1], got {typical_p}")
    if top_k is not None and top_k < 1:
        raise RequestError(f"top_k must be >= 1, got {top_k}")
    if repetition_penalty is not None and repetition_penalty <= 0:
        raise RequestError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
        if value is not None and not -2.0 <= value <= 2.0:
            raise RequestError(f"{name} must be in [-2, 2], got {value}")
    stops = tuple(stop_sequences)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise RequestError(f"stop_sequences holds {len(stops)} entries; at most {MAX_STOP_SEQUENCES} are allowed")
    if any(s == "" for s in stops):
        raise RequestError("stop_sequences must not contain empty strings")
    if not 0 <= top_n_tokens <= MAX_TOP_N_TOKENS:
        raise RequestError(f"top_n_tokens must be in [0, {MAX_TOP_N_TOKENS}], got {top_n_tokens}")
    if seed is not None and not 0 <= seed < 2**63:
        raise RequestError(f"seed must be in [0, 2^63), got {seed}")
    _finite("min_p", min_p)
    if min_p is not None and not 0 <= min_p <= 1:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens ({max_new_tokens})], got {min_new_tokens}")
    if not 0 <= prefill_top_n_tokens <= MAX_TOP_N_TOKENS:
        raise RequestError(f"prefill_top_n_tokens must be in [0, {MAX_TOP_N_TOKENS}], got {prefill_top_n_tokens}")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"stop_token_ids holds {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
    bias = dict(logit_bias or {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    for token, value in bias.items():
        if not math.isfinite(value) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
    if not 1 <= n <= MAX_SEQUENCES:
        raise RequestError(f"n must be in [1, {MAX_SEQUENCES}], got {n}")
    if grammar is not None and grammar.kind not in GRAMMAR_KINDS:
        raise RequestError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {grammar.kind!r}")
    if do_sample and seed is None:
        seed = random.getrandbits(63)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=1.0 if temperature in (None, 0) else float(temperature),
        top_k=top_k,
        top_p=top_p,
        typical_p=typical_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        seed=seed,
        stop_sequences=stops,
        ignore_eos=ignore_eos,
        top_n_tokens=top_n_tokens,
        prefill_details=prefill_details,
        prefill_top_n_tokens=prefill_top_n_tokens if prefill_details else 0,
        min_p=min_p if min_p else None,
        logit_bias=tuple(sorted(bias.items())),
        stop_token_ids=frozenset(stop_token_ids),
        min_new_tokens=min_new_tokens,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        n=n,
        grammar=grammar,
        adapter=adapter or None,
        speculative=bool(speculative),
    )


def check_prompt(prompt_ids: list[int], params: SamplingParams, limits: Limits, vocab_size: int) -> None:
    n = len(prompt_ids)
    if n == 0:
        raise RequestError("the prompt is empty: `inputs` must hold at least one token")
    if n > limits.max_input_tokens:
        raise RequestError(f"the prompt has {n} tokens, more than max_input_tokens ({limits.max_input_tokens})")
    if n + params.max_new_tokens > limits.max_total_tokens:
        raise RequestError(
            f"prompt tokens ({n}) + max_new_tokens ({params.max_new_tokens}) must be <= max_total_tokens "
            f"({limits.max_total_tokens}); lower max_new_tokens to at most {max(limits.max_total_tokens - n, 0)}")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"input_ids contains ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
        bad = sorted(t for t in ids if not 0 <= t < vocab_size)
        if bad:
            raise RequestError(f"{name} names token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
