"""The router's ``openai`` backend kind (an OpenAI-compatible HTTP engine) in the normal
suite: the real router process and the real ``kubeshard engine-info`` beside each engine
(Info, Health, Stats), in front of FakeOpenAIEngine, a test double that speaks vLLM's and
llama.cpp's dialects and plain OpenAI (the generic ``openai`` runtime: SGLang, TGI's own
server, trtllm-serve) (tests/router/fake_openai_engine.py; the real vLLM and llama.cpp
take 15-60 min to build here and are covered by test_peer_engines.py under
``make test-engines``).

For each dialect: every TGI and OpenAI route, streamed and not, with the
``text-generation`` and ``openai`` clients, equals the engine's own answer, token ids
included; EOS and stop sequences; a client that goes away closes the engine's request;
the Redis response cache answers a repeat without the engine; the load counters
autoscaling reads; what the engine cannot give is a 422 that names it. Then retries
before the first token on another replica.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import text_generation

from tests.router.fake_openai_engine import FakeOpenAIEngine
from tests.support.servers import start_router
from tests.support.engines import start_engine_info
from tests.support.metrics import metric
from tests.support.processes import Proc
from tests.support.response_cache import assert_repeat_is_cached
from tests.support.sse import sse
from tests.support.waiting import wait_for

DIALECTS = ["vllm", "llamacpp", "openai"]
MAX_TOTAL = 256
PROMPT = "Why is the sky blue?"
NO_CACHE = {"Cache-Control": "no-cache"}
LOAD_TOKEN = "fake-engine-load-token"


@dataclass
class Served:
    dialect: str
    model: str
    fake: FakeOpenAIEngine
    info: Proc
    router: Proc

    @property
    def url(self) -> str:
        return self.router.url

    def own_answer(self, prompt, max_tokens: int) -> dict:
        """What the engine itself answers, without the router in between."""
        r = httpx.post(self.fake.url + "/v1/completions", timeout=30,
                       json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        return r.json()["choices"][0]


def serve(dialect: str, model_dir: Path, *router_flags: str, replicas: int = 1
          ) -> tuple[list[FakeOpenAIEngine], list[Proc], Proc]:
    model = f"fake-{dialect}"
    fakes = [FakeOpenAIEngine(dialect, model_dir, model).start() for _ in range(replicas)]
    infos = [start_engine_info(dialect, model_dir, model, f.url, MAX_TOTAL) for f in fakes]
    router = start_router("--backend", f"{model}={','.join(i.address for i in infos)}",
                          "--health-interval", "0.5", *router_flags)
    assert wait_for(lambda: httpx.get(router.url + "/health").status_code == 200, 30), router.output[-2000:]
    return fakes, infos, router


def stop(fakes: list[FakeOpenAIEngine], infos: list[Proc], router: Proc) -> None:
    router.stop()
    for info in infos:
        info.stop()
    for fake in fakes:
        fake.stop()


@pytest.fixture(scope="module", params=DIALECTS)
def served(request, demo_model, redis_server, tmp_path_factory):
    redis_server.start()
    token = tmp_path_factory.mktemp("load") / "token"
    token.write_text(LOAD_TOKEN)
    fakes, infos, router = serve(request.param, demo_model(), "--redis-url", redis_server.url,
                                 "--load-token-file", str(token))
    yield Served(request.param, f"fake-{request.param}", fakes[0], infos[0], router)
    stop(fakes, infos, router)


@pytest.fixture
def engine(served) -> Served:
    """The module's router and engine, the engine's steering back at its defaults."""
    f = served.fake
    f.token_delay_s, f.eos_after, f.fail_status, f.healthy, f.idle_close_s = 0.0, None, None, True, None
    return served


def test_every_route_streamed_and_not_equals_the_engines_own_answer(engine):
    own = engine.own_answer(PROMPT, 8)
    ids = engine.fake.answer(PROMPT, 8)
    expected = own["text"]
    assert expected and own["finish_reason"] == "length"
    seen = len(engine.fake.bodies)

    tgi = text_generation.Client(engine.url, timeout=30, headers=NO_CACHE)
    out = tgi.generate(PROMPT, max_new_tokens=8)
    assert out.generated_text == expected
    assert [t.id for t in out.details.tokens] == ids  # vLLM's ids, or the router's tokenization
    assert out.details.finish_reason.value == "length" and out.details.generated_tokens == 8
    logprob = -0.25 if engine.dialect == "vllm" else None  # not asked of llama.cpp's server and others
    assert all(t.logprob == logprob for t in out.details.tokens)
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=8))
    assert [e.token.id for e in events] == ids and "".join(e.token.text for e in events) == expected
    assert events[-1].generated_text == expected and events[-1].details.finish_reason.value == "length"
    assert all(e.generated_text is None for e in events[:-1])

    with httpx.Client(base_url=engine.url, timeout=30, headers=NO_CACHE) as http:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}
        assert http.post("/", json=body).json()[0]["generated_text"] == expected  # TGI's compat route
        compat = sse(http.post("/", json={**body, "stream": True}).text)
        assert compat[-1]["generated_text"] == expected
        named = http.post(f"/models/{engine.model}/generate", json=body).json()
        assert named["generated_text"] == expected
        named_stream = sse(http.post(f"/models/{engine.model}/generate_stream", json=body).text)
        assert "".join(e["token"]["text"] for e in named_stream) == expected

    oai = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", default_headers=NO_CACHE)
    assert [m.id for m in oai.models.list().data] == [engine.model]
    comp = oai.completions.create(model=engine.model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert comp.choices[0].text == expected and comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 8 and comp.usage.prompt_tokens == len(
        engine.fake.tokenizer.encode(PROMPT).ids)
    chunks = list(oai.completions.create(model=engine.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 8

    chat_messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = oai.chat.completions.create(model=engine.model, max_tokens=6, temperature=0, messages=chat_messages)
    rendered = engine.fake.bodies[-1]["prompt"]  # the router renders the chat template itself
    assert chat.choices[0].message.content == engine.own_answer(rendered, 6)["text"]
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6
    streamed = list(oai.chat.completions.create(model=engine.model, max_tokens=6, temperature=0,
                                                messages=chat_messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        chat.choices[0].message.content
    # every request through the router went to the engine (no cache), each as one streamed
    # completion (the engine's own answers above were asked for without streaming)
    mine = [b for b in engine.fake.bodies[seen:] if b.get("stream")]
    assert len(mine) == 10 and all(b["model"] == engine.model for b in mine)
    if engine.dialect == "vllm":
        assert all(isinstance(b["prompt"], list) and b["return_tokens_as_token_ids"] for b in mine)
    elif engine.dialect == "llamacpp":
        assert all(isinstance(b["prompt"], str) and b["repeat_penalty"] == 1.0 for b in mine)
    else:  # only fields of OpenAI's completions API
        assert all(isinstance(b["prompt"], str) and set(b) <= OPENAI_FIELDS for b in mine)


OPENAI_FIELDS = {"model", "prompt", "stream", "max_tokens", "temperature", "top_p", "seed",
                 "frequency_penalty", "presence_penalty"}


def test_eos_and_stop_sequences(engine):
    engine.fake.eos_after = 3
    tgi = text_generation.Client(engine.url, timeout=30, headers=NO_CACHE)
    out = tgi.generate(PROMPT, max_new_tokens=8)
    assert out.details.finish_reason.value == "eos_token"
    assert out.details.generated_tokens == 4 and out.details.tokens[-1].id == engine.fake.eos_id
    assert out.details.tokens[-1].special and out.details.tokens[-1].text == ""
    assert out.generated_text == engine.fake.text(engine.fake.answer(PROMPT, 8))
    oai = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", default_headers=NO_CACHE)
    comp = oai.completions.create(model=engine.model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert comp.choices[0].finish_reason == "stop" and comp.usage.completion_tokens == 4

    engine.fake.eos_after = None
    full = engine.own_answer(PROMPT, 8)["text"]
    stop = engine.fake.tokenizer.decode([engine.fake.answer(PROMPT, 8)[3]])  # the 4th token's word
    cut = full[:full.index(stop)]
    out = tgi.generate(PROMPT, max_new_tokens=8, stop_sequences=[stop])
    assert out.details.finish_reason.value == "stop_sequence"
    assert out.generated_text == cut + stop and out.details.generated_tokens == 4  # TGI keeps the stop
    comp = oai.completions.create(model=engine.model, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert comp.choices[0].finish_reason == "stop" and comp.choices[0].text == cut  # OpenAI trims it


def test_a_client_that_goes_away_closes_the_engines_request(engine):
    engine.fake.token_delay_s = 0.05
    # earlier tests' connections settle first (a stream they left may still end as a
    # disconnect), so the count below sees this request's alone
    quiet_since = [time.monotonic(), engine.fake.disconnects]

    def quiet_for_a_while() -> bool:  # no stream running and no new disconnect for 1.5 s
        if engine.fake.running or engine.fake.disconnects != quiet_since[1]:
            quiet_since[:] = [time.monotonic(), engine.fake.disconnects]
        return time.monotonic() - quiet_since[0] >= 1.5

    assert wait_for(quiet_for_a_while, 20)
    before = engine.fake.disconnects
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 200}}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", engine.url + "/generate_stream", json=body, headers=NO_CACHE) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator closes the stream (httpcore) at once
            first = next(lines)  # the first token is out: the engine is generating
            fake = engine.fake
            assert fake.running == 1, (first, len(fake.bodies), fake.disconnects - before, fake.dropped,
                                       fake.bodies[-1] if fake.bodies else None)
    assert wait_for(lambda: engine.fake.disconnects == before + 1 and engine.fake.running == 0, 10), \
        "the engine still streams the abandoned request"
    assert wait_for(lambda: metric(engine.router, "kubeshard_router_client_disconnects_total") >= 1, 10)


def test_a_repeat_is_answered_from_the_redis_cache_without_the_engine(engine):
    body = {"inputs": f"Cached question for {engine.dialect}?", "parameters": {"max_new_tokens": 6}}
    seen = len(engine.fake.bodies)
    assert_repeat_is_cached(engine.url, body, timeout=30)
    assert len(engine.fake.bodies) == seen + 1  # only the first reached the engine


def _load(served: Served) -> dict:
    r = httpx.get(served.url + "/internal/load", headers={"Authorization": f"Bearer {LOAD_TOKEN}"}, timeout=10)
    r.raise_for_status()
    return next(m for m in r.json()["models"] if m["model"] == served.model)


def _engine_info_stats(served: Served):
    import grpc

    from kubeshard_proto import pb, pb_grpc

    with grpc.insecure_channel(served.info.address) as channel:
        return pb_grpc.TextGenerationStub(channel).Stats(pb.StatsRequest(), timeout=10)


def test_load_counters_count_the_engines_streams(engine):
    engine.fake.token_delay_s = 0.05
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 40}}
    threads = [threading.Thread(target=lambda: httpx.post(engine.url + "/generate", json=body, timeout=30,
                                                          headers=NO_CACHE)) for _ in range(2)]
    for t in threads:
        t.start()
    # llama-cpp-python's server runs one request at a time (engine-info's Info says so):
    # the router holds the second one in its queue
    running = 1 if engine.dialect == "llamacpp" else 2
    try:
        assert wait_for(lambda: engine.fake.running == running and _load(engine)["queued"] == 2 - running, 10)
        busy = _load(engine)
        assert busy["in_flight"] == running
        # each reserved its prompt and 40 new tokens, less what has streamed already
        assert 0 < busy["tokens_in_flight"] <= 2 * (len(engine.fake.tokenizer.encode(PROMPT).ids) + 40)
        assert metric(engine.router, f'kubeshard_router_in_flight{{model="{engine.model}"}}') == running
        if engine.dialect == "vllm":  # engine-info's Stats read the engine's vllm:* gauges
            assert _engine_info_stats(engine).running == 2
    finally:
        for t in threads:
            t.join()
    assert wait_for(lambda: (v := _load(engine))["in_flight"] == 0 and v["tokens_in_flight"] == 0, 10)
    assert _load(engine)["tokens_per_second"] > 0


def _generate(served: Served) -> httpx.Response:
    return httpx.post(served.url + "/generate", timeout=30, headers=NO_CACHE,
                      json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})


def _failures(served: Served) -> float:
    return metric(served.router, "kubeshard_router_backend_errors_total") + \
        metric(served.router, "kubeshard_router_retries_total")


def test_consecutive_requests_share_one_kept_alive_connection(engine):
    """After the engine's last token the router reads the end of its body, so the
    connection goes back to the pool instead of being closed (a new TCP connection per
    request would cost every request a handshake)."""
    assert _generate(engine).status_code == 200
    connections = engine.fake.connections
    for _ in range(3):
        assert _generate(engine).status_code == 200
    assert engine.fake.connections == connections


def test_a_kept_alive_connection_the_engine_closed_is_retried_once_on_a_new_one(engine):
    """The engine closes a connection idle 1 s just as the router reuses it (as uvicorn
    does when its keep-alive timer fires while a request is on its way): nothing was
    answered, so the router sends the request again on a new connection, and neither fails
    the request nor takes the (only) replica out."""
    engine.fake.idle_close_s = 1.0
    assert _generate(engine).status_code == 200
    failures, dropped = _failures(engine), engine.fake.dropped
    time.sleep(1.5)
    r = _generate(engine)
    assert r.status_code == 200, r.text
    assert engine.fake.dropped == dropped + 1  # the stale connection was reused, and dropped
    assert _failures(engine) == failures
    assert metric(engine.router, "kubeshard_router_ready_replicas") == 1


def test_the_router_drops_idle_connections_before_the_engine_does(engine):
    """Engines' servers (uvicorn) close a connection after 5 s idle; the router keeps one
    idle for less (KEEPALIVE_S), so it opens a new one rather than reuse one the engine
    may be closing."""
    from kubeshard_router.backends.openai_http import KEEPALIVE_S

    assert KEEPALIVE_S < 5.0
    engine.fake.idle_close_s = KEEPALIVE_S + 0.5
    assert _generate(engine).status_code == 200
    connections, dropped = engine.fake.connections, engine.fake.dropped
    time.sleep(KEEPALIVE_S + 1.0)
    assert _generate(engine).status_code == 200
    assert engine.fake.dropped == dropped and engine.fake.connections == connections + 1


REFUSED = {  # what each engine cannot give, and the request field the 422 names
    "vllm": [({"decoder_input_details": True}, "decoder_input_details"),
             ({"typical_p": 0.5, "do_sample": True}, "typical_p")],
    "llamacpp": [({"top_n_tokens": 2}, "top_n_tokens"),
                 ({"decoder_input_details": True}, "decoder_input_details")],
    "openai": [({"top_n_tokens": 2}, "top_n_tokens"),
               ({"repetition_penalty": 1.2}, "repetition_penalty"),
               ({"top_k": 5, "do_sample": True}, "top_k")],
}


def test_what_the_engine_cannot_give_is_a_422_naming_it(engine):
    seen = len(engine.fake.bodies)
    for params, field in REFUSED[engine.dialect]:
        r = httpx.post(engine.url + "/generate", timeout=30, headers=NO_CACHE,
                       json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, **params}})
        assert r.status_code == 422, r.text
        error = r.json()
        assert error["error_type"] == "validation"
        assert f"`{field}`" in error["error"] and f"the {engine.dialect} engine" in error["error"], error
    assert len(engine.fake.bodies) == seen  # refused before anything was sent


def test_top_n_alternatives_come_from_vllm_and_are_refused_by_the_others(engine):
    r = httpx.post(engine.url + "/generate", timeout=30, headers=NO_CACHE, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": 4, "top_n_tokens": 2, "details": True}})
    if engine.dialect != "vllm":  # llama.cpp's server runs without logprobs; the others' differ
        assert r.status_code == 422 and f"the {engine.dialect} engine" in r.json()["error"]
        return
    assert r.status_code == 200, r.text
    assert engine.fake.bodies[-1]["logprobs"] == 2
    details = r.json()["details"]
    for token, alternatives in zip(details["tokens"], details["top_tokens"], strict=True):
        assert [a["id"] for a in alternatives][0] == token["id"] and len(alternatives) == 2
        assert [a["logprob"] for a in alternatives] == [-0.25, -1.25]


def test_a_replica_that_fails_before_the_first_token_is_retried_on_another(demo_model):
    """Two replicas, round robin; one engine answers 503 to every completion (its /health
    still says ready): each request that picks it goes to the other before any token (and
    the failing replica is out of the ready set until its next probe)."""
    fakes, infos, router = serve("vllm", demo_model(), "--no-redis", "--balance", "round-robin",
                                 replicas=2)
    try:
        assert wait_for(lambda: metric(router, "kubeshard_router_ready_replicas") == 2, 20)
        fakes[0].fail_status = 503
        for _ in range(4):
            r = httpx.post(router.url + "/generate", timeout=30,
                           json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
            assert r.status_code == 200, r.text
            assert r.json()["generated_text"] == fakes[1].text(fakes[1].answer(PROMPT, 4))
        assert len(fakes[0].bodies) >= 1 and len(fakes[1].bodies) == 4
        assert metric(router, "kubeshard_router_retries_total") >= 1
        assert metric(router, 'kubeshard_router_backend_errors_total{code="UNAVAILABLE",model="fake-vllm"}') >= 1
    finally:
        stop(fakes, infos, router)
