"""How each OpenAI-compatible engine's ``POST /v1/completions`` is spoken: a *dialect*
per engine (a registry, not a chain of ifs). ``body`` builds the request from the gRPC
contract's ``GenerateRequest`` (raising ``Unsupported``, a 422 naming the field and the
engine, for what the engine cannot honour); ``token_ids`` and ``finish`` read its SSE
chunks (``openai_http._Decoder`` turns them into tokens).

- ``vllm``: the prompt goes as token ids (exactly what the router tokenized), vLLM's
  sampling extensions map one to one, and ``return_tokens_as_token_ids`` with
  ``logprobs`` gives each token's id and logprob (and the top-n alternatives). Stop
  strings stay in the output (``include_stop_str_in_output``) as with kubeshard's engine;
  ``stop_reason`` tells a stop string from EOS.
- ``llamacpp`` (llama-cpp-python's server): the prompt goes as text (the router's tokens
  decoded; the server re-encodes them to the same tokens), one SSE chunk per generated
  token. Token ids are derived honestly: the router tokenizes each streamed piece. Stop
  sequences are matched by the router, which then cancels the engine's request (its
  server trims them and cannot say which one matched). The server runs without
  ``logits_all`` (a buffer of context x vocabulary floats, and logprobs computed over the
  whole vocabulary in Python per token), so a token's logprob is unknown (NaN, shown as
  null) and ``top_n_tokens`` is refused.

- ``openai`` (generic: SGLang, TGI's own server, trtllm-serve, llama.cpp's
  ``llama-server``): only the fields of OpenAI's completions API (prompt as text,
  ``max_tokens``, ``temperature``, ``top_p``, ``seed``, frequency and presence
  penalties), whose meaning is the same everywhere (a server that lacks one of them,
  such as the penalties, ignores it: the router cannot tell). A streamed piece may hold
  several tokens: their ids are the router's tokenization of the piece, their logprobs
  unknown.
  Stop sequences are matched by the router (the API trims them and cannot say which one
  matched). Everything else (top-k, min-p, typical-p, repetition penalty, logit bias,
  top-n alternatives, ignoring EOS, stop token ids, a minimum length, keeping special
  tokens) is refused: engines name and honour those differently or not at all.
"""

from __future__ import annotations

from typing import Any, Optional

from kubeshard_proto import pb
from kubeshard_router.tokenization import ModelTokenizer

NAN = float("nan")


def _f(value: float) -> float:
    """A proto float32 as the decimal it was written as (0.7, not 0.699999988)."""
    return float(f"{value:.7g}")


class Unsupported(Exception):
    """A request field this engine cannot honour (the message names field and engine)."""


def _extensions(request: pb.GenerateRequest) -> dict[str, tuple[str, bool]]:
    """What a request may ask beyond OpenAI's completions API, by its field name in the
    error: (what it is, whether this request asks for it)."""
    s, stop = request.sampling, request.stopping
    return {
        "top_k": ("top-k sampling", s.do_sample and s.HasField("top_k") and s.top_k > 0),
        "min_p": ("min-p sampling", s.do_sample and s.HasField("min_p")),
        "typical_p": ("typical sampling", s.HasField("typical_p")),
        "repetition_penalty": ("a repetition penalty", s.HasField("repetition_penalty")),
        "logit_bias": ("a logit bias", bool(s.logit_bias)),
        "top_n_tokens": ("top-n alternatives (logprobs)", bool(request.top_n_tokens)),
        "ignore_eos": ("ignoring EOS", stop.ignore_eos),
        "stop_token_ids": ("stopping on token ids", bool(stop.stop_token_ids)),
        "min_tokens": ("a minimum number of new tokens", bool(stop.min_new_tokens)),
        "skip_special_tokens": ("keeping special tokens in the text",
                                request.HasField("skip_special_tokens")
                                and not request.skip_special_tokens),
    }


