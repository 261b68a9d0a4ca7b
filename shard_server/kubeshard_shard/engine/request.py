"""Validation of a generation request against the engine's limits.

Every rule raises ``RequestError`` with a message that names the field, so the gRPC
server can answer INVALID_ARGUMENT and the router can pass the message on.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kubeshard_shard.engine.sequence import SamplingParams

MAX_STOP_SEQUENCES = 16
MAX_TOP_N_TOKENS = 20


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
