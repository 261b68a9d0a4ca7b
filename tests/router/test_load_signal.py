"""The router's autoscaling signal: tokens in flight, tokens/s and the last request,
published to Redis (with its index of live routers) and served to the metrics server
directly, behind a token, by GET /internal/load; and the activator's scale-up calls."""

from __future__ import annotations

import json
import time

import httpx
import redis

from kubeshard_router.load import LoadTracker
from tests.router.test_resilience_stub import RecordingHook
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
