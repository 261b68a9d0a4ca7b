"""Builds an engine from an ``EngineConfig``: device, model, tokenizer, limits, KV pool."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import psutil
import torch

from kubeshard_shard.config import EngineConfig, MemoryBudget
from kubeshard_shard.engine import kernels
from kubeshard_shard.engine.attention import KVCache
from kubeshard_shard.engine.llm_engine import LLMEngine, Stream
from kubeshard_shard.engine.model_runner import ModelRunner, StepInputs
from kubeshard_shard.engine.request import Limits
from kubeshard_shard.models.config import CheckpointError, ModelConfig, load_model_config
from kubeshard_shard.models.loader import load_model, resolve_dtype
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
    device: torch.device
    dtype: torch.dtype
    num_kv_blocks: int
    rank_parameter_bytes: list[int] = field(default_factory=list)
    # set by a sharded group: heartbeat while idle, and the stop message to its ranks
    on_idle: Callable[[], None] | None = None
    on_stop: Callable[[], None] | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return device


def configure_threads(num_threads: int | None) -> None:
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(num_threads or available)


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
                    device: torch.device, limits: Limits, num_layers: int | None = None) -> int:
    per_block = KVCache.bytes_per_block(num_layers or model_config.num_hidden_layers, config.block_size,
                                        num_kv_heads, model_config.head_dim, dtype)
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


def build_served_model(config: EngineConfig, strategy_pass: Callable | None = None,
                       execute: Callable[[list[StepInputs | None]], list] | None = None,
                       num_kv_heads: int | None = None, device: torch.device | None = None,
                       num_streams: int = 1, load_weights_fn: Callable | None = None,
                       agree_blocks: Callable[[int], int] | None = None) -> ServedModel:
    """Loads everything and preallocates the KV pool. ``strategy_pass`` and ``execute``
    let a sharded group swap layers and send steps to its ranks; ``num_kv_heads`` is
    the number of KV heads this process keeps; ``num_streams`` the data-parallel
    streams the engine schedules (one per zero3 rank)."""
    device = device or resolve_device(config.device)
    if device.type == "cpu":
        configure_threads(config.num_threads)
    model_config = load_model_config(config.model_dir)
    tokenizer = load_tokenizer(config.model_dir, model_config)
    limits = resolve_limits(config, model_config)
    dtype = resolve_dtype(config.dtype, model_config, device)
    model = load_model(config.model_dir, device, config.dtype, max_positions=limits.max_total_tokens,
                       strategy_pass=strategy_pass, config=model_config, load_weights_fn=load_weights_fn)
    if device.type == "cpu" and dtype == torch.float32:
        kernels.load()
    kv_heads = num_kv_heads or model_config.num_key_value_heads
    num_blocks = kv_cache_blocks(config, model_config, kv_heads, dtype, device, limits)
    if agree_blocks is not None:  # every rank of a group uses the same pool size
        num_blocks = agree_blocks(num_blocks)
    cache = KVCache(model_config.num_hidden_layers, num_blocks, config.block_size, kv_heads,
                    model_config.head_dim, dtype, device)
    runner = ModelRunner(model, cache, device)
    streams = [Stream.create(i, num_blocks, config.block_size, config.enable_prefix_caching, config.max_batch_tokens,
                             config.max_num_seqs) for i in range(num_streams)]
    engine = LLMEngine(runner, tokenizer, streams, execute)
    log.info("loaded %s (%s, %s on %s): %d KV blocks of %d tokens; limits input %d, total %d",
             config.model_id, model_config.architecture, str(dtype).removeprefix("torch."), device, num_blocks,
             config.block_size, limits.max_input_tokens, limits.max_total_tokens)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    return ServedModel(engine, config, model_config, tokenizer, limits, device, dtype, num_blocks, [resident])


__all__ = ["ServedModel", "build_served_model", "CheckpointError", "load_model_config"]
