"""Builds the speculative-decoding proposer of a served model at start (the leader's:
followers only verify, as ordinary steps)."""

from __future__ import annotations

import logging

import torch

from kubeshard_shard.checkpoints import local_checkpoint
from kubeshard_shard.compute import Compute
from kubeshard_shard.config import EngineConfig, SpeculativeConfig
from kubeshard_shard.engine.attention import KVCache
from kubeshard_shard.engine.draft import DraftProposer
from kubeshard_shard.engine.model_runner import ModelRunner
from kubeshard_shard.engine.ngram import NgramProposer
from kubeshard_shard.engine.request import Limits
from kubeshard_shard.engine.speculative import Speculator
from kubeshard_shard.models.config import ModelConfig, load_model_config
from kubeshard_shard.models.loader import load_model
from kubeshard_shard.tokenizer import ModelTokenizer, load_tokenizer

log = logging.getLogger(__name__)


def build_speculator(config: EngineConfig, model_config: ModelConfig, compute: Compute, tokenizer: ModelTokenizer,
                     limits: Limits, num_blocks: int, lanes: int) -> Speculator | None:
    spec = config.speculative
    if not spec.enabled:
        return None
    if spec.method == "ngram":
        proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
        log.info("speculative decoding: n-gram proposals (suffixes of %d-%d tokens), %d tokens per step",
                 spec.ngram_min, spec.ngram_max, spec.num_tokens)
    else:
        proposer = build_draft(config, spec, model_config, compute, tokenizer, limits, num_blocks, lanes)
    if spec.disable_by_batch_size:
        log.info("speculative decoding pauses while %d or more sequences run", spec.disable_by_batch_size)
    return Speculator(proposer, spec.num_tokens, spec.disable_by_batch_size)


def build_draft(config: EngineConfig, spec: SpeculativeConfig, model_config: ModelConfig, compute: Compute,
                tokenizer: ModelTokenizer, limits: Limits, num_blocks: int, lanes: int) -> DraftProposer:
    """Loads the draft model (whole, on this process's device) with one KV pool per lane,
    each as large as the target's pool of that lane."""
    folder = local_checkpoint(spec.draft_model)
    draft_config = load_model_config(folder)
    check_draft(spec, folder, draft_config, model_config, load_tokenizer(folder, draft_config), tokenizer, limits,
                compute)
    model = load_model(folder, draft_config, compute.device, compute.dtype, max_positions=limits.max_total_tokens,
                       gemm=compute.gemm, kernels=compute.kernels)
    if spec.draft_quantize != "none":
        from kubeshard_shard.models.quant import quantize_model

        quantize_model(model, spec.draft_quantize, config.quantize_group_size, compute.kernels, compute.gemm)
    runners = []
    for _ in range(lanes):
        pool = KVCache(draft_config.num_hidden_layers, num_blocks, config.block_size,
                       draft_config.num_key_value_heads, draft_config.head_dim, compute.dtype, compute.device,
                       compute.kernels)
        runners.append(ModelRunner(model, pool, compute.device, compute.decode_kernel))
    pool_bytes = lanes * num_blocks * KVCache.bytes_per_block(draft_config.num_hidden_layers, config.block_size,
                                                               draft_config.num_key_value_heads,
                                                               draft_config.head_dim, compute.dtype)
    log.info("speculative decoding: draft model %s (%d layers%s), %d tokens per step; draft KV pools %.1f MiB",
             spec.draft_model, draft_config.num_hidden_layers,
             f", weights {spec.draft_quantize}" if spec.draft_quantize != "none" else "", spec.num_tokens,
             pool_bytes / 2**20)
    return DraftProposer(runners)


def check_draft(spec: SpeculativeConfig, folder, draft_config: ModelConfig, model_config: ModelConfig,
                draft_tokenizer: ModelTokenizer, tokenizer: ModelTokenizer, limits: Limits, compute: Compute) -> None:
    """Refuses, naming the flag, a draft that cannot propose for this model."""
    what = f"--speculative-draft-model {spec.draft_model}"
    if draft_config.vocab_size != model_config.vocab_size:
        raise ValueError(f"{what}: its vocabulary has {draft_config.vocab_size} entries, the model's "
                         f"{model_config.vocab_size}; a draft model must share the model's tokenizer")
    if draft_tokenizer.tokenizer.get_vocab() != tokenizer.tokenizer.get_vocab():
        raise ValueError(f"{what}: its tokenizer differs from the model's (the same ids must mean the same "
                         "tokens)")
    if draft_config.max_position_embeddings < limits.max_total_tokens:
        raise ValueError(f"{what}: it holds {draft_config.max_position_embeddings} positions, fewer than "
                         f"--max-total-tokens ({limits.max_total_tokens})")
    if spec.draft_quantize != "none":
        if compute.device.type != "cpu" or compute.dtype != torch.float32 or compute.kernels is None:
            raise ValueError(f"--speculative-draft-quantize {spec.draft_quantize} needs float32 on CPU with the "
                             "compiled CPU kernels (as --quantize does)")
    log.debug("draft model %s accepted (%s)", folder, draft_config.architecture)
