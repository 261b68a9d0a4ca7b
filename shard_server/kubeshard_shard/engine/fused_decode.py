"""A decode-only step through the whole model in one call to the CPU kernels.

At batch 1 a decoder layer's dozen kernel calls each cost a Python module call, tensor
views and the binding's checks on top of their arithmetic: milliseconds a step at 30
layers. ``FusedStep`` runs the loop over layers in C++ (``csrc/fused_decode.cpp``),
calling the same kernels the modules call, in their order, with the same arguments, so
its logits and the K/V it writes are the modules' bit for bit.

``build`` takes a model only where that holds: a Llama-family model of the base modules
(no tensor-parallel layers, no ZeRO-3 hooks), float32, every layer on the CPU kernels
(RMSNorm, rotary, SwiGLU) and every GEMM on our kernels (float32 through
``SmallBatchGemm``, int8/int4 through ``QuantGemm``), and a pool the decode kernel reads.
A step qualifies when every row decodes one sequence (plain decodes and speculative
verification rows) and there are no more rows than every GEMM takes on our kernels;
anything else runs through the modules. With LoRA on, the projections are
``LoraLinear``s around the base layers: the fused step runs each base layer's GEMM, then
adds the adapters' deltas of the step's runs of rows with the kernel
``LoraLinear.forward`` calls (``csrc/lora.cpp``), so adapter rows stay bit for bit too.
The kernel holds the registry's stacked buffers (``LayerPack.native``), taken again when
the registry swaps them (an adapter loaded or unloaded).
"""

from __future__ import annotations

import torch
from torch import nn

from kubeshard_shard import compute
from kubeshard_shard.engine import kernels as kernel_build
from kubeshard_shard.engine.attention import AttentionMetadata, KVCache
from kubeshard_shard.models import quant
from kubeshard_shard.models.layers import Embedding, Linear, LMHead, MergedLinear, RMSNorm, RotaryEmbedding
from kubeshard_shard.models.lora import AdapterRegistry, LayerPack, LoraLinear, slot_runs
from kubeshard_shard.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                          LlamaModel)

F32, Q8, Q4 = 0, 1, 2  # FusedDecode.add_gemm's kinds

# exactly these classes: a sharding pass swaps in subclasses whose forward adds collectives
BASE_MODULES = (LlamaForCausalLM, LlamaModel, nn.ModuleList, Embedding, LMHead, LlamaDecoderLayer, LlamaAttention,
                LlamaMLP, MergedLinear, Linear, RMSNorm, RotaryEmbedding)


class FusedStep:
    def __init__(self, kernel, embed: Embedding, max_rows: int, lora: AdapterRegistry | None = None,
                 lora_gemms: tuple[tuple[int, str], ...] = ()) -> None:
        self.kernel, self.embed, self.max_rows = kernel, embed, max_rows
        self.lora, self.lora_gemms = lora, lora_gemms  # the registry; (GEMM index, its LoraLinear's key)
        self._packs = None  # the registry's packs the kernel holds

    def serves(self, rows: int, num_decode: int, prefills: int, adapters: bool = False) -> bool:
        """Whether the step runs here: ``rows`` decode rows (of ``num_decode``), ``prefills``
        prefill chunks, and whether any row uses a LoRA adapter."""
        return 0 < rows == num_decode <= self.max_rows and not prefills and (not adapters or self.lora is not None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            lora_slots: list[int] | None = None) -> torch.Tensor:
        """The final norm's output [rows, hidden], as ``LlamaForCausalLM.forward`` returns it;
        ``lora_slots``: each row's adapter slot (0: the base model)."""
        runs = None
        if lora_slots:
            ordered = slot_runs(lora_slots)
            if ordered:
                self._hold(self.lora.packs)
                runs = torch.tensor(ordered, dtype=torch.long)
        return self.kernel.run(self.embed(input_ids), positions, meta.slot_mapping, meta.block_tables,
                               meta.context_lens, runs)

    def _hold(self, packs: dict[str, LayerPack]) -> None:
        """The kernel takes the registry's packs, when they changed since it last did (an
        adapter loaded or unloaded: the registry swaps them whole)."""
        if packs is self._packs:
            return
        self.kernel.clear_lora()
        for gemm, key in self.lora_gemms:
            pack = packs.get(key)
            if pack is not None:
                self.kernel.set_lora(gemm, pack.native)
        self._packs = packs


