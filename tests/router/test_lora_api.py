"""Multi-LoRA through the router, on real shard servers (tiny demo model, PEFT adapters
made here): `model: "<adapter>"` (OpenAI) and `adapter_id` (TGI) give transformers+peft's
tokens; a request for an adapter goes only to the replicas that serve it; two adapters in
one batch through the router; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
are off unless enabled, admin-only under API keys and confined to --lora-root, and a
replica that starts after a runtime load gets the adapter too, also from a router that
did not take the load (through Redis); the cache key and prefix
affinity include the adapter; a live engine reports vllm:lora_requests_info.

Layout: replica A starts with `alpha`; replica B's port is given to the router from the
start but B starts only after `beta` was loaded at run time. Router 1 (API keys, runtime
loading on) balances over A and B; router 2 (no keys, runtime loading off) over A alone.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from kubeshard_proto import pb
from kubeshard_router.balancer import Balancer
from kubeshard_router.config import RouterConfig
from kubeshard_router.engine_request import EngineRequest
from tests.support.lora import ALL, make_adapter, peft_greedy
from tests.support.processes import start
from tests.support.ports import free_port
from tests.support.servers import start_router
from tests.support.sse import DONE, sse_events
from tests.support.shard_process import ShardProcess, start_shard
from tests.support.waiting import wait_for

NO_CACHE = {"Cache-Control": "no-cache"}
USER = {"Authorization": "Bearer sk-user", **NO_CACHE}
ADMIN = {"Authorization": "Bearer sk-ops", **NO_CACHE}
UVICORN_UP = re.compile(r"Uvicorn running on http://(?P<host>[^:\s]+):(?P<port>\d+)")
SHARD_FLAGS = ("--num-threads", "1", "--kv-cache-memory", "64MiB", "--max-loras", "4")


@dataclass
class Setup:
    model_dir: Path
    root: Path                 # --lora-root of the router and of both shards
    paths: dict[str, str]
    outside: str               # an adapter folder outside the root
    a: ShardProcess
    b_port: int
    router: object             # API keys, runtime loading on, replicas A and B
    plain: object              # no keys, runtime loading off, replica A only


def _shard(model_dir, root, *flags, port: int = 0) -> ShardProcess:
    return start_shard(model_dir, *SHARD_FLAGS, "--lora-root", str(root), *flags, port=port, metrics=True)


@pytest.fixture(scope="module")
def setup(demo_model, tmp_path_factory):
    model_dir = demo_model("llama")
    tmp = tmp_path_factory.mktemp("lora-api")
    root = tmp / "adapters"
    root.mkdir()
    paths = {"alpha": make_adapter(model_dir, root / "alpha", seed=1, r=8, targets=ALL, alpha=16),
             "beta": make_adapter(model_dir, root / "beta", seed=2, r=4, targets=["q_proj", "v_proj"], alpha=8),
             "gamma": make_adapter(model_dir, root / "gamma", seed=3, r=4, targets=["o_proj"], alpha=8)}
    outside = make_adapter(model_dir, tmp / "elsewhere", seed=4, r=4, targets=["q_proj"], alpha=8)
    os.symlink(outside, root / "link-out")
    keys = tmp / "keys.yaml"
    keys.write_text("keys:\n  - name: user\n    key: sk-user\n  - name: ops\n    key: sk-ops\n    admin: true\n")
    a = _shard(model_dir, root, "--lora-adapter", f"alpha={paths['alpha']}")
    b_port = free_port()
    # B does not answer yet, so the router never prints its ready line (it waits for every
    # static replica's Info): wait for uvicorn's line instead
    router = start("kubeshard-router", [
        sys.executable, "-m", "kubeshard_router.cli", "--host", "127.0.0.1", "--port", "0",
        "--backend", f"demo={a.address},127.0.0.1:{b_port}", "--no-redis", "--health-interval", "0.5",
        "--api-keys-file", str(keys), "--allow-runtime-lora", "--lora-root", str(root)], UVICORN_UP, timeout=120)
    assert wait_for(lambda: "replica 127.0.0.1:%s ready" % a.address.rsplit(":", 1)[1] in router.output, 60)
    plain = start_router("--backend", f"demo={a.address}", "--no-redis")
    yield Setup(model_dir, root, paths, outside, a, b_port, router, plain)
    for proc in (router, plain, a):
        proc.stop()


@pytest.fixture(scope="module")
def late_b(setup):
    """Replica B, started once `beta` was loaded at run time through router 1 (so only A
    loaded it then); the router loads it on B when B becomes ready."""
    r = httpx.post(setup.router.url + "/v1/load_lora_adapter", headers=ADMIN, timeout=60,
                   json={"lora_name": "beta", "lora_path": setup.paths["beta"]})
    assert r.status_code == 200 or "already loaded" in r.text, r.text
    b = _shard(setup.model_dir, setup.root, port=setup.b_port)
    # settled before any test uses B: the router has seen it ready and replayed `beta` on it
    # (a test that loads another adapter before that would find B without it)
    wait_for(lambda: f"replica 127.0.0.1:{setup.b_port} ready" in setup.router.output, 60)
    wait_for(lambda: _adapters_of(b) == ["beta"], timeout=60)
    yield b
    b.stop()


def _engine_metrics(shard: ShardProcess) -> str:
    return httpx.get(f"http://127.0.0.1:{shard.metrics_port}/metrics", timeout=10).text


def _refused(shard: ShardProcess) -> float:
    """Requests the shard refused (an adapter it does not have among them)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in _engine_metrics(shard).splitlines()
               if line.startswith("kubeshard_engine_requests_total") and 'outcome="invalid"' in line)


