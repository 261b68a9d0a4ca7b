"""The rest of the API, end to end (router + real engine on the tiny demo model) through the
`openai` and `text-generation` clients and plain HTTP: vLLM's request extensions,
logit_bias, n and best_of (exact token counts, reproducible choices, 422s that name the
field); structured output (every constrained answer validates, constrained and free
requests share a batch); tool calls (required, named, auto, streamed)."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import openai
import pytest

from tests.support.sse import sse

NO_CACHE = {"Cache-Control": "no-cache"}


@pytest.fixture(scope="module")
def serve(demo_serve):
    return demo_serve


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


def test_several_prompts_in_one_completion(serve, client, model):
    """prompt: [...] (as OpenAI and vLLM take it): each prompt gets n choices, prompt k's at
    indexes k*n .., the same texts as the prompt alone; usage sums them; streamed too."""
    kw = dict(model=model, max_tokens=6, n=2, seed=21, extra_body={"ignore_eos": True})
    prompts = ["Tell me", "Pick one", "Why"]
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    both = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in both.choices] == list(range(6))
    assert [c.text for c in both.choices] == [c.text for a in alone for c in a.choices]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 36
    stream = client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **kw)
    streamed, usage = [""] * 6, None
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
        usage = chunk.usage or usage
    assert streamed == [c.text for c in both.choices]
    assert usage.prompt_tokens == both.usage.prompt_tokens and usage.completion_tokens == 36
    # token-id prompts, echo: each choice as its prompt alone gives it, its own prompt first
    ids = [httpx.post(serve.url + "/tokenize", json={"model": model, "prompt": p}, timeout=60).json()["tokens"]
           for p in prompts[:2]]
    echo = dict(model=model, max_tokens=3, echo=True, temperature=0)
    echoed = client.completions.create(prompt=ids, **echo)
    assert [c.text for c in echoed.choices] == [client.completions.create(prompt=i, **echo).choices[0].text
                                                for i in ids]
    assert all(p in c.text for c, p in zip(echoed.choices, prompts))
    # one bad prompt refuses the request, naming it; none of it runs
    r = httpx.post(serve.url + "/v1/completions", json={"model": model, "prompt": ["fine", ""], "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 422 and r.json()["error"]["param"] == "prompt[1]", r.text


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


# ---- structured output -------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"]}}}


def test_response_format_json_schema_and_json_object_validate(client, model):
    import jsonschema

    for temperature in (0, 1.0):
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "A person, please"}], max_tokens=80,
            temperature=temperature, seed=4,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}})
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
        assert out.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON!"}],
                                         max_tokens=120, temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # an unbounded object may run out of tokens on a random model
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_vllm_guided_fields_on_completions(client, model):
    import jsonschema

    regex = client.completions.create(model=model, prompt="Call me at", max_tokens=30, temperature=0,
                                      extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", regex.choices[0].text)
    choice = client.completions.create(model=model, prompt="Sentiment:", max_tokens=10, temperature=1, seed=2,
                                       extra_body={"guided_choice": ["positive", "negative"]})
    assert choice.choices[0].text in ("positive", "negative")
    js = client.completions.create(model=model, prompt="Person:", max_tokens=80, temperature=0,
                                   extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(js.choices[0].text), PERSON)
    so = client.completions.create(model=model, prompt="Person:", max_tokens=80, temperature=0,
                                   extra_body={"structured_outputs": {"json": PERSON}})
    assert so.choices[0].text == js.choices[0].text
    grammar = client.completions.create(model=model, prompt="Answer:", max_tokens=10, temperature=0,
                                        extra_body={"guided_grammar": 'root ::= "yes" | "no" | "maybe"'})
    assert grammar.choices[0].text in ("yes", "no", "maybe")


def test_a_bad_grammar_is_a_422_naming_its_field(serve, model):
    r = httpx.post(serve.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "x", "max_tokens": 4, "guided_regex": "(unclosed"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "guided_regex"
    assert "`guided_regex`: grammar (regex) does not compile" in r.json()["error"]["message"]


def test_constrained_and_free_requests_share_a_batch(serve, model):
    import jsonschema

    free = {"model": model, "prompt": "Free text here", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=serve.url, timeout=120, headers=NO_CACHE) as c:
        alone = c.post("/v1/completions", json=free).json()["choices"][0]["text"]
    bodies = [free if i % 2 else {**free, "prompt": f"Person {i}", "max_tokens": 80, "ignore_eos": False,
                                  "guided_json": PERSON} for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: httpx.post(serve.url + "/v1/completions", json=b, timeout=120,
                                                     headers=NO_CACHE).json(), bodies))
    for body, answer in zip(bodies, answers):
        text = answer["choices"][0]["text"]
        if "guided_json" in body:
            jsonschema.validate(json.loads(text), PERSON)
        else:
            assert text == alone


def test_text_generation_client_grammar(serve):
    import jsonschema
    import text_generation
    from text_generation.types import Grammar, GrammarType

    client = text_generation.Client(serve.url, timeout=60)
    out = client.generate("A person:", max_new_tokens=80, grammar=Grammar(type=GrammarType.Json, value=PERSON))
    jsonschema.validate(json.loads(out.generated_text), PERSON)
    rx = client.generate("Code:", max_new_tokens=10, grammar=Grammar(type=GrammarType.Regex, value="[A-Z]{3}-[0-9]{2}"))
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", rx.generated_text)
    best = client.generate("Best of", max_new_tokens=6, best_of=3, do_sample=True)
    assert len(best.details.best_of_sequences) == 2


# ---- tool calls ----------------------------------------------------------------------------

def _check_call(call, tools=(WEATHER, TIME)):
    import jsonschema

    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_openai_client_tool_calls_required_named_and_streamed(client, model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    required = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=200, temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)
    named = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           max_tokens=80, temperature=0)
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call)
    # streamed: the arguments come piece by piece, and the deltas add up to the same calls
    stream = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                            tool_choice="required", max_tokens=200, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None, "deltas": 0})
                assert (d.id is not None) == (entry["deltas"] == 0)  # the id (and name) once, first
                entry["id"] = d.id or entry["id"]
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
                entry["deltas"] += 1
    assert finish == "tool_calls"
    assert all(c["deltas"] > 2 for c in calls.values()), calls
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    # the call and its result go back into the conversation
    follow = client.chat.completions.create(model=model, max_tokens=8, temperature=0, tools=[WEATHER, TIME],
                                            messages=messages + [choice.message.model_dump(exclude_none=True),
                                                                 {"role": "tool", "tool_call_id": call.id,
                                                                  "content": "sunny, 21 C"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_auto_answers_or_calls_validly(client, model):
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                         tools=[WEATHER], max_tokens=60, temperature=1, seed=1)
    message = out.choices[0].message
    for call in message.tool_calls or []:
        _check_call(call)
    none = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                          tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None


def test_text_generation_client_tools(serve):
    import text_generation
    from text_generation.types import Message, Tool

    client = text_generation.Client(serve.url, timeout=60)
    tools = [Tool(**WEATHER)]
    out = client.chat(messages=[Message(role="user", content="Weather in Rome?")], tools=tools,
                      tool_choice="get_weather", max_tokens=200, temperature=0.01, seed=1)
    [call] = out.choices[0].message.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}
    streamed = list(client.chat(messages=[Message(role="user", content="Weather in Rome?")], tools=tools,
                                tool_choice="get_weather", max_tokens=200, temperature=0.01, seed=1, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == json.loads(call["function"]["arguments"]), deltas
