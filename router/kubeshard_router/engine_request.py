"""The validated, API-neutral request the router sends to a leader.

Both the TGI and the OpenAI handlers reduce their request to this one dataclass; the
dispatcher turns it into a ``GenerateRequest`` and the cache derives its key from it, so
a /generate and a /v1/completions asking for the same thing share a cache entry.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import orjson

from kubeshard_proto import pb


@dataclass(frozen=True, slots=True)
class GrammarRequest:
    """A structured-output constraint (``pb.Grammar``): ``kind`` is json_schema, regex,
    ebnf, choice or structural_tag; ``value`` its text, or the choices."""

    kind: str
    value: str | tuple[str, ...]
    field: str = "grammar"  # the request field it came from, named in errors

    def to_proto(self) -> pb.Grammar:
        if self.kind == "choice":
            return pb.Grammar(choice=pb.ChoiceList(choices=list(self.value)))
        return pb.Grammar(**{self.kind: self.value})


# SamplingParameters fields sent as they are when set: the sampler's only when sampling.
_SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "typical_p", "seed", "min_p")
_PENALTY_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty")


@dataclass(slots=True)
class EngineRequest:
    input_ids: list[int]
    max_new_tokens: int
    do_sample: bool = False
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    typical_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_n_tokens: int = 0
    prefill_details: bool = False
    # vLLM's extensions
    min_p: Optional[float] = None
    logit_bias: Optional[dict[int, float]] = None
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prefill_top_n_tokens: int = 0
    # sequences generated from the prompt (n, or best_of)
    n: int = 1
    grammar: Optional[GrammarRequest] = None
    adapter: Optional[str] = None
    # False: no speculative decoding for this request (the server's setting otherwise)
    speculative: bool = True

    @property
    def token_budget(self) -> int:
        """The most tokens this request can generate (all its sequences)."""
        return self.max_new_tokens * self.n

    @property
    def deterministic(self) -> bool:
        """Greedy, or sampled with a fixed seed: the same request gives the same tokens."""
        return not self.do_sample or self.seed is not None

    def to_proto(self, request_id: str) -> pb.GenerateRequest:
        sampling = pb.SamplingParameters(do_sample=self.do_sample)
        for name in (_SAMPLER_FIELDS if self.do_sample else ()) + _PENALTY_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(sampling, name, value)
        if self.logit_bias:
            sampling.logit_bias.update(self.logit_bias)
        if not self.speculative:
            sampling.speculative = False
        request = pb.GenerateRequest(
            request_id=request_id,
            input_ids=self.input_ids,
            sampling=sampling,
            stopping=pb.StoppingCriteria(max_new_tokens=self.max_new_tokens,
                                         stop_sequences=self.stop, ignore_eos=self.ignore_eos,
                                         stop_token_ids=self.stop_token_ids,
                                         min_new_tokens=self.min_new_tokens),
            top_n_tokens=self.top_n_tokens,
            prefill_details=self.prefill_details,
            prefill_top_n_tokens=self.prefill_top_n_tokens,
            n=self.n if self.n > 1 else 0,
            adapter=self.adapter or "",
        )
        if not self.skip_special_tokens:
            request.skip_special_tokens = False
        if not self.spaces_between_special_tokens:
            request.spaces_between_special_tokens = False
        if self.grammar is not None:
            request.grammar.CopyFrom(self.grammar.to_proto())
        return request

    def fingerprint(self) -> str:
        """A stable digest of everything that decides the output (for cache keys)."""
        sampled = self.do_sample
        normalized = (
            self.input_ids, self.max_new_tokens, sampled,
            self.temperature if sampled else None, self.top_k if sampled else None,
            self.top_p if sampled else None, self.typical_p if sampled else None,
            self.seed if sampled else None,
            self.repetition_penalty, self.frequency_penalty, self.presence_penalty,
            list(self.stop), self.ignore_eos, self.top_n_tokens, self.prefill_details,
            self.min_p if sampled else None, sorted((self.logit_bias or {}).items()),
            sorted(self.stop_token_ids), self.min_new_tokens, self.skip_special_tokens,
            self.spaces_between_special_tokens, self.prefill_top_n_tokens, self.n,
            None if self.grammar is None else [self.grammar.kind, self.grammar.value],
            self.adapter,
            # sampled tokens depend on it (their distribution does not)
            self.speculative if sampled else None,
        )
        return hashlib.blake2b(orjson.dumps(normalized), digest_size=20).hexdigest()
