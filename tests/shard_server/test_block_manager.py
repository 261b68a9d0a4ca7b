"""The block allocator and prefix cache: exact block ids, sharing and eviction order."""

from __future__ import annotations

from kubeshard_shard.engine.block_manager import BlockManager
from kubeshard_shard.engine.sequence import SamplingParams, Sequence


# hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8]), fixed since the hash names Redis entries
GOLDEN_CHAIN_HASH = 0xf2a09bff7ccb997917cda1c893b217a9


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_new_tokens=4))


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    cached = bm.find_cached_prefix(s)
    start = len(cached) * bm.block_size
    assert bm.allocate(s, s.num_tokens - start, cached)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return cached


def test_allocates_blocks_in_order_and_frees_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.free_sequence(a)
    assert bm.num_free_blocks == 8 and a.block_table == []


def test_shared_prefix_reuses_blocks_by_reference():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43], "b")
    cached = admit(bm, b)
    assert cached == [0, 1]                       # the two full blocks of the shared prefix
    assert b.block_table[:2] == [0, 1] and b.block_table[2] == 3
    assert bm.blocks[0].ref_count == 2 and bm.blocks[1].ref_count == 2
    assert bm.prefix_hits == 2


def test_whole_prompt_cached_still_computes_last_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(8))
    admit(bm, a)
    bm.free_sequence(a)
    b = seq(range(8), "b")
    cached = bm.find_cached_prefix(b)
    assert cached == [0]  # the last block is recomputed so the step yields logits


def test_eviction_is_lru_and_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4])          # blocks 0, 1 (both full, cached)
    admit(bm, a)
    bm.free_sequence(a)            # freed tail first: free order 2, 3, then 1, 0
    assert list(bm.free) == [2, 3, 1, 0]
    assert bm.num_cached_free_blocks == 2
    c = seq([9, 9, 8, 8, 7, 7], "c")  # needs 3 blocks: takes 2, 3, then evicts 1 (a's tail)
    admit(bm, c)
    assert c.block_table == [2, 3, 1]
    assert bm.blocks[0].block_hash is not None and bm.blocks[1].block_hash is not None  # 1 re-cached for c
    d = seq([1, 2, 5, 5], "d")
    assert bm.find_cached_prefix(d) == [0]   # a's head survived


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq(range(12))
    assert not bm.allocate(a, 12)
    assert a.block_table == [] and bm.num_free_blocks == 2


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(range(9))
    admit(bm, a)
    b = seq(range(9), "b")
    assert bm.find_cached_prefix(b) == []


def test_block_hash_is_stable_across_processes_and_machines():
    """The chained hash names KV blocks in Redis: it must not depend on the process's
    hash seed, and a change of its definition must be deliberate (this golden value)."""
    import subprocess
    import sys

    from kubeshard_shard.engine.block_manager import hash_block

    script = ("from kubeshard_shard.engine.block_manager import hash_block as h;"
              "print(h(h(None, [1, 2, 3, 4]), [5, 6, 7, 8]))")
    values = {subprocess.run([sys.executable, "-c", script], env={"PYTHONHASHSEED": seed}, capture_output=True,
                             text=True, check=True).stdout.strip() for seed in ("0", "1", "12345")}
    here = hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert values == {str(here)}
    assert here == GOLDEN_CHAIN_HASH
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])
    assert hash_block(None, [5, 6, 7, 8]) != here  # the parent is part of the hash


def test_reserved_blocks_are_adopted_into_the_prefix_cache_or_released():
    from kubeshard_shard.engine.block_manager import hash_block

    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(8))
    admit(bm, a)                                   # blocks 0, 1 cached
    bm.free_sequence(a)
    assert list(bm.free) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.reserve(10, keep_free=5) == [2, 3, 4]   # only what leaves 5 free
    h0 = hash_block(None, [9, 9, 9, 9])
    h1 = hash_block(h0, [8, 8, 8, 8])
    assert bm.adopt([2, 3], [h0, h1]) == 2         # loaded from elsewhere: now cached, free, at the back
    bm.release([4])                                # not loaded: plain free, at the front
    assert list(bm.free)[:1] == [4] and list(bm.free)[-2:] == [3, 2]
    b = seq([9, 9, 9, 9, 8, 8, 8, 8, 7], "b")
    assert bm.find_cached_prefix(b) == [2, 3]
    assert bm.cached_block(h1) == 3 and bm.count_cached(bm.prompt_hashes(b)) == 2


def test_pinned_blocks_are_neither_reused_nor_evicted():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4])
    admit(bm, a)
    bm.free_sequence(a)                            # blocks 0, 1 cached and free
    bm.pin([0, 1])
    assert bm.num_free_blocks == 1 and bm.num_cached_free_blocks == 0
    c = seq([5, 6, 7, 8], "c")
    assert not bm.allocate(c, 4)                   # only block 2 is left
    bm.release([0, 1])
    assert bm.num_cached_free_blocks == 2 and bm.find_cached_prefix(seq([1, 2, 3, 4, 5], "d")) == [0, 1]
