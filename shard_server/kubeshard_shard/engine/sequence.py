"""A request inside the engine: its tokens, its place in the KV cache, its parameters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    STOP_TOKEN = "stop_token"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint: ``kind`` is json_schema, regex, ebnf, choice or
    structural_tag; ``source`` its text (choices: a JSON list of strings)."""

    kind: str
    source: str


@dataclass(frozen=True)
class SamplingParams:
    """Validated per-request parameters (see ``engine.request`` for the rules)."""

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_n_tokens: int = 0
    prefill_details: bool = False
    prefill_top_n_tokens: int = 0
    min_p: float | None = None
    # (token id, bias) pairs added to the logits first
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # sequences generated from the prompt (OpenAI n / best_of)
    n: int = 1
    grammar: GrammarSpec | None = None
    adapter: str | None = None
    # speculative decoding for this request, when the server has a proposer (off: one
    # token per step, as without it)
    speculative: bool = True

    def seed_of(self, index: int) -> int | None:
        """The seed of sequence ``index`` of an n-sequence request."""
        return None if self.seed is None else (self.seed + index) % 2**63

    @property
    def has_penalties(self) -> bool:
        return bool((self.repetition_penalty not in (None, 1.0)) or self.frequency_penalty
                    or self.presence_penalty)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)

    # which of the request's n sequences this is
    index: int = 0

    def __post_init__(self) -> None:
        self.key = 0  # the engine's unique id for this request (shared by its n sequences)
        self.token_ids: list[int] = list(self.prompt_ids)
        self.num_prompt_tokens = len(self.prompt_ids)
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are in the cache; the rest are computed by coming steps.
        self.num_computed_tokens = 0
        # Prompt tokens that were found in the prefix cache on first scheduling.
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        # Hash of each full block of token_ids, chained over the blocks before it.
        self.block_hashes: list[int] = []
        # How many leading blocks have been offered to the prefix cache already.
        self.num_registered_blocks = 0
        self.first_scheduled_time: float | None = None
        self.preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.generator: torch.Generator | None = None
        self.prefill_logprobs: list[float] | None = None
        self.prefill_top: list[list[tuple[int, float]]] | None = None
        self.seen_first_output = False
        self.aborted = False
        self.cumulative_logprob = 0.0
        # structured output: the grammar matcher of this sequence (engine.grammar)
        self.matcher = None
        # LoRA: the adapter's slot in the runner's adapter table (0: the base model), and the
        # root of its block-hash chain (an adapter's KV differs from the base model's)
        self.adapter_slot = 0
        self.hash_root: int | None = None
        # logit_bias as (ids, values) tensors, built on first use by the sampler
        self.bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        # speculative decoding (engine.speculative): this step's proposed tokens, the
        # draft model's distributions they were drawn from ([k, vocab]; None: proposals
        # that are certain, as n-gram lookups and greedy drafts are), and how many
        # leading tokens the draft model's KV pool holds; the most proposals it may get
        # next (Speculator.verified sets it; 0: the configured number)
        self.spec_tokens: list[int] = []
        self.spec_probs: torch.Tensor | None = None
        self.draft_computed = 0
        self.spec_limit = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
