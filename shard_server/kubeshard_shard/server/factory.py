"""Builds a served model from an ``EngineConfig`` and a strategy: compute plan, model,
tokenizer, limits, KV pool, activation cache, engine. What is built at start lives
here; what runs per step lives in ``engine/`` (and ``activations/``)."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Callable

import psutil
import torch

from kubeshard_shard.activations.coordinator import ActivationCache
from kubeshard_shard.activations.layout import KVLayout
from kubeshard_shard.activations.store import Budget, RedisTier, redact
from kubeshard_shard.activations.worker import CacheWorker
from kubeshard_shard.compute import Compute, resolve_compute
from kubeshard_shard.config import EngineConfig, MemoryBudget
from kubeshard_shard.distributed.strategy import Single, Strategy
from kubeshard_shard.engine.attention import KVCache
from kubeshard_shard.engine.lane import Lane
from kubeshard_shard.engine.llm_engine import LLMEngine
from kubeshard_shard.engine.model_runner import ModelRunner
from kubeshard_shard.engine.request import Limits
from kubeshard_shard.engine.sequence import SamplingParams
from kubeshard_shard.models.config import ModelConfig, load_model_config
from kubeshard_shard.models.loader import load_model
from kubeshard_shard.models.lora import AdapterRegistry, enable_lora
from kubeshard_shard.server.speculation import build_speculator
from kubeshard_shard.tokenizer import ModelTokenizer, load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOTAL_TOKENS = 4096
DEFAULT_CPU_KV_BUDGET = MemoryBudget(fraction=0.1)
DEFAULT_CUDA_KV_BUDGET = MemoryBudget(fraction=0.9)


@dataclass
class ServedModel:
    engine: LLMEngine
    config: EngineConfig
    model_config: ModelConfig
    tokenizer: ModelTokenizer
    limits: Limits
    compute: Compute
    num_kv_blocks: int
    strategy: Strategy
    rank_parameter_bytes: list[int]
    cache_worker: CacheWorker | None = None  # this rank's activation-cache worker
    # the engine that generates: "kubeshard" (LLMEngine) or "onnx" (runtimes/onnx_engine.py)
    runtime: str = "kubeshard"
    # what this runtime refuses (RequestError naming the field), checked before a request is queued
    check_request: Callable[[SamplingParams], None] | None = None

    @property
    def device(self) -> torch.device:
        return self.compute.device

    @property
    def dtype(self) -> torch.dtype:
        return self.compute.dtype


def resolve_limits(config: EngineConfig, model_config: ModelConfig) -> Limits:
    max_pos = model_config.max_position_embeddings
    max_total = config.max_total_tokens or min(max_pos, DEFAULT_MAX_TOTAL_TOKENS)
    if max_total > max_pos:
        raise ValueError(f"--max-total-tokens ({max_total}) exceeds the model's max_position_embeddings ({max_pos})")
    if model_config.sliding_window and max_total > model_config.sliding_window:
        raise ValueError(
            f"--max-total-tokens ({max_total}) exceeds the model's sliding_window ({model_config.sliding_window}); "
            "kubeshard does not implement sliding-window attention, so it serves at most that many tokens")
    max_input = config.max_input_tokens or max_total - 1
    if max_input >= max_total:
        raise ValueError(f"--max-input-tokens ({max_input}) must be less than --max-total-tokens ({max_total})")
    return Limits(max_input_tokens=max_input, max_total_tokens=max_total)


def kv_cache_blocks(config: EngineConfig, model_config: ModelConfig, num_kv_heads: int, dtype: torch.dtype,
                    device: torch.device, limits: Limits) -> int:
    per_block = KVCache.bytes_per_block(model_config.num_hidden_layers, config.block_size, num_kv_heads,
                                        model_config.head_dim, dtype)
    if device.type == "cuda":
        budget = config.kv_cache_memory or DEFAULT_CUDA_KV_BUDGET
        free, total = torch.cuda.mem_get_info(device)
        nbytes = budget.resolve(total) if budget.bytes is not None else int(budget.fraction * free)
    else:
        budget = config.kv_cache_memory or DEFAULT_CPU_KV_BUDGET
        nbytes = budget.resolve(psutil.virtual_memory().total)
    num_blocks = nbytes // per_block
    # No use for more blocks than every sequence at full length could fill.
    ceiling = config.max_num_seqs * -(-limits.max_total_tokens // config.block_size)
    num_blocks = min(num_blocks, ceiling)
    need = -(-limits.max_total_tokens // config.block_size)
    if num_blocks < need:
        raise ValueError(
            f"--kv-cache-memory gives {num_blocks} blocks of {config.block_size} tokens ({per_block} bytes each), "
            f"but one request of max_total_tokens ({limits.max_total_tokens}) needs {need}; raise "
            f"--kv-cache-memory or lower --max-total-tokens")
    return int(num_blocks)


def check_quantize_strategy(config: EngineConfig, strategy: Strategy) -> None:
    if config.quantize != "none":
        strategy.check_quantize(config.quantize)


def quantize_weights(config: EngineConfig, compute: Compute, model) -> None:
    """Packs the weights for ``--quantize`` (``models.quant``), once they are loaded."""
    if config.quantize == "none":
        return
    from kubeshard_shard.models.quant import quantize_model

    chosen = quantize_model(model, config.quantize, config.quantize_group_size, compute.kernels, compute.gemm,
                            config.model_dir)
    if not chosen:
        raise ValueError(f"--quantize {config.quantize}: no layer of {config.model_dir} can be packed "
                         "(for gguf: the file holds no Q8_0, Q4_0 or Q4_1 projection)")


def build_lora(config: EngineConfig, model, compute: Compute) -> AdapterRegistry | None:
    """The LoRA adapter registry (None when LoRA is off), with the start-up adapters loaded."""
    if not config.lora_on:
        return None
    registry = AdapterRegistry(config.max_loras, config.max_lora_rank, compute.kernels, config.lora_root)
    enable_lora(model, registry)
    registry.bind(model, compute.dtype, compute.device)
    for name, source in config.lora_adapters:
        adapter = registry.read(name, source)
        registry.add(adapter)
        log.info("LoRA adapter %s from %s: rank %d on %s", name, source, adapter.rank,
                 ", ".join(adapter.target_modules))
    return registry


def kv_weights_tag(config: EngineConfig) -> str:
    """What the weight quantization adds to the activation cache's keys: the same
    prompt gives other keys and values under int8, int4 of another group size, or
    another GGUF file's mix of types."""
    if config.quantize == "int4":
        return f"int4g{config.quantize_group_size}"
    if config.quantize == "gguf":
        from kubeshard_shard.models.quant import gguf_types

        types = json.dumps(gguf_types(config.model_dir), sort_keys=True).encode()
        return "gguf." + hashlib.blake2b(types, digest_size=4).hexdigest()
    return config.quantize


