"""TGI and OpenAI request rules, on the real (stub) tokenizer, without HTTP."""

from __future__ import annotations

import json

import pytest

from kubeshard_router.errors import MalformedRequest, ValidationFailed
from kubeshard_router.openai_schema import (ChatCompletionRequest, CompletionRequest, plan_chat,
                                            plan_completion)
from kubeshard_router.tgi_schema import GenerateRequest, plan_tgi
from kubeshard_router.tokenization import ModelTokenizer
from kubeshard_router.validation import Limits, parse_body
from tests.support.stub_backend import stub_tokenizer_config, stub_tokenizer_json

LIMITS = Limits(max_input_tokens=20, max_total_tokens=32, vocab_size=489, max_top_n_tokens=5,
                max_stop_sequences=4)


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer(stub_tokenizer_json().encode(), json.dumps(stub_tokenizer_config()).encode())


def tgi(tok, body: dict, stream: bool = False):
    return plan_tgi(parse_body(json.dumps(body).encode(), GenerateRequest), tok, LIMITS, stream=stream)


def tgi_error(tok, body: dict, stream: bool = False) -> str:
    with pytest.raises(ValidationFailed) as err:
        tgi(tok, body, stream)
    assert err.value.status == 422
    return err.value.message


def test_body_must_be_json_object():
    with pytest.raises(MalformedRequest, match="not valid JSON"):
        parse_body(b'{"inputs": ', GenerateRequest)
    with pytest.raises(MalformedRequest, match="empty"):
        parse_body(b"", GenerateRequest)
    with pytest.raises(ValidationFailed, match="must be a JSON object"):
        parse_body(b"[1, 2]", GenerateRequest)
    with pytest.raises(MalformedRequest):
        parse_body(b'{"inputs": NaN}', GenerateRequest)
    with pytest.raises(MalformedRequest, match="infinity"):
        parse_body(b'{"inputs": "x", "parameters": {"temperature": 1e999}}', GenerateRequest)


@pytest.mark.parametrize("body, field", [
    ({}, "`inputs`: Field required"),
    ({"inputs": 5}, "`inputs`: Input should be a valid string"),
    ({"inputs": "x", "parameters": {"max_new_tokens": "many"}}, "`parameters.max_new_tokens`"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 2.5}}, "`parameters.max_new_tokens`"),
    ({"inputs": "x", "parameters": {"stop": "end"}}, "`parameters.stop`"),
    ({"inputs": "x", "parameters": {"stop": [1]}}, "`parameters.stop[0]`"),
    ({"inputs": "x", "parameters": []}, "`parameters`"),
    ({"inputs": "x", "parameters": {"seed": 2**64}}, "`parameters.seed`"),
])
def test_wrong_types_name_the_field(body, field):
    with pytest.raises(ValidationFailed) as err:
        parse_body(json.dumps(body).encode(), GenerateRequest)
    assert field in err.value.message
    assert err.value.message.startswith("Input validation error: ")


@pytest.mark.parametrize("params, message", [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"temperature": -1}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"top_p": 0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 1.5}, "`top_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 2}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"frequency_penalty": 3}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"max_new_tokens": 100}, "`inputs` tokens + `max_new_tokens` must be <= 32"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"stop": [""]}, "`stop[0]` must not be an empty string"),
    ({"seed": -1}, "`seed` must be >= 0"),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 20. Given: 0"),
    ({"truncate": 21}, "`truncate` must be strictly positive and less than 20. Given: 21"),
    ({"best_of": 2}, "`best_of` must be > 0 and <= 1. Given: 2"),
    ({"best_of": 0}, "`best_of` must be > 0"),
    ({"watermark": True}, "`watermark` is not supported"),
    ({"grammar": {"type": "xml", "value": {}}}, "`grammar.type` must be json, regex or json_schema"),
    ({"grammar": {"type": "json", "value": "{nope"}}, "`grammar.value` is not valid JSON"),
    ({"grammar": {"type": "json_schema", "value": {"name": "x"}}}, "`grammar.value` must be {\"name\""),
    ({"grammar": "json"}, "`grammar` must be {\"type\""),

])
def test_tgi_parameter_rules(tok, params, message):
    assert message in tgi_error(tok, {"inputs": "hello world", "parameters": params})


def test_tgi_prompt_limits(tok):
    long = "hello world " * 20
    assert "`inputs` must have less than 20 tokens. Given: " in tgi_error(tok, {"inputs": long})
    assert "`inputs` cannot be empty" in tgi_error(tok, {"inputs": ""})
    # Truncation keeps the last tokens and makes the same prompt acceptable.
    plan = tgi(tok, {"inputs": long, "parameters": {"truncate": 10, "max_new_tokens": 5}})
    assert plan.prompt_tokens == 10
    assert plan.engine.input_ids == tok.encode(long)[-10:]


