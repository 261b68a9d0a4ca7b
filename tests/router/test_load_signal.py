"""The router's autoscaling signal: tokens in flight, tokens/s and the last request,
published to Redis (with its index of live routers) and served to the metrics server
directly, behind a token, by GET /internal/load; and the activator's scale-up calls."""

from __future__ import annotations

import json
import time

import httpx
import redis

from kubeshard_router.load import LoadTracker
from tests.support.router_harness import RecordingHook
from tests.support.http import post_in_thread
from e2e.waiting import wait_for as wait_until
from tests.support.waiting import wait_for


def test_tracker_counts_reserved_tokens_and_the_output_rate():
    t = LoadTracker(window_s=10)
    assert t.snapshot(now=100.0).tokens_in_flight == 0
    t.arrived()
    t.begin(3 + 30)  # a 3-token prompt that may generate 30
    t.begin(5 + 10)
    t.produced(4)    # 4 streamed tokens free 4 reserved ones
    snap = t.snapshot(now=102.0)
    assert snap.tokens_in_flight == 33 + 15 - 4
    assert abs(snap.last_request_at - time.time()) < 5
    t.produced(6)
    t.end(33 - 6)    # the first request ends having streamed 6 of its tokens
    t.end(15 - 4)
    later = t.snapshot(now=104.0)
    assert later.tokens_in_flight == 0
    assert later.tokens_per_second == 10 / 4  # 10 tokens between the samples at 100 s and 104 s
    # Past the window the old samples go, and with no new tokens the rate falls to 0.
    assert t.snapshot(now=120.0).tokens_per_second < later.tokens_per_second
    assert t.snapshot(now=131.0).tokens_per_second == 0.0


def _hash(r: redis.Redis, key: str) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in r.hgetall(key).items()}


def test_tokens_in_flight_and_last_request_reach_redis_and_the_index(make_router, redis_url):
    h = make_router(redis_url=redis_url, counters_interval_s=0.1, counters_ttl_s=5, router_id="router-a")
    h.stub().behaviour.token_delay_s = 0.1
    r = redis.Redis.from_url(redis_url)
    key = "kubeshard:stub:r1:load:router-a"
    results: list = []
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 30}}
    before = time.time()
    threads = [post_in_thread(h.url + "/generate_stream", body, results) for _ in range(2)]
    busy = wait_until(lambda: (v := _hash(r, key)) and v["in_flight"] == 2 and v["tokens_in_flight"] > 0 and v,
                      10, interval=0.02, what="both streams in the router's load hash")
    # each request reserved its prompt (the stub tokenizes "hi" to a few tokens) and 30 new
    assert 2 * 30 < busy["tokens_in_flight"] <= 2 * (30 + 8)
    assert busy["last_request_at"] >= before - 1
    members = r.zrange("kubeshard:stub:routers", 0, -1, withscores=True)
    # Scored by when the entry expires; the newest names the revision the replica serves
    # (an entry from before its Info, "unknown", may linger until it expires).
    assert members[-1][0].decode() == "r1|router-a" and members[-1][1] > time.time()
    assert {m.decode() for m, _ in members} <= {"r1|router-a", "unknown|router-a"}
    for t in threads:
        t.join()
    idle = wait_until(lambda: (v := _hash(r, key)) and v["in_flight"] == 0 and v["tokens_in_flight"] == 0 and v,
                      10, interval=0.02, what="an idle load hash")
    assert idle["tokens_per_second"] > 0  # 60 tokens in the last few seconds
    h.close()  # a router that shuts down takes its entry out of the index too
    assert wait_for(lambda: not r.exists(key) and r.zcard("kubeshard:stub:routers") == 0)


