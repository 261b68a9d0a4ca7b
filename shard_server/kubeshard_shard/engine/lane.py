"""A lane: one continuous-batching scheduler over its own KV-block pool.

A single process or a tensor-parallel group has one lane; a zero3 group has one per
rank (data parallel). The engine (``llm_engine``) schedules every lane and executes
them in lockstep; the activation cache (``activations.coordinator``) holds a lane's new
requests while their prefix blocks arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kubeshard_shard.engine.block_manager import BlockManager
from kubeshard_shard.engine.scheduler import Scheduler
from kubeshard_shard.engine.sequence import Sequence


@dataclass
class Lane:
    """One continuous-batching lane: a scheduler over its own KV-block pool."""

    index: int
    block_manager: BlockManager
    scheduler: Scheduler

    @classmethod
    def create(cls, index: int, num_blocks: int, block_size: int, prefix_caching: bool, max_batch_tokens: int,
               max_num_seqs: int, lookahead: Callable[[Sequence, int], int] | None = None) -> "Lane":
        bm = BlockManager(num_blocks, block_size, prefix_caching)
        return cls(index, bm, Scheduler(bm, max_batch_tokens, max_num_seqs, lookahead))

    @property
    def load(self) -> int:
        return self.scheduler.num_unfinished
