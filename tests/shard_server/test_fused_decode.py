"""The fused decode step (engine/fused_decode.py) against the modules it stands in for:
every step it serves is run both ways from the same pool, and the logits and the K/V
written must be equal bit for bit; and the models and steps it must not serve go
through the modules."""

from __future__ import annotations

import pytest
import torch

from kubeshard_shard import compute
from kubeshard_shard.config import SpeculativeConfig
from kubeshard_shard.engine import fused_decode
from kubeshard_shard.hardware import CpuFeatures
from kubeshard_shard.models import quant
from kubeshard_shard.models.layers import Linear

from tests.support.engine import build_engine, greedy, random_prompts, run_to_completion


class Twin:
    """Wraps a runner: each step the fused step serves also runs through the modules from
    a copy of the pool taken before it, and both results are kept for comparison."""

    def __init__(self, runner) -> None:
        self.runner, self.run = runner, runner.run
        self.compared, self.rows, self.mismatches, self.adapter_steps = 0, set(), [], 0
        runner.run = self

    def pool(self):
        cache = self.runner.cache
        return cache.data.clone(), None if cache.scales is None else cache.scales.clone()

    def restore(self, saved) -> None:
        cache = self.runner.cache
        cache.data.copy_(saved[0])
        if saved[1] is not None:
            cache.scales.copy_(saved[1])

    def __call__(self, inputs):
        fused = self.runner.fused
        rows = len(inputs.input_ids)
        if fused is None or not fused.serves(rows, inputs.num_decode, len(inputs.prefill_chunks),
                                             adapters=inputs.lora_slots is not None):
            # decode-only steps with adapter rows that the fused step left to the modules
            self.adapter_steps += inputs.lora_slots is not None and not inputs.prefill_chunks
            return self.run(inputs)
        before = self.pool()
        self.runner.fused = None
        try:
            want = self.run(inputs)
        finally:
            self.runner.fused = fused
        want_pool = self.pool()
        self.restore(before)
        got = self.run(inputs)
        got_pool = self.pool()
        self.compared += 1
        self.rows.add(rows)
        same_pool = torch.equal(got_pool[0], want_pool[0]) and (
            got_pool[1] is None or torch.equal(got_pool[1], want_pool[1]))
        if not (torch.equal(got, want) and same_pool):
            self.mismatches.append((rows, (got - want).abs().max().item(), same_pool))
        return got


