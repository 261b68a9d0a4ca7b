"""The KV pool in another type than the model (``--kv-cache-dtype``), and the fused CPU
steps of a layer.

- bfloat16 / float16 pools: rows converted exactly as torch converts them; the decode
  kernel reads them;
- int8 pools: one float32 scale per (token, head), q = round(x / s), s = max |x| / 127; the
  same memory holds 3.8x float32's tokens (1.9x bfloat16's); attention over them within
  a stated tolerance of float32's (per row: 1/254 of the row's largest value), greedy
  agreement with a float32 pool measured (first differing token reported);
- the fused rotary embedding and K/V write round exactly as the torch ops they replace.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kubeshard_shard.engine.attention import KVCache, decode_attention_reference, quantize_rows

from tests.support.engine import build_engine, greedy, random_prompts, run_to_completion
from tests.support.paged_pool import scattered_pool


@pytest.fixture
def k(cpu_kernels):
    return cpu_kernels


def _paged(hkv=2, d=64, block_size=16, lens=(1, 17, 40, 1300), seed=0):  # 1300: cut into parts by the kernel
    return scattered_pool(torch.Generator().manual_seed(seed), lens, hkv, d, block_size, spare=3)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.int8])
def test_decode_kernel_reads_half_and_int8_pools(k, cache_dtype):
    k32, v32, tables, lens = _paged()
    q = torch.randn(4, 8, 64)
    if cache_dtype == torch.int8:
        kq, ks = quantize_rows(k32)
        vq, vs = quantize_rows(v32)
        k_dense, v_dense = kq.float() * ks[..., None], vq.float() * vs[..., None]
    else:
        kq, vq, ks, vs = k32.to(cache_dtype), v32.to(cache_dtype), None, None
        k_dense, v_dense = kq.float(), vq.float()
    want = decode_attention_reference(q, k_dense, v_dense, tables, lens, int(lens.max()), 16, 0.125)
    out = torch.full_like(q, float("nan"))
    k.paged_decode_scaled(out, q, kq, vq, ks, vs, tables, lens, 16, 0.125)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_kernel_serves_half_precision_models(k, dtype):
    k32, v32, tables, lens = _paged(seed=1)
    q = torch.randn(4, 8, 64).to(dtype)
    kc, vc = k32.to(dtype), v32.to(dtype)
    want = decode_attention_reference(q.float(), kc.float(), vc.float(), tables, lens, int(lens.max()), 16, 0.125)
    out = torch.empty_like(q)
    k.paged_decode_scaled(out, q, kc, vc, None, None, tables, lens, 16, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_kv_write_matches_torch(k, cache_dtype):
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 3 * 2 * 64, generator=gen) * 3
    kk, vv = qkv[:, :128].view(5, 2, 64), qkv[:, 128:256].view(5, 2, 64)  # strided views, as the model has
    slots = torch.tensor([9, 0, 31, 4, 17])
    fused = KVCache(1, 4, 8, 2, 64, cache_dtype, torch.device("cpu"), k)
    plain = KVCache(1, 4, 8, 2, 64, cache_dtype, torch.device("cpu"), None)
    fused.write(0, slots, kk, vv)
    plain.write(0, slots, kk, vv)
    assert torch.equal(fused.data, plain.data)
    if cache_dtype == torch.int8:
        assert torch.equal(fused.scales, plain.scales)
        back, _ = fused.read(0, slots, torch.float32)
        bound = kk.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)
        assert ((back - kk).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rotary_is_bit_identical(k, dtype):
    from kubeshard_shard.models.config import RopeScaling
    from kubeshard_shard.models.layers import RotaryEmbedding

    class Config:
        head_dim, rope_theta, rope_scaling, max_position_embeddings = 64, 10000.0, RopeScaling(), 4096

    rotary = RotaryEmbedding(Config(), 256)
    rotary.materialize(torch.device("cpu"), dtype)
    qkv = torch.randn(7, (4 + 2 + 2) * 64).to(dtype)
    positions = torch.tensor([0, 1, 5, 200, 17, 255, 3])
    q, kk = qkv[:, :256].view(7, 4, 64), qkv[:, 256:384].view(7, 2, 64)
    want_q, want_k = rotary(positions, q.clone(), kk.clone())
    rotary.set_kernels(k)
    got_q, got_k = rotary(positions, q, kk)
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the projection's output
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rmsnorm_and_swiglu_within_rounding(k, dtype):
    from kubeshard_shard.models.layers import RMSNorm

    x, r = torch.randn(4, 576).to(dtype), torch.randn(4, 576).to(dtype)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576).to(dtype) + 0.5
    want_out, want_res = norm(x, r)
    norm.set_kernels(k)
    got_out, got_res = norm(x, r)
    assert torch.equal(got_res, want_res)  # the residual add rounds once, as torch's
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # a few ulps of the type
    torch.testing.assert_close(got_out.float(), want_out.float(), rtol=tol, atol=tol)
    gu = torch.randn(3, 2 * 1536).to(dtype) * 4
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(k.silu_mul(gu).float(), (F.silu(gate) * up).float(), rtol=tol * 4, atol=tol * 4)


def test_int8_pool_holds_more_tokens_in_the_same_memory(demo_model):
    """A row of head_dim D costs D bytes and a 4-byte scale: 4D / (D + 4) float32's tokens
    (3.76x at D = 64, the default model's) and 2D / (D + 4) bfloat16's (1.88x)."""
    f32 = build_engine(demo_model("llama"), kv="8MiB")
    bf16 = build_engine(demo_model("llama"), kv="8MiB", kv_cache_dtype="bfloat16")
    i8 = build_engine(demo_model("llama"), kv="8MiB", kv_cache_dtype="int8")
    assert i8.engine.runner.cache.dtype == torch.int8 and i8.engine.runner.cache.scales is not None
    d = i8.model_config.head_dim
    assert i8.num_kv_blocks / f32.num_kv_blocks == pytest.approx(4 * d / (d + 4), rel=0.01)
    assert i8.num_kv_blocks / bf16.num_kv_blocks == pytest.approx(2 * d / (d + 4), rel=0.01)
    for d in (64, 128):
        per_row = KVCache.bytes_per_block(1, 1, 1, d, torch.int8) / 2
        assert per_row == d + 4 and 4 * d / per_row >= 3.7 and 2 * d / per_row >= 1.88


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_compressed_pool_serves_batches_and_preemption(demo_model, kv_dtype, decode_path):
    """Greedy agreement with a float32 pool, measured: a batch through chunked prefill,
    a cached prefix, and a pool too small for the batch (preemption recomputes)."""
    model = demo_model("llama")
    prompts = random_prompts(8, 1000, (10, 90), seed=12)
    ref = run_to_completion(build_engine(model, max_batch_tokens=96).engine, [(p, greedy(16)) for p in prompts])
    per_block = KVCache.bytes_per_block(2, 16, 4, 16, getattr(torch, kv_dtype))
    for kv in ("64MiB", str(per_block * 24)):
        served = build_engine(model, kv=kv, kv_cache_dtype=kv_dtype, max_total_tokens=256, max_batch_tokens=96,
                              **decode_path)
        outs = run_to_completion(served.engine, [(p, greedy(16)) for p in prompts])
        firsts = []
        for want, got in zip(ref, outs):
            a, b = [o.token_id for o in want], [o.token_id for o in got]
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
        print(f"{kv_dtype} pool of {kv}: first differing token per request {firsts}")
        assert all(len(o) == 16 for o in outs)
        if kv != "64MiB":
            assert served.engine.scheduler.preemptions_total > 0, "the pool was meant to be too small"
        # the random demo model's logits are close together, so rounding can flip a late
        # token; the first tokens follow float32's
        assert sum(f is None or f >= 4 for f in firsts) >= 6, firsts
        assert served.engine.block_manager.num_used_blocks == 0


def test_unsupported_kv_cache_dtype_fails_at_start(demo_model):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8"):
        build_engine(demo_model("llama"), kv_cache_dtype="fp8")
    from kubeshard_shard.config import EngineConfig

    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        EngineConfig(model_dir=".", model_id="m", kv_cache_dtype="int4")
