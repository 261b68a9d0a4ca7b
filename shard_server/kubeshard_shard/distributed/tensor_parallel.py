"""Tensor parallelism: a pass that swaps the model's layers for parallel ones.

Each rank keeps, for good, its slice of every weight:
- attention: its share of query heads and the KV heads they read (when there are
  fewer KV heads than ranks, each KV head is replicated on the ranks that need it);
- MLP: its share of the intermediate dimension;
- column-parallel q|k|v and gate|up projections, row-parallel o and down projections
  followed by an all-reduce;
- a vocabulary-parallel embedding (all-reduce) and LM head (logits gathered on the
  leader, the only rank that samples).
Each parallel layer reads from the checkpoint only the rows or columns it keeps.
"""

from __future__ import annotations

import torch

from kubeshard_shard.distributed.comm import Comm
from kubeshard_shard.models.config import ModelConfig
from kubeshard_shard.models.layers import Embedding, Linear, MergedLinear, UsesGemm, _copy_into


class ShardingError(ValueError):
    """The model's sizes do not divide by the shard count."""


def check_divisible(config: ModelConfig, shards: int) -> None:
    problems = []
    h, kv = config.num_attention_heads, config.num_key_value_heads
    if h % shards:
        problems.append(f"num_attention_heads ({h}) is not divisible by {shards}")
    if kv % shards and shards % kv:
        problems.append(f"num_key_value_heads ({kv}) neither divides nor is divisible by {shards}")
    if config.intermediate_size % shards:
        problems.append(f"intermediate_size ({config.intermediate_size}) is not divisible by {shards}")
    if config.vocab_size % shards:
        problems.append(f"vocab_size ({config.vocab_size}) is not divisible by {shards}")
    if problems:
        raise ShardingError(f"cannot split {config.architecture} over {shards} shards with --strategy tensor: "
                            + "; ".join(problems))


def local_kv_heads(config: ModelConfig, rank: int, shards: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) kept by ``rank``."""
    kv = config.num_key_value_heads
    if kv >= shards:
        n = kv // shards
        return rank * n, n
    return rank * kv // shards, 1  # replicated: ranks shards/kv apart share one head


class QKVParallelLinear(MergedLinear):
    def __init__(self, config: ModelConfig, rank: int, shards: int) -> None:
        hd = config.head_dim
        q_heads = config.num_attention_heads // shards
        kv_start, kv_heads = local_kv_heads(config, rank, shards)
        super().__init__(config.hidden_size, [q_heads * hd, kv_heads * hd, kv_heads * hd], bias=config.attention_bias)
        # rows of the checkpoint's q, k and v tensors that this rank keeps
        self.source_rows = [(rank * q_heads * hd, q_heads * hd), (kv_start * hd, kv_heads * hd),
                            (kv_start * hd, kv_heads * hd)]
        self.full_sizes = [config.num_attention_heads * hd, config.num_key_value_heads * hd,
                           config.num_key_value_heads * hd]
        self.num_heads, self.num_kv_heads = q_heads, kv_heads

    def load_weight(self, name, param, tensor_slice, shard_id=None) -> None:
        start, size = self.source_rows[shard_id]
        _copy_into(param.data.narrow(0, self.shard_offset(shard_id), size), tensor_slice[start:start + size], name)

    def lora_slice(self, sub: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A LoRA adapter's (A, B) of sub-projection ``sub`` as this rank applies them: B's
        rows of the outputs it keeps (models/lora.py)."""
        start, size = self.source_rows[sub]
        return a, b[start:start + size]


class MergedColumnParallelLinear(MergedLinear):
    """gate|up: each projection split along its output rows."""

    def __init__(self, in_features: int, full_sizes: list[int], bias: bool, rank: int, shards: int) -> None:
        super().__init__(in_features, [n // shards for n in full_sizes], bias)
        self.source_rows = [(rank * (n // shards), n // shards) for n in full_sizes]
        self.full_sizes = list(full_sizes)

    def load_weight(self, name, param, tensor_slice, shard_id=None) -> None:
        start, size = self.source_rows[shard_id]
        _copy_into(param.data.narrow(0, self.shard_offset(shard_id), size), tensor_slice[start:start + size], name)

    lora_slice = QKVParallelLinear.lora_slice


class RowParallelLinear(Linear):
    """Split along the input dimension; partial products are summed by an all-reduce.
    ``forward``'s ``partial`` (a LoRA wrapper's) adds to this rank's partial product
    before the reduction, so the sum carries it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, shards: int, comm: Comm) -> None:
        super().__init__(in_features // shards, out_features, bias)
        self.start = rank * (in_features // shards)
        self.full_in_features = in_features
        self.comm = comm

    def lora_slice(self, sub: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A LoRA adapter's (A, B) as this rank applies them: A's columns of the inputs it
        keeps; its partial x·Aᵀ times B joins the partial product the all-reduce sums."""
        return a[:, self.start:self.start + self.in_features], b

    def load_weight(self, name, param, tensor_slice, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            _copy_into(param, tensor_slice[:], name)
        else:
            _copy_into(param, tensor_slice[:, self.start:self.start + self.in_features], name)

    def forward(self, x: torch.Tensor, partial=None) -> torch.Tensor:
        out = self.gemm(x, self.weight)
        if partial is not None:
            partial(x, out)
        out = self.comm.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(Embedding):
    def __init__(self, vocab: int, dim: int, rank: int, shards: int, comm: Comm) -> None:
        super().__init__(vocab // shards, dim)
        self.start = rank * (vocab // shards)
        self.comm = comm

    def load_weight(self, name, param, tensor_slice, shard_id=None) -> None:
        _copy_into(param, tensor_slice[self.start:self.start + self.num_embeddings], name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = self.lookup(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.comm.all_reduce(out)


class ParallelLMHead(UsesGemm, VocabParallelEmbedding):
    """The same vocabulary slice as the embedding (and its weight when they are tied),
    projecting instead of looking up; the leader gathers the slices' logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = self.comm.gather_last_dim(self.gemm(hidden, self.weight))
        # followers get an empty result; only the leader samples
        return logits if logits is not None else hidden.new_empty((hidden.shape[0], 0))


def apply_tensor_parallel(model, comm: Comm) -> None:
    """Swaps every layer of ``model`` (on the meta device) for its parallel version."""
    cfg: ModelConfig = model.config
    rank, shards = comm.rank, comm.shards
    check_divisible(cfg, shards)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = QKVParallelLinear(cfg, rank, shards)
        attn.num_heads, attn.num_kv_heads = attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads
        attn.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, False, rank, shards, comm)
        mlp.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias,
                                                      rank, shards)
        mlp.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, rank, shards, comm)
    model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, rank, shards, comm)
    model.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, rank, shards, comm)