def _generated(shard: ShardProcess) -> float:
    """Tokens the shard's engine generated (counted as it generates them: exact once the
    answers are in)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in _engine_metrics(shard).splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def _adapters_of(shard: ShardProcess) -> list[str]:
    return sorted(a.name for a in shard.stub().Info(pb.InfoRequest(), timeout=10).adapters)


def _tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_adapters_by_model_name_and_adapter_id_match_peft(setup):
    client = openai.OpenAI(base_url=setup.router.url + "/v1", api_key="sk-user", default_headers=NO_CACHE)
    cards = {m.id: m for m in client.models.list().data}
    assert cards["alpha"].model_extra["parent"] == "demo"
    prompt = [5, 17, 99, 230, 411, 12, 8, 77, 301, 64, 29, 3, 18, 400, 512, 6, 44]
    want = peft_greedy(setup.model_dir, setup.paths["alpha"], prompt, 10)
    out = client.completions.create(model="alpha", prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    base_out = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True})
    assert (out.model, base_out.model) == ("alpha", "demo")  # as vLLM: the adapter answered
    tokenizer = _tokenizer(setup.model_dir)
    assert [tokenizer.token_to_id(t) for t in out.choices[0].logprobs.tokens] == want or \
        out.choices[0].text == tokenizer.decode(want)
    assert out.choices[0].text != base_out.choices[0].text
    tgi = httpx.post(setup.router.url + "/generate", headers=USER, timeout=60, json={
        "inputs": "hello world", "parameters": {"max_new_tokens": 6, "adapter_id": "alpha", "details": True}})
    assert tgi.status_code == 200
    tgi_base = httpx.post(setup.router.url + "/generate", headers=USER, timeout=60, json={
        "inputs": "hello world", "parameters": {"max_new_tokens": 6, "details": True}}).json()
    assert [t["id"] for t in tgi.json()["details"]["tokens"]] != [t["id"] for t in tgi_base["details"]["tokens"]]
    bad = httpx.post(setup.router.url + "/generate", headers=USER, timeout=60,
                     json={"inputs": "x", "parameters": {"adapter_id": "nope"}})
    assert bad.status_code == 422 and "`adapter_id` 'nope' is not an adapter" in bad.json()["error"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_runtime_loading_is_off_unless_enabled_admin_only_and_under_the_root(setup):
    load = setup.router.url + "/v1/load_lora_adapter"
    body = {"lora_name": "x", "lora_path": setup.paths["gamma"]}
    assert httpx.post(load, json=body, timeout=30).status_code == 401
    user = httpx.post(load, json=body, headers=USER, timeout=30)
    assert user.status_code == 403 and user.json()["error"]["code"] == "admin_key_required"
    assert "`user` is not an admin key" in user.json()["error"]["message"]
    for path, says in (("adapters/gamma", "must be an absolute path"),
                       ("/etc", "outside the router's --lora-root"),
                       (str(setup.root / ".." / "elsewhere"), "outside the router's --lora-root"),
                       (str(setup.root / "link-out"), "outside this server's --lora-root"),  # the shard resolves
                       ("", "is required")):
        r = httpx.post(load, json={"lora_name": "x", "lora_path": path}, headers=ADMIN, timeout=60)
        assert r.status_code == 422, (path, r.text)
        assert r.json()["error"]["param"] == "lora_path" and says in r.json()["error"]["message"], (path, r.text)
    assert "x" not in _adapters_of(setup.a)
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # router 2: not enabled
        off = httpx.post(setup.plain.url + route, json={"lora_name": "alpha", "lora_path": setup.paths["gamma"]},
                         timeout=30)
        assert off.status_code == 403 and off.json()["error"]["code"] == "runtime_lora_disabled", off.text
        assert "--allow-runtime-lora" in off.json()["error"]["message"]
    assert _adapters_of(setup.a) == ["alpha"]
    with pytest.raises(ValueError, match="lora_root: --allow-runtime-lora needs --lora-root"):
        RouterConfig(backends={"demo": ("127.0.0.1:1",)}, allow_runtime_lora=True)


def test_a_replica_that_starts_later_gets_the_runtime_adapter(setup, late_b):
    assert wait_for(lambda: _adapters_of(late_b) == ["beta"], timeout=60), _adapters_of(late_b)
    assert _adapters_of(setup.a) == ["alpha", "beta"]
    assert wait_for(lambda: httpx.get(setup.router.url + "/metrics").text.count(
        'kubeshard_router_ready_replicas{model="demo"} 2.0') == 1, timeout=30)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 100, 200, 300]
    want = _tokenizer(setup.model_dir).decode(peft_greedy(setup.model_dir, setup.paths["beta"], prompt, 8))
    for _ in range(4):  # beta is on both replicas now: every answer is beta's, wherever it ran
        out = httpx.post(setup.router.url + "/v1/completions", headers=USER, timeout=60, json={
            "model": "beta", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
        assert out["choices"][0]["text"] == want


def _concurrently(url: str, bodies: list[dict], headers: dict) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: httpx.post(url, json=b, headers=headers, timeout=120), bodies))


def test_an_adapter_request_goes_only_to_the_replicas_that_serve_it(setup, late_b):
    assert wait_for(lambda: _adapters_of(late_b) == ["beta"], timeout=60)
    url = setup.router.url + "/v1/completions"
    prompts = [[(i * 37 + j * 11) % 900 + 20 for j in range(40)] for i in range(8)]  # distinct prefixes
    before = _generated(setup.a), _generated(late_b)
    base = _concurrently(url, [{"model": "demo", "prompt": p, "max_tokens": 24, "temperature": 0,
                                "ignore_eos": True} for p in prompts], USER)
    assert [r.status_code for r in base] == [200] * 8
    after_base = _generated(setup.a), _generated(late_b)
    refused = _refused(late_b)
    assert sum(after_base) - sum(before) == 8 * 24
    assert after_base[1] > before[1] and after_base[0] > before[0]  # base requests use both replicas
    alpha = _concurrently(url, [{"model": "alpha", "prompt": p, "max_tokens": 24, "temperature": 0,
                                 "ignore_eos": True} for p in prompts], USER)
    assert [r.status_code for r in alpha] == [200] * 8, [r.text for r in alpha if r.status_code != 200]
    after = _generated(setup.a), _generated(late_b)
    assert (after[0] - after_base[0], after[1] - after_base[1]) == (8 * 24, 0)  # alpha: on A only
    assert _refused(late_b) == refused  # and never tried on B (which would refuse it, NOT_FOUND)


def _lora_info(shard: ShardProcess) -> list[str]:
    """The vllm:lora_requests_info lines of the shard's live /metrics."""
    return [line for line in _engine_metrics(shard).splitlines() if line.startswith("vllm:lora_requests_info{")]


