"""Weight-only quantization on CPU: a pass over a loaded model that packs the weights of
its GEMM layers into int8 or int4, and the GEMM that reads them.

Schemes (``--quantize``):
- ``int8``: one float16 scale per output channel (row), values in [-127, 127];
- ``int4``: groups of ``--quantize-group-size`` (32 or 64) values along each row with a
  float16 scale d and minimum m (w = d q + m, q in 0..15; GGUF's Q4_1 at 32); the LM
  head, which decides every token and is read whole each step, gets int8;
- ``gguf``: what a GGUF file's tensors were: Q8_0 (int8, scale per 32), Q4_0 (int4,
  scale per 32, m = -8 d) and Q4_1 stay those formats, bit for bit (a GGUF conversion
  keeps the dequantized values, and these quantizers are GGUF's own, which give back
  the same bytes); other types stay float.

The pass keeps the layers' seams: ``Linear.forward`` still calls ``self.gemm(x,
self.weight, self.bias)``; the weight becomes the packed integers and the GEMM a
``QuantGemm`` holding the scales, so a layer that adds to ``forward`` (LoRA) or
reads its rows by name works unchanged. A tied embedding table looks its rows up
through ``Embedding.lookup``, which dequantizes them. The packing runs after the
float weights are loaded (each rank packs the slice it keeps), so a quantized model
briefly holds its float weights at start.

Decode-sized batches go through the int8 x int8 kernels of ``engine/csrc/gemm.cpp``;
larger ones (prefill) dequantize the weight and use the float32 GEMM, where the
arithmetic, not the weight traffic, is what costs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

# rows of x up to which the integer kernels run; above it the weight is dequantized
MAX_KERNEL_ROWS = 32


@dataclass(frozen=True)
class Format:
    """A packed layout: ``q8`` (int8) or ``q4`` (int4 pairs in a byte), its group size
    along a row (0: the whole row), and for q4 whether the minimum is -8 d (Q4_0)."""

    kind: str
    group: int = 0
    symmetric: bool = False

    def group_for(self, cols: int) -> int:
        return self.group or cols

    @property
    def name(self) -> str:
        if self.kind == "q8":
            return "int8 per channel" if not self.group else f"int8/{self.group}"
        return f"int4/{self.group}" + (" symmetric" if self.symmetric else "")


GGUF_FORMATS = {"Q8_0": Format("q8", 32), "Q4_0": Format("q4", 32, symmetric=True), "Q4_1": Format("q4", 32)}


# ---- quantizers (GGUF's reference arithmetic, in torch) ---------------------------------
def quantize_q8(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float16 scales [N, K / group]: d = max |w| / 127, q = round(w / d)
    (half away from zero, as GGUF's Q8_0)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    d = g.abs().amax(-1) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = g * inv[..., None]
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf
    return q.clamp(-127, 127).to(torch.int8).reshape(n, k), d.half()


def quantize_q4(w: torch.Tensor, group: int, symmetric: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed uint8 [N, K / 2] and float16 scales and minimums [N, K / group]. Asymmetric
    is GGUF's Q4_1 (d = (max - min) / 15, q = trunc((w - min) / d + 0.5)); symmetric its
    Q4_0 (d = the value of largest magnitude / -8, q = trunc(w / d + 8.5), m = -8 d)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    if symmetric:
        idx = g.abs().argmax(-1, keepdim=True)
        d = torch.gather(g, -1, idx)[..., 0] / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(g * inv[..., None] + 8.5)
        d16 = d.half()
        m16 = (d16.float() * -8).half()
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc((g - lo[..., None]) * inv[..., None] + 0.5)
        d16, m16 = d.half(), lo.half()
    q = q.clamp(0, 15).to(torch.uint8).reshape(n, k // 32, 2, 16)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return packed, d16, m16


def dequantize(fmt: Format, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """The float32 matrix a packed one stands for (reference arithmetic, in torch)."""
    n = qweight.shape[0]
    if fmt.kind == "q8":
        k = qweight.shape[1]
        group = fmt.group_for(k)
        return (qweight.float().reshape(n, k // group, group) * scales.float()[..., None]).reshape(n, k)
    k = qweight.shape[1] * 2
    group = fmt.group_for(k)
    q = torch.stack((qweight & 0x0F, qweight >> 4), dim=2)  # [n, k/32 * 16, 2] -> per 32: low 16, high 16
    q = q.reshape(n, k // 32, 16, 2).transpose(2, 3).reshape(n, k // group, group).float()
    return (q * scales.float()[..., None] + mins.float()[..., None]).reshape(n, k)


# ---- the packed weight and its GEMM -------------------------------------------------------
class QuantGemm:
    """The GEMM of one quantized layer: ``(x, qweight, bias) -> x Wᵀ + b``, with W's
    scales (and minimums) held here. ``fallback`` is the process's float32 GEMM, used on
    dequantized weights for batches above ``MAX_KERNEL_ROWS`` rows."""

    def __init__(self, fmt: Format, cols: int, scales: torch.Tensor, mins: torch.Tensor | None, kernels,
                 fallback) -> None:
        self.fmt, self.cols, self.group = fmt, cols, fmt.group_for(cols)
        self.scales, self.mins = scales, mins
        self.kernels, self.fallback = kernels, fallback

    def __call__(self, x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] > MAX_KERNEL_ROWS:
            return self.fallback(x2, self.dense(qweight), bias).reshape(*lead, -1)
        x2 = x2.float().contiguous()
        if self.fmt.kind == "q8":
            y = self.kernels.gemm_q8(x2, qweight, self.scales, self.group, bias)
        else:
            y = self.kernels.gemm_q4(x2, qweight, self.scales, self.mins, self.group, bias)
        return y.reshape(*lead, -1)

    def dense(self, qweight: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(qweight.shape[0], dtype=torch.long)
        return self.rows(qweight, ids)

    def rows(self, qweight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.dequant_rows(qweight, self.scales, self.mins, self.group, ids.contiguous())

    def lookup(self, ids: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, W)`` for the quantized table (``Embedding.lookup``)."""
        flat = ids.reshape(-1).long()
        return self.rows(qweight, flat).reshape(*ids.shape, self.cols)

    def nbytes(self, qweight: torch.Tensor) -> int:
        extra = self.scales.numel() * 2 + (self.mins.numel() * 2 if self.mins is not None else 0)
        return qweight.numel() * qweight.element_size() + extra


