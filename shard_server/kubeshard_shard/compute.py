"""How this process computes, resolved once from the config and the machine.

``resolve_compute`` picks the device (a group's rank takes its own GPU), the dtype, the
GEMM path, the decode-attention kernel and the weight quantization, and the model runner
and layers receive the result; nothing decides these later from globals or the
environment. A choice this machine cannot serve (a quantization on CUDA or without the
CPU kernels, say) fails here, at start, naming the flag.

The GEMM: oneDNN's fused linear (the kernel torch.compile's CPU backend calls) runs
float32 GEMMs about 2x faster than the MKL path ``F.linear`` takes on AMD CPUs, where
MKL falls back to generic code. Its bfloat16 kernels need AVX-512 BF16 or AMX: on
other CPUs oneDNN cannot even build the primitive, so bfloat16 goes through
``F.linear`` there (slower, and it works on every x86-64 CPU). Each choice is checked
once against ``F.linear`` on a small product before it is used. Under oneDNN, products
of a few rows (decode at small batch) go through our float32 kernel
(``engine/csrc/gemm.cpp``), which streams the weight at memory speed where oneDNN's
matrix-vector path does not; on AVX2 CPUs without AVX-512 the larger ones (prefill) go
through our packed-tile kernel (``engine/csrc/packed_gemm.cpp``), which runs 1.1-1.4x
oneDNN's linear there without a second, prepacked copy of the weights.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kubeshard_shard.config import EngineConfig, Placement
from kubeshard_shard.engine import kernels
from kubeshard_shard.hardware import CpuFeatures
from kubeshard_shard.models.config import ModelConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Gemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def torch_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def onednn_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dim() != 2:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# Rows of x up to which our float32 kernel beats oneDNN on a step's pass over the
# weights, on AVX-512 builds (bench/results/cpu-kernels.md, the default and the small
# model: 1.7-1.9x at one row and 1.1-1.4x at 24 on a Xeon, 2026-12-05, and on an AMD
# EPYC with AVX-512 in that file's run of 2026-12-04, `git show 91515cf`, where 32 rows
# came out about even; 1.25x on the Xeon). Speculative verifications (k + 1 rows) and
# decode batches up to 24 sequences fall under it. The AVX2 build (no AVX-512) beats
# oneDNN further on the default model's layers: 1.26x at 32 rows, 1.13x at 48, 1.03x at
# 64 (bench/results/cpu-kernels-avx2.md, 2026-12-05, EPYC), so there it takes up to 48.
SMALL_ROWS = 24
SMALL_ROWS_AVX2 = 48


def _avx2_only(cpu: CpuFeatures) -> bool:
    return {"avx2", "fma"} <= cpu.flags and not {"avx512f", "avx512bw"} <= cpu.flags


def small_rows(cpu: CpuFeatures) -> int:
    """The most rows our float32 kernel takes on this CPU (the build follows its flags)."""
    return SMALL_ROWS_AVX2 if _avx2_only(cpu) else SMALL_ROWS


def packed_for_many_rows(cpu: CpuFeatures) -> bool:
    """Whether products of more than ``small_rows`` rows take our packed-tile kernel
    (``gemm_f32_packed``) on this CPU rather than oneDNN's: where AVX2 is the widest
    vector (measured there; with AVX-512 oneDNN's kernels use twice the width ours do)."""
    return _avx2_only(cpu)


class SmallBatchGemm:
    """Our float32 kernels: ``gemm_f32`` for products of at most ``rows`` rows; above,
    ``gemm_f32_packed`` where ``packed`` (else ``large``, the library's)."""

    def __init__(self, kernels, large: Gemm, rows: int = SMALL_ROWS, packed: bool = False) -> None:
        self.kernel, self.large, self.rows = kernels.gemm_f32, large, rows
        self.many = kernels.gemm_f32_packed if packed else None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (x.dim() == 2 and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.is_contiguous()
                and x.device.type == "cpu" and (bias is None or bias.dtype == torch.float32)):
            if x.shape[0] <= self.rows:
                return self.kernel(x.contiguous(), weight, bias)
            if self.many is not None:
                return self.many(x.contiguous(), weight, bias)
        return self.large(x, weight, bias)


@dataclass(frozen=True)
class Compute:
    device: torch.device
    dtype: torch.dtype
    gemm: Gemm
    gemm_name: str                      # "onednn" or "torch" (for logs and Info)
    decode_kernel: Callable | None      # the compiled CPU decode attention, if any
    cpu: CpuFeatures
    kernels: object | None = None       # the CPU kernels' module (GEMMs, quantized GEMMs), if built
    quantize: str = "none"              # weight quantization (models/quant.py)
    quantize_group_size: int = 32
    kv_dtype: torch.dtype | None = None  # what the KV pool stores (None: ``dtype``)

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


def resolve_device(name: str, placement: Placement | None = None) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was requested but no CUDA device is available")
        if device.index is None and placement is not None:  # one GPU per rank
            device = torch.device("cuda", placement.rank % torch.cuda.device_count())
    return device


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` keeps the checkpoint's dtype on CUDA and uses float32 on CPU, where
    half-precision matmuls are slow or unsupported on many machines."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(str(model_config.torch_dtype), torch.bfloat16)
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got '{name}'")
    return DTYPES[name]


def _onednn_works(dtype: torch.dtype) -> bool:
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
        got = onednn_gemm(x.to(dtype), w.to(dtype), b.to(dtype)).float()
        want = F.linear(x.to(dtype).float(), w.to(dtype).float(), b.to(dtype).float())
        return bool(torch.allclose(got, want, atol=0.05 if dtype != torch.float32 else 1e-5))
    except Exception:  # e.g. "could not create a primitive descriptor" on CPUs without BF16
        return False


def choose_gemm(choice: str, device: torch.device, dtype: torch.dtype, cpu: CpuFeatures) -> tuple[Gemm, str]:
    if device.type != "cpu" or choice == "torch":
        return torch_gemm, "torch"
    eligible = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu.native_bf16)
    if choice == "onednn" and not eligible:
        raise ValueError(f"--cpu-gemm onednn: oneDNN has no {str(dtype).removeprefix('torch.')} GEMM on this CPU "
                         f"({cpu.describe()}); use --cpu-gemm auto or torch")
    if eligible and _onednn_works(dtype):
        return onednn_gemm, "onednn"
    if choice == "onednn":
        raise ValueError("--cpu-gemm onednn: oneDNN's linear kernel is unavailable in this torch build")
    return torch_gemm, "torch"


def configure_threads(num_threads: int | None) -> None:
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(num_threads or available)


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device, cpu: CpuFeatures) -> torch.dtype:
    """The KV pool's type for ``--kv-cache-dtype``; fp8 fails here, naming the hardware
    it needs."""
    if name == "auto":
        return dtype
    if name == "fp8":
        if device.type == "cpu":
            raise ValueError(f"--kv-cache-dtype fp8 needs FP8 arithmetic, which this CPU ({cpu.describe()}) does not "
                             "have; use --kv-cache-dtype int8 (one scale per token and head, the same memory)")
        raise ValueError("--kv-cache-dtype fp8 is not implemented for CUDA pools yet; use int8, bfloat16 or float16")
    return KV_DTYPES[name]


def check_quantize(config: EngineConfig, device: torch.device, dtype: torch.dtype, cpu: CpuFeatures,
                   built) -> None:
    """Whether ``--quantize`` can serve here; a ValueError naming it otherwise."""
    if config.quantize == "none":
        return
    what = f"--quantize {config.quantize}"
    if device.type != "cpu":
        raise ValueError(f"{what}: weight-only int8/int4 kernels are CPU kernels; on CUDA serve bfloat16 or "
                         "float16 (--quantize none)")
    if dtype != torch.float32:
        raise ValueError(f"{what} computes in float32 (its kernels take float32 activations); got --dtype "
                         f"{str(dtype).removeprefix('torch.')}: use --dtype float32 or auto")
    if not config.cpu_kernels:
        raise ValueError(f"{what} needs the compiled CPU kernels, and --no-cpu-kernels turns them off")
    if built is None:
        raise ValueError(f"{what} needs the compiled CPU kernels, which could not be built on this machine "
                         "(a C++ compiler and ninja; see the log)")
    if "avx2" not in cpu.flags and cpu.flags and not any(f in cpu.flags for f in ("asimd", "neon")):
        log.warning("%s: this CPU (%s) has no AVX2: the int8/int4 kernels run their portable loops, slower "
                    "than float32", what, cpu.describe())


def resolve_compute(config: EngineConfig, model_config: ModelConfig,
                    placement: Placement | None = None, cpu: CpuFeatures | None = None) -> Compute:
    """Resolves the device, dtype, GEMM, decode kernel and quantization; builds the
    kernels now (a first build takes a while, so a group member does this before joining
    its peers). ``cpu``: this machine's CPU features unless given (a plan for another
    CPU, e.g. one with AVX2 only)."""
    device = resolve_device(config.device, placement)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        configure_threads(config.num_threads)
    dtype = resolve_dtype(config.dtype, model_config, device)
    cpu = cpu or CpuFeatures.detect()
    gemm, gemm_name = choose_gemm(config.cpu_gemm, device, dtype, cpu)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, device, cpu)
    # built for float32 and the quantized paths only: other dtypes serve without them
    wanted = device.type == "cpu" and config.cpu_kernels and (dtype == torch.float32 or config.quantize != "none")
    built = kernels.module() if wanted else None
    check_quantize(config, device, dtype, cpu, built)
    kernel = built.paged_decode_scaled if built is not None else None
    if built is not None and dtype == torch.float32 and config.cpu_gemm == "auto" and gemm_name == "onednn":
        packed = packed_for_many_rows(cpu)
        gemm = SmallBatchGemm(built, gemm, small_rows(cpu), packed)
        gemm_name = "kubeshard" if packed else "kubeshard+onednn"
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu.native_bf16:
        log.warning("this CPU (%s) has no native bfloat16 arithmetic: bfloat16 runs on the portable path, "
                    "slower than float32 here", cpu.describe())
    return Compute(device, dtype, gemm, gemm_name, kernel, cpu, built, config.quantize, config.quantize_group_size,
                   kv_dtype)