def test_two_adapters_in_one_batch_through_the_router(setup, late_b):
    """Router 2 has replica A alone, which serves alpha and beta: streamed requests for both
    (and for the base model) run in its batch at once — A's live /metrics names both
    running adapters while every stream is open — and each gets its own adapter's tokens."""
    assert "beta" in _adapters_of(setup.a)
    prompt = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 444, 555]
    names = ("alpha", "beta", "demo", "alpha", "beta")

    def body(name: str, n: int) -> dict:
        return {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": True}

    # 1. five streams as long as the context allows (the tiny model makes 300 tokens in a
    # fraction of a second: a CI run saw them all end before /metrics was read), held open
    # after their first text until A's gauge was read; leaving a stream cancels its request
    started = threading.Barrier(len(names) + 1, timeout=120)
    read = threading.Event()

    def hold(name: str) -> None:
        with httpx.stream("POST", setup.plain.url + "/v1/completions", json=body(name, 4000), headers=NO_CACHE,
                          timeout=120) as r:
            # waits inside the loop: leaving it would close the stream (httpx closes the
            # response with its line iterator) and cancel the request
            for event in sse_events(r.iter_lines()):
                assert event != DONE, f"the {name} stream ended before the others began"
                if event["choices"][0]["text"] and not read.is_set():
                    started.wait()
                    read.wait(60)
                    return

    with ThreadPoolExecutor(len(names)) as pool:
        futures = [pool.submit(hold, name) for name in names]
        started.wait()  # every stream has its first text: all five are in A's batch
        both = wait_for(lambda: any('running_lora_adapters="alpha,beta"' in line
                                    for line in _lora_info(setup.a)), 30)
        info = _lora_info(setup.a)
        read.set()
        for f in futures:
            f.result()
    assert both and len(info) == 1 and 'max_lora="4"' in info[0], info

    # 2. the same five at once, to the end: each gets its own adapter's tokens
    n = 300

    def stream(name: str) -> str:
        text = ""
        with httpx.stream("POST", setup.plain.url + "/v1/completions", json=body(name, n), headers=NO_CACHE,
                          timeout=120) as r:
            for event in sse_events(r.iter_lines()):
                if event == DONE:
                    break
                text += event["choices"][0]["text"]
        return text

    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(stream, names))
    tokenizer = _tokenizer(setup.model_dir)
    want = {name: tokenizer.decode(peft_greedy(setup.model_dir, setup.paths.get(name), prompt, n))
            for name in ("alpha", "beta", "demo")}
    assert texts == [want[name] for name in names]
    assert len(set(want.values())) == 3


