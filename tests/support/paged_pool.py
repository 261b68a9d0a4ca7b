"""A paged KV pool of random K/V for decode-attention tests: each sequence's blocks lie
anywhere in the pool, as they do in a running engine."""

from __future__ import annotations

import torch


def scattered_pool(gen: torch.Generator, lens, hkv: int, d: int, block_size: int, spare: int):
    """(k_cache, v_cache [blocks * block_size, hkv, d], block_tables [len(lens), width]
    int32, context_lens int32) for sequences of ``lens`` tokens, with ``spare`` blocks no
    sequence uses; drawn from ``gen`` in that order (K, V, then the block order)."""
    num_blocks = sum(-(-n // block_size) for n in lens) + spare
    k_cache = torch.randn(num_blocks * block_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks * block_size, hkv, d, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in lens)
    tables = []
    for n in lens:
        need = -(-n // block_size)
        tables.append(order[:need] + [0] * (width - need))
        order = order[need:]
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(list(lens), dtype=torch.int32)
