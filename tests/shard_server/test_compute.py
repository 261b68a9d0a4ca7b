"""The compute plan on a CPU without AVX-512 BF16 (AVX2 and FMA only), on any machine.

The CPU differs from one machine to the next here; oneDNN cannot build a bfloat16 GEMM
on an AVX2-only CPU (issue 10: "could not create a primitive descriptor" mid-request).
These tests hand the plan that CPU's /proc/cpuinfo flags instead of this machine's, so
the portable path is what runs, wherever the test runs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kubeshard_shard.compute import (SMALL_ROWS, SMALL_ROWS_AVX2, SmallBatchGemm, choose_gemm, packed_for_many_rows,
                                     resolve_compute, small_rows, torch_gemm)
from kubeshard_shard.config import EngineConfig, MemoryBudget
from kubeshard_shard.hardware import CpuFeatures
from kubeshard_shard.models.config import load_model_config
from kubeshard_shard.models.layers import UsesGemm
from kubeshard_shard.server.factory import build_served_model

from tests.support.engine import greedy, random_prompts, run_to_completion

# the flags line of an AVX2-only x86-64 CPU (a Haswell-to-Zen2 class machine)
AVX2_CPUINFO = ("processor\t: 0\nvendor_id\t: GenuineIntel\n"
                "flags\t\t: fpu vme de pse tsc msr sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 fma bmi1 bmi2\n")
AVX2_ONLY = CpuFeatures.parse(AVX2_CPUINFO)
CPU = torch.device("cpu")


def config(model: Path, **overrides) -> EngineConfig:
    return EngineConfig(model_dir=model, model_id=model.name, kv_cache_memory=MemoryBudget.parse("64MiB"),
                        **overrides)


def test_cpuinfo_flags_say_which_cpus_have_native_bfloat16():
    assert {"avx2", "fma"} <= AVX2_ONLY.flags
    assert not AVX2_ONLY.native_bf16
    assert AVX2_ONLY.describe() == "avx2 fma"
    bf16 = CpuFeatures.parse(AVX2_CPUINFO.replace("bmi2", "bmi2 avx512f avx512_bf16"))
    assert bf16.native_bf16
    assert CpuFeatures.parse(AVX2_CPUINFO.replace("bmi2", "amx_bf16")).native_bf16


def test_our_float32_gemm_takes_more_rows_on_the_avx2_build_than_on_avx512_or_portable_ones():
    assert small_rows(AVX2_ONLY) == SMALL_ROWS_AVX2 > SMALL_ROWS
    assert small_rows(CpuFeatures.parse(AVX2_CPUINFO.replace("bmi2", "bmi2 avx512f avx512bw"))) == SMALL_ROWS
    assert small_rows(CpuFeatures.parse(AVX2_CPUINFO.replace(" avx2 fma", ""))) == SMALL_ROWS


def test_many_rows_take_our_packed_kernel_only_where_avx2_is_the_widest_vector():
    assert packed_for_many_rows(AVX2_ONLY)
    assert not packed_for_many_rows(CpuFeatures.parse(AVX2_CPUINFO.replace("bmi2", "bmi2 avx512f avx512bw")))
    assert not packed_for_many_rows(CpuFeatures.parse(AVX2_CPUINFO.replace(" avx2 fma", "")))


@pytest.mark.parametrize("avx512", [False, True], ids=["avx2 plan", "avx-512 plan"])
def test_the_float32_plan_routes_each_product_by_its_rows(demo_model, avx512):
    """Up to small_rows rows: our few-rows kernel; above: the packed kernel on an AVX2
    plan, oneDNN's linear on an AVX-512 one (each the very bits of that path)."""
    model = demo_model("llama")
    cpu = CpuFeatures.parse(AVX2_CPUINFO.replace("bmi2", "bmi2 avx512f avx512bw")) if avx512 else AVX2_ONLY
    plan = resolve_compute(config(model), load_model_config(model), cpu=cpu)
    gemm = plan.gemm
    if plan.gemm_name == "torch":
        pytest.skip("oneDNN's linear is unavailable in this torch build")  # the plan's own choice, tested above
    assert isinstance(gemm, SmallBatchGemm)
    assert plan.gemm_name == ("kubeshard+onednn" if avx512 else "kubeshard")
    w, b = torch.randn(40, 64), torch.randn(40)
    few, many = torch.randn(gemm.rows, 64), torch.randn(gemm.rows + 5, 64)
    assert torch.equal(gemm(few, w, b), plan.kernels.gemm_f32(few, w, b))
    if avx512:
        assert gemm.many is None
        assert torch.equal(gemm(many, w, b), gemm.large(many, w, b))
    else:
        assert torch.equal(gemm(many, w, b), plan.kernels.gemm_f32_packed(many, w, b))
        # a view of x (rows of a larger step) goes through the same kernel, copied contiguous
        wide = torch.randn(gemm.rows + 5, 128)
        assert torch.equal(gemm(wide[:, :64], w, b), plan.kernels.gemm_f32_packed(wide[:, :64].contiguous(), w, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_takes_the_portable_gemm_for_half_precision_without_native_bfloat16(dtype):
    gemm, name = choose_gemm("auto", CPU, dtype, AVX2_ONLY)
    assert gemm is torch_gemm and name == "torch"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cpu_gemm_onednn_with_half_precision_is_refused_at_start_naming_the_flag(demo_model, dtype):
    model = demo_model("llama")
    with pytest.raises(ValueError) as err:
        resolve_compute(config(model, dtype=dtype, cpu_gemm="onednn"), load_model_config(model), cpu=AVX2_ONLY)
    message = str(err.value)
    assert message.startswith("--cpu-gemm onednn:"), message
    assert f"no {dtype} GEMM on this CPU (avx2 fma)" in message
    assert "--cpu-gemm auto or torch" in message


def test_bfloat16_plan_without_native_bfloat16_is_the_portable_path(demo_model, caplog):
    model = demo_model("llama")
    with caplog.at_level(logging.WARNING, logger="kubeshard_shard.compute"):
        compute = resolve_compute(config(model, dtype="bfloat16"), load_model_config(model), cpu=AVX2_ONLY)
    assert compute.dtype == torch.bfloat16 and compute.device == CPU
    assert compute.gemm is torch_gemm and compute.gemm_name == "torch"
    assert compute.cpu is AVX2_ONLY
    assert "no native bfloat16 arithmetic" in caplog.text and "(avx2 fma)" in caplog.text


def test_bfloat16_engine_on_the_portable_gemm_serves(demo_model):
    model = demo_model("llama")
    cfg = config(model, dtype="bfloat16")
    compute = resolve_compute(cfg, load_model_config(model), cpu=AVX2_ONLY)
    served = build_served_model(cfg, compute=compute)
    gemm_layers = [m for m in served.engine.runner.model.modules() if isinstance(m, UsesGemm)]
    assert gemm_layers and all(m.gemm is torch_gemm for m in gemm_layers)
    assert all(p.dtype == torch.bfloat16 for p in served.engine.runner.model.parameters())
    assert served.engine.runner.cache.k[0].dtype == torch.bfloat16
    prompts = random_prompts(3, 1000, (12, 40), seed=11)
    outs = run_to_completion(served.engine, [(p, greedy(16)) for p in prompts])
    for i, out in enumerate(outs):
        ids = [o.token_id for o in out]
        assert len(ids) == 16 and all(0 <= t < 1024 for t in ids), f"request {i}: {ids}"
        # NaN or garbage logits come out as one id repeated (argmax of NaN is 0)
        assert len(set(ids)) >= 6, f"request {i} repeats itself: {ids}"
