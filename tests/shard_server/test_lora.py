"""Multi-LoRA: two PEFT adapters (random weights, fixed seeds) served at once, in one batch
with base-model requests, give per request the tokens transformers+peft gives for that
adapter; an adapter's prompt never reuses the base model's cached KV blocks; loading
at run time, unloading, and the errors that name the adapter."""

from __future__ import annotations

import pytest
import torch

from kubeshard_shard.engine.request import RequestError, make_sampling_params
from kubeshard_shard.models.lora import AdapterError, load_adapter
from tests.support.engine import build_engine, random_prompts, run_to_completion
from tests.support.lora import ALL, make_adapter, peft_greedy


@pytest.fixture(scope="module")
def adapters(demo_model, tmp_path_factory):
    model_dir = demo_model("llama")
    root = tmp_path_factory.mktemp("lora")
    a = make_adapter(model_dir, root / "a", seed=1, r=8, targets=ALL, alpha=16)
    b = make_adapter(model_dir, root / "b", seed=2, r=4, targets=["q_proj", "v_proj", "down_proj"], alpha=8)
    return model_dir, {"a": a, "b": b}


def greedy(n, adapter=None):
    return make_sampling_params(max_new_tokens=n, ignore_eos=True, adapter=adapter)


def test_two_adapters_in_one_batch_match_transformers_and_peft(adapters):
    model_dir, paths = adapters
    served = build_engine(model_dir, lora_adapters=tuple(paths.items()))
    prompts = random_prompts(5, 1000, (20, 40), seed=8)
    shared = prompts[0]
    # the base model computes (and caches) the shared prompt first
    run_to_completion(served.engine, [(shared, greedy(4))])
    plan = [(shared, "a"), (prompts[1], None), (prompts[2], "b"), (prompts[3], "a"), (prompts[4], "b"),
            (shared, None), (shared, "b")]
    outs = run_to_completion(served.engine, [(p, greedy(12, name)) for p, name in plan])
    got = [[o.token_id for o in out] for out in outs]
    want = [peft_greedy(model_dir, paths[name] if name else None, p, 12) for p, name in plan]
    assert got == want
    assert len({tuple(got[0]), tuple(got[5]), tuple(got[6])}) == 3  # the adapters change the output


def test_runtime_load_unload_and_errors(adapters):
    model_dir, paths = adapters
    served = build_engine(model_dir, enable_lora=True, max_loras=2)
    engine = served.engine
    lora = engine.runner.lora
    with pytest.raises(RequestError, match="adapter 'a' is not loaded"):
        engine.check_adapter("a")
    lora.add(load_adapter("a", paths["a"], engine.runner.model, torch.float32, torch.device("cpu"), 64))
    prompt = random_prompts(1, 1000, (16, 16), seed=3)[0]
    [out] = run_to_completion(engine, [(prompt, greedy(6, "a"))])
    assert [o.token_id for o in out] == peft_greedy(model_dir, paths["a"], prompt, 6)
    with pytest.raises(FileExistsError):
        lora.add(load_adapter("a", paths["a"], engine.runner.model, torch.float32, torch.device("cpu"), 64))
    with pytest.raises(AdapterError, match="rank 8 is outside"):
        load_adapter("big", paths["a"], engine.runner.model, torch.float32, torch.device("cpu"), 4)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter("x", str(model_dir), engine.runner.model, torch.float32, torch.device("cpu"), 64)
    key = engine.add_request("busy", prompt, greedy(50, "a"))
    engine.step()
    with pytest.raises(RuntimeError, match="serving 1 sequences"):
        lora.remove("a")
    engine.abort(key)
    lora.remove("a")
    assert lora.names() == [] and engine.stats().max_loras == 2


def test_no_lora_server_refuses_adapters(demo_model):
    served = build_engine(demo_model("llama"))
    with pytest.raises(RequestError, match="serves no LoRA adapters"):
        served.engine.check_adapter("a")


