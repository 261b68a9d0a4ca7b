"""What a strategy answers about itself, so no code outside it branches on its name,
and what every rank of a group must agree on before it loads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kubeshard_shard.config import EngineConfig, Placement
from kubeshard_shard.distributed.strategy import Single, Tensor, Zero3, make_strategy
from kubeshard_shard.server.factory import build_lora, check_quantize_strategy
from kubeshard_shard.server.shard_main import engine_fingerprint

SINGLE = make_strategy(Placement(strategy="zero3", shards=1))
TENSOR = make_strategy(Placement(strategy="tensor", shards=2, rank=1))
ZERO3 = make_strategy(Placement(strategy="zero3", shards=2, rank=1))


def config(**overrides) -> EngineConfig:
    return EngineConfig(model_dir=Path("."), model_id="m", **overrides)


def test_make_strategy_by_placement():
    assert isinstance(SINGLE, Single) and SINGLE.name == "zero3" and SINGLE.shards == 1
    assert isinstance(TENSOR, Tensor) and (TENSOR.shards, TENSOR.rank, TENSOR.lanes) == (2, 1, 1)
    assert isinstance(ZERO3, Zero3) and (ZERO3.shards, ZERO3.rank, ZERO3.lanes) == (2, 1, 2)


def test_only_a_tensor_rank_splits_the_kv_heads():
    assert TENSOR.splits_kv_heads
    assert not SINGLE.splits_kv_heads and not ZERO3.splits_kv_heads


@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_only_zero3_refuses_quantized_weights(method):
    with pytest.raises(ValueError, match=f"--quantize {method} is not available with --strategy zero3"):
        ZERO3.check_quantize(method)
    with pytest.raises(ValueError, match="--strategy zero3"):
        check_quantize_strategy(config(quantize=method), ZERO3)
    for strategy in (SINGLE, TENSOR):
        strategy.check_quantize(method)
        check_quantize_strategy(config(quantize=method), strategy)
    check_quantize_strategy(config(), ZERO3)  # no quantization: nothing to refuse


def test_lora_off_builds_no_registry():
    assert build_lora(config(), model=None, compute=None) is None


@pytest.mark.parametrize("change", [
    {"dtype": "bfloat16"}, {"max_total_tokens": 512}, {"block_size": 32}, {"max_batch_tokens": 1024},
    {"quantize": "int8"}, {"quantize": "int4", "quantize_group_size": 64}, {"kv_cache_dtype": "int8"},
    {"cpu_gemm": "torch"}, {"enable_lora": True}, {"lora_adapters": (("a", "/adapters/a"),)},
    {"enable_lora": True, "max_loras": 3}, {"enable_lora": True, "max_lora_rank": 16},
])
def test_ranks_must_agree_on_what_a_step_computes(change):
    base = config(quantize="int4")
    assert engine_fingerprint(base) == engine_fingerprint(replace(base))
    assert engine_fingerprint(replace(base, **change)) != engine_fingerprint(base), change


def test_settings_a_rank_may_hold_alone_do_not_split_the_group():
    base = config()
    assert engine_fingerprint(replace(base, num_threads=3, max_concurrent_requests=7)) == engine_fingerprint(base)
    # LoRA's limits matter only with LoRA on (a group of fingerprints taken before it had LoRA stays one)
    assert engine_fingerprint(replace(base, max_loras=3)) == engine_fingerprint(base)
