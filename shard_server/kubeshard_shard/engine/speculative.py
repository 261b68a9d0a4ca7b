"""Speculative decoding: guess a few tokens cheaply, let the model check them at once.

Decoding one token per step reads every weight once per token; a step over ``k + 1``
tokens of one sequence costs little more on a memory-bound machine. So for each
decoding sequence that speculates, the engine:

1. *schedules* it with room for ``1 + k`` tokens (``lookahead``: the scheduler reserves
   their KV slots, preempting as for any allocation);
2. *proposes* up to ``k`` tokens (``Proposer``: ``engine.ngram`` looks them up in the
   sequence's own tokens, ``engine.draft`` asks a smaller model);
3. *verifies* them: the model runner computes the newest token and the proposals in
   one step (an ordinary step for every rank of a sharded group): each as a decode row
   over the cached context where the paged decode kernel runs, else as one chunk; then
   ``engine.rejection`` keeps the longest agreeing run plus one more token — the
   same tokens as without speculation for greedy requests, the same distribution for
   sampled ones.

K/V written for refused proposals sit past ``num_computed_tokens`` and are overwritten
by later steps; the prefix cache only registers blocks of kept tokens.

How many tokens a sequence may propose adapts to how its last proposals fared (at most
``k``) where proposing costs something or the step is shared: after a refusal, one more
than were kept; after a draft kept whole, twice as many. A draft model's proposals cost
a draft step each, and in a batch every verification row adds to a step whose rows
already keep the cores busy. A sequence alone with a free proposer (n-gram lookups)
always may propose ``k`` (the proposer bounds short matches itself, ``engine.ngram``): a
verification row costs a few percent of a one-row step there, little against the tokens
a proposal after a refusal still brings. On the default model's copy-heavy answers,
replayed (bench/results/ngram-replay-avx2.md, 2026-12-06): 2.43x the decoding speed at k =
6 against 2.19x shrinking; end to end at 1 client (speculative-rounds-avx2.md, prefill
included) 1.94x plain decoding, 1.70x the day before with shrinking (and a slower
prefill). Which tokens come out does not change (the greedy ones, or the target's
distribution: a proposal's length depends only on what came before).

A request speculates unless it turned it off, and only where the one-token-at-a-time
semantics need no state between positions: not under a grammar, repetition/frequency/
presence penalties, or before ``min_new_tokens``. With ``disable_by_batch_size`` no
sequence of a lane speculates in a step while that many sequences run in it (vLLM's
option of that name): a large batch already fills the step, and its verifications would
only add rows (bench/results/speculative.md: ngram on free chat at 8 clients 0.82x of
plain decoding, 0.97x paused from 4 sequences, in the run of 2026-12-05).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kubeshard_shard.engine.sequence import Sequence


class Proposer(Protocol):
    name: str
    free: bool  # proposing costs nothing next to verifying (no model runs)

    def propose(self, lane_index: int, batch: list[tuple[Sequence, int]]) -> None:
        """Sets ``seq.spec_tokens`` (at most its budget) and ``seq.spec_probs`` for each
        (sequence, budget) of one lane."""

    def verified(self, seq: Sequence, position: int, proposed: int, emitted: int) -> None:
        """Hears how a sequence's proposals fared: its newest token was at ``position``,
        ``proposed`` tokens were checked and ``emitted`` tokens came out."""


@dataclass
class SpeculativeStats:
    """Totals since start, with vLLM's meanings: a *draft* is one sequence's proposals
    in one step; ``accepted_per_position[i]`` counts drafts whose (i+1)-th proposal
    was kept."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (kept proposals + 1)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class Speculator:
    def __init__(self, proposer: Proposer, num_tokens: int, disable_by_batch_size: int = 0) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.disable_by_batch_size = disable_by_batch_size  # 0: speculate at any batch size
        self.totals = SpeculativeStats(accepted_per_position=[0] * num_tokens)

    @property
    def method(self) -> str:
        return self.proposer.name

    def lookahead(self, seq: Sequence, running: int) -> int:
        """Proposals a decoding sequence may get this step, ``running`` sequences running
        in its lane (0: it decodes one token)."""
        if self.disable_by_batch_size and running >= self.disable_by_batch_size:
            return 0
        p = seq.params
        if not p.speculative or seq.matcher is not None or p.has_penalties:
            return 0
        if seq.num_output_tokens < p.min_new_tokens:
            return 0
        adapted = running > 1 or not self.proposer.free
        limit = (seq.spec_limit or self.num_tokens) if adapted else self.num_tokens
        return max(0, min(limit, p.max_new_tokens - seq.num_output_tokens - 1))

    def propose(self, lane_index: int, batch: list[tuple[Sequence, int]]) -> None:
        if batch:
            self.proposer.propose(lane_index, batch)

    def verified(self, seq: Sequence, position: int, proposed: int, kept: int) -> None:
        """Counts one verification (``kept`` proposals of ``proposed``, then one more
        token), sets how many the sequence may propose next, and tells the proposer."""
        limit = seq.spec_limit or self.num_tokens
        seq.spec_limit = min(self.num_tokens, 2 * limit) if kept == proposed else kept + 1
        t = self.totals
        t.drafts += 1
        t.draft_tokens += proposed
        t.accepted_tokens += kept
        for i in range(kept):
            t.accepted_per_position[i] += 1
        self.proposer.verified(seq, position, proposed, kept + 1)

    def stats(self) -> SpeculativeStats:
        t = self.totals
        return SpeculativeStats(t.drafts, t.draft_tokens, t.accepted_tokens, list(t.accepted_per_position))
