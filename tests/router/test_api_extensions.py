"""vLLM's request extensions, logit_bias, n and best_of on the OpenAI routes, end to end
(router + real engine on the tiny demo model), through the `openai` client and plain HTTP:
exact token counts, reproducible choices, and 422s that name the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.processes import start_serve
from tests.support.sse import sse

NO_CACHE = {"Cache-Control": "no-cache"}


@pytest.fixture(scope="module")
def serve(demo_model):
    proc = start_serve(demo_model(), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                       "--max-input-tokens", "256", "--max-total-tokens", "512")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", default_headers=NO_CACHE)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def eos(demo_model) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(demo_model() / "tokenizer.json")).token_to_id("</s>")


def test_ignore_eos_with_max_tokens_128_gives_exactly_128_tokens(client, model, eos):
    # EOS pushed to the top: without ignore_eos the answer would end at once
    bias = {str(eos): 100}
    out = client.completions.create(model=model, prompt="Benchmark prompt", max_tokens=128, temperature=0,
                                    extra_body={"ignore_eos": True}, logit_bias=bias)
    assert out.usage.completion_tokens == 128 and out.choices[0].finish_reason == "length"
    short = client.completions.create(model=model, prompt="Benchmark prompt", max_tokens=128, temperature=0,
                                      logit_bias=bias)
    assert short.usage.completion_tokens == 1 and short.choices[0].finish_reason == "stop"
    # streamed and sampled, as a benchmark harness sends it
    stream = client.completions.create(model=model, prompt="Benchmark prompt", max_tokens=128, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 128
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=128, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 128


def test_min_tokens_is_honoured(client, model, eos):
    out = client.completions.create(model=model, prompt="Short answer", max_tokens=64, temperature=0,
                                    logit_bias={str(eos): 100}, extra_body={"min_tokens": 10})
    assert out.usage.completion_tokens == 11 and out.choices[0].finish_reason == "stop"


def test_stop_token_ids_and_stop_reason(client, model):
    free = client.completions.create(model=model, prompt="Stop here", max_tokens=6, temperature=0,
                                     logprobs=0, extra_body={"ignore_eos": True})
    tokens = free.choices[0].logprobs.tokens
    stopped = httpx.post(client.base_url.join("completions").__str__(), headers=NO_CACHE, timeout=60, json={
        "model": model, "prompt": "Stop here", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "stop_token_ids": [42], "logit_bias": {"42": 100}}).json()
    choice = stopped["choices"][0]
    assert stopped["usage"]["completion_tokens"] == 1 and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == 42
    assert len(tokens) == 6


def test_include_stop_str_in_output(client, model):
    free = client.completions.create(model=model, prompt="Once", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[4:7]
    assert stop.strip()
    trimmed = client.completions.create(model=model, prompt="Once", max_tokens=12, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    kept = client.completions.create(model=model, prompt="Once", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert not trimmed.text.endswith(stop) and kept.text.endswith(stop)
    assert kept.text.startswith(trimmed.text) and kept.model_extra["stop_reason"] == stop


def test_skip_special_tokens_false_keeps_their_text(client, model, eos):
    kw = dict(model=model, prompt="Specials", max_tokens=2, temperature=0, logit_bias={str(eos): 100})
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    kept = client.completions.create(**kw, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    tight = client.completions.create(**kw, extra_body={"ignore_eos": True, "skip_special_tokens": False,
                                                        "spaces_between_special_tokens": False})
    assert plain == "" and kept.choices[0].text == "</s> </s>" and tight.choices[0].text == "</s></s>"


def test_n_choices_are_reproducible_with_a_seed(client, model):
    kw = dict(model=model, prompt="Tell me", max_tokens=12, n=3, seed=21, extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [c.text for c in again.choices] == texts
    assert first.usage.completion_tokens == 36
    single = client.completions.create(model=model, prompt="Tell me", max_tokens=12, seed=21,
                                       extra_body={"ignore_eos": True})
    assert single.choices[0].text == texts[0]  # choice 0 is the one-choice request with that seed
    # streamed: the same three texts, chunks told apart by index
    stream = client.completions.create(**kw, stream=True)
    streamed = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=8, n=2, seed=3)
    assert len(chat.choices) == 2 and [c.index for c in chat.choices] == [0, 1]


def test_best_of_returns_the_likeliest(client, model):
    out = client.completions.create(model=model, prompt="Pick", max_tokens=8, n=1, best_of=4, seed=5,
                                    logprobs=0, extra_body={"ignore_eos": True})
    every = client.completions.create(model=model, prompt="Pick", max_tokens=8, n=4, seed=5, logprobs=0,
                                      extra_body={"ignore_eos": True})
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = every.choices[max(range(4), key=lambda i: sums[i])].text
    assert len(out.choices) == 1 and out.choices[0].text == best
    with pytest.raises(openai.UnprocessableEntityError, match="`best_of` > `n` cannot stream"):
        client.completions.create(model=model, prompt="Pick", max_tokens=8, best_of=2, stream=True)


def test_prompt_logprobs(client, model):
    out = client.completions.create(model=model, prompt="Prompt logprobs here", max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == out.usage.prompt_tokens
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 3
        assert all("logprob" in v and "decoded_token" in v for v in entry.values())


def test_known_fields_with_bad_values_name_them_unknown_ones_are_ignored(serve, model):
    url = serve.url + "/v1/completions"
    ok = httpx.post(url, json={"model": model, "prompt": "x", "max_tokens": 2, "not_a_field": {"a": 1},
                               "use_beam_search": False}, timeout=60)
    assert ok.status_code == 200
    for body, field in [({"min_p": 2}, "min_p"), ({"n": 0}, "n"), ({"n": 99}, "n"), ({"top_k": -5}, "top_k"),
                        ({"logit_bias": {"x": 1}}, "logit_bias"), ({"min_tokens": 50}, "min_tokens"),
                        ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"ignore_eos": [1]}, "ignore_eos"),
                        ({"prompt_logprobs": -1}, "prompt_logprobs")]:
        r = httpx.post(url, json={"model": model, "prompt": "x", "max_tokens": 8, **body}, timeout=60)
        assert r.status_code == 422, (body, r.text)
        error = r.json()["error"]
        assert f"`{field}" in error["message"] and error["param"].startswith(field), (body, error)


def test_streamed_n_chat_carries_every_index(serve, model):
    r = httpx.post(serve.url + "/v1/chat/completions", headers=NO_CACHE, timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "seed": 1,
        "stream": True, "ignore_eos": True})
    events = [e for e in sse(r.text) if e != "[DONE]"]
    finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finishes) == [0, 1]
