"""The OpenAI-compatible HTTP generator's pure parts: what each engine's dialect sends,
what it refuses (naming the field and the engine), and how its SSE chunks become the
gRPC contract's tokens (ids, text, finish, the router's own stop matching for llama.cpp).
The real engines behind it are exercised in test_peer_engines.py."""

from __future__ import annotations

import math

import pytest

from kubeshard_proto import pb
from kubeshard_router.backends.openai_http import DIALECTS, OpenAIEngine, Unsupported, _Decoder
from kubeshard_router.tokenization import ModelTokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_model) -> ModelTokenizer:
    folder = demo_model()
    return ModelTokenizer((folder / "tokenizer.json").read_bytes(), (folder / "tokenizer_config.json").read_bytes())


def request(**kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", {})
    stopping = {"max_new_tokens": 8, **kw.pop("stopping", {})}
    return pb.GenerateRequest(request_id="r", input_ids=[5, 6, 7], sampling=pb.SamplingParameters(**sampling),
                              stopping=pb.StoppingCriteria(**stopping), **kw)


def test_vllm_gets_token_ids_and_its_extensions(tokenizer):
    body = DIALECTS["vllm"].body(request(sampling={"do_sample": True, "temperature": 0.7, "top_k": 5,
                                                    "seed": 3, "min_p": 0.1, "repetition_penalty": 1.2},
                                         stopping={"stop_sequences": ["\n"], "stop_token_ids": [9],
                                                   "ignore_eos": True, "min_new_tokens": 2},
                                         top_n_tokens=2), "m", tokenizer)
    assert body["prompt"] == [5, 6, 7] and body["return_tokens_as_token_ids"] is True
    assert body["logprobs"] == 2 and body["include_stop_str_in_output"] is True
    assert (body["temperature"], body["top_k"], body["seed"], body["min_p"]) == (0.7, 5, 3, 0.1)
    assert body["repetition_penalty"] == 1.2 and body["stop"] == ["\n"] and body["stop_token_ids"] == [9]
    assert body["ignore_eos"] and body["min_tokens"] == 2 and body["stream"] and body["max_tokens"] == 8
    greedy = DIALECTS["vllm"].body(request(), "m", tokenizer)
    assert greedy["temperature"] == 0.0 and "seed" not in greedy and "top_k" not in greedy


def test_llamacpp_gets_text_and_every_warper_off(tokenizer):
    body = DIALECTS["llamacpp"].body(request(stopping={"stop_sequences": ["."]}), "m", tokenizer)
    assert body["prompt"] == tokenizer.decode([5, 6, 7])
    # llama-cpp-python's own defaults would filter: kubeshard's semantics are sent explicitly
    assert (body["top_k"], body["top_p"], body["min_p"], body["repeat_penalty"]) == (0, 1.0, 0.0, 1.0)
    assert "stop" not in body  # the router matches stop sequences itself


@pytest.mark.parametrize("runtime, fields, name", [
    ("llamacpp", {"top_n_tokens": 2}, "top_n_tokens"),
    ("llamacpp", {"stopping": {"ignore_eos": True}}, "ignore_eos"),
    ("llamacpp", {"stopping": {"stop_token_ids": [3]}}, "stop_token_ids"),
    ("vllm", {"sampling": {"do_sample": True, "typical_p": 0.5}}, "typical_p"),
    ("vllm", {"n": 2}, "n"),
    ("vllm", {"prefill_details": True}, "decoder_input_details"),
    ("vllm", {"adapter": "x"}, "adapter_id"),
])
def test_what_an_engine_lacks_is_refused_naming_field_and_engine(tokenizer, runtime, fields, name):
    with pytest.raises(Unsupported, match=f"`{name}`.*the {runtime} engine"):
        DIALECTS[runtime].body(request(**fields), "m", tokenizer)


def engine(runtime: str, tokenizer: ModelTokenizer) -> OpenAIEngine:
    return OpenAIEngine("http://127.0.0.1:1", runtime, pb.InfoResponse(model_id="m", eos_token_ids=[2]),
                        lambda: tokenizer)


def decode(runtime: str, tokenizer, req: pb.GenerateRequest, chunks: list[dict]) -> list[pb.Token]:
    out: list[pb.Token] = []
    decoder = _Decoder(engine(runtime, tokenizer), req, tokenizer, 0, out.append)
    for chunk in chunks:
        if decoder.chunk(chunk):
            break
    return out


def choice(text: str, finish=None, **kw) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish, **kw}]}