def _hooked(model: nn.Module) -> bool:
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _add_gemm(fused, layer: Linear | LoraLinear, built) -> tuple[int, int] | None:
    """The layer's GEMM added to ``fused`` (a LoRA-wrapped layer's base: the step adds the
    adapters' deltas after it): its index there, and the most rows our kernel takes on it
    (above, the modules' GEMM goes to another path); None where the layer's GEMM is not
    one of our kernels."""
    if isinstance(layer, LoraLinear):
        layer = layer.base  # a base module: build checked every module's type
    gemm, bias = layer.gemm, layer.bias
    if bias is not None and bias.dtype != torch.float32:
        return None
    if isinstance(gemm, compute.SmallBatchGemm):
        if gemm.kernel is not built.gemm_f32 or layer.weight.dtype != torch.float32 or not layer.weight.is_contiguous():
            return None
        return fused.add_gemm(F32, layer.weight, None, None, 0, bias), gemm.rows
    if isinstance(gemm, quant.QuantGemm) and gemm.kernels is built and gemm.fmt.kind in ("q8", "q4"):
        kind = Q8 if gemm.fmt.kind == "q8" else Q4
        return fused.add_gemm(kind, layer.weight, gemm.scales, gemm.mins, gemm.group, bias), quant.MAX_KERNEL_ROWS
    return None


def build(model: nn.Module, cache: KVCache, decode_kernel, lora) -> FusedStep | None:
    """The fused step for ``model`` over ``cache``, or None where the modules must serve."""
    if type(model) is not LlamaForCausalLM or cache.device.type != "cpu":
        return None
    allowed = BASE_MODULES if lora is None else BASE_MODULES + (LoraLinear,)
    if any(type(m) not in allowed for m in model.modules()) or _hooked(model):
        return None
    built = model.model.norm.kernels
    if built is None or not hasattr(built, "FusedDecode") or decode_kernel is not built.paged_decode_scaled:
        return None
    layers = list(model.model.layers)
    fused_modules = [model.model.norm, model.rotary] + [m for layer in layers for m in
                                                        (layer.input_layernorm, layer.post_attention_layernorm,
                                                         layer.mlp)]
    if any(m.kernels is not built for m in fused_modules) or not layers:
        return None
    if any(p.dtype != torch.float32 for m in fused_modules for p in m.parameters(recurse=False)):
        return None
    attn = layers[0].self_attn
    probe = torch.empty(0, attn.num_heads, attn.head_dim)
    if model.rotary.cos_sin.dtype != torch.float32 or not kernel_build.supports(decode_kernel, probe, cache.k[0]):
        return None
    fused = built.FusedDecode(model.rotary.cos_sin, model.model.norm.weight, model.model.norm.eps, attn.num_heads,
                              attn.num_kv_heads, attn.head_dim, cache.block_size, attn.scale)
    if lora is not None and lora.native is None:
        lora = None  # adapters' deltas only through the modules (the packs have no kernel form)
    row_limits, lora_gemms = [], []
    for i, layer in enumerate(layers):
        a = layer.self_attn
        if (a.num_heads, a.num_kv_heads, a.head_dim, a.scale) != (attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                                  attn.scale) or a.layer_idx != i:
            return None
        linears = (a.qkv_proj, a.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        gemms = [_add_gemm(fused, lin, built) for lin in linears]
        if any(g is None for g in gemms):
            return None
        lora_gemms += [(index, lin.key) for (index, _), lin in zip(gemms, linears) if isinstance(lin, LoraLinear)]
        row_limits += [rows for _, rows in gemms]
        fused.add_layer(layer.input_layernorm.weight, layer.input_layernorm.eps, layer.post_attention_layernorm.weight,
                        layer.post_attention_layernorm.eps, *[index for index, _ in gemms], cache.k[i], cache.v[i],
                        cache.k_scale[i], cache.v_scale[i])
    return FusedStep(fused, model.model.embed_tokens, min(row_limits), lora, tuple(lora_gemms))