def test_internal_load_answers_only_with_the_token(make_router, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    h = make_router(load_token_file=str(token))
    h.stub().behaviour.token_delay_s = 0.1
    url = h.url + "/internal/load"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    results: list = []
    t = post_in_thread(h.url + "/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 20}},
                       results)

    def loaded():
        r = httpx.get(url, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        models = {m["model"]: m for m in r.json()["models"]}
        return models["stub"] if models["stub"]["in_flight"] == 1 else None

    stub = wait_until(loaded, 10, interval=0.02, what="the stream in /internal/load")
    assert stub["queued"] == 0 and stub["tokens_in_flight"] > 0 and stub["last_request_at"] > 0
    t.join()
    assert results[0][0] == 200
    # Without a token file the route does not exist.
    other = make_router()
    assert httpx.get(other.url + "/internal/load", headers={"Authorization": "Bearer s3cret"}).status_code == 404


def test_the_activator_asks_again_while_requests_wait(make_router):
    hook = RecordingHook()
    h = make_router(hook=hook, activation_timeout_s=30)
    h.state.activator.hook_interval_s = 0.3
    h.stub().behaviour.serving = False
    h.wait_ready("stub", 0)
    results: list = []
    t = post_in_thread(h.url + "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}, results)
    # The first call may have been lost to a concurrent scale-down: the held request asks again.
    assert wait_for(lambda: len(hook.calls) >= 3, timeout=10)
    h.stub().behaviour.serving = True
    t.join()
    assert results[0][0] == 200 and json.loads(results[0][1])["generated_text"]
    calls = len(hook.calls)
    time.sleep(0.8)
    assert len(hook.calls) == calls  # nothing is held any more: no more calls


def test_a_request_held_too_long_says_the_model_is_starting_and_how_long_it_waited(make_router):
    h = make_router(activation_timeout_s=0.5)
    h.stub().behaviour.serving = False
    h.wait_ready("stub", 0)
    r = httpx.post(h.url + "/generate", json={"inputs": "hi"})
    assert r.status_code == 503
    message = r.json()["error"]
    assert "is starting" in message and "within 0.5s" in message and "waited 0." in message, message


def _gauge(url: str, name: str, model: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    (sample,) = [s for s in families[name].samples if s.labels == {"model": model}]
    return sample.value


def test_token_gauges_on_metrics_follow_the_streams(make_router):
    """kubeshard_router_tokens_in_flight and _tokens_per_second on a live /metrics (what a
    prometheus-adapter rule reads for tokensInFlight and tokens/s)."""
    h = make_router()
    h.stub().behaviour.token_delay_s = 0.05
    assert _gauge(h.url, "kubeshard_router_tokens_in_flight", "stub") == 0
    assert _gauge(h.url, "kubeshard_router_tokens_per_second", "stub") == 0
    results: list = []
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 40}}
    threads = [post_in_thread(h.url + "/generate_stream", body, results) for _ in range(2)]
    busy = wait_until(lambda: (v := _gauge(h.url, "kubeshard_router_tokens_in_flight", "stub")) > 2 * 20 and v,
                      10, interval=0.02, what="both streams' tokens in the gauge")
    assert busy <= 2 * (40 + 8)  # prompts ("hi": a few tokens) plus 40 reserved each, less what streamed
    for t in threads:
        t.join()
    assert [r[0] for r in results] == [200, 200]
    assert _gauge(h.url, "kubeshard_router_tokens_in_flight", "stub") == 0
    assert _gauge(h.url, "kubeshard_router_tokens_per_second", "stub") > 0  # 80 tokens in the last seconds


def test_requests_beyond_the_hold_bound_get_429_with_retry_after(make_router):
    """A model at zero holds at most --max-queue-per-model requests; the next one is told
    to come back (429, Retry-After), and the held ones are served once a replica is ready."""
    h = make_router(max_queue_per_model=2, activation_timeout_s=30)
    h.stub().behaviour.serving = False
    h.wait_ready("stub", 0)
    held: list = []
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 3}}
    threads = [post_in_thread(h.url + "/generate", body, held) for _ in range(2)]
    assert wait_for(lambda: h.state.activator.held("stub") == 2, timeout=10)
    r = httpx.post(h.url + "/generate", json=body, timeout=10)
    assert r.status_code == 429 and r.headers["Retry-After"] == "5"
    assert r.json()["error_type"] == "overloaded"
    assert "is starting and 2 requests already wait" in r.json()["error"], r.text
    chat = httpx.post(h.url + "/v1/chat/completions", timeout=10,
                      json={"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 429 and chat.headers["Retry-After"] == "5"
    h.stub().behaviour.serving = True
    for t in threads:
        t.join()
    assert [s for s, _, _ in held] == [200, 200]
    assert h.state.activator.held("stub") == 0


def test_the_readmes_prometheus_adapter_rules_serve_the_four_metrics_from_live_gauges(make_router):
    """The README's prometheus-adapter option names the metrics server's four metrics, and
    every router series its rules read is on a live /metrics."""
    import re
    from pathlib import Path

    import yaml
    from prometheus_client.parser import text_string_to_metric_families

    from kubeshard_operator.naming import CUSTOM_METRICS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL) if "seriesQuery" in b]
    rules = yaml.safe_load(block)["rules"]["custom"]
    assert [r["name"]["as"] for r in rules] == list(CUSTOM_METRICS)
    h = make_router()
    assert httpx.post(h.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
    live = {s.name for f in text_string_to_metric_families(httpx.get(h.url + "/metrics").text) for s in f.samples
            if s.labels.get("model") == "stub"}
    for rule in rules:
        used = set(re.findall(r"kubeshard_router_\w+", rule["seriesQuery"] + rule["metricsQuery"]))
        assert used and used <= live, (rule["name"], used - live)
        assert rule["resources"]["overrides"]["model"] == {"group": "kubeshard.io", "resource": "inferenceservice"}


def test_a_model_the_router_no_longer_serves_leaves_redis_at_the_next_publish(redis_url):
    """The operator deletes a deleted model's keys; a router that published once more before
    noticing takes its entry out itself (not 15 s later at expiry), and a revision it moved
    off goes the same way."""
    import asyncio

    from kubeshard_router.counters import LoadPublisher, ModelLoad

    serving = [ModelLoad("gone-soon", "r1", in_flight=1), ModelLoad("stays", "r1")]
    r = redis.Redis.from_url(redis_url)

    async def run() -> None:
        publisher = LoadPublisher(redis_url, "router-b", lambda: list(serving), interval_s=1.0, ttl_s=30)
        try:
            await publisher.publish_once()
            assert r.exists("kubeshard:gone-soon:r1:load:router-b", "kubeshard:stays:r1:load:router-b") == 2
            assert r.zrange("kubeshard:gone-soon:routers", 0, -1) == [b"r1|router-b"]
            serving[:] = [ModelLoad("stays", "r2")]
            await publisher.publish_once()
            assert not r.exists("kubeshard:gone-soon:r1:load:router-b")
            assert r.zcard("kubeshard:gone-soon:routers") == 0
            assert not r.exists("kubeshard:stays:r1:load:router-b") and r.exists("kubeshard:stays:r2:load:router-b")
            assert r.zrange("kubeshard:stays:routers", 0, -1) == [b"r2|router-b"]
            serving.clear()  # nothing served at all: the last entries go too
            await publisher.publish_once()
            assert r.keys("kubeshard:stays:*") == [] and r.keys("kubeshard:gone-soon:*") == []
        finally:
            await publisher.close()

    asyncio.run(run())
