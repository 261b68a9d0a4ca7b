"""Weight-only int8/int4 quantization: the kernels against exact references, GGUF's own
quantizers reproduced byte for byte, quantized models within stated tolerances of
float32, and the flags that cannot serve refused at start naming themselves.

Stated tolerances (what the assertions hold the engine to):
- the integer kernels equal a float64 evaluation of the same integer arithmetic to 1e-5
  of the output's scale; against the float product of the dequantized weights, the only
  difference is that x is quantized to int16 per 32 values: within 1e-4 of max |y|;
- each packed layer of a demo model, fed the float model's input, stays within 2% (int8)
  and 12% (int4, group 32) of the float layer's output RMS; int8's logits within 10%.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kubeshard_shard.config import EngineConfig
from kubeshard_shard.models import quant

from tests.support.cpu_kernels import (F32_SHAPES, INT4_GROUPS, INT8_GROUPS, check_float32_kernel,
                                       check_int4_kernel, check_int8_kernel, exact_q4, kernels_for_level)
from tests.support.engine import (build_engine, greedy, prefill_logits, random_prompts, relative_rms,
                                  run_to_completion)


@pytest.fixture
def k(cpu_kernels):
    return cpu_kernels


@pytest.mark.parametrize("m,n,kdim", F32_SHAPES)
def test_float32_kernel_matches_linear(k, m, n, kdim):
    check_float32_kernel(k, m, n, kdim)


def test_float32_kernels_name_a_bad_argument(k):
    x, w = torch.randn(60, 8), torch.randn(5, 8)
    for gemm, name in ((k.gemm_f32, "gemm_f32"), (k.gemm_f32_packed, "gemm_f32_packed")):
        with pytest.raises(RuntimeError, match=f"{name} x: expected a contiguous 2-d CPU tensor of Float"):
            gemm(x.double(), w, None)
        with pytest.raises(RuntimeError, match=f"{name} weight: expected a contiguous 2-d CPU tensor of Float"):
            gemm(x, w.t(), None)
        with pytest.raises(RuntimeError, match=f"{name}: x has 7 columns, the weight 8"):
            gemm(x[:, :7].contiguous(), w, None)
        with pytest.raises(RuntimeError, match=f"{name}: bias must be 5 contiguous floats"):
            gemm(x, w, torch.randn(4))


@pytest.mark.parametrize("march", ["x86-64-v4", "x86-64-v3-vnni", "x86-64-v3", "x86-64"])
def test_gemm_kernels_of_the_portable_builds_are_exact(march):
    """The kernels of the shard image's x86-64 levels (the tests above check this CPU's
    own build): AVX-512 without VNNI, AVX2 with and without it, and plain x86-64 are each
    other code in the float32 and integer tiles, checked here too (the v4 level with VNNI
    is what the tests above check on a CPU with AVX-512 VNNI)."""
    built = kernels_for_level(march)
    for m, n, kdim in F32_SHAPES:
        check_float32_kernel(built, m, n, kdim)
    for args in INT8_GROUPS:  # the integer tiles differ by build too (AVX2 and VNNI, or scalar)
        check_int8_kernel(built, *args)
    for args in INT4_GROUPS:
        check_int4_kernel(built, *args)


@pytest.mark.parametrize("m,n,kdim,group", INT8_GROUPS)
def test_int8_kernel_is_exact_integer_arithmetic(k, m, n, kdim, group):
    check_int8_kernel(k, m, n, kdim, group)


@pytest.mark.parametrize("m,n,kdim,group,symmetric", INT4_GROUPS)
def test_int4_kernel_is_exact_integer_arithmetic(k, m, n, kdim, group, symmetric):
    check_int4_kernel(k, m, n, kdim, group, symmetric)


@pytest.mark.parametrize("m", [1, 3])
def test_integer_kernels_give_the_same_bits_on_any_number_of_threads(k, m):
    """The row kernels hand W's rows to the threads in chunks that a free thread may take
    from another's share (csrc/parallel.h): every row is still computed once, and which
    thread computes it does not change its bits. 999 rows: 32 chunks, the last partial
    and odd (the int4 kernel's pairs end in a row alone)."""
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 576, generator=gen), torch.randn(999, 576, generator=gen) * 0.05
    q8 = quant.quantize_q8(w, 32)
    q4 = quant.quantize_q4(w, 32, False)
    products = {"int8": lambda: k.gemm_q8(x, *q8, 32, None), "int4": lambda: k.gemm_q4(x, *q4, 32, None)}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {name: gemm() for name, gemm in products.items()}
        torch.set_num_threads(2)
        for _ in range(20):
            for name, gemm in products.items():
                assert torch.equal(gemm(), alone[name]), name
    finally:
        torch.set_num_threads(threads)
    assert (alone["int4"].double() - exact_q4(x, *q4, 32)).abs().max() <= 1e-5 * alone["int4"].abs().max()


