"""The compiled paged-decode kernel against the torch reference, on shapes the models use
and on the edges of its loops (partial blocks, one-token contexts, GQA groups of 1 to 8,
head sizes 16 to 256, block tables in any order)."""

from __future__ import annotations

import pytest
import torch

from kubeshard_shard.engine import kernels
from kubeshard_shard.engine.attention import decode_attention_reference
from tests.support.paged_pool import scattered_pool


@pytest.fixture
def kernel(cpu_kernels):
    return cpu_kernels.paged_decode


@pytest.mark.parametrize("hq,hkv,d,block_size", [
    (8, 4, 64, 16),    # the small demo model
    (8, 8, 64, 16),    # no grouping
    (8, 1, 128, 16),   # one KV head for 8 query heads
    (6, 2, 16, 8),     # groups of 3: a pair and a single in the V pass
    (4, 2, 80, 32),
    (2, 2, 256, 1),    # the largest head size, one-token blocks
])
def test_kernel_matches_reference(kernel, hq, hkv, d, block_size):
    check_against_reference(kernel, hq, hkv, d, block_size)


def test_kernel_of_the_portable_builds_matches_reference(portable_kernels):
    """The builds for an AVX2-only CPU and for plain x86-64 run other vector widths than
    this CPU's own (8 floats, not 16 with AVX-512; SSE pairs on x86-64)."""
    for shape in [(8, 4, 64, 16), (6, 2, 16, 8), (4, 2, 80, 32), (2, 2, 256, 1)]:
        check_against_reference(portable_kernels.paged_decode, *shape)


def check_against_reference(kernel, hq, hkv, d, block_size):
    gen = torch.Generator().manual_seed(hq * 1000 + d)
    # 1300 tokens: a context the kernel cuts into parts (more than 512), whose results it combines
    lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1, 197, 1300]
    k_cache, v_cache, block_tables, context_lens = scattered_pool(gen, lens, hkv, d, block_size, spare=7)
    q = torch.randn(len(lens), hq, d, generator=gen)
    scale = d ** -0.5

    assert kernels.supports(kernel, q)
    out = torch.full_like(q, float("nan"))
    kernel(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale)
    want = decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, max(lens), block_size, scale)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_unsupported_head_size_uses_the_fallback(kernel):
    assert not kernels.supports(kernel, torch.zeros(1, 2, 72))
    assert not kernels.supports(kernel, torch.zeros(1, 2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        q = torch.zeros(1, 2, 72)
        kernel(torch.empty_like(q), q, torch.zeros(16, 2, 72), torch.zeros(16, 2, 72),
                             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 16, 1.0)


@pytest.mark.parametrize("block_size", [16, 1])
def test_a_long_context_is_cut_into_parts_with_the_same_bits_in_any_batch(kernel, block_size):
    """Contexts over 512 tokens are cut into parts that run as work items of their own
    (batch 1 then keeps every thread busy) and combined: each sequence gets the
    reference's attention, and the same bits alone as beside others (the cut depends on
    its length only); 512 tokens and fewer stay one part."""
    gen = torch.Generator().manual_seed(21)
    lens = [512, 513, 4000, 40, 1031]
    k_cache, v_cache, block_tables, context_lens = scattered_pool(gen, lens, 3, 64, block_size, spare=3)
    q = torch.randn(len(lens), 9, 64, generator=gen) * 4  # peaked softmaxes: parts' maximums differ
    out = torch.full_like(q, float("nan"))
    kernel(out, q, k_cache, v_cache, block_tables, context_lens, block_size, 0.125)
    want = decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, max(lens), block_size, 0.125)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for i in range(len(lens)):
        alone = torch.full_like(q[i:i + 1], float("nan"))
        kernel(alone, q[i:i + 1].contiguous(), k_cache, v_cache, block_tables[i:i + 1].contiguous(),
               context_lens[i:i + 1].contiguous(), block_size, 0.125)
        assert torch.equal(alone, out[i:i + 1]), lens[i]
