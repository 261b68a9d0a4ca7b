"""Multi-LoRA through the router (real engine, tiny demo model, PEFT adapters made here):
`model: "<adapter>"` (OpenAI) and `adapter_id` (TGI) give transformers+peft's tokens,
/v1/models lists the adapters, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
work at run time, the cache key and prefix affinity include the adapter, and the engine
reports vllm:lora_requests_info."""

from __future__ import annotations

import httpx
import openai
import pytest

from kubeshard_router.balancer import Balancer
from kubeshard_router.engine_request import EngineRequest
from tests.support.servers import start_serve
from tests.support.lora import ALL, make_adapter, peft_greedy

NO_CACHE = {"Cache-Control": "no-cache"}


@pytest.fixture(scope="module")
def setup(demo_model, tmp_path_factory):
    model_dir = demo_model("llama")
    root = tmp_path_factory.mktemp("lora-api")
    paths = {"alpha": make_adapter(model_dir, root / "alpha", seed=1, r=8, targets=ALL, alpha=16),
             "beta": make_adapter(model_dir, root / "beta", seed=2, r=4, targets=["q_proj", "v_proj"], alpha=8)}
    proc = start_serve(model_dir, "--num-threads", "1", "--kv-cache-memory", "64MiB", "--enable-lora",
                       "--lora-adapter", f"alpha={paths['alpha']}")
    yield proc, model_dir, paths
    proc.stop()


def test_adapters_by_model_name_and_adapter_id_match_peft(setup):
    proc, model_dir, paths = setup
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", default_headers=NO_CACHE)
    cards = {m.id: m for m in client.models.list().data}
    base = next(m for m in cards if m != "alpha")
    assert cards["alpha"].model_extra["parent"] == base
    prompt = [5, 17, 99, 230, 411, 12, 8, 77, 301, 64, 29, 3, 18, 400, 512, 6, 44]
    want = peft_greedy(model_dir, paths["alpha"], prompt, 10)
    out = client.completions.create(model="alpha", prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    base_out = client.completions.create(model=base, prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True})
    assert out.model == base or out.model == "alpha"
    tgi = httpx.post(proc.url + "/generate", headers=NO_CACHE, timeout=60, json={
        "inputs": "hello world", "parameters": {"max_new_tokens": 6, "adapter_id": "alpha", "details": True}})
    assert tgi.status_code == 200
    tgi_base = httpx.post(proc.url + "/generate", headers=NO_CACHE, timeout=60, json={
        "inputs": "hello world", "parameters": {"max_new_tokens": 6, "details": True}}).json()
    assert [t["id"] for t in tgi.json()["details"]["tokens"]] != [t["id"] for t in tgi_base["details"]["tokens"]]
    tokenizer = _tokenizer(model_dir)
    assert [tokenizer.token_to_id(t) for t in out.choices[0].logprobs.tokens] == want or \
        out.choices[0].text == tokenizer.decode(want)
    assert out.choices[0].text != base_out.choices[0].text
    bad = httpx.post(proc.url + "/generate", timeout=60, json={"inputs": "x", "parameters": {"adapter_id": "nope"}})
    assert bad.status_code == 422 and "`adapter_id` 'nope' is not an adapter" in bad.json()["error"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def _tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_load_and_unload_at_run_time(setup):
    proc, model_dir, paths = setup
    url = proc.url + "/v1"
    r = httpx.post(url + "/load_lora_adapter", timeout=60, json={"lora_name": "beta", "lora_path": paths["beta"]})
    assert r.status_code == 200 and "beta" in r.text
    ids = [m["id"] for m in httpx.get(url + "/models").json()["data"]]
    assert "beta" in ids and "alpha" in ids
    again = httpx.post(url + "/load_lora_adapter", timeout=60, json={"lora_name": "beta", "lora_path": paths["beta"]})
    assert again.status_code == 422 and "already loaded" in again.text
    missing = httpx.post(url + "/load_lora_adapter", timeout=60, json={"lora_name": "gamma", "lora_path": "/nope"})
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "lora_path"
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 100, 200, 300]
    out = httpx.post(url + "/completions", headers=NO_CACHE, timeout=60, json={
        "model": "beta", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
    assert out["choices"][0]["text"] == _tokenizer(model_dir).decode(peft_greedy(model_dir, paths["beta"], prompt, 8))
    tgi = httpx.post(proc.url + "/generate", timeout=60, json={"inputs": "hi", "parameters": {
        "max_new_tokens": 3, "adapter_id": "beta"}})
    assert tgi.status_code == 200
    r = httpx.post(url + "/unload_lora_adapter", timeout=60, json={"lora_name": "beta"})
    assert r.status_code == 200
    assert "beta" not in [m["id"] for m in httpx.get(url + "/models").json()["data"]]


def test_cache_key_and_prefix_affinity_include_the_adapter():
    base = EngineRequest(input_ids=list(range(64)), max_new_tokens=4)
    lora = EngineRequest(input_ids=list(range(64)), max_new_tokens=4, adapter="alpha")
    assert base.fingerprint() != lora.fingerprint()
    b = Balancer()
    assert b.prefix_key(base.input_ids, 16) != b.prefix_key(lora.input_ids, 16, "alpha")
    assert b.prefix_key(base.input_ids, 16, "alpha") == b.prefix_key(lora.input_ids, 16, "alpha")
    assert lora.to_proto("r").adapter == "alpha" and base.to_proto("r").adapter == ""


def test_engine_reports_lora_requests_info():
    from kubeshard_shard.engine.llm_engine import EngineStats
    from kubeshard_shard.server.metrics import _StatsCollector

    stats = EngineStats(running_adapters=["alpha"], waiting_adapters=["beta", "gamma"], max_loras=8)
    families = {f.name: f for f in _StatsCollector("demo", lambda: stats).collect()}
    [sample] = families["vllm:lora_requests_info"].samples
    assert sample.labels == {"running_lora_adapters": "alpha", "waiting_lora_adapters": "beta,gamma",
                             "max_lora": "8"}
