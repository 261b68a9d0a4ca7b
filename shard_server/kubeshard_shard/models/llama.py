"""The Llama family (Llama 2/3, Mistral, Qwen2) on a paged KV cache.

The model is written over a flat batch of tokens from many sequences (no padding): a
step's tokens arrive as one ``[T]`` vector with their positions, and attention goes
through the step's ``attn`` context, which knows where each sequence's KV blocks live.
Layers come from ``models.layers`` and can be swapped by a sharding pass.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kubeshard_shard.models.config import ModelConfig
from kubeshard_shard.models.layers import (Embedding, Linear, LMHead, MergedLinear, RMSNorm, RotaryEmbedding,
                                           UsesCpuKernels)


class AttentionBackend(Protocol):
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> [T, Hq, D]."""


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        # Heads held by this process; a tensor-parallel pass lowers them to the rank's share.
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = MergedLinear(config.hidden_size, [config.q_size, config.kv_size, config.kv_size],
                                     bias=config.attention_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = attn.forward(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.reshape(-1, q_size))


class LlamaMLP(UsesCpuKernels, nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [i, i], bias=config.mlp_bias)
        self.down_proj = Linear(i, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        k = self.fused(gate_up)
        if k is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            return self.down_proj(k.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions, hidden, residual, rotary, attn):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rotary, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections that live inside one of our fused layers: name -> (fused, index).
    STACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, max_positions)

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head when the checkpoint ties them; call after
        the parameters are materialized."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_target(self, name: str) -> tuple[str, int | None] | None:
        """Maps a checkpoint tensor name to (our parameter name, shard index), or None
        for tensors we do not use."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.STACKED:
            fused, index = self.STACKED[parts[-2]]
            return ".".join(parts[:-2] + [fused, parts[-1]]), index
        return name, None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] for the step's tokens."""
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(positions, hidden, residual, self.rotary, attn)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


# Registry: family -> implementation. Mistral and Qwen2 differ from Llama only in
# config flags (biases, tying, rope), which the shared implementation reads.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}