def test_unload_at_run_time(setup, late_b):
    url = setup.router.url + "/v1"
    r = httpx.post(url + "/load_lora_adapter", headers=ADMIN, timeout=60,
                   json={"lora_name": "gamma", "lora_path": setup.paths["gamma"]})
    assert r.status_code == 200 and "gamma" in r.text
    assert "gamma" in _adapters_of(setup.a) and "gamma" in _adapters_of(late_b)
    again = httpx.post(url + "/load_lora_adapter", headers=ADMIN, timeout=60,
                       json={"lora_name": "gamma", "lora_path": setup.paths["gamma"]})
    assert again.status_code == 422 and "already loaded" in again.text
    missing = httpx.post(url + "/load_lora_adapter", headers=ADMIN, timeout=60,
                         json={"lora_name": "delta", "lora_path": str(setup.root / "nope")})
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "lora_path"
    assert httpx.post(url + "/unload_lora_adapter", headers=USER, timeout=60,
                      json={"lora_name": "gamma"}).status_code == 403
    r = httpx.post(url + "/unload_lora_adapter", headers=ADMIN, timeout=60, json={"lora_name": "gamma"})
    assert r.status_code == 200
    assert "gamma" not in [m["id"] for m in httpx.get(url + "/models", headers=USER).json()["data"]]
    assert "gamma" not in _adapters_of(setup.a) and "gamma" not in _adapters_of(late_b)