def test_vllm_chunks_carry_ids_logprobs_and_the_stop_reason(tokenizer):
    lp = lambda i, v: {"tokens": [f"token_id:{i}"], "token_logprobs": [v], "top_logprobs": [{f"token_id:{i}": v}]}
    tokens = decode("vllm", tokenizer, request(top_n_tokens=1), [
        choice("a", logprobs=lp(11, -0.5)), choice("b.", "stop", stop_reason=".", logprobs=lp(12, -0.25))])
    assert [(t.id, t.text, t.logprob) for t in tokens] == [(11, "a", -0.5), (12, "b.", -0.25)]
    assert tokens[-1].finish.reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert tokens[-1].finish.generated_tokens == 2 and tokens[-1].finish.prompt_tokens == 3
    assert tokens[0].top_tokens[0].id == 11
    eos = decode("vllm", tokenizer, request(), [choice("a", logprobs=lp(11, -1.0)), choice("", "stop")])
    assert eos[-1].special and eos[-1].id == 2 and eos[-1].finish.reason == pb.FINISH_REASON_EOS_TOKEN


def test_llamacpp_stops_are_matched_by_the_router(tokenizer):
    req = request(stopping={"stop_sequences": [" world"], "max_new_tokens": 20})
    tokens = decode("llamacpp", tokenizer, req, [choice("hello"), choice(" wor"), choice("ld and"), choice(" more")])
    assert "".join(t.text for t in tokens) == "hello world"  # the stop stays, as kubeshard's engine does
    assert tokens[-1].finish.reason == pb.FINISH_REASON_STOP_SEQUENCE and len(tokens) == 3
    assert math.isnan(tokens[0].logprob)  # unknown, not invented


def test_llamacpp_length_ends_on_the_last_token(tokenizer):
    tokens = decode("llamacpp", tokenizer, request(stopping={"max_new_tokens": 2}),
                    [choice("a"), choice("b"), choice("", "length")])
    assert len(tokens) == 2 and tokens[-1].finish.reason == pb.FINISH_REASON_LENGTH


def test_the_generic_openai_dialect_sends_only_openai_fields(tokenizer):
    body = DIALECTS["openai"].body(request(sampling={"do_sample": True, "temperature": 0.7, "top_p": 0.9, "seed": 3,
                                                     "frequency_penalty": 0.5},
                                           stopping={"stop_sequences": ["\n"]}), "m", tokenizer)
    assert body == {"model": "m", "stream": True, "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 3,
                    "frequency_penalty": 0.5, "prompt": tokenizer.decode([5, 6, 7])}  # stops: the router's


@pytest.mark.parametrize("fields, name", [
    ({"sampling": {"do_sample": True, "top_k": 5}}, "top_k"),
    ({"sampling": {"do_sample": True, "min_p": 0.1}}, "min_p"),
    ({"sampling": {"typical_p": 0.5}}, "typical_p"),
    ({"sampling": {"repetition_penalty": 1.2}}, "repetition_penalty"),
    ({"sampling": {"logit_bias": {5: 1.0}}}, "logit_bias"),
    ({"top_n_tokens": 2}, "top_n_tokens"),
    ({"stopping": {"ignore_eos": True}}, "ignore_eos"),
    ({"stopping": {"stop_token_ids": [3]}}, "stop_token_ids"),
    ({"stopping": {"min_new_tokens": 2}}, "min_tokens"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
])
def test_the_generic_openai_dialect_refuses_what_engines_name_differently(tokenizer, fields, name):
    with pytest.raises(Unsupported, match=f"`{name}`.*the openai engine"):
        DIALECTS["openai"].body(request(**fields), "m", tokenizer)


def test_a_generic_piece_of_several_tokens_becomes_several_tokens(tokenizer):
    piece = " the capital"
    ids = tokenizer.encode(piece, add_special_tokens=False)
    assert len(ids) > 1
    tokens = decode("openai", tokenizer, request(stopping={"max_new_tokens": 20}), [choice(piece), choice("", "stop")])
    assert [t.id for t in tokens[:-1]] == ids and "".join(t.text for t in tokens) == piece
    assert tokens[-1].special and tokens[-1].finish.reason == pb.FINISH_REASON_EOS_TOKEN
    assert tokens[-1].finish.generated_tokens == len(ids) + 1
