"""Checks of the CPU kernels' GEMMs, shared by the tests of this CPU's own build, of the
portable builds and of the prebuilt modules: float32 against a float64 linear, int8 and
int4 against a float64 evaluation of the same integer arithmetic (1e-5 of the output's
scale) and against the float product of the dequantized weights (1e-4: x is quantized to
int16 per 32 values); every row also against that row multiplied alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kubeshard_shard.models import quant

# (rows of x, N, K); K = 1024: whole sweeps of eight 32-value blocks and no remainder, the
# integer kernels' groups of 4 and 8 blocks (128, 256)
SHAPES = [(1, 64, 96), (3, 577, 192), (5, 130, 576), (16, 96, 576), (33, 70, 64), (2, 40, 1024)]
# K not a multiple of a vector (the tail of each row); 4 and 6 rows: the AVX2 kernel's
# sweeps over three and two W rows at a time; many rows (the packed kernel's six-row
# steps and a remainder; N not a multiple of its 16-column tiles); K = 1
F32_SHAPES = SHAPES + [(7, 50, 100), (4, 40, 200), (6, 37, 576), (53, 37, 100), (100, 64, 576), (13, 17, 1)]
# group 96 (three blocks): the kernels' path for groups that are not a power of two blocks
INT8_GROUPS = [(m, n, kdim, group) for m, n, kdim in SHAPES for group in (32, 64, 96, 128, 256, 0)
               if not group or kdim % group == 0]
INT4_GROUPS = [(m, n, kdim, group, symmetric) for m, n, kdim in SHAPES
               for group, symmetric in ((32, False), (32, True), (64, False), (128, False), (256, True))
               if kdim % group == 0]
# rows ending 1, 4, 5 and 7 blocks past a sweep of eight blocks (the AVX-512 kernel's
# last, partial sweep; SHAPES end 0, 2, 3 and 6 past one); 9 W rows: pairs and a last one
INT4_GROUPS += [(2, 9, kdim, 32, False) for kdim in (32, 128, 160, 224)]


def kernels_for_level(level: str):
    """The CPU kernels built for the x86-64 ``level`` (one of ``kernels.LEVELS``):
    skipped only where this CPU cannot run that build, failed where it does not build."""
    from kubeshard_shard.engine import kernels
    from kubeshard_shard.hardware import CpuFeatures

    lacks = dict(kernels.LEVELS)[level] - CpuFeatures.detect().flags
    if lacks:
        pytest.skip(f"this CPU cannot run a {level} build (it lacks {', '.join(sorted(lacks))})")
    built = kernels.module(march=level)
    assert built is not None, f"the CPU kernels failed to build for -march={level}"
    return built


def quantize_x(x: torch.Tensor):
    """The kernels' activation quantization: per 32 values d = max|x| / 32767 (float32),
    q = round half to even (x / d)."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    d = (blocks.float().abs().amax(-1) / 32767).double()
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d.float().double())
    q = torch.round((blocks.float() * inv.float()[..., None]).double())
    return q, d


def exact_q8(x, qw, scales, group):
    q, d = quantize_x(x)
    m, nb = q.shape[:2]
    w = qw.double().reshape(qw.shape[0], nb, 32)
    dots = torch.einsum("mbi,nbi->mnb", q, w)
    ws = scales.double().repeat_interleave(group // 32, dim=1)  # [n, nb]
    return (dots * d[:, None, :] * ws[None]).sum(-1)


def exact_q4(x, packed, scales, mins, group):
    q, d = quantize_x(x)
    n = packed.shape[0]
    nb = q.shape[1]
    nib = torch.stack((packed & 0x0F, packed >> 4), dim=2).reshape(n, nb, 16, 2).transpose(2, 3).reshape(n, nb, 32)
    dots = torch.einsum("mbi,nbi->mnb", q, nib.double())
    ws = scales.double().repeat_interleave(group // 32, dim=1)
    wm = mins.double().repeat_interleave(group // 32, dim=1)
    xs = x.double().reshape(x.shape[0], nb, 32).sum(-1)
    qsum = q.sum(-1) * d
    return (dots * d[:, None, :] * ws[None] + wm[None] * xs[:, None, :]
            + 8 * ws[None] * (xs - qsum)[:, None, :]).sum(-1)


def check_float32_kernel(built, m: int, n: int, kdim: int) -> None:
    """Both float32 kernels: ``gemm_f32`` (a few rows) and ``gemm_f32_packed`` (many)."""
    gen = torch.Generator().manual_seed(m * n)
    x, w, b = torch.randn(m, kdim, generator=gen), torch.randn(n, kdim, generator=gen), torch.randn(n, generator=gen)
    want = F.linear(x.double(), w.double(), b.double())
    for gemm in (built.gemm_f32, built.gemm_f32_packed):
        got = gemm(x, w, b)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item()), (gemm, m, n, kdim)
        # each row's result is the same bit for bit whatever rows share its product (the
        # tiles differ with the number of rows): a verification row's logits are a decode's
        for i in range(m):
            assert torch.equal(got[i], gemm(x[i:i + 1], w, b)[0]), (gemm, m, n, kdim, i)
    without_bias = built.gemm_f32_packed(x, w, None).double()
    assert torch.allclose(without_bias, want - b.double(), rtol=1e-5, atol=1e-4 * want.abs().max().item())


def check_int8_kernel(built, m: int, n: int, kdim: int, group: int) -> None:
    """``group`` 0: one group per row."""
    gen = torch.Generator().manual_seed(7 + m)
    x, w = torch.randn(m, kdim, generator=gen), torch.randn(n, kdim, generator=gen) * 0.05
    g = group or kdim
    qw, scales = quant.quantize_q8(w, g)
    raw = built.gemm_q8(x, qw, scales, g, None)
    for i in range(m):  # a verification row's logits are a decode's, bit for bit
        assert torch.equal(raw[i], built.gemm_q8(x[i:i + 1], qw, scales, g, None)[0]), (m, n, kdim, group, i)
    got = raw.double()
    want = exact_q8(x, qw, scales, g)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * scale, (m, n, kdim, group)
    dense = F.linear(x.double(), quant.dequantize(quant.Format("q8", group), qw, scales, None).double())
    assert (got - dense).abs().max().item() <= 1e-4 * scale, (m, n, kdim, group)


def check_int4_kernel(built, m: int, n: int, kdim: int, group: int, symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(11 + m)
    x, w = torch.randn(m, kdim, generator=gen), torch.randn(n, kdim, generator=gen) * 0.05
    packed, scales, mins = quant.quantize_q4(w, group, symmetric)
    raw = built.gemm_q4(x, packed, scales, mins, group, None)
    for i in range(m):  # a verification row's logits are a decode's, bit for bit
        assert torch.equal(raw[i], built.gemm_q4(x[i:i + 1], packed, scales, mins, group, None)[0]), \
            (m, n, kdim, group, symmetric, i)
    got = raw.double()
    want = exact_q4(x, packed, scales, mins, group)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * scale, (m, n, kdim, group, symmetric)
    dense = F.linear(x.double(), quant.dequantize(quant.Format("q4", group, symmetric), packed, scales, mins).double())
    assert (got - dense).abs().max().item() <= 1e-4 * scale, (m, n, kdim, group, symmetric)