def test_dequantized_rows_equal_the_reference_bit_for_bit(k):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(50, 128, generator=gen)
    ids = torch.tensor([49, 0, 7, 7], dtype=torch.long)
    qw, s = quant.quantize_q8(w, 32)
    assert torch.equal(k.dequant_rows(qw, s, None, 32, ids), quant.dequantize(quant.Format("q8", 32), qw, s, None)[ids])
    for group in (32, 64):
        p, s, mn = quant.quantize_q4(w, group)
        want = quant.dequantize(quant.Format("q4", group), p, s, mn)[ids]
        assert torch.equal(k.dequant_rows(p, s, mn, group, ids), want)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantizers_give_ggufs_bytes(qtype):
    """gguf-py's quantizers are bit-exact with ggml's reference ones; ours match them on
    float weights and on dequantized ones, whose re-quantization gives the file's bytes
    back (what ``--quantize gguf`` relies on; an all-zero Q4_0 block is the exception:
    its scale comes back as +0 for -0, in gguf-py too)."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 1.0, (48, 1))).astype(np.float32)
    w[3, :32] = 0.0  # an all-zero block
    kind = GGMLQuantizationType[qtype]
    first = quants.quantize(w, kind)
    again = quants.dequantize(first, kind).reshape(48, 256)
    fmt = quant.GGUF_FORMATS[qtype]
    for values in (w, again):
        ref = quants.quantize(values, kind).reshape(48, 256 // 32, -1)
        t = torch.from_numpy(np.ascontiguousarray(values))
        if fmt.kind == "q8":
            q, d = quant.quantize_q8(t, 32)
            mine = np.concatenate([d.numpy().view(np.uint8).reshape(48, -1, 2), q.numpy().view(np.uint8).reshape(48, -1, 32)], -1)
        else:
            p, d, m = quant.quantize_q4(t, 32, fmt.symmetric)
            fields = [d.numpy().view(np.uint8).reshape(48, -1, 2)]
            if not fmt.symmetric:
                fields.append(m.numpy().view(np.uint8).reshape(48, -1, 2))
            mine = np.concatenate(fields + [p.numpy().reshape(48, -1, 16)], -1)
        assert np.array_equal(mine, ref)
    mismatched = (quants.quantize(again, kind) != first).reshape(48, 8, -1).any(-1)
    assert mismatched.sum() <= (1 if qtype == "Q4_0" else 0) and not mismatched[:3].any()


def _layer_io(served, prompt) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of every GEMM layer while the model runs ``prompt``'s prefill."""
    from kubeshard_shard.models.layers import UsesGemm

    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name):
        def hook(module, args, out):
            seen.setdefault(name, (args[0].detach().clone(), out.detach().clone()))
        return hook

    model = served.engine.runner.model
    hooks = [module.register_forward_hook(keep(name)) for name, module in model.named_modules()
             if isinstance(module, UsesGemm)]
    try:
        prefill_logits(served, prompt)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("method,layer_tol,logit_tol", [("int8", 0.02, 0.10), ("int4", 0.12, None)])