CASES = {
    "llama": ("llama", {}),
    "qwen2-biases-tied": ("qwen2", {}),
    "mistral-bfloat16-pool": ("mistral", {"kv_cache_dtype": "bfloat16"}),
    "llama-int8": ("llama", {"quantize": "int8"}),
    "llama-int4-int8-pool": ("llama", {"quantize": "int4", "kv_cache_dtype": "int8"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_fused_step_equals_the_modules_bit_for_bit(demo_model, case):
    arch, overrides = CASES[case]
    model = demo_model(arch)
    served = build_engine(model, **overrides)
    runner = served.engine.runner
    assert runner.fused is not None, f"{case}: the model should qualify for the fused step"
    twin = Twin(runner)
    prompts = random_prompts(5, served.model_config.vocab_size, (3, 40), seed=3)
    outs = run_to_completion(served.engine, [(p, greedy(12 + 3 * i)) for i, p in enumerate(prompts)])
    assert all(len(o) == 12 + 3 * i for i, o in enumerate(outs))
    assert twin.compared >= 20 and max(twin.rows) > 1, (twin.compared, twin.rows)
    assert not twin.mismatches, twin.mismatches


def test_a_batch_at_the_row_limit_goes_through_the_fused_step_as_the_modules_do(demo_model):
    """As many decode rows as our float32 kernel takes on this CPU (48 on AVX2, 24
    elsewhere) in one step: every GEMM chunks its rows the widest ways the kernel has."""
    served = build_engine(demo_model("llama"))
    limit = served.engine.runner.fused.max_rows
    twin = Twin(served.engine.runner)
    prompts = random_prompts(limit, served.model_config.vocab_size, (3, 12), seed=5)
    run_to_completion(served.engine, [(p, greedy(4)) for p in prompts])
    assert max(twin.rows) == limit, twin.rows
    assert not twin.mismatches, twin.mismatches


def test_speculative_verification_rows_go_through_the_fused_step(demo_model):
    """With n-gram proposals a step's verification rows are decode rows; the fused step
    serves them too, and each is what the modules compute."""
    model = demo_model("llama")
    served = build_engine(model, speculative=SpeculativeConfig("ngram", 3, ngram_min=1, ngram_max=3))
    twin = Twin(served.engine.runner)
    prompt = [7, 8, 9, 10, 11] * 6
    run_to_completion(served.engine, [(prompt, greedy(30)), (prompt[:17], greedy(20))])
    assert twin.compared and max(twin.rows) > 2, (twin.compared, twin.rows)
    assert not twin.mismatches, twin.mismatches


def test_a_wrong_position_is_seen(demo_model):
    """The comparison can fail: the fused step fed positions one on gives other logits."""
    served = build_engine(demo_model("llama"))
    runner = served.engine.runner
    fused, real = runner.fused, runner.fused.run
    runner.fused.run = lambda ids, positions, meta, lora_slots: real(ids, positions + 1, meta, lora_slots)
    twin = Twin(runner)
    run_to_completion(served.engine, [([5, 6, 7, 8], greedy(4))])
    assert fused is runner.fused and twin.compared and len(twin.mismatches) == twin.compared


@pytest.mark.parametrize("quantize, limit", [("none", compute.small_rows(CpuFeatures.detect())),
                                             ("int8", quant.MAX_KERNEL_ROWS),
                                             ("int4", quant.MAX_KERNEL_ROWS)])
def test_the_step_takes_as_many_rows_as_every_gemm_does_on_our_kernels(demo_model, quantize, limit):
    fused = build_engine(demo_model("llama"), quantize=quantize).engine.runner.fused
    assert fused.max_rows == limit
    assert fused.serves(limit, limit, 0) and fused.serves(1, 1, 0)
    assert not fused.serves(limit + 1, limit + 1, 0)
    assert not fused.serves(3, 2, 0) and not fused.serves(3, 3, 1) and not fused.serves(0, 0, 0)


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_with_lora_on_every_decode_step_goes_through_the_fused_step(demo_model, tmp_path, quantize):
    """A LoRA engine's decode steps run fused whatever adapters their rows use (none, one,
    several side by side, and after an adapter is loaded and another unloaded between
    steps), bit for bit the modules' (LoraLinear's, which call the same kernel); and each
    request's tokens are those of an engine serving it alone (the base ones a LoRA-less
    engine's)."""
    from kubeshard_shard.models.lora import load_adapter
    from tests.support.lora import ALL, make_adapter

    model_dir = demo_model("llama")
    a = make_adapter(model_dir, tmp_path / "a", seed=1, r=8, targets=ALL, alpha=16)
    b = make_adapter(model_dir, tmp_path / "b", seed=2, r=4, targets=["q_proj", "v_proj", "down_proj"], alpha=8)
    served = build_engine(model_dir, quantize=quantize, lora_adapters=(("a", a), ("b", b)), max_loras=3)
    runner = served.engine.runner
    assert runner.fused is not None and runner.fused.lora is runner.lora
    twin = Twin(runner)
    prompts = random_prompts(6, served.model_config.vocab_size, (5, 20), seed=11)
    plan = [(prompts[0], greedy(10)), (prompts[1], greedy(12, adapter="a")), (prompts[2], greedy(8, adapter="b")),
            (prompts[3], greedy(9, adapter="a")), (prompts[4], greedy(11))]
    mixed = run_to_completion(served.engine, plan)
    assert twin.compared >= 9 and max(twin.rows) > 2 and not twin.adapter_steps, (twin.compared, twin.adapter_steps)
    assert not twin.mismatches, twin.mismatches
    # the registry swaps its packs on a load and an unload; the next step's kernel holds the new ones
    lora = runner.lora
    lora.add(load_adapter("c", b, runner.model, torch.float32, torch.device("cpu"), 64))
    lora.remove("a")
    compared = twin.compared
    swapped = run_to_completion(served.engine, [(prompts[5], greedy(8, adapter="c")), (prompts[2], greedy(8))])
    assert twin.compared - compared >= 7 and not twin.mismatches, (twin.compared, twin.mismatches)
    assert runner.fused._packs is lora.packs
    tokens = [[o.token_id for o in out] for out in mixed + swapped]

    def alone(adapter, request):
        adapters = () if adapter is None else ((adapter, {"a": a, "b": b, "c": b}[adapter]),)
        engine = build_engine(model_dir, quantize=quantize, lora_adapters=adapters).engine
        return [o.token_id for o in run_to_completion(engine, [request])[0]]

    want = [alone(None, plan[0]), alone("a", plan[1]), alone("b", plan[2]), alone("a", plan[3]), alone(None, plan[4]),
            alone("c", (prompts[5], greedy(8, adapter="c"))), alone(None, (prompts[2], greedy(8)))]
    assert tokens == want
    assert tokens[5] == alone("b", (prompts[5], greedy(8, adapter="b")))  # c holds b's weights
    assert alone(None, (prompts[1], greedy(12))) != tokens[1]  # the adapter changes the tokens


@pytest.mark.parametrize("overrides", [{"cpu_gemm": "torch"}, {"cpu_kernels": False}],
                         ids=["cpu-gemm-torch", "no-cpu-kernels"])
def test_what_the_modules_must_serve_gets_no_fused_step(demo_model, overrides):
    served = build_engine(demo_model("llama"), **overrides)
    assert served.engine.runner.fused is None
    # and the engine still decodes
    out = run_to_completion(served.engine, [([5, 6, 7], greedy(3))])
    assert len(out[0]) == 3


def test_a_swapped_layer_or_a_hook_gets_no_fused_step(demo_model):
    """A sharding pass swaps in subclasses (tensor parallel) or hooks the layers (ZeRO-3):
    their forward does more than the kernels, so the model does not qualify."""
    served = build_engine(demo_model("llama"))
    runner = served.engine.runner
    model, cache = runner.model, runner.cache
    assert fused_decode.build(model, cache, runner.decode_kernel, None) is not None

    class ParallelLinear(Linear):
        pass

    mlp = model.model.layers[0].mlp
    original = mlp.down_proj
    mlp.down_proj = ParallelLinear(original.in_features, original.out_features)
    try:
        assert fused_decode.build(model, cache, runner.decode_kernel, None) is None
    finally:
        mlp.down_proj = original
    handle = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda module, args: None)
    try:
        assert fused_decode.build(model, cache, runner.decode_kernel, None) is None
    finally:
        handle.remove()
    assert fused_decode.build(model, cache, runner.decode_kernel, None) is not None


def test_the_kernel_checks_its_parts_when_built_and_its_inputs_each_step(cpu_kernels):
    """The step runs on raw pointers into its own buffers, so what it is given is checked
    where it is given, naming what is wrong: a GEMM whose shape does not fit the model's
    widths, a cache of the wrong shape, a slot or position outside the pool or the table."""
    built = cpu_kernels
    H, heads, kv_heads, D, inter, slots = 64, 4, 2, 16, 96, 32
    cos_sin = torch.randn(2, 40, D)
    fused = built.FusedDecode(cos_sin, torch.ones(H), 1e-6, heads, kv_heads, D, 16, D ** -0.5)

    def gemm(n, k):
        return fused.add_gemm(0, torch.randn(n, k) * 0.05, None, None, 0, None)

    qkv, o, gate_up, down = gemm((heads + 2 * kv_heads) * D, H), gemm(H, heads * D), gemm(2 * inter, H), gemm(H, inter)
    cache = [torch.zeros(slots, kv_heads, D) for _ in range(2)]
    with pytest.raises(RuntimeError, match="GEMMs' shapes do not fit"):
        fused.add_layer(torch.ones(H), 1e-6, torch.ones(H), 1e-6, o, qkv, gate_up, down, *cache, None, None)
    with pytest.raises(RuntimeError, match=r"caches \[slots, kv heads, head_dim\]"):
        fused.add_layer(torch.ones(H), 1e-6, torch.ones(H), 1e-6, qkv, o, gate_up, down,
                        torch.zeros(slots, heads, D), cache[1], None, None)
    with pytest.raises(RuntimeError, match="an int4 weight needs its minimums"):
        fused.add_gemm(2, torch.zeros(H, H // 2, dtype=torch.uint8), torch.ones(H, 2, dtype=torch.half), None, 32,
                       None)
    with pytest.raises(RuntimeError, match="must be multiples of 32"):
        fused.add_gemm(1, torch.zeros(H, H, dtype=torch.int8), torch.ones(H, 3, dtype=torch.half), None, 48, None)
    fused.add_layer(torch.ones(H), 1e-6, torch.ones(H), 1e-6, qkv, o, gate_up, down, *cache, None, None)

    def step(position, slot):
        return fused.run(torch.randn(1, H), torch.tensor([position]), torch.tensor([slot]),
                         torch.zeros(1, 2, dtype=torch.int32), torch.tensor([position + 1], dtype=torch.int32))

    assert step(3, 3).shape == (1, H)
    assert cache[0][3].abs().sum() > 0, "the step wrote the token's key at its slot"
    with pytest.raises(RuntimeError, match="slot 32 out of range"):
        step(3, slots)
    with pytest.raises(RuntimeError, match="position 40 out of range"):
        step(40, 3)
    with pytest.raises(RuntimeError, match="hidden has 32 columns, the model 64"):
        fused.run(torch.randn(1, 32), torch.tensor([1]), torch.tensor([1]), torch.zeros(1, 2, dtype=torch.int32),
                  torch.tensor([2], dtype=torch.int32))
    # LoRA: a pack must fit its GEMM; a step's runs must lie within its rows
    with pytest.raises(RuntimeError, match="set_lora: the adapters' A has 32 inputs, the layer 64"):
        fused.set_lora(qkv, built.LoraPack(torch.randn(1, 4, 32), [torch.randn(1, 4, 8)], [0], [1]))
    with pytest.raises(RuntimeError, match="set_lora: no GEMM 9"):
        fused.set_lora(9, built.LoraPack(torch.randn(1, 4, H), [torch.randn(1, 4, H)], [0], [1]))
    fused.set_lora(o, built.LoraPack(torch.randn(1, 4, heads * D), [torch.randn(1, 4, H)], [0], [1]))
    with pytest.raises(RuntimeError, match=r"run 0 \(slot 1, rows 0..2\) must name a slot from 1 and rows in order "
                                           "within the 1 rows"):
        fused.run(torch.randn(1, H), torch.tensor([1]), torch.tensor([1]), torch.zeros(1, 2, dtype=torch.int32),
                  torch.tensor([2], dtype=torch.int32), torch.tensor([[1, 0, 2]]))
    base = fused.run(torch.ones(1, H), torch.tensor([1]), torch.tensor([1]), torch.zeros(1, 2, dtype=torch.int32),
                     torch.tensor([2], dtype=torch.int32))
    adapted = fused.run(torch.ones(1, H), torch.tensor([1]), torch.tensor([1]), torch.zeros(1, 2, dtype=torch.int32),
                        torch.tensor([2], dtype=torch.int32), torch.tensor([[1, 0, 1]]))
    assert not torch.equal(base, adapted), "the adapter's delta changed the o projection's output"
    fused.clear_lora()
    assert torch.equal(base, fused.run(torch.ones(1, H), torch.tensor([1]), torch.tensor([1]),
                                       torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                                       torch.tensor([[1, 0, 1]])))