def test_decoder_input_details_refused_when_streaming(tok):
    message = tgi_error(tok, {"inputs": "x", "parameters": {"decoder_input_details": True}}, stream=True)
    assert "`decoder_input_details` == true is not supported when streaming tokens" in message
    assert tgi(tok, {"inputs": "x", "parameters": {"decoder_input_details": True}}).engine.prefill_details


def test_tgi_defaults_and_sampling_inference(tok):
    plan = tgi(tok, {"inputs": "hello world"})
    ids = tok.encode("hello world")
    assert plan.engine.input_ids == ids and ids[0] == 0  # BOS added by the tokenizer
    assert plan.engine.max_new_tokens == 32 - len(ids)   # TGI: what the total limit leaves
    assert not plan.engine.do_sample and plan.engine.deterministic
    assert not plan.details and not plan.return_full_text
    # As TGI: any warper implies sampling.
    for params in ({"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9}, {"typical_p": 0.5}):
        assert tgi(tok, {"inputs": "x", "parameters": params}).engine.do_sample
    assert not tgi(tok, {"inputs": "x", "parameters": {"temperature": 1.0, "top_p": 1.0}}).engine.do_sample
    sampled = tgi(tok, {"inputs": "x", "parameters": {"do_sample": True}}).engine
    assert sampled.do_sample and not sampled.deterministic
    seeded = tgi(tok, {"inputs": "x", "parameters": {"do_sample": True, "seed": 7}}).engine
    assert seeded.deterministic
    no_bos = tgi(tok, {"inputs": "hello world", "add_special_tokens": False}).engine
    assert no_bos.input_ids == ids[1:]


def test_unknown_fields_are_ignored_like_tgi(tok):
    assert tgi(tok, {"inputs": "x", "extra": 1, "parameters": {"whatever": True}}).prompt_tokens == 2


def openai(tok, model, body: dict):
    req = parse_body(json.dumps(body).encode(), model)
    return (plan_chat if model is ChatCompletionRequest else plan_completion)(req, tok, LIMITS)


def openai_error(tok, model, body: dict) -> ValidationFailed:
    with pytest.raises(ValidationFailed) as err:
        openai(tok, model, body)
    return err.value


CHAT = {"messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("extra, message, param", [
    ({"n": 2}, "`n` must be >= 1 and <= 1 (this model's max sequences per request)", "n"),
    ({"n": 0}, "`n` must be >= 1", "n"),
    ({"temperature": 2.5}, "`temperature` must be in [0.0, 2.0]. Given: 2.5", "temperature"),
    ({"top_p": 0}, "`top_p` must be in (0.0, 1.0]", "top_p"),
    ({"presence_penalty": -3}, "`presence_penalty` must be in [-2.0, 2.0]", "presence_penalty"),
    ({"max_tokens": 0}, "`max_tokens` must be strictly positive", "max_tokens"),
    ({"max_tokens": 1000}, "`messages` tokens + `max_tokens` must be <= 32", "max_tokens"),
    ({"max_completion_tokens": 0}, "`max_completion_tokens` must be strictly positive",
     "max_completion_tokens"),
    ({"stop": ["a"] * 5}, "`stop` supports up to 4", "stop"),
    ({"logit_bias": {"x": 1.0}}, "`logit_bias` keys must be token ids", "logit_bias"),
    ({"logit_bias": {"5": 101}}, "`logit_bias[5]` must be in [-100, 100]", "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "`logit_bias[99999]`: 99999 is not a token id", "logit_bias"),
    ({"top_k": -2}, "`top_k` must be -1 or 0 (no filter) or strictly positive", "top_k"),
    ({"min_p": 1.5}, "`min_p` must be in [0.0, 1.0]", "min_p"),
    ({"min_tokens": -1}, "`min_tokens` must be >= 0", "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "`min_tokens` (5) must be <= the maximum number of new tokens (4)",
     "min_tokens"),
    ({"stop_token_ids": [99999]}, "`stop_token_ids[0]` = 99999 is not a token id", "stop_token_ids"),
    ({"prompt_logprobs": 9}, "`prompt_logprobs` must be >= 0 and <= 5", "prompt_logprobs"),
    ({"ignore_eos": "maybe"}, "`ignore_eos`", "ignore_eos"),
    ({"guided_json": "{nope"}, "`guided_json` is not valid JSON", "guided_json"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "only one structured-output constraint",
     "guided_regex"),
    ({"guided_choice": []}, "`guided_choice` must be a non-empty list", "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "`structured_outputs` must hold exactly one",
     "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "`response_format.json_schema.schema` is required",
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "`tools[0].function.name` must be",
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "`tools[0]` must be", "tools[0]"),
    ({"tool_choice": "required"}, "`tool_choice` needs `tools`", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "`tool_choice` names no function", "tool_choice"),
    ({"response_format": {"type": "xml"}}, "`response_format.type`", "response_format"),
    ({"top_logprobs": 2}, "`top_logprobs` needs `logprobs` set to true", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 9}, "`top_logprobs` must be >= 0 and <= 5", "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "`stream_options` is only allowed when `stream`",
     "stream_options"),
])
def test_chat_rules_name_the_field(tok, extra, message, param):
    err = openai_error(tok, ChatCompletionRequest, {**CHAT, **extra})
    assert message in err.message
    assert err.param == param


@pytest.mark.parametrize("messages, message", [
    ([], "`messages` must not be empty"),
    ([{"role": "wizard", "content": "x"}], "`messages[0].role` must be one of"),
    ([{"role": "user", "content": None}], "`messages[0].content` must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "`messages[0].content[0]` has type 'image_url'"),
    ([{"role": "tool", "content": "x"}], "role tool is not supported by this template"),
])
def test_chat_message_problems(tok, messages, message):
    assert message in openai_error(tok, ChatCompletionRequest, {"messages": messages}).message


def test_chat_uses_template_without_second_bos(tok):
    req = parse_body(json.dumps({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}],
        "temperature": 0}).encode(), ChatCompletionRequest)
    plan = plan_chat(req, tok, Limits(max_input_tokens=100, max_total_tokens=200, vocab_size=489))
    assert plan.prompt_text == "<s><|system|>\nbe brief</s>\n<|user|>\nhello</s>\n<|assistant|>\n"
    assert plan.engine.input_ids == tok.encode(plan.prompt_text, add_special_tokens=False)
    assert plan.engine.input_ids.count(0) == 1  # exactly one BOS: the template's
    assert not plan.engine.do_sample