class Dialect:
    """How one engine's /v1/completions is spoken. ``body`` builds the request (raising
    ``Unsupported``); ``token_ids`` and ``finish`` read its chunks."""

    name = "base"
    router_stops = False  # True: the router matches stop sequences itself
    refused: tuple[str, ...] = ()  # the ``_extensions`` this engine cannot honour, in check order

    def refuse(self, field: str, what: str) -> Unsupported:
        return Unsupported(f"`{field}`: {what} is not supported by the {self.name} engine "
                           f"that serves this model")

    def common(self, request: pb.GenerateRequest, model_id: str) -> dict[str, Any]:
        if request.n > 1:
            raise self.refuse("n", "more than one sequence per request")
        if request.HasField("grammar"):
            raise self.refuse("grammar", "a grammar")
        if request.adapter:
            raise self.refuse("adapter_id", "a LoRA adapter")
        if request.prefill_details or request.prefill_top_n_tokens:
            raise self.refuse("decoder_input_details", "prompt token details")
        extensions = _extensions(request)
        for field in self.refused:
            what, asked = extensions[field]
            if asked:
                raise self.refuse(field, what)
        s, stop = request.sampling, request.stopping
        body: dict[str, Any] = {"model": model_id, "stream": True,
                                "max_tokens": stop.max_new_tokens}
        if s.do_sample:
            body["temperature"] = _f(s.temperature) if s.HasField("temperature") else 1.0
            body["top_p"] = _f(s.top_p) if s.HasField("top_p") else 1.0
            if s.HasField("seed"):
                body["seed"] = s.seed
        else:
            body["temperature"] = 0.0
        if s.HasField("frequency_penalty"):
            body["frequency_penalty"] = _f(s.frequency_penalty)
        if s.HasField("presence_penalty"):
            body["presence_penalty"] = _f(s.presence_penalty)
        return body

    @staticmethod
    def add_extensions(request: pb.GenerateRequest, body: dict[str, Any],
                       repetition_penalty: str) -> None:
        """vLLM's extensions that llama.cpp takes too: min-p, a repetition penalty (under
        the engine's name for it), a logit bias, a minimum length."""
        s, stop = request.sampling, request.stopping
        if s.do_sample and s.HasField("min_p"):
            body["min_p"] = _f(s.min_p)
        if s.HasField("repetition_penalty"):
            body[repetition_penalty] = _f(s.repetition_penalty)
        if s.logit_bias:
            body["logit_bias"] = {str(k): _f(v) for k, v in s.logit_bias.items()}
        if stop.min_new_tokens:
            body["min_tokens"] = stop.min_new_tokens

    def finish(self, choice: dict, eos: bool) -> "pb.FinishReason.ValueType":
        """OpenAI's ``finish_reason`` says length or stop, and a stop is EOS: the router
        matches stop sequences itself."""
        if choice.get("finish_reason") == "length":
            return pb.FINISH_REASON_LENGTH
        return pb.FINISH_REASON_EOS_TOKEN