def test_quantized_layers_and_logits_stay_close_to_float32(demo_model, method, layer_tol, logit_tol):
    """Each packed layer, fed the float model's input, against the float layer's output;
    then the logits end to end. On the random demo model int4's per-weight error (about
    8% of a Gaussian weight's RMS, group 32) compounds through the layers, so its end-to-end
    figure is measured on the real model instead (test_default_model_agreement below)."""
    model = demo_model("llama")
    prompt = random_prompts(1, 1000, (40, 40), seed=9)[0]
    ref, q = build_engine(model), build_engine(model, quantize=method)
    assert q.rank_parameter_bytes[0] < ref.rank_parameter_bytes[0]
    float_io = _layer_io(ref, prompt)
    packed = {name: m for name, m in q.engine.runner.model.named_modules() if hasattr(m, "weight_scale")}
    assert set(packed) == set(float_io)  # every projection and the LM head
    with torch.inference_mode():
        for name, module in packed.items():
            x, want = float_io[name]
            assert relative_rms(want, module(x)) <= layer_tol, name
    if logit_tol is not None:
        assert relative_rms(prefill_logits(ref, prompt), prefill_logits(q, prompt)) <= logit_tol


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_engine_serves_batches_and_tied_embeddings(demo_model, arch):
    """int4 on a batch of mixed prompts through chunked prefill (the dequantized path)
    and decode (the kernels); qwen2's demo model ties its embedding to the LM head, whose
    packed table then serves the embedding lookups too."""
    model = demo_model(arch)
    served = build_engine(model, quantize="int4", max_batch_tokens=64)
    m = served.engine.runner.model
    if served.model_config.tie_word_embeddings:
        assert m.model.embed_tokens.weight is m.lm_head.weight and m.lm_head.weight.dtype == torch.int8
    prompts = random_prompts(6, 1000, (1, 90), seed=4)
    outs = run_to_completion(served.engine, [(p, greedy(8)) for p in prompts])
    assert all(len(o) == 8 for o in outs)
    # the same requests one at a time give the same tokens (batching changes nothing)
    for p, o in zip(prompts[:2], outs[:2]):
        [alone] = run_to_completion(served.engine, [(p, greedy(8))])
        assert [t.token_id for t in alone] == [t.token_id for t in o]


@pytest.mark.parametrize("overrides,named", [
    ({"quantize": "int8", "dtype": "bfloat16"}, "--quantize int8"),
    ({"quantize": "int4", "cpu_kernels": False}, "--quantize int4"),
    ({"quantize": "gguf"}, "--quantize gguf"),
])
def test_quantize_that_cannot_serve_fails_at_start(demo_model, overrides, named):
    with pytest.raises(ValueError, match=named):
        build_engine(demo_model("llama"), **overrides)


def test_quantize_with_zero3_fails_at_start():
    from kubeshard_shard.config import Placement
    from kubeshard_shard.distributed.strategy import make_strategy
    from kubeshard_shard.server.factory import check_quantize_strategy

    config = EngineConfig(model_dir=".", model_id="m", quantize="int8")
    with pytest.raises(ValueError, match="--quantize int8 is not available with --strategy zero3"):
        check_quantize_strategy(config, make_strategy(Placement(strategy="zero3", shards=2)))
    check_quantize_strategy(config, make_strategy(Placement(strategy="tensor", shards=2)))


def test_bad_quantize_values_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--quantize must be one of"):
        EngineConfig(model_dir=tmp_path, model_id="m", quantize="int3")
    with pytest.raises(ValueError, match="--quantize-group-size"):
        EngineConfig(model_dir=tmp_path, model_id="m", quantize="int4", quantize_group_size=48)
    config = EngineConfig(model_dir=tmp_path, model_id="m", quantize="int4", quantize_group_size=64)
    flags = config.to_flags()
    assert flags[flags.index("--quantize") + 1] == "int4" and flags[flags.index("--quantize-group-size") + 1] == "64"