def test_openai_defaults_sample_like_openai(tok):
    plan = openai(tok, CompletionRequest, {"prompt": "hello"})
    assert plan.engine.do_sample and plan.engine.temperature == 1.0 and not plan.engine.deterministic
    assert plan.engine.max_new_tokens == 16  # OpenAI's completions default
    greedy = openai(tok, CompletionRequest, {"prompt": "hello", "temperature": 0, "stop": "x"})
    assert not greedy.engine.do_sample and greedy.stop == ("x",)
    chat = openai(tok, ChatCompletionRequest, {**CHAT, "seed": 3})
    assert chat.engine.deterministic and chat.engine.seed == 3


def test_completion_prompt_forms(tok):
    ids = tok.encode("hello world")
    assert openai(tok, CompletionRequest, {"prompt": ["hello world"]}).engine.input_ids == ids
    assert openai(tok, CompletionRequest, {"prompt": ids}).engine.input_ids == ids
    assert openai(tok, CompletionRequest, {"prompt": [ids]}).engine.input_ids == ids
    two = openai(tok, CompletionRequest, {"prompt": ["hello world", "a b c"], "n": 1})
    assert [p.engine.input_ids for p in two.prompts] == [ids, tok.encode("a b c")]
    assert two.engines == (two.engine, two.more[0].engine)
    assert two.prompt_tokens == len(ids) + len(tok.encode("a b c"))  # every prompt's tokens
    assert [p.prompt_tokens for p in two.more] == [len(tok.encode("a b c"))]
    assert [p.engine.input_ids for p in openai(tok, CompletionRequest, {"prompt": [ids, [5, 6]]}).prompts] == \
        [ids, [5, 6]]
    assert "`prompt[1]` cannot be empty" in openai_error(tok, CompletionRequest, {"prompt": ["a", ""]}).message
    assert "`prompt[1][0]` = 99999 is not a token id" in openai_error(
        tok, CompletionRequest, {"prompt": [[1], [99999]]}).message
    assert "at most 2048" in openai_error(tok, CompletionRequest, {"prompt": ["a"] * 2049}).message
    assert "`prompt[1]` = 99999 is not a token id" in openai_error(
        tok, CompletionRequest, {"prompt": [1, 99999]}).message
    assert "`prompt` cannot be empty" in openai_error(tok, CompletionRequest, {"prompt": ""}).message
    assert "`prompt` cannot be empty" in openai_error(tok, CompletionRequest, {"prompt": []}).message
    assert "`logprobs` must be >= 0 and <= 5" in openai_error(
        tok, CompletionRequest, {"prompt": "x", "logprobs": 6}).message
    assert "`best_of` must be >= `n` (1) and <= 1" in openai_error(
        tok, CompletionRequest, {"prompt": "x", "best_of": 3}).message
    assert "`suffix` is not supported" in openai_error(
        tok, CompletionRequest, {"prompt": "x", "suffix": "y"}).message
    assert "`prompt`: " in openai_error(tok, CompletionRequest, {"prompt": {"a": 1}}).message


def test_echo_with_logprobs_asks_for_prefill(tok):
    plan = openai(tok, CompletionRequest, {"prompt": "hello", "echo": True, "logprobs": 2})
    assert plan.engine.prefill_details and plan.engine.top_n_tokens == 2 and plan.echo
