"""Allocation of KV-cache blocks, with automatic prefix caching.

The pool holds ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns a
block table (block ids in token order). A *full* block is identified by a hash chained
over its tokens and all tokens before it, so two prompts that share a prefix share the
blocks of that prefix by reference count. A block whose count drops to zero stays in
the cache and goes to the back of the free queue; allocation takes blocks from the
front, evicting the least recently used cached block only when no plain free block is
left. Nobody else touches the free queue: ``allocate`` answers False when memory is
short, and the scheduler preempts.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from kubeshard_shard.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


HASH_BYTES = 16
_ROOT = b"kubeshard-kv-chain-v1"


def hash_block(parent_hash: int | None, tokens: list[int]) -> int:
    """The chained hash of one full block: BLAKE2b-128 over the parent block's hash and
    the block's token ids (little-endian uint32). The same in every process and on every
    machine (never Python's salted ``hash``), so it can name KV blocks shared through
    Redis; 128 bits and a cryptographic hash, so no crafted prompt collides with
    another's prefix."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(_ROOT if parent_hash is None else parent_hash.to_bytes(HASH_BYTES, "little"))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: front = next to reuse. Plain blocks go to the
        # front, cached ones to the back (least recently used first).
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self._cached_free = 0  # free blocks that still hold cached content
        self.prefix_queries = 0  # full prompt blocks looked up
        self.prefix_hits = 0     # ... and found

    # ---- figures -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._cached_free

    # ---- hashing -------------------------------------------------------------------
    def _update_hashes(self, seq: Sequence, upto_tokens: int) -> None:
        """Extends ``seq.block_hashes`` to cover every full block within ``upto_tokens``."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= upto_tokens:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs]))

    # ---- prefix cache lookup ---------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq`` (not yet held). At least one
        token is always left to compute, so the step yields logits for sampling."""
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(seq, seq.num_tokens)
        hits: list[int] = []
        for h in seq.block_hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if len(hits) * self.block_size >= seq.num_tokens:
            hits.pop()
        self.prefix_queries += (seq.num_tokens - 1) // self.block_size
        self.prefix_hits += len(hits)
        return hits

    def prompt_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the full blocks a cached prefix of ``seq`` can cover (its last token
        is always computed, see ``find_cached_prefix``)."""
        self._update_hashes(seq, seq.num_tokens)
        return seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]

    def count_cached(self, hashes: list[int]) -> int:
        """Leading entries of a hash chain present in the cache (no side effects)."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def count_cached_prefix(self, token_ids: list[int]) -> int:
        """Leading full blocks of ``token_ids`` present in the cache (no side effects)."""
        if not self.enable_prefix_caching:
            return 0
        bs, parent, n = self.block_size, None, 0
        for i in range(len(token_ids) // bs):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            if parent not in self.cached:
                break
            n += 1
        return n

    # ---- allocation ------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int] = ()) -> bool:
        needed = self._blocks_needed(seq, num_new_tokens, cached_prefix)
        reviving = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        return needed + reviving <= len(self.free)

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, cached_prefix) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        if cached_prefix:
            total = max(total, len(cached_prefix) * self.block_size + num_new_tokens)
        want = -(-total // self.block_size)
        return max(want - len(seq.block_table) - len(cached_prefix), 0)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[int] = ()) -> bool:
        """Makes room for ``num_new_tokens`` more tokens of ``seq`` (after taking the
        ``cached_prefix`` blocks, if any). Returns False, changing nothing, when the pool
        cannot hold them."""
        if not self.can_allocate(seq, num_new_tokens, cached_prefix):
            return False
        needed = self._blocks_needed(seq, num_new_tokens, cached_prefix)
        for block_id in cached_prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
                self._cached_free -= 1
            block.ref_count += 1
            seq.block_table.append(block_id)
        if cached_prefix:
            seq.num_computed_tokens = len(cached_prefix) * self.block_size
            seq.num_registered_blocks = len(cached_prefix)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict the least recently used cached block
            self._cached_free -= 1
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers the blocks that the last step filled, so later prompts can share them."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        self._update_hashes(seq, full * self.block_size)
        for i in range(seq.num_registered_blocks, full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block.block_id
        seq.num_registered_blocks = full

    def free_sequence(self, seq: Sequence) -> None:
        """Releases the blocks of a finished, aborted or preempted sequence. Its tail
        blocks are freed first, so they are evicted before the prefix they extend."""
        self.release(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _release_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.block_hash is None:
                self.free.move_to_end(block_id, last=False)
            else:
                self._cached_free += 1

    # ---- blocks held outside sequences (the activation cache) ------------------------
    def release(self, block_ids: list[int]) -> None:
        """Drops one reference from each block, the last first (see ``free_sequence``)."""
        for block_id in reversed(block_ids):
            self._release_block(block_id)

    def pin(self, block_ids: list[int]) -> None:
        """Takes a reference on blocks (cached ones included), so that they are neither
        reused nor evicted until ``release``: their content can be read meanwhile."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
                if block.block_hash is not None:
                    self._cached_free -= 1
            block.ref_count += 1

    def reserve(self, n: int, keep_free: int = 0) -> list[int]:
        """Takes up to ``n`` blocks to fill from elsewhere (a KV transfer), leaving at
        least ``keep_free`` free; they hold one reference and no hash until ``adopt``
        or ``release``. May return fewer blocks than asked, or none."""
        n = max(0, min(n, len(self.free) - keep_free))
        return [self._take_free_block() for _ in range(n)]

    def adopt(self, block_ids: list[int], hashes: list[int]) -> int:
        """Registers reserved blocks that now hold the content of ``hashes`` (a chain,
        in order) in the prefix cache, then releases them; returns how many were new
        (a hash already cached keeps its block, and the copy goes back as plain free)."""
        added = 0
        if self.enable_prefix_caching:
            for block_id, h in zip(block_ids, hashes):
                if h not in self.cached:
                    self.blocks[block_id].block_hash = h
                    self.cached[h] = block_id
                    added += 1
        self.release(block_ids)
        return added

    def cached_block(self, block_hash: int) -> int | None:
        """The block that caches the content named by ``block_hash``, if any."""
        return self.cached.get(block_hash)

    def share_prompt(self, parent: Sequence, child: Sequence) -> None:
        """Gives ``child`` (a new sequence with the same prompt) the full blocks of the
        prompt ``parent`` has computed, by reference count (n > 1 sequences of one
        request). The partial last block is not shared — the child recomputes those few
        tokens itself — so no block is ever written by two sequences; at least one
        prompt token is left for the child to compute, so its step yields logits."""
        bs = self.block_size
        full = min(parent.num_computed_tokens, parent.num_prompt_tokens - 1) // bs
        full = min(full, len(parent.block_table))
        for block_id in parent.block_table[:full]:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table[:full])
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_computed_tokens = full * bs
        child.num_registered_blocks = full
