"""The HTTP API shapes (TGI and OpenAI) over loopback, in front of the StubBackend test double."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.support.sse import sse


def test_generate_returns_tgi_json_details_and_timing_headers(router):
    r = httpx.post(router.url + "/generate", json={
        "inputs": "hello world", "parameters": {"max_new_tokens": 4, "details": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    details = body["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 4
    assert details["seed"] is None and details["prefill"] == []
    assert [set(t) for t in details["tokens"]] == [{"id", "text", "logprob", "special"}] * 4
    assert body["generated_text"] == "".join(t["text"] for t in details["tokens"])
    for header in ("x-compute-time", "x-total-time", "x-queue-time", "x-inference-time",
                   "x-time-per-token", "x-validation-time"):
        float(r.headers[header])
    assert r.headers["x-prompt-tokens"] == "3" and r.headers["x-generated-tokens"] == "4"
    assert r.headers["x-compute-type"] == "cpu"
    without = httpx.post(router.url + "/generate", json={"inputs": "hello world",
                                                          "parameters": {"max_new_tokens": 4}}).json()
    assert without == {"generated_text": body["generated_text"]}  # details only on request


def test_compat_route_returns_a_list_or_a_stream(router):
    body = {"inputs": "hello world", "parameters": {"max_new_tokens": 3}}
    listed = httpx.post(router.url + "/", json=body)
    assert listed.status_code == 200 and isinstance(listed.json(), list)
    streamed = httpx.post(router.url + "/", json={**body, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse(streamed.text)
    assert events[-1]["generated_text"] == listed.json()[0]["generated_text"]


def test_stream_events_have_tgi_shape(router):
    r = httpx.post(router.url + "/generate_stream", json={
        "inputs": "hello world", "parameters": {"max_new_tokens": 5, "details": True, "top_n_tokens": 2,
                                                 "return_full_text": True}})
    assert r.status_code == 200
    assert r.headers["cache-control"] == "no-cache" and "content-length" not in r.headers
    events = sse(r.text)
    assert [e["index"] for e in events] == [1, 2, 3, 4, 5]
    for e in events[:-1]:
        assert e["generated_text"] is None and e["details"] is None
        assert len(e["top_tokens"]) == 2 and set(e["token"]) == {"id", "text", "logprob", "special"}
    last = events[-1]
    text = "".join(e["token"]["text"] for e in events)
    assert last["generated_text"] == "hello world" + text  # return_full_text
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 5, "seed": None,
                               "input_length": 3}


def test_prefill_details_and_eos(router):
    router.stub().behaviour.eos_after = 2
    r = httpx.post(router.url + "/generate", json={
        "inputs": "hello world", "parameters": {"max_new_tokens": 8, "details": True,
                                                 "decoder_input_details": True}})
    details = r.json()["details"]
    assert [p["id"] for p in details["prefill"]] == [0, 440, 482]
    assert details["prefill"][0]["logprob"] is None and details["prefill"][1]["logprob"] == -1.0
    assert details["finish_reason"] == "eos_token" and details["tokens"][-1]["special"]
    assert "</s>" not in r.json()["generated_text"]  # special tokens are not text
    chat = httpx.post(router.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}).json()
    assert chat["choices"][0]["finish_reason"] == "stop" and "</s>" not in chat["choices"][0]["message"]["content"]


def test_stop_sequences_kept_by_tgi_trimmed_by_openai(router):
    first = httpx.post(router.url + "/generate", json={"inputs": "hello world",
                                                       "parameters": {"max_new_tokens": 6}}).json()
    words = first["generated_text"].split(" ")
    stop = " " + words[3]  # the 3rd generated word, with its space
    tgi = httpx.post(router.url + "/generate", json={"inputs": "hello world", "parameters": {
        "max_new_tokens": 6, "stop": [stop], "details": True}}).json()
    assert tgi["details"]["finish_reason"] == "stop_sequence"
    assert tgi["generated_text"].endswith(stop)
    body = {"prompt": "hello world", "max_tokens": 6, "temperature": 0, "stop": stop}
    done = httpx.post(router.url + "/v1/completions", json=body).json()
    assert done["choices"][0]["text"] == tgi["generated_text"][: -len(stop)]
    assert done["choices"][0]["finish_reason"] == "stop"
    streamed = sse(httpx.post(router.url + "/v1/completions", json={**body, "stream": True}).text)
    assert streamed[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == done["choices"][0]["text"]


def test_openai_shapes_usage_and_logprobs(router):
    chat = httpx.post(router.url + "/v1/chat/completions", json={
        "model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0, "logprobs": True, "top_logprobs": 2})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 3
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and len(content[0]["top_logprobs"]) == 2
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    comp = httpx.post(router.url + "/v1/completions", json={
        "prompt": "hello world", "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}).json()
    lp = comp["choices"][0]["logprobs"]
    assert comp["choices"][0]["text"].startswith("hello world")
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == 3 + 3  # prompt + generated
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_openai_stream_with_usage(router):
    r = httpx.post(router.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "tool_calls": None}
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_request_id_reaches_the_engine(router):
    r = httpx.post(router.url + "/generate", headers={"x-request-id": "abc-123"},
                   json={"inputs": "hi", "parameters": {"max_new_tokens": 1}})
    assert r.headers["x-request-id"] == "abc-123"
    assert router.stub().counters.requests[-1].request_id == "abc-123"
    expected = router.state.registry.models["stub"].tokenizer.encode("hi")
    assert expected[0] == 0  # BOS
    assert list(router.stub().counters.requests[-1].input_ids) == expected  # tokenized by the router


def test_several_models_behind_one_router(make_router):
    h = make_router(models={"alpha": 1, "beta": 1})
    a = httpx.post(h.url + "/models/alpha/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    b = httpx.post(h.url + "/v1/completions", json={"model": "beta", "prompt": "hi", "max_tokens": 2})
    assert a.status_code == 200 and b.status_code == 200
    assert a.headers["x-kubeshard-model"] == "alpha" and b.json()["model"] == "beta"
    assert h.stub("alpha").counters.generate_calls == 1 and h.stub("beta").counters.generate_calls == 1
    # No default among two models: the request must say which.
    r = httpx.post(h.url + "/generate", json={"inputs": "hi"})
    assert r.status_code == 422 and "`model` is required" in r.json()["error"]
    missing = httpx.post(h.url + "/v1/chat/completions", json={
        "model": "gamma", "messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found" and "`gamma`" in missing.json()["error"]["message"]
    tgi_missing = httpx.post(h.url + "/models/gamma/generate", json={"inputs": "x"})
    assert tgi_missing.status_code == 404 and tgi_missing.json()["error_type"] == "not_found"
    models = httpx.get(h.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["alpha", "beta"]
    assert httpx.get(h.url + "/models/beta/info").json()["served_model_id"] == "beta-id"


def test_default_model_and_tgi_alias(make_router):
    h = make_router(models={"alpha": 1, "beta": 1}, default_model="beta")
    assert httpx.post(h.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 1}}).status_code == 200
    r = httpx.post(h.url + "/v1/chat/completions", json={
        "model": "tgi", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "beta"
    assert h.stub("beta").counters.generate_calls == 2 and h.stub("alpha").counters.generate_calls == 0


def test_info_health_and_models(router):
    info = httpx.get(router.url + "/info").json()
    assert info["max_input_tokens"] == 200 and info["max_total_tokens"] == 256
    assert info["model_id"] == "stub" and info["model_sha"] == "r1"
    assert httpx.get(router.url + "/health").status_code == 200
    assert httpx.get(router.url + "/readyz").status_code == 200
    router.stub().behaviour.serving = False
    router.wait_ready("stub", 0)
    r = httpx.get(router.url + "/health")
    assert r.status_code == 503 and "stub" in r.json()["error"]
    router.stub().behaviour.serving = True
    router.wait_ready("stub", 1)
    assert httpx.get(router.url + "/models/stub/health").status_code == 200


def test_metrics_use_tgi_names(router):
    httpx.post(router.url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    httpx.post(router.url + "/generate", json={"inputs": "hi", "parameters": {"temperature": -1}})
    text = httpx.get(router.url + "/metrics").text
    assert 'tgi_request_count{model="stub"} 2.0' in text
    assert 'tgi_request_success{model="stub"} 1.0' in text
    assert 'tgi_request_failure{err="validation",model="stub"} 1.0' in text
    for name in ("tgi_request_duration_bucket", "tgi_request_queue_duration_bucket",
                 "tgi_request_mean_time_per_token_duration_bucket", "tgi_request_input_length_bucket",
                 "tgi_request_generated_tokens_bucket", "tgi_queue_size", "tgi_batch_current_size",
                 "kubeshard_router_time_to_first_token_seconds_bucket",
                 "kubeshard_router_e2e_request_latency_seconds_bucket", "kubeshard_router_in_flight",
                 'kubeshard_router_requests_total{model="stub",route="/generate",status="422"} 1.0',
                 'kubeshard_router_ready_replicas{model="stub"} 1.0'):
        assert name in text, name


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_error_shapes_per_api(router, path):
    r = httpx.post(router.url + path, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    if path.startswith("/v1"):
        assert r.json()["error"]["type"] == "invalid_request_error" and "not valid JSON" in r.json()["error"]["message"]
    else:
        assert r.json()["error_type"] == "validation" and "not valid JSON" in r.json()["error"]


def test_body_limits_and_unknown_paths(make_router):
    h = make_router(max_body_bytes=1000)
    r = httpx.post(h.url + "/generate", json={"inputs": "x" * 2000})
    assert r.status_code == 413 and "1000-byte limit" in r.json()["error"]
    nf = httpx.get(h.url + "/nope")
    assert nf.status_code == 404 and nf.json()["error_type"] == "not_found"
    wrong = httpx.get(h.url + "/generate")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_form_encoded_json_is_accepted_like_curl_d(router):
    # `curl -d '{...}'` sends application/x-www-form-urlencoded; the body is still JSON.
    r = httpx.post(router.url + "/generate", content=b'{"inputs": "hi", "parameters": {"max_new_tokens": 1}}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200


def test_openapi_and_docs_describe_the_routes(router):
    spec = httpx.get(router.url + "/openapi.json").json()
    for path in ("/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions",
                 "/v1/models", "/info", "/health", "/metrics", "/models/{model}/generate", "/tokenize",
                 "/chat_tokenize", "/detokenize"):
        assert path in spec["paths"], path
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/ChatCompletionRequest"
    assert "messages" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    # every reference resolves (the tokenize routes' bodies once pointed at schemas the document lacked)
    refs = set(re.findall(r'"\$ref":\s*"#/components/schemas/([^"]+)"', json.dumps(spec)))
    assert refs and refs <= set(spec["components"]["schemas"]), refs - set(spec["components"]["schemas"])
    tokenize = spec["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert [ref["$ref"].rsplit("/", 1)[1] for ref in tokenize["anyOf"]] == [
        "TgiTokenizeRequest", "TokenizeCompletionRequest", "TokenizeChatRequest"]  # TGI's body and vLLM's two
    assert httpx.get(router.url + "/docs").status_code == 200