class VllmDialect(Dialect):
    name = "vllm"
    refused = ("typical_p",)

    def body(self, request: pb.GenerateRequest, model_id: str, tokenizer: ModelTokenizer
             ) -> dict[str, Any]:
        body = self.common(request, model_id)
        s, stop = request.sampling, request.stopping
        body.update(prompt=list(request.input_ids), return_tokens_as_token_ids=True,
                    logprobs=request.top_n_tokens, include_stop_str_in_output=True,
                    skip_special_tokens=request.skip_special_tokens
                    if request.HasField("skip_special_tokens") else True)
        if s.do_sample:
            body["top_k"] = s.top_k if s.HasField("top_k") and s.top_k > 0 else -1
        self.add_extensions(request, body, repetition_penalty="repetition_penalty")
        if stop.stop_sequences:
            body["stop"] = list(stop.stop_sequences)
        if stop.ignore_eos:
            body["ignore_eos"] = True
        if stop.stop_token_ids:
            body["stop_token_ids"] = list(stop.stop_token_ids)
        return body

    def token_ids(self, logprobs: Optional[dict], text: str, tokenizer: ModelTokenizer
                  ) -> list[tuple[int, float, list[pb.TopToken]]]:
        out = []
        if not logprobs:
            return [(i, NAN, []) for i in tokenizer.encode(text, add_special_tokens=False)]
        tops = logprobs.get("top_logprobs") or []
        for k, (tok, lp) in enumerate(zip(logprobs.get("tokens") or [],
                                          logprobs.get("token_logprobs") or [])):
            alternatives = []
            for alt, alt_lp in (tops[k] or {}).items() if k < len(tops) else ():
                alt_id = _vllm_id(alt)
                alternatives.append(pb.TopToken(id=alt_id, logprob=alt_lp,
                                                text=tokenizer.decode([alt_id])))
            alternatives.sort(key=lambda t: -t.logprob)
            out.append((_vllm_id(tok), NAN if lp is None else lp, alternatives))
        return out

    def finish(self, choice: dict, eos: bool) -> "pb.FinishReason.ValueType":
        reason = choice.get("finish_reason")
        if reason == "length":
            return pb.FINISH_REASON_LENGTH
        stop_reason = choice.get("stop_reason")
        if isinstance(stop_reason, str):
            return pb.FINISH_REASON_STOP_SEQUENCE
        if isinstance(stop_reason, int):
            return pb.FINISH_REASON_STOP_TOKEN
        return pb.FINISH_REASON_EOS_TOKEN


def _vllm_id(token: str) -> int:
    """vLLM's ``return_tokens_as_token_ids`` spelling, ``token_id:123``."""
    return int(token.rsplit(":", 1)[-1])


class LlamaCppDialect(Dialect):
    name = "llamacpp"
    router_stops = True
    refused = ("ignore_eos", "stop_token_ids", "skip_special_tokens", "typical_p", "top_n_tokens")

    def body(self, request: pb.GenerateRequest, model_id: str, tokenizer: ModelTokenizer
             ) -> dict[str, Any]:
        body = self.common(request, model_id)
        s = request.sampling
        # llama-cpp-python's own defaults (top_k 40, top_p 0.95, min_p 0.05) would filter
        # what kubeshard's engine leaves alone: send every warper, off unless asked for.
        body.update(prompt=tokenizer.decode(list(request.input_ids)), top_k=0,
                    top_p=body.get("top_p", 1.0), min_p=0.0, repeat_penalty=1.0)
        if s.do_sample and s.HasField("top_k") and s.top_k > 0:
            body["top_k"] = s.top_k
        self.add_extensions(request, body, repetition_penalty="repeat_penalty")
        if s.logit_bias:
            body["logit_bias_type"] = "input_ids"
        return body

    def token_ids(self, logprobs: Optional[dict], text: str, tokenizer: ModelTokenizer
                  ) -> list[tuple[int, float, list[pb.TopToken]]]:
        # One chunk is one engine token: its id is the router's tokenization of its text.
        ids = tokenizer.encode(text, add_special_tokens=False)
        return [(ids[0] if ids else 0, NAN, [])]


class OpenAIDialect(Dialect):
    name = "openai"
    router_stops = True
    refused = ("top_k", "min_p", "typical_p", "repetition_penalty", "logit_bias", "top_n_tokens",
               "ignore_eos", "stop_token_ids", "min_tokens", "skip_special_tokens")

    def body(self, request: pb.GenerateRequest, model_id: str, tokenizer: ModelTokenizer
             ) -> dict[str, Any]:
        body = self.common(request, model_id)
        body["prompt"] = tokenizer.decode(list(request.input_ids))
        return body

    def token_ids(self, logprobs: Optional[dict], text: str, tokenizer: ModelTokenizer
                  ) -> list[tuple[int, float, list[pb.TopToken]]]:
        return [(i, NAN, []) for i in tokenizer.encode(text, add_special_tokens=False)]


DIALECTS: dict[str, Dialect] = {"vllm": VllmDialect(), "llamacpp": LlamaCppDialect(),
                               "openai": OpenAIDialect()}