def pack(module: nn.Module, fmt: Format, kernels, fallback) -> QuantGemm:
    """Replaces ``module.weight`` (float, [N, K]) by its packed form; the scales (and
    minimums) become parameters beside it, so memory figures count them."""
    w = module.weight.data
    cols = w.shape[1]
    group = fmt.group_for(cols)
    if fmt.kind == "q8":
        q, scales = quantize_q8(w, group)
        mins = None
    else:
        q, scales, mins = quantize_q4(w, group, fmt.symmetric)
    module.weight = nn.Parameter(q, requires_grad=False)
    module.weight_scale = nn.Parameter(scales, requires_grad=False)
    if mins is not None:
        module.weight_min = nn.Parameter(mins, requires_grad=False)
    return QuantGemm(fmt, cols, module.weight_scale.data, mins if mins is None else module.weight_min.data,
                     kernels, fallback)


def _supported_shape(weight: torch.Tensor, fmt: Format) -> bool:
    cols = weight.shape[1] if weight.dim() == 2 else 0
    return cols > 0 and cols % 32 == 0 and cols % fmt.group_for(cols) == 0


def gguf_types(model_dir: Path) -> dict[str, str]:
    from kubeshard_shard.models.gguf_checkpoint import TENSOR_TYPES_FILE

    path = Path(model_dir) / TENSOR_TYPES_FILE
    if not path.is_file():
        raise ValueError(f"--quantize gguf: {model_dir} is not a GGUF conversion (no {TENSOR_TYPES_FILE}); "
                         "serve the .gguf file itself, or use --quantize int8 or int4")
    return json.loads(path.read_text())


def plan(model, method: str, group_size: int = 32, model_dir: Path | None = None) -> dict[str, Format]:
    """Which of ``model``'s GEMM layers get which format (by module name), for
    ``--quantize method`` (int8, int4 or gguf)."""
    from kubeshard_shard.models.layers import LMHead, UsesGemm

    types = gguf_types(model_dir) if method == "gguf" else {}
    out: dict[str, Format] = {}
    for name, module in model.named_modules():
        if not isinstance(module, UsesGemm) or not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        head = isinstance(module, LMHead) or name == "lm_head"
        if method == "int8":
            fmt = Format("q8")
        elif method == "int4":
            fmt = Format("q8") if head else Format("q4", group_size)
        elif method == "gguf":
            fmt = _gguf_format(model, name, head, types)
            if fmt is None:
                continue
        else:
            raise ValueError(f"--quantize: unknown method '{method}'")
        if _supported_shape(module.weight, fmt):
            out[name] = fmt
        else:
            log.info("quantize: %s keeps float weights (%s columns are not a multiple of its group)", name,
                     tuple(module.weight.shape))
    return out


def _gguf_format(model, name: str, head: bool, types: dict[str, str]) -> Format | None:
    """The GGUF type of the checkpoint tensors behind a layer (fused layers: all of them)."""
    if head and model.config.tie_word_embeddings:
        sources = ["model.embed_tokens.weight"]
    else:
        stacked = {fused: [k for k, (f, _) in model.STACKED.items() if f == fused]
                   for fused in {f for f, _ in model.STACKED.values()}}
        base, _, leaf = name.rpartition(".")
        parts = stacked.get(leaf, [leaf])
        sources = [f"{base}.{p}.weight" if base else f"{p}.weight" for p in parts]
    found = {types.get(s) for s in sources}
    if len(found) != 1 or None in found:
        if found - {None}:
            log.info("quantize gguf: %s mixes GGUF types %s; it keeps float weights", name, sorted(found - {None}))
        return None
    kind = found.pop()
    fmt = GGUF_FORMATS.get(kind)
    if fmt is None:
        log.info("quantize gguf: %s is %s in the file; it keeps float weights (kept quantized: %s)", name, kind,
                 ", ".join(GGUF_FORMATS))
    return fmt


def quantize_model(model, method: str, group_size: int, kernels, fallback,
                   model_dir: Path | None = None) -> dict[str, Format]:
    """Packs the planned layers' weights in place (``kernels``: the CPU kernels' module;
    ``fallback``: the float32 GEMM for large batches); returns the plan. A tied
    embedding reads its rows from the LM head's packed table."""
    chosen = plan(model, method, group_size, model_dir)
    modules = dict(model.named_modules())
    for name, fmt in chosen.items():
        module = modules[name]
        module.set_gemm(pack(module, fmt, kernels, fallback))
    tied = getattr(model, "lm_head", None)
    if tied is not None and model.config.tie_word_embeddings and "lm_head" in chosen:
        embed = model.model.embed_tokens
        embed.weight = tied.weight
        embed.weight_scale = tied.weight_scale
        if hasattr(tied, "weight_min"):
            embed.weight_min = tied.weight_min
        embed.set_lookup(tied.gemm.lookup)
    if chosen:
        kinds = sorted({f.name for f in chosen.values()})
        log.info("quantize %s: %d layers packed (%s)", method, len(chosen), ", ".join(kinds))
    return chosen
