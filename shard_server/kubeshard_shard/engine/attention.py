"""Attention over the paged KV cache, for one engine step.

A step's tokens are laid out as: first one token for each decoding sequence, then the
prefill chunks, one after another. Every token's K/V is first written to its slot in
the cache (``slot_mapping``); attention then reads each sequence's context from the
blocks in its block table.

- Decode tokens use a fused kernel (``kernels.load``'s, when the process has one) that
  reads K/V straight from the blocks; without it, the contexts are gathered into a
  padded batch.
- A prefill chunk with nothing before it attends over its own fresh K/V (causal SDPA);
  a chunk that continues a cached prefix or an earlier chunk gathers that context from
  its blocks and attends with a bottom-right causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from kubeshard_shard.engine import kernels


@dataclass
class PrefillChunk:
    query_start: int          # index of the chunk's first token in the step's flat batch
    query_len: int            # tokens in this chunk
    context_len: int          # tokens of the sequence before this chunk (already in the cache)
    context_slots: torch.Tensor | None  # [context_len] cache slots of those tokens, or None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [T] cache slot of every token of the step
    num_decode: int = 0                   # the first num_decode tokens each decode one sequence
    block_tables: torch.Tensor | None = None   # [num_decode, max_blocks] int32
    context_lens: torch.Tensor | None = None   # [num_decode] int32, including the new token
    max_context_len: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)


class KVCache:
    """The preallocated pool: per layer, K and V of shape [num_blocks * block_size, Hkv, D].

    One tensor ``data`` [layers, 2, num_blocks * block_size, Hkv, D] holds them all
    (``k[l]`` is ``data[l, 0]``, contiguous), so one block of every layer is a single
    strided view: ``block(b)`` is [layers, 2, block_size, Hkv, D], the unit the
    activation cache moves to and from Redis."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.data = torch.zeros((num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim), dtype=dtype,
                                device=device)
        self.k = [self.data[layer, 0] for layer in range(num_layers)]
        self.v = [self.data[layer, 1] for layer in range(num_layers)]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def block(self, block_id: int) -> torch.Tensor:
        """K and V of every layer for one block: a view [layers, 2, block_size, Hkv, D]."""
        bs = self.block_size
        return self.data[:, :, block_id * bs:(block_id + 1) * bs]

    def host_view(self):
        """The pool as a numpy array of same-size integers (CPU pools only): blocks are
        copied in and out with numpy, which copies in the calling thread without waking
        torch's thread pool (the activation cache's workers run beside the engine)."""
        same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[self.data.element_size()]
        return self.data.view(same_size).numpy()

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy [n, layers, 2, block_size, Hkv, D] of the given blocks."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        by_block = self.data.view(self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                                  self.head_dim)
        return by_block.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class PagedAttention:
    """The model's attention backend for one step (``AttentionBackend`` protocol)."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata, decode_kernel: Callable | None = None) -> None:
        self.cache, self.meta, self.decode_kernel = cache, meta, decode_kernel

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        n = meta.num_decode
        if n:
            out[:n] = decode_attention(q[:n], k_cache, v_cache, meta.block_tables, meta.context_lens,
                                       meta.max_context_len, self.cache.block_size, scale, self.decode_kernel)
        for chunk in meta.prefills:
            s, e = chunk.query_start, chunk.query_start + chunk.query_len
            out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, scale)
        return out


def prefill_attention(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    """q: [n, Hq, D]; k/v: [n, Hkv, D] (the chunk's own tokens)."""
    if chunk.context_len:
        k = torch.cat((k_cache.index_select(0, chunk.context_slots), k))
        v = torch.cat((v_cache.index_select(0, chunk.context_slots), v))
    n, total = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = qh.shape[1] != kh.shape[1]
    if total == n:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Query i sits at position context_len + i and sees keys 0..context_len + i.
        rows = torch.arange(n, device=q.device)[:, None] + (total - n)
        mask = torch.arange(total, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, max_context_len: int,
                     block_size: int, scale: float, kernel: Callable | None = None) -> torch.Tensor:
    """q: [B, Hq, D], one new token per sequence -> [B, Hq, D]."""
    if kernels.supports(kernel, q):
        out = torch.empty_like(q)
        kernel(out, q.contiguous(), k_cache, v_cache, block_tables, context_lens, block_size, scale)
        return out
    return decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, max_context_len,
                                      block_size, scale)


def decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, max_context_len: int,
                               block_size: int, scale: float) -> torch.Tensor:
    """Gathers every context into a padded [B, L, Hkv, D] batch; portable, used on CUDA
    and when the CPU kernel is unavailable."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    nblocks = (max_context_len + block_size - 1) // block_size
    tables = block_tables[:, :nblocks].long()
    offsets = torch.arange(block_size, device=q.device)
    slots = (tables[:, :, None] * block_size + offsets).reshape(B, -1)[:, :max_context_len]
    valid = torch.arange(max_context_len, device=q.device)[None, :] < context_lens[:, None].long()
    keys = k_cache[slots].transpose(1, 2)      # [B, Hkv, L, D]
    values = v_cache[slots].transpose(1, 2)
    o = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=valid[:, None, None, :],
                                       scale=scale, enable_gqa=Hq != Hkv)
    return o[:, :, 0, :]
