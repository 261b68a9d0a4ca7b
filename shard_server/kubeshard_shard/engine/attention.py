"""Attention over the paged KV cache, for one engine step.

A step's tokens are laid out as: first one token for each decoding sequence, then the
prefill chunks, one after another. Every token's K/V is first written to its slot in
the cache (``slot_mapping``); attention then reads each sequence's context from the
blocks in its block table.

- Decode tokens use a fused kernel (the compiled ``paged_decode_scaled``, which the
  compute plan hands the model runner when the process has one) that reads K/V
  straight from the blocks; without it, the contexts are gathered into a padded batch.
- The pool may hold K/V in another type than the model computes in
  (``--kv-cache-dtype``): bfloat16 or float16 (half the bytes of float32), or int8 with
  one float32 scale per (token, head) -- a block of head_dim values, q = round(x / s),
  s = max |x| / 127 -- which holds about four times float32's tokens and twice
  bfloat16's in the same memory. Attention reads them converted back to the model's
  type; the K/V write converts (and quantizes) on the way in.
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
    activation cache moves to and from Redis. An int8 pool has ``scales`` beside it,
    [layers, 2, slots, Hkv] float32 (``k_scale[l]``, ``v_scale[l]``). ``kernels`` (the
    CPU kernels' module) writes rows in one call; without it torch ops do."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, kernels=None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.kernels = kernels if device.type == "cpu" else None
        slots = num_blocks * block_size
        self.data = torch.zeros((num_layers, 2, slots, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.k = [self.data[layer, 0] for layer in range(num_layers)]
        self.v = [self.data[layer, 1] for layer in range(num_layers)]
        self.scales = None
        self.k_scale: list[torch.Tensor | None] = [None] * num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * num_layers
        if dtype == torch.int8:
            self.scales = torch.zeros((num_layers, 2, slots, num_kv_heads), dtype=torch.float32, device=device)
            self.k_scale = [self.scales[layer, 0] for layer in range(num_layers)]
            self.v_scale = [self.scales[layer, 1] for layer in range(num_layers)]

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores the step's K/V rows ([T, Hkv, D], any type) at ``slots``."""
        if self.kernels is not None and k.stride(-1) == 1 and v.stride(-1) == 1:
            self.kernels.kv_store(k, v, self.k[layer], self.v[layer], slots, self.k_scale[layer], self.v_scale[layer])
            return
        for cache, scale, x in ((self.k[layer], self.k_scale[layer], k), (self.v[layer], self.v_scale[layer], v)):
            if scale is None:
                cache.index_copy_(0, slots, x.to(cache.dtype))
            else:
                q, s = quantize_rows(x)
                cache.index_copy_(0, slots, q)
                scale.index_copy_(0, slots, s)

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` ([n, Hkv, D]) in ``dtype`` (dequantized from int8)."""
        out = []
        for cache, scale in ((self.k[layer], self.k_scale[layer]), (self.v[layer], self.v_scale[layer])):
            rows = cache.index_select(0, slots)
            if scale is not None:
                rows = rows.float() * scale.index_select(0, slots)[..., None]
            out.append(rows.to(dtype))
        return out[0], out[1]

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
        per_row = head_dim * torch.tensor([], dtype=dtype).element_size() + (4 if dtype == torch.int8 else 0)
        return 2 * num_layers * block_size * num_kv_heads * per_row


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and their scales for an int8 pool: per (token, head) s = max |x| / 127,
    q = round(x / s) (the kernels' arithmetic)."""
    x = x.float()
    s = x.abs().amax(-1) / 127
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return torch.round(x * inv[..., None]).to(torch.int8), s


class PagedAttention:
    """The model's attention backend for one step (``AttentionBackend`` protocol)."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata, decode_kernel: Callable | None = None) -> None:
        self.cache, self.meta, self.decode_kernel = cache, meta, decode_kernel

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        meta, cache = self.meta, self.cache
        cache.write(layer_idx, meta.slot_mapping, k, v)
        n = meta.num_decode
        if n and n == q.shape[0] and not meta.prefills:  # a decode-only step: the kernel writes the result
            return decode_attention(q, cache, layer_idx, meta, scale, self.decode_kernel)
        out = torch.empty_like(q)
        if n:
            out[:n] = decode_attention(q[:n], cache, layer_idx, meta, scale, self.decode_kernel)
        for chunk in meta.prefills:
            s, e = chunk.query_start, chunk.query_start + chunk.query_len
            out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], cache, layer_idx, chunk, scale)
        return out


def prefill_attention(q, k, v, cache: KVCache, layer: int, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    """q: [n, Hq, D]; k/v: [n, Hkv, D] (the chunk's own tokens)."""
    if chunk.context_len:
        k_past, v_past = cache.read(layer, chunk.context_slots, q.dtype)
        k = torch.cat((k_past, k.to(q.dtype)))
        v = torch.cat((v_past, v.to(q.dtype)))
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


def decode_attention(q, cache: KVCache, layer: int, meta: AttentionMetadata, scale: float,
                     kernel: Callable | None = None) -> torch.Tensor:
    """q: [B, Hq, D], one new token per sequence -> [B, Hq, D]."""
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    if kernels.supports(kernel, q, k_cache):
        out = torch.empty_like(q)
        kernel(out, q.contiguous(), k_cache, v_cache, cache.k_scale[layer], cache.v_scale[layer], meta.block_tables,
               meta.context_lens, cache.block_size, scale)
        return out
    if cache.quantized or k_cache.dtype != q.dtype:
        return decode_attention_gathered(q, cache, layer, meta, scale)
    return decode_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      meta.max_context_len, cache.block_size, scale)


def decode_attention_gathered(q, cache: KVCache, layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference path for a pool of another type than q (int8, or half under float32):
    the contexts' rows read converted, then the padded attention."""
    B, Hq, D = q.shape
    bs, L = cache.block_size, meta.max_context_len
    nblocks = (L + bs - 1) // bs
    tables = meta.block_tables[:, :nblocks].long()
    slots = (tables[:, :, None] * bs + torch.arange(bs, device=q.device)).reshape(B, -1)[:, :L]
    keys, values = cache.read(layer, slots.reshape(-1), q.dtype)
    keys = keys.view(B, L, -1, D).transpose(1, 2)
    values = values.view(B, L, -1, D).transpose(1, 2)
    valid = torch.arange(L, device=q.device)[None, :] < meta.context_lens[:, None].long()
    o = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=valid[:, None, None, :],
                                       scale=scale, enable_gqa=Hq != keys.shape[1])
    return o[:, :, 0, :]


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
