"""Cache, load counters and rate limits against a real redis-server (and its outages)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import redis

from kubeshard_router.counters import read_load
from tests.support.http import post_in_thread
from tests.support.metrics import metric
from tests.support.sse import sse
from tests.support.waiting import wait_for

GREEDY = {"inputs": "hello world", "parameters": {"max_new_tokens": 6, "details": True}}


def cache_keys(url: str) -> list[str]:
    return sorted(k.decode() for k in redis.Redis.from_url(url).scan_iter(match="kubeshard:*:cache:*"))


def test_repeated_greedy_request_is_served_from_redis(make_router, redis_url):
    h = make_router(redis_url=redis_url)
    first = httpx.post(h.url + "/generate", json=GREEDY)
    assert first.headers["x-kubeshard-cache"] == "miss"
    assert wait_for(lambda: len(cache_keys(redis_url)) == 1)
    second = httpx.post(h.url + "/generate", json=GREEDY)
    assert second.headers["x-kubeshard-cache"] == "hit" and second.headers["x-compute-type"] == "cache"
    assert second.json() == first.json()
    assert h.stub().counters.generate_calls == 1  # the engine saw it once
    assert metric(h, "kubeshard_router_cache_hits_total") == 1
    assert metric(h, "kubeshard_router_cache_misses_total") == 1
    assert 'kubeshard_router_e2e_request_latency_seconds_count{cache="hit",model="stub"} 1.0' in \
        httpx.get(h.url + "/metrics").text
    ttl = redis.Redis.from_url(redis_url).ttl(cache_keys(redis_url)[0])
    assert 0 < ttl <= 3600


def test_a_hit_replays_the_same_sse_events(make_router, redis_url):
    h = make_router(redis_url=redis_url)
    body = {"inputs": "hello world", "parameters": {"max_new_tokens": 5, "details": True, "top_n_tokens": 2}}
    miss = httpx.post(h.url + "/generate_stream", json=body)
    assert wait_for(lambda: len(cache_keys(redis_url)) == 1)
    hit = httpx.post(h.url + "/generate_stream", json=body)
    assert hit.text == miss.text and len(sse(hit.text)) == 5
    assert (miss.headers["x-kubeshard-cache"], hit.headers["x-kubeshard-cache"]) == ("miss", "hit")
    assert h.stub().counters.generate_calls == 1
    # The entry holds engine tokens, so other APIs asking the same thing reuse it.
    comp = httpx.post(h.url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 5,
                                                        "temperature": 0, "logprobs": 2})
    assert comp.headers["x-kubeshard-cache"] == "hit"
    assert comp.json()["choices"][0]["text"] == sse(miss.text)[-1]["generated_text"]


def test_sampled_requests_without_seed_are_never_cached(make_router, redis_url):
    h = make_router(redis_url=redis_url)
    sampled = {"inputs": "hello world", "parameters": {"max_new_tokens": 4, "do_sample": True}}
    for _ in range(2):
        r = httpx.post(h.url + "/generate", json=sampled)
        assert r.headers["x-kubeshard-cache"] == "off"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}  # OpenAI default: sampling
    for _ in range(2):
        httpx.post(h.url + "/v1/chat/completions", json=chat)
    assert h.stub().counters.generate_calls == 4
    assert cache_keys(redis_url) == []
    seeded = {"inputs": "hello world", "parameters": {"max_new_tokens": 4, "do_sample": True, "seed": 11}}
    one = httpx.post(h.url + "/generate", json=seeded)
    assert wait_for(lambda: len(cache_keys(redis_url)) == 1)
    two = httpx.post(h.url + "/generate", json=seeded)
    assert two.headers["x-kubeshard-cache"] == "hit" and two.json() == one.json()


def test_keys_of_two_models_never_mix(make_router, redis_url):
    h = make_router(models={"alpha": 1, "beta": 1}, redis_url=redis_url)
    body = {"inputs": "same prompt", "parameters": {"max_new_tokens": 3}}
    a = httpx.post(h.url + "/models/alpha/generate", json=body)
    assert wait_for(lambda: len(cache_keys(redis_url)) == 1)
    b = httpx.post(h.url + "/models/beta/generate", json=body)
    assert (a.headers["x-kubeshard-cache"], b.headers["x-kubeshard-cache"]) == ("miss", "miss")
    assert wait_for(lambda: len(cache_keys(redis_url)) == 2)
    keys = cache_keys(redis_url)
    assert keys[0].startswith("kubeshard:alpha:r1:cache:") and keys[1].startswith("kubeshard:beta:r1:cache:")
    assert h.stub("alpha").counters.generate_calls == 1 and h.stub("beta").counters.generate_calls == 1
    assert httpx.post(h.url + "/models/beta/generate", json=body).headers["x-kubeshard-cache"] == "hit"
    assert h.stub("alpha").counters.generate_calls == 1


def test_cache_control_bypass(make_router, redis_url):
    h = make_router(redis_url=redis_url)
    httpx.post(h.url + "/generate", json=GREEDY)
    assert wait_for(lambda: len(cache_keys(redis_url)) == 1)
    r = httpx.post(h.url + "/generate", json=GREEDY, headers={"Cache-Control": "no-cache"})
    assert r.headers["x-kubeshard-cache"] == "bypass" and h.stub().counters.generate_calls == 2
    redis.Redis.from_url(redis_url).flushall()
    httpx.post(h.url + "/generate", json=GREEDY, headers={"Cache-Control": "no-store"})
    httpx.post(h.url + "/generate", json=GREEDY, headers={"Cache-Control": "no-store"})
    assert cache_keys(redis_url) == [] and h.stub().counters.generate_calls == 4


def test_redis_outage_is_invisible_to_clients_and_caching_resumes(make_router, redis_server, redis_url, caplog):
    h = make_router(redis_url=redis_url, redis_retry_s=0.2)
    assert httpx.post(h.url + "/generate", json=GREEDY).status_code == 200
    assert wait_for(lambda: len(cache_keys(redis_url)) == 1)
    caplog.set_level(logging.WARNING, logger="kubeshard.router.redis")
    redis_server.stop()
    for i in range(6):
        r = httpx.post(h.url + "/generate", json=GREEDY)
        assert r.status_code == 200 and r.headers["x-kubeshard-cache"] == "miss"
        s = httpx.post(h.url + "/generate_stream", json={"inputs": f"x{i}", "parameters": {"max_new_tokens": 2}})
        assert s.status_code == 200 and sse(s.text)[-1]["generated_text"]
    assert metric(h, "kubeshard_router_redis_errors_total") >= 1
    assert "kubeshard_router_redis_up 0.0" in httpx.get(h.url + "/metrics").text
    outage_lines = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(outage_lines) == 1  # one line per outage, not per request
    redis_server.start()
    # Caching resumes: a request stores again, and the next one hits.
    assert wait_for(lambda: (httpx.post(h.url + "/generate", json=GREEDY).headers["x-kubeshard-cache"] == "hit"))
    assert "kubeshard_router_redis_up 1.0" in httpx.get(h.url + "/metrics").text


def test_load_counters_are_published_per_router_and_summed(make_router, redis_url):
    h1 = make_router(redis_url=redis_url, counters_interval_s=0.1, counters_ttl_s=5, router_id="router-a")
    h2 = make_router(redis_url=redis_url, counters_interval_s=0.1, counters_ttl_s=5, router_id="router-b")
    for h in (h1, h2):
        h.stub().behaviour.token_delay_s = 0.1
    results: list = []
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 30}}
    threads = [post_in_thread(h1.url + "/generate_stream", body, results),
               post_in_thread(h2.url + "/generate_stream", body, results)]
    r = redis.Redis.from_url(redis_url)

    def total() -> tuple[int, int]:
        return asyncio.run(_read(redis_url))
    assert wait_for(lambda: total() == (2, 0))
    assert sorted(k.decode() for k in r.scan_iter(match="kubeshard:stub:r1:load:*")) == [
        "kubeshard:stub:r1:load:router-a", "kubeshard:stub:r1:load:router-b"]
    assert 0 < r.ttl("kubeshard:stub:r1:load:router-a") <= 5  # a dead router's counts expire
    for t in threads:
        t.join()
    assert wait_for(lambda: total() == (0, 0))
    h2.close()  # a router that shuts down removes its counts at once
    assert wait_for(lambda: not r.exists("kubeshard:stub:r1:load:router-b"))


async def _read(url: str) -> tuple[int, int]:
    import redis.asyncio as aioredis
    client = aioredis.Redis.from_url(url)
    try:
        return await read_load(client, "stub", "r1")
    finally:
        await client.aclose()


def test_requests_per_minute_limit_is_shared_by_router_replicas(make_router, redis_url):
    h1 = make_router(redis_url=redis_url, rate_limit_rpm=2)
    h2 = make_router(redis_url=redis_url, rate_limit_rpm=2)
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 1}}
    assert httpx.post(h1.url + "/generate", json=body).status_code == 200
    assert httpx.post(h2.url + "/generate", json=body).status_code == 200
    r = httpx.post(h1.url + "/generate", json=body)
    assert r.status_code == 429 and r.json()["error_type"] == "rate_limit"
    assert "2 requests per minute" in r.json()["error"] and 1 <= int(r.headers["retry-after"]) <= 30
    oa = httpx.post(h2.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert oa.status_code == 429 and oa.json()["error"]["code"] == "rate_limit_exceeded"


def test_token_limit_reserves_then_refunds_unused_tokens(make_router, redis_url):
    h = make_router(redis_url=redis_url, rate_limit_tpm=100)
    h.stub().behaviour.eos_after = 1  # stops after 2 tokens whatever max_new_tokens says
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 60}}  # reserves 3 + 60 = 63
    assert httpx.post(h.url + "/generate", json=body).status_code == 200
    # 63 reserved, 58 refunded in the background: another 63 fit only thanks to the refund.
    assert wait_for(lambda: httpx.post(h.url + "/generate", json=body).status_code == 200, timeout=5)
    huge = httpx.post(h.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 300}})
    assert huge.status_code == 422  # over the model's total-token limit first
    big = httpx.post(h.url + "/generate", json={"inputs": "hi " * 30, "parameters": {"max_new_tokens": 90}})
    assert big.status_code == 429 and "more than the key's 100 tokens per minute" in big.json()["error"]


def test_rate_limits_still_hold_while_redis_is_down(make_router, redis_server, redis_url):
    h = make_router(redis_url=redis_url, rate_limit_rpm=3)
    redis_server.stop()
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 1}}
    codes = [httpx.post(h.url + "/generate", json=body).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429]
