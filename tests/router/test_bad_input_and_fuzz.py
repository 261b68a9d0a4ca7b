"""Bad input against the real stack (router CLI + a real leader): each gets the right 4xx
naming the problem; then schemathesis fuzzes /openapi.json and no request gets a 5xx."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.support.servers import start_router, start_shard

KEY, LIMITED = "sk-test-key-0001", "sk-test-limited-0002"


@pytest.fixture(scope="module")
def shard(demo_model):
    proc = start_shard(demo_model(), "--max-input-tokens", "96", "--max-total-tokens", "160")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def guarded(shard, tmp_path_factory, redis_server):
    redis_server.start()
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(f"keys:\n  - name: tester\n    key: {KEY}\n  - name: limited\n    key: {LIMITED}\n    rpm: 1\n")
    router = start_router("--backend", f"tiny={shard.address}", "--redis-url", redis_server.url,
                          "--api-keys-file", str(keys))
    yield router
    router.stop()


def post(router, path: str, key: str = KEY, **kwargs) -> httpx.Response:
    return httpx.post(router.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60, **kwargs)


def test_malformed_json(guarded):
    r = httpx.post(guarded.url + "/generate", content=b'{"inputs": "x",', timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    o = httpx.post(guarded.url + "/v1/chat/completions", content=b"[", timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert o.status_code == 400 and "not valid JSON" in o.json()["error"]["message"]


def test_wrong_types(guarded):
    r = post(guarded, "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": "ten"}})
    assert r.status_code == 422 and "`parameters.max_new_tokens`" in r.json()["error"]
    o = post(guarded, "/v1/completions", json={"prompt": "x", "temperature": [1]})
    assert o.status_code == 422 and "`temperature`" in o.json()["error"]["message"]
    m = post(guarded, "/v1/chat/completions", json={"messages": "hello"})
    assert m.status_code == 422 and "`messages`" in m.json()["error"]["message"]


def test_unknown_model(guarded):
    r = post(guarded, "/v1/completions", json={"model": "gpt-5", "prompt": "x"})
    assert r.status_code == 404 and "`gpt-5` does not exist" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "model"
    t = post(guarded, "/models/gpt-5/generate", json={"inputs": "x"})
    assert t.status_code == 404 and "`tiny`" in t.json()["error"]  # says what is served


def test_max_new_tokens_over_the_limit(guarded):
    r = post(guarded, "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 500}})
    assert r.status_code == 422
    assert "`inputs` tokens + `max_new_tokens` must be <= 160" in r.json()["error"]
    o = post(guarded, "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 500})
    assert o.status_code == 422 and o.json()["error"]["param"] == "max_tokens"


def test_empty_messages_and_prompts(guarded):
    r = post(guarded, "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 422 and "`messages` must not be empty" in r.json()["error"]["message"]
    t = post(guarded, "/generate", json={"inputs": ""})
    assert t.status_code == 422 and "`inputs` cannot be empty" in t.json()["error"]


def test_prompt_over_the_input_limit(guarded):
    r = post(guarded, "/generate", json={"inputs": "word " * 200})
    assert r.status_code == 422 and "`inputs` must have less than 96 tokens. Given: " in r.json()["error"]
    o = post(guarded, "/v1/completions", json={"prompt": "word " * 200})
    assert o.status_code == 422 and "`prompt` must have less than 96 tokens" in o.json()["error"]["message"]


def test_invalid_api_key(guarded):
    r = post(guarded, "/generate", key="sk-wrong", json={"inputs": "x"})
    assert r.status_code == 401 and r.json()["error"] == "invalid API key"
    o = httpx.post(guarded.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert o.status_code == 401 and "missing API key" in o.json()["error"]["message"]


def test_rate_limit_exceeded(guarded):
    body = {"inputs": "x", "parameters": {"max_new_tokens": 1}}
    assert post(guarded, "/generate", key=LIMITED, json=body).status_code == 200
    r = post(guarded, "/generate", key=LIMITED, json=body)
    assert r.status_code == 429 and "Rate limit exceeded for this API key: 1 requests per minute" in r.json()["error"]
    assert int(r.headers["Retry-After"]) >= 1
    assert "sk-test" not in guarded.output  # keys never reach the log


@pytest.fixture(scope="module")
def open_router(shard):
    router = start_router("--backend", f"tiny={shard.address}", "--no-redis", "--max-queue-per-model", "64")
    yield router
    router.stop()


def test_fuzzing_the_openapi_spec_finds_no_5xx(open_router):
    schema = schemathesis.openapi.from_url(open_router.url + "/openapi.json")
    failures: list[str] = []
    statuses: dict[int, int] = {}
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                nonlocal calls
                calls += 1
                response = case.call(base_url=open_router.url, timeout=60)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.formatted_path} {case.body!r:.300} -> "
                                    f"{response.status_code} {response.text[:300]}")
            try:
                run()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # nothing to break in a parameterless GET
    assert calls > 300
    assert statuses.get(200, 0) > 50, statuses  # it reached the engine, not only validation
    print(f"fuzzing: {calls} calls, statuses {sorted(statuses.items())}")
    assert failures == []
    assert "Traceback" not in open_router.output