def build_cache_worker(config: EngineConfig, model_config: ModelConfig, strategy: Strategy, cache: KVCache,
                       compute: Compute) -> CacheWorker | None:
    """This rank's activation-cache worker, when there is a Redis URL and it is not off.
    Its keys name the pool's dtype, the compute dtype when it differs, and the weight
    quantization: replicas share entries only when their blocks hold the same bytes."""
    act = config.activations
    if not act.active:
        return None
    if not config.enable_prefix_caching:
        log.warning("activation cache off: it shares prefix-cache blocks, and --no-prefix-caching is set")
        return None
    if cache.quantized:
        log.warning("activation cache off: an int8 KV pool keeps scales beside its blocks, which it does not move "
                    "(--kv-cache-dtype int8)")
        return None
    layout = KVLayout.for_rank(act.key_model or config.model_id, config.revision, compute.cache_dtype,
                               config.block_size, model_config.num_hidden_layers, cache.num_kv_heads,
                               model_config.head_dim, strategy.splits_kv_heads, strategy.shards, strategy.rank,
                               compute.dtype, kv_weights_tag(config))
    budget = Budget(*layout.budget_keys(), act.max_bytes) if act.max_bytes else None
    lane = strategy.rank if strategy.lanes > 1 else 0
    log.info("activation cache on: %s, keys %s:*, %d bytes per block, min hits %d, ttl %d s, budget %s",
             redact(act.redis_url), layout.prefix, layout.block_bytes, act.min_hits, act.ttl_s,
             f"{act.max_bytes} bytes" if act.max_bytes else "none (Redis's eviction)")
    return CacheWorker(RedisTier(act.redis_url, act.timeout_s, act.retry_s), layout, cache, lane, strategy.shards,
                       act.ttl_s, budget)


