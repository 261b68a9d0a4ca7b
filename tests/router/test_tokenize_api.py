"""Tokenizing without generating (router/kubeshard_router/tokenize_api.py): TGI's
/tokenize and /chat_tokenize, vLLM's /tokenize (prompt or messages) and /detokenize, on
`kubeshard serve` with the demo model — the ids are the ones a generation's prompt gets —
and their errors in each API's shape; API keys apply (stub replica)."""

from __future__ import annotations

import httpx
import pytest

NO_CACHE = {"Cache-Control": "no-cache"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Rome?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def serve(demo_serve):
    return demo_serve


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(demo_model() / "tokenizer.json"))


def _post(serve, route: str, body) -> httpx.Response:
    return httpx.post(serve.url + route, json=body, headers=NO_CACHE, timeout=60)


def test_tgi_tokenize_gives_the_ids_and_characters_a_generation_prompt_has(serve, tokenizer):
    text = "Hello world, où est Rome?"
    r = _post(serve, "/tokenize", {"inputs": text})
    assert r.status_code == 200, r.text
    tokens = r.json()
    assert [t["id"] for t in tokens] == tokenizer.encode(text).ids
    assert all(t["text"] == text[t["start"]:t["stop"]] for t in tokens)
    # every character stands in a token (the bytes of "ù" are two tokens of the same character)
    spans = dict.fromkeys((t["start"], t["stop"]) for t in tokens)
    assert "".join(text[start:stop] for start, stop in spans) == text
    generated = _post(serve, "/generate", {"inputs": text, "parameters": {
        "max_new_tokens": 1, "details": True, "decoder_input_details": True}}).json()
    assert [p["id"] for p in generated["details"]["prefill"]] == [t["id"] for t in tokens]
    bare = _post(serve, "/tokenize", {"inputs": text, "add_special_tokens": False}).json()
    assert [t["id"] for t in bare] == tokenizer.encode(text, add_special_tokens=False).ids


def test_vllm_tokenize_a_prompt_or_a_chat_as_a_completion_would(serve, tokenizer):
    r = _post(serve, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    ids = tokenizer.encode("Hello world").ids
    assert out == {"count": len(ids), "max_model_len": 1536, "tokens": ids,
                   "token_strs": [tokenizer.id_to_token(i) for i in ids]}
    assert _post(serve, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"] == \
        tokenizer.encode("Hello world", add_special_tokens=False).ids
    for extra in ({}, {"tools": [WEATHER]}):  # with tools, rendered as a chat completion renders them
        chat = _post(serve, "/tokenize", {"messages": MESSAGES, **extra}).json()
        completion = _post(serve, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **extra}).json()
        assert chat["count"] == completion["usage"]["prompt_tokens"] == len(chat["tokens"])
        assert chat["token_strs"] is None
    with_tools = _post(serve, "/tokenize", {"messages": MESSAGES, "tools": [WEATHER]}).json()
    plain = _post(serve, "/tokenize", {"messages": MESSAGES}).json()
    assert with_tools["count"] > plain["count"]
    no_prompt = _post(serve, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < plain["count"] and plain["tokens"][:no_prompt["count"]] == no_prompt["tokens"]


def test_tgi_chat_tokenize_and_vllm_detokenize(serve, tokenizer):
    r = _post(serve, "/chat_tokenize", {"model": "tgi", "messages": MESSAGES})
    assert r.status_code == 200, r.text
    out = r.json()
    text = out["templated_text"]
    assert "Where is Rome?" in text
    assert [t["id"] for t in out["tokenize_response"]] == \
        _post(serve, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    spans = dict.fromkeys((t["start"], t["stop"]) for t in out["tokenize_response"])
    assert "".join(text[start:stop] for start, stop in spans) == text
    ids = tokenizer.encode("Hello world", add_special_tokens=False).ids
    assert _post(serve, "/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}


@pytest.mark.parametrize("route, body, status, shape, says", [
    ("/tokenize", {"inputs": 3}, 422, "tgi", "inputs"),
    ("/tokenize", {}, 422, "openai", "prompt"),
    ("/tokenize", {"messages": []}, 422, "openai", "messages"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 422, "openai",
     "continue_final_message"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "openai", "nope"),
    ("/tokenize", {"inputs": "x", "model": "nope"}, 404, "tgi", "nope"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 422, "openai", "`tokens[1]`"),
    ("/detokenize", {"tokens": "abc"}, 422, "openai", "tokens"),
    ("/chat_tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 422, "tgi", "messages[0].role"),
])
def test_bad_input_gets_a_clear_error_in_its_apis_shape(serve, route, body, status, shape, says):
    r = _post(serve, route, body)
    assert r.status_code == status, r.text
    error = r.json()
    if shape == "tgi":
        assert says in error["error"] and "error_type" in error, error
    else:
        assert says in error["error"]["message"], error


def test_malformed_json_is_a_400(serve):
    r = httpx.post(serve.url + "/tokenize", content=b"{not json", headers=NO_CACHE, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]  # no `inputs`: vLLM's shape


def test_api_keys_apply(make_router, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - name: user\n    key: sk-user\n")
    h = make_router(api_keys_file=str(keys))
    # before the body is read, /tokenize answers in TGI's shape (the route is TGI's first)
    for route, body, shape in (("/tokenize", {"inputs": "hello"}, "tgi"), ("/tokenize", {"prompt": "hello"}, "tgi"),
                               ("/detokenize", {"tokens": [1]}, "openai"),
                               ("/chat_tokenize", {"messages": MESSAGES}, "tgi")):
        r = httpx.post(h.url + route, json=body, timeout=30)
        assert r.status_code == 401, route
        message = r.json()["error"] if shape == "tgi" else r.json()["error"]["message"]
        assert "API key" in message, (route, r.text)
    ok = httpx.post(h.url + "/tokenize", json={"prompt": "hello world"}, timeout=30,
                    headers={"Authorization": "Bearer sk-user"})
    assert ok.status_code == 200 and ok.json()["count"] > 0