def test_a_router_that_did_not_take_the_load_replays_it_from_redis(setup, late_b, redis_url):
    """Router 3 (with Redis) takes a runtime load and goes (the HPA scaled it down); router
    4, started after it over the same Redis, loads the adapter on replica C, which starts
    after that; router 4's unload reaches Redis and both replicas."""
    lora = ("--allow-runtime-lora", "--lora-root", str(setup.root), "--redis-url", redis_url,
            "--health-interval", "0.5")
    key = "kubeshard:demo:lora"
    third = start_router("--backend", f"demo={setup.a.address}", *lora)
    try:
        # its ready line means A answered Info; A is ready for loads once its probe has also
        # seen it serving (after reading Redis)
        assert wait_for(lambda: f"replica {setup.a.address} ready" in third.output, 60), third.output
        r = httpx.post(third.url + "/v1/load_lora_adapter", headers=NO_CACHE, timeout=60,
                       json={"lora_name": "gamma", "lora_path": setup.paths["gamma"]})
        assert r.status_code == 200, r.text
    finally:
        third.stop()
    assert redis.Redis.from_url(redis_url).hget(key, "gamma") == setup.paths["gamma"].encode()
    c_port = free_port()
    fourth = start("kubeshard-router", [
        sys.executable, "-m", "kubeshard_router.cli", "--host", "127.0.0.1", "--port", "0",
        "--backend", f"demo={setup.a.address},127.0.0.1:{c_port}", *lora], UVICORN_UP, timeout=120)
    c = _shard(setup.model_dir, setup.root, port=c_port)
    try:
        assert wait_for(lambda: _adapters_of(c) == ["gamma"], timeout=60), _adapters_of(c)
        assert wait_for(lambda: f"replica 127.0.0.1:{c_port}: LoRA adapter gamma loaded again" in fourth.output,
                        timeout=10), fourth.output
        assert wait_for(lambda: all(f"replica {address} ready" in fourth.output
                                    for address in (setup.a.address, f"127.0.0.1:{c_port}")), 60), fourth.output
        r = httpx.post(fourth.url + "/v1/unload_lora_adapter", headers=NO_CACHE, timeout=60,
                       json={"lora_name": "gamma"})
        assert r.status_code == 200, r.text
        # at once, or (where a Redis call of this router timed out under load just before)
        # within a probe round after its retry period
        assert wait_for(lambda: redis.Redis.from_url(redis_url).hgetall(key) == {b"": b""}, timeout=10), \
            redis.Redis.from_url(redis_url).hgetall(key)
        assert "gamma" not in _adapters_of(setup.a) and _adapters_of(c) == []
    finally:
        c.stop()
        fourth.stop()


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


def test_admin_keys_parse_and_a_bad_admin_value_names_the_field():
    from kubeshard_router.auth import ApiKeys, parse_keys_yaml

    keys = ApiKeys(parse_keys_yaml("keys:\n  - {name: u, key: a}\n  - {name: o, key: b, admin: true}\n", "f"))
    assert (keys.authenticate("Bearer a").admin, keys.authenticate("Bearer b").admin) == (False, True)
    with pytest.raises(ValueError, match=r"f keys\[0\]: `admin` must be true or false"):
        parse_keys_yaml("keys:\n  - {name: u, key: a, admin: 'yes'}\n", "f")