def build_served_model(config: EngineConfig, strategy: Strategy | None = None,
                       compute: Compute | None = None) -> ServedModel:
    """Loads this process's share of the model and preallocates its KV pool. A group
    member passes its strategy (and the compute plan it resolved before joining)."""
    strategy = strategy or Single()
    model_config = load_model_config(config.model_dir)
    compute = compute or resolve_compute(config, model_config)
    tokenizer = load_tokenizer(config.model_dir, model_config)
    limits = resolve_limits(config, model_config)
    strategy.check(model_config)
    check_quantize_strategy(config, strategy)
    model = load_model(config.model_dir, model_config, compute.device, compute.dtype,
                       max_positions=limits.max_total_tokens, sharding=strategy, gemm=compute.gemm,
                       kernels=compute.kernels)
    quantize_weights(config, compute, model)
    kv_heads = strategy.kv_heads(model_config)
    # every rank of a group uses the same pool size
    num_blocks = strategy.agree_blocks(kv_cache_blocks(config, model_config, kv_heads, compute.cache_dtype,
                                                       compute.device, limits))
    cache = KVCache(model_config.num_hidden_layers, num_blocks, config.block_size, kv_heads,
                    model_config.head_dim, compute.cache_dtype, compute.device, compute.kernels)
    runner = ModelRunner(model, cache, compute.device, compute.decode_kernel, build_lora(config, model, compute))
    # the leader proposes; followers only verify, as ordinary steps
    speculator = build_speculator(config, model_config, compute, tokenizer, limits, num_blocks,
                                  strategy.lanes) if strategy.rank == 0 else None
    lookahead = speculator.lookahead if speculator is not None else None
    lanes = [Lane.create(i, num_blocks, config.block_size, config.enable_prefix_caching, config.max_batch_tokens,
                         config.max_num_seqs, lookahead) for i in range(strategy.lanes)]
    worker = build_cache_worker(config, model_config, strategy, cache, compute)
    coordinator = None
    if worker is not None and strategy.rank == 0:
        coordinator = ActivationCache(config.activations, worker, lambda ops: strategy.exchange_cache(ops, worker),
                                      config.block_size)
    engine = LLMEngine(runner, tokenizer, lanes, strategy, coordinator, speculator, compute.kernels)
    log.info("loaded %s (%s, %s%s on %s, GEMM %s, decode kernel %s): %d KV blocks of %d tokens (%s); limits "
             "input %d, total %d", config.model_id, model_config.architecture,
             str(compute.dtype).removeprefix("torch."),
             f", weights {config.quantize}" if config.quantize != "none" else "", compute.device, compute.gemm_name,
             "on" if compute.decode_kernel else "off", num_blocks, config.block_size,
             str(cache.dtype).removeprefix("torch."), limits.max_input_tokens, limits.max_total_tokens)
    return ServedModel(engine, config, model_config, tokenizer, limits, compute, num_blocks, strategy,
                       strategy.parameter_bytes(model), worker)