def peft_delta(adapter: str, layer: int, modules: list[str], x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """x's LoRA delta for one of our (possibly fused) layers, from the PEFT file itself."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    parts = []
    for module, size in zip(modules, sizes):
        key = next((k for k in tensors if f"layers.{layer}." in k and f".{module}.lora_A" in k), None)
        if key is None:
            parts.append(torch.zeros(x.shape[0], size))
            continue
        a, b = tensors[key], tensors[key.replace("lora_A", "lora_B")]
        parts.append(x @ a.t() @ b.t() * scale)
    return torch.cat(parts, 1)


def test_stacked_buffers_give_each_row_its_adapter_on_a_quantized_base(adapters):
    """The masked path (rows of several adapters in any order, a loaded adapter between
    them that no row uses, an unloaded slot), the single-adapter slice path and the
    base-only path, on int8 base layers: each row gets exactly its adapter's delta."""
    model_dir, paths = adapters
    served = build_engine(model_dir, quantize="int8", enable_lora=True, max_loras=4)
    lora, model = served.engine.runner.lora, served.engine.runner.model
    for name, path in (("a", paths["a"]), ("gone", paths["b"]), ("b", paths["b"]), ("c", paths["a"])):
        lora.add(load_adapter(name, path, model, torch.float32, torch.device("cpu"), 64))
    lora.remove("gone")  # slot 2 empty: a=1, b=3, c=4 (the same weights as a)
    assert (lora.slot_of, sorted(lora.packs["layers.1.self_attn.qkv_proj"].present)) == ({"a": 1, "b": 3, "c": 4},
                                                                                          [1, 3, 4])
    layers = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "self_attn.o_proj": ["o_proj"],
              "mlp.gate_up_proj": ["gate_proj", "up_proj"], "mlp.down_proj": ["down_proj"]}
    source = {1: paths["a"], 3: paths["b"], 4: paths["a"]}
    g = torch.Generator().manual_seed(5)
    patterns = [[0, 1, 3, 1, 0, 3, 3, 1],  # three adapters' rows interleaved: the mask
                [0, 0, 3, 3, 3, 0],         # one adapter, one run: the slice path
                [1, 1, 0, 1],               # one adapter, two runs: the mask over one slot
                [4, 1, 4]]                  # a and c: two slots holding the same weights
    for attr, modules in layers.items():
        layer = model.model.layers[1].get_submodule(attr)
        assert layer.base.weight.dtype == torch.int8 and type(layer.base.gemm).__name__ == "QuantGemm"
        moved_rows = 0
        for slots in patterns:
            x = torch.randn(len(slots), layer.in_features, generator=g)
            with torch.inference_mode():
                lora.begin_step(None)
                base = layer(x).clone()
                lora.begin_step(slots)
                got = layer(x.clone())
            want = base.clone()
            for row, slot in enumerate(slots):
                if slot:
                    want[row] += peft_delta(source[slot], 1, modules, x[row:row + 1], layer.sizes)[0]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{attr} rows {slots}")
            moved_rows += int(((got - base).abs().amax(1) > 1e-3).sum())
        assert moved_rows >= 6, attr  # the deltas are there (b adapts q, v and down only)
    lora.begin_step(None)


def test_runtime_loads_need_a_root_and_stay_under_it(tmp_path):
    """The shard's own check of a runtime load's folder (LoadAdapter): refused without
    --lora-root, and a path that leaves the root, by '..' or by a symbolic link, is
    refused naming the root."""
    from kubeshard_shard.models.lora import AdapterRegistry, RuntimeLoadsOff

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(RuntimeLoadsOff, match="--lora-root DIR"):
        AdapterRegistry(2, 8).runtime_source(str(root / "a"))
    registry = AdapterRegistry(2, 8, runtime_root=root)
    assert registry.runtime_source(str(root / "a")) == str((root / "a").resolve())
    for path in (root / ".." / "outside", root / "link", outside):
        with pytest.raises(AdapterError, match="is outside this server's --lora-root"):
            registry.runtime_source(str(path))
