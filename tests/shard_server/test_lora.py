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
