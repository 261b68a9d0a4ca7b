"""Greedy decoding is token-for-token identical to transformers' generate (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from kubeshard_shard.engine.attention import KVCache

from tests.support.engine import build_engine, greedy, hf_greedy, random_prompts, run_to_completion

ARCHES = ["llama", "qwen2", "mistral"]


@pytest.mark.parametrize("arch", ARCHES)
def test_alone_short_and_long_prompts(demo_model, arch, decode_path):
    model = demo_model(arch)
    served = build_engine(model, **decode_path)
    assert (served.engine.runner.decode_kernel is not None) == decode_path["cpu_kernels"]
    for prompt in ([17], random_prompts(1, 1000, (5, 5), seed=1)[0], random_prompts(1, 1000, (300, 300), seed=2)[0]):
        [outs] = run_to_completion(served.engine, [(prompt, greedy(24))])
        assert [o.token_id for o in outs] == hf_greedy(model, prompt, 24), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch", ARCHES)
def test_batch_of_16_mixed_lengths(demo_model, arch, decode_path):
    model = demo_model(arch)
    # A small step budget forces chunked prefill interleaved with running decodes.
    served = build_engine(model, max_batch_tokens=96, **decode_path)
    prompts = random_prompts(16, 1000, (1, 200), seed=3)
    outs = run_to_completion(served.engine, [(p, greedy(20)) for p in prompts])
    for i, prompt in enumerate(prompts):
        assert [o.token_id for o in outs[i]] == hf_greedy(model, prompt, 20), f"request {i} ({len(prompt)} tokens)"


def test_cached_prefix_gives_same_tokens_and_skips_prefill(demo_model):
    model = demo_model("llama")
    served = build_engine(model)
    engine = served.engine
    shared = random_prompts(1, 1000, (80, 80), seed=4)[0]
    first = shared + [11, 12, 13]
    second = shared + [21, 22]
    run_to_completion(engine, [(first, greedy(8))])
    [outs] = run_to_completion(engine, [(second, greedy(16))])
    assert outs[-1].finish.cached_prompt_tokens == 80  # five full blocks of 16 reused
    assert engine.block_manager.prefix_hits >= 5
    assert [o.token_id for o in outs] == hf_greedy(model, second, 16)


@pytest.mark.parametrize("arch", ARCHES)
def test_forced_preemption(demo_model, arch):
    model = demo_model(arch)
    # 24 blocks of 16 tokens cannot hold 16 sequences of up to ~120 tokens at once.
    per_block = KVCache.bytes_per_block(2, 16, 4, 16, torch.float32)
    served = build_engine(model, kv=str(per_block * 24), max_total_tokens=256, max_batch_tokens=128)
    prompts = random_prompts(16, 1000, (20, 100), seed=5)
    outs = run_to_completion(served.engine, [(p, greedy(24)) for p in prompts])
    assert served.engine.scheduler.preemptions_total > 0, "the pool was meant to be too small"
    assert any(o[-1].finish.preemptions for o in outs)
    for i, prompt in enumerate(prompts):
        assert [o.token_id for o in outs[i]] == hf_greedy(model, prompt, 24), f"request {i}"
    assert served.engine.block_manager.num_used_blocks == 0


def test_small_model_matches(demo_model):
    model = demo_model("llama", "small")
    served = build_engine(model, kv="128MiB")
    prompts = random_prompts(4, 8000, (30, 140), seed=6)
    outs = run_to_completion(served.engine, [(p, greedy(16)) for p in prompts])
    for i, prompt in enumerate(prompts):
        assert [o.token_id for o in outs[i]] == hf_greedy(model, prompt, 16)


@pytest.mark.parametrize("arch", ARCHES)
def test_demo_model_greedy_output_is_not_degenerate(demo_model, arch):
    served = build_engine(demo_model(arch))
    [outs] = run_to_completion(served.engine, [(served.tokenizer.encode("Hello there"), greedy(48))])
    ids = [o.token_id for o in outs]
    assert len(set(ids)) >= 24, f"random model repeats itself: {ids}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_serves_on_cpu(demo_model, dtype):
    served = build_engine(demo_model("llama"), dtype=dtype)
    assert served.dtype == getattr(torch, dtype)
    assert served.engine.runner.cache.k[0].dtype == getattr(torch, dtype)
    [outs] = run_to_completion(served.engine, [(random_prompts(1, 1000, (20, 20), seed=7)[0], greedy(12))])
    assert len(outs) == 12 and all(0 <= o.token_id < 1024 for o in outs)
