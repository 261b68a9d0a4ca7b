"""The router in front of the real engine: existing clients unchanged against
``kubeshard serve``, curl, the same greedy text on every endpoint, the Redis cache, and
replicas killed before and during a stream."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess

import httpx
import openai
import pytest
import text_generation
import transformers

from tests.support.servers import start_router, start_serve, start_shard
from tests.support.metrics import metric
from tests.support.sse import sse, sse_events
from tests.support.waiting import wait_for

LIMITS = ["--max-input-tokens", "96", "--max-total-tokens", "160"]
NO_CACHE = {"Cache-Control": "no-cache"}


@pytest.fixture(scope="module")
def serve(demo_model, redis_server):
    redis_server.start()
    proc = start_serve(demo_model(), "--redis-url", redis_server.url, "--num-threads", "1",
                       "--kv-cache-memory", "64MiB", *LIMITS)
    yield proc
    proc.stop()


def test_text_generation_client_sync(serve):
    client = text_generation.Client(serve.url, timeout=60)
    out = client.generate("Why is the sky blue?", max_new_tokens=12, decoder_input_details=True)
    assert out.details.generated_tokens == len(out.details.tokens) <= 12
    assert out.details.finish_reason.value in ("length", "eos_token")
    assert len(out.details.prefill) >= 5 and out.details.prefill[0].logprob is None
    assert out.generated_text == "".join(t.text for t in out.details.tokens if not t.special)
    events = list(client.generate_stream("Why is the sky blue?", max_new_tokens=12))
    assert events[-1].details is not None and events[-1].details.generated_tokens == len(events)
    assert events[-1].generated_text == out.generated_text  # greedy: the same text either way
    assert all(e.generated_text is None for e in events[:-1])
    top = client.generate("Hello", max_new_tokens=3, top_n_tokens=2)
    assert all(len(alts) == 2 for alts in top.details.top_tokens)
    with pytest.raises(text_generation.errors.ValidationError, match="`temperature` must be strictly positive"):
        client.generate("Hello", temperature=0)  # the client's own check; the router says the same


def test_text_generation_client_async(serve):
    async def go() -> tuple:
        client = text_generation.AsyncClient(serve.url, timeout=60)
        whole = await client.generate("Tell me a story", max_new_tokens=10, seed=5, do_sample=True)
        parts = [r async for r in client.generate_stream("Tell me a story", max_new_tokens=10, seed=5,
                                                         do_sample=True)]
        return whole, parts

    whole, parts = asyncio.run(go())
    assert whole.details.seed == 5
    assert parts[-1].details.seed == 5
    assert "".join(p.token.text for p in parts if not p.token.special) == whole.generated_text


def test_openai_client_completions_and_chat(serve):
    client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert comp.choices[0].finish_reason in ("length", "stop")
    assert comp.usage.completion_tokens <= 8 and comp.usage.prompt_tokens > 0
    streamed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].usage.completion_tokens == comp.usage.completion_tokens
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=1)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=8, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.UnprocessableEntityError, match="`messages` must not be empty"):
        client.chat.completions.create(model=model, messages=[])


def test_curl_streams_sse(serve):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    out = subprocess.run([curl, "-sS", "-N", serve.url + "/generate_stream", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 6}})],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = sse(out)
    assert len(events) >= 1 and events[-1]["generated_text"] is not None
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    # And without -H: `curl -d` sends a form content type; the body is still read as JSON.
    plain = subprocess.run([curl, "-sS", "-N", serve.url + "/v1/completions", "-d",
                            json.dumps({"prompt": "Hello", "max_tokens": 4, "stream": True})],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert sse(plain)[-1] == "[DONE]"


def test_same_greedy_text_on_all_four_endpoints(serve, demo_model):
    n = 24
    prompt = "The capital of France is"
    messages = [{"role": "user", "content": prompt}]
    templated = transformers.AutoTokenizer.from_pretrained(str(demo_model())).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    with httpx.Client(base_url=serve.url, timeout=60, headers=NO_CACHE) as c:
        gen = c.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": n}}).json()
        stream = sse(c.post("/generate_stream", json={"inputs": prompt, "parameters": {"max_new_tokens": n}}).text)
        comp = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0}).json()
        chat = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": n, "temperature": 0}).json()
        via_template = c.post("/generate", json={"inputs": templated, "add_special_tokens": False,
                                                 "parameters": {"max_new_tokens": n, "details": True}}).json()
    text = gen["generated_text"]
    assert text and stream[-1]["generated_text"] == text
    assert comp["choices"][0]["text"] == text
    assert chat["choices"][0]["message"]["content"] == via_template["generated_text"]
    assert chat["usage"]["completion_tokens"] == via_template["details"]["generated_tokens"]


def test_repeated_greedy_request_is_a_cache_hit(serve):
    body = {"inputs": "A cached question", "parameters": {"max_new_tokens": 16, "details": True}}
    first = httpx.post(serve.url + "/generate", json=body, timeout=60, headers=NO_CACHE)
    hits_before = metric(serve, "kubeshard_router_cache_hits_total")
    assert wait_for(lambda: httpx.post(serve.url + "/generate", json=body, timeout=60)
                    .headers["x-kubeshard-cache"] == "hit")
    again = httpx.post(serve.url + "/generate", json=body, timeout=60)
    assert again.headers["x-kubeshard-cache"] == "hit" and again.json() == first.json()
    assert metric(serve, "kubeshard_router_cache_hits_total") >= hits_before + 2
    sampled = {"inputs": "A cached question", "parameters": {"max_new_tokens": 4, "do_sample": True}}
    assert httpx.post(serve.url + "/generate", json=sampled, timeout=60).headers["x-kubeshard-cache"] == "off"


def test_redis_stopped_mid_run_then_back(serve, redis_server):
    body = {"inputs": "Redis goes away", "parameters": {"max_new_tokens": 8}}
    redis_server.stop()
    try:
        for _ in range(4):
            r = httpx.post(serve.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200 and r.headers["x-kubeshard-cache"] == "miss"
            s = httpx.post(serve.url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True})
            assert s.status_code == 200 and sse(s.text)[-1] == "[DONE]"
    finally:
        redis_server.start()
    assert wait_for(lambda: httpx.post(serve.url + "/generate", json=body, timeout=60)
                    .headers["x-kubeshard-cache"] == "hit", timeout=20)


@pytest.fixture
def two_replicas(demo_model):
    shards = [start_shard(demo_model(), "--max-input-tokens", "96", "--max-total-tokens", "4096")
              for _ in range(2)]
    # Slow health probes: the router learns of a dead replica from a failed request, not a probe.
    router = start_router("--backend", "tiny=" + ",".join(s.address for s in shards), "--no-redis",
                          "--health-interval", "60", "--max-retries", "2")
    yield router, shards
    router.stop()
    for s in shards:
        s.stop()


def test_replica_killed_before_first_token_retries_elsewhere(two_replicas):
    router, shards = two_replicas
    # The router is ready once one replica is; a replica killed before its first probe
    # answered never enters the ring, and nothing would be retried (this failed CI twice).
    assert wait_for(lambda: metric(router, "kubeshard_router_ready_replicas") == 2, 30)
    shards[0].kill()
    # Each prompt lands on the replica its prefix hashes to; the first one that lands on
    # the dead replica is retried on the live one (which then takes every later request),
    # so prompts keep coming, up to 32, until a retry was seen.
    for i in range(32):
        body = {"inputs": f"Prompt number {i} " * 6, "parameters": {"max_new_tokens": 4}}
        r = httpx.post(router.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        s = httpx.post(router.url + "/generate_stream", json=body, timeout=60)
        assert s.status_code == 200 and sse(s.text)[-1]["generated_text"] is not None
        if i >= 7 and metric(router, "kubeshard_router_retries_total") >= 1:
            break
    assert metric(router, "kubeshard_router_retries_total") >= 1
    assert metric(router, 'kubeshard_router_backend_errors_total{code="UNAVAILABLE"') >= 1


def test_replica_killed_mid_stream_gives_an_error_event(demo_model):
    shard = start_shard(demo_model(), "--max-input-tokens", "96", "--max-total-tokens", "4096")
    router = start_router("--backend", f"tiny={shard.address}", "--no-redis", "--activation-timeout", "2")
    try:
        events = []
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", router.url + "/generate_stream",
                          json={"inputs": "Go on forever", "parameters": {"max_new_tokens": 3900}}) as r:
                for event in sse_events(r.iter_lines()):
                    events.append(event)
                    if len(events) == 5:
                        shard.kill()
        assert len(events) > 5 and "token" in events[0]
        assert events[-1]["error_type"] == "incomplete_generation" and "tokens" in events[-1]["error"]
        assert all(e.get("generated_text") is None for e in events[:-1])
        # With its only replica gone, a new request is held for activation, then refused clearly.
        late = httpx.post(router.url + "/generate", json={"inputs": "x"}, timeout=60)
        assert late.status_code == 503 and "has no ready replica" in late.json()["error"]
    finally:
        router.stop()
        shard.stop(signal.SIGKILL)
