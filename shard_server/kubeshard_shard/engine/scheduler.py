"""Iteration-level continuous batching with chunked prefill and preemption.

Each step fills a token budget (``max_batch_tokens``) in this order:
  1. one token for every running sequence that is decoding — decodes never wait
     behind a long prompt — plus room for its speculative proposals, if any
     (``lookahead``, see ``engine.speculative``);
  2. the next chunk of every running sequence still in its prefill;
  3. new (or preempted) sequences from the waiting queue, first come first served,
     starting after the longest cached prefix of their tokens.
When the KV pool cannot hold a running sequence's next token, the most recently
admitted running sequence is preempted: its blocks are freed and it goes back to the
front of the queue, to be recomputed later (its generated tokens are kept).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kubeshard_shard.engine.block_manager import BlockManager
from kubeshard_shard.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)
    # per decode: how many speculative proposals its reserved slots can hold
    lookaheads: list[int] = field(default_factory=list)
    # (sequence, number of its tokens computed in this step)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(self.lookaheads) + sum(n for _, n in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_tokens: int, max_num_seqs: int,
                 lookahead: Callable[[Sequence, int], int] | None = None) -> None:
        self.block_manager = block_manager
        self.lookahead = lookahead
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions_total = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queues a sequence: at the back, or at the front (``front``: the other
        sequences of a request whose first one has just computed the prompt)."""
        seq.status = SequenceStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a finished or aborted sequence out and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_sequence(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.draft_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Allocates for a running sequence, preempting others (latest first) when short.
        False when ``seq`` itself had to be preempted."""
        while not self.block_manager.allocate(seq, num_tokens):
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = victims[-1] if victims else seq
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batch_tokens
        scheduled: set[int] = set()

        # 1. decodes
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            extra = min(self.lookahead(seq, len(self.running)), budget - 1) if self.lookahead is not None else 0
            if self._reserve(seq, 1 + extra, out, scheduled):
                out.decodes.append(seq)
                out.lookaheads.append(extra)
                scheduled.add(id(seq))
                budget -= 1 + extra

        # 2. prefill chunks of running sequences
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or id(seq) in scheduled:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if n <= 0:
                continue
            if self._reserve(seq, n, out, scheduled):
                out.prefills.append((seq, n))
                scheduled.add(id(seq))
                budget -= n

        # 3. admit waiting sequences (not in a step that had to preempt: memory is short)
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Prompt log-probabilities need every prompt position computed: no prefix reuse.
            reuse = seq.num_computed_tokens == 0 and not seq.params.prefill_details
            cached = self.block_manager.find_cached_prefix(seq) if reuse else []
            start = len(cached) * self.block_manager.block_size if cached else seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            if not self.block_manager.allocate(seq, n, cached):
                break  # wait for running sequences to finish (a lone sequence always fits)
            self.waiting.popleft()
            if seq.preemptions == 0 and seq.first_scheduled_time is None:
                seq.num_cached_tokens = start
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
        return out
