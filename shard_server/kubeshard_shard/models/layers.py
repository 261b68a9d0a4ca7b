"""Building blocks of the Llama family, each owning its weight loading.

Every module with parameters has a ``load_weight(name, param, tensor_slice, shard_id)``
that reads from a safetensors slice only what the parameter keeps. The replicated layers here
read whole tensors; the parallel layers of ``kubeshard_shard.distributed`` subclass
them, read their slice, and add the collective their math needs — so a sharding
strategy is a pass that swaps modules, and the model code holds no strategy.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kubeshard_shard.models.config import ModelConfig, RopeScaling


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class UsesGemm:
    """A layer whose matmuls go through a GEMM chosen once per process (``compute.py``):
    ``F.linear`` until ``bind_gemm`` hands it another."""

    gemm = staticmethod(linear)

    def set_gemm(self, gemm) -> None:
        self.gemm = gemm


def bind_gemm(model: nn.Module, gemm) -> None:
    """Gives every GEMM layer of ``model`` (parallel ones included) the process's GEMM."""
    for module in model.modules():
        if isinstance(module, UsesGemm):
            module.set_gemm(gemm)


class UsesCpuKernels:
    """A layer with a fused CPU kernel (``engine/csrc/fused.cpp``: RMSNorm with its
    residual, rotary in place, SwiGLU): the torch ops until ``bind_kernels`` hands it the
    process's compiled module, and wherever the kernel does not apply (CUDA tensors)."""

    kernels = None

    def set_kernels(self, kernels) -> None:
        self.kernels = kernels

    def fused(self, x: torch.Tensor):
        """The kernels' module when it serves ``x``, else None."""
        k = self.kernels
        return k if k is not None and x.device.type == "cpu" else None


def bind_kernels(model: nn.Module, kernels) -> None:
    """Gives every layer with a fused CPU path the process's kernels' module (or None)."""
    for module in model.modules():
        if isinstance(module, UsesCpuKernels):
            module.set_kernels(kernels)


def _copy_into(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"the model expects {tuple(param.shape)}")
    param.data.copy_(loaded)


def default_load_weight(name: str, param: torch.Tensor, tensor_slice, shard_id=None) -> None:
    _copy_into(param, tensor_slice[:], name)


class Linear(UsesGemm, nn.Module):
    """y = x Wᵀ + b with the full weight on every rank (replicated)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def load_weight(self, name: str, param: torch.Tensor, tensor_slice, shard_id=None) -> None:
        default_load_weight(name, param, tensor_slice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul (q|k|v, gate|up).

    ``output_sizes`` lists each projection's rows; ``shard_id`` of the weight loader is
    the index of the projection being loaded. Fusing halves the number of kernel
    launches per layer, which matters on CPU at small batch sizes.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def shard_offset(self, shard_id: int) -> int:
        return sum(self.output_sizes[:shard_id])

    def load_weight(self, name: str, param: torch.Tensor, tensor_slice, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError(f"{name}: a fused layer needs the index of the projection being loaded")
        offset, size = self.shard_offset(shard_id), self.output_sizes[shard_id]
        _copy_into(param.data.narrow(0, offset, size), tensor_slice[:], name)


class Embedding(nn.Module):
    """Token embedding with the full table on every rank. Rows are read through
    ``lookup`` (``F.embedding``), which a quantized table replaces with one that
    dequantizes the rows it reads (``models.quant``)."""

    lookup = staticmethod(F.embedding)

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def load_weight(self, name: str, param: torch.Tensor, tensor_slice, shard_id=None) -> None:
        default_load_weight(name, param, tensor_slice)

    def set_lookup(self, lookup) -> None:
        self.lookup = lookup

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids, self.weight)


class LMHead(UsesGemm, Embedding):
    """Projects hidden states onto the vocabulary; may share its weight with the embedding."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.gemm(hidden, self.weight)


class RMSNorm(UsesCpuKernels, nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)

    def load_weight(self, name: str, param: torch.Tensor, tensor_slice, shard_id=None) -> None:
        default_load_weight(name, param, tensor_slice)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalizes ``x`` (+ ``residual`` when given, returned as the new residual).
        Computed in float32 like the reference implementation, then cast back."""
        k = self.fused(x)
        if k is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            out, total = k.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, total)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            # torch's fused kernel: the same float32 arithmetic in one pass
            out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        else:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling,
                             max_positions: int) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.freq_factors is not None:  # llama.cpp's rope_freqs: theta_i / factor_i
        inv = inv / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings or max_positions
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(UsesCpuKernels, nn.Module):
    """Rotary position embedding (non-interleaved halves, as in the HF Llama code).

    cos/sin are tabulated per position once; a lookup by position id is exactly what the
    reference computes per step (one multiply, then cos/sin, in float32).
    """

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.scaling = config.rope_scaling
        self.model_max_positions = config.max_position_embeddings
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        inv = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling, self.model_max_positions)
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_sin = torch.stack((emb.cos(), emb.sin())).to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated copies (with the fused kernel: q and k
        themselves, rotated in place -- views of a projection's fresh output)."""
        kernels = self.fused(q)
        if kernels is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            kernels.rope_(q, k, positions.contiguous(), self.cos_sin)
            return q, k
        cos = self.cos_sin[0].index_select(0, positions).unsqueeze(1)
        sin = self.cos_sin[1].index_select(0, positions).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
