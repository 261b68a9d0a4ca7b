"""ONNX Runtime GenAI as an engine of the shard server (``--runtime onnx``).

It implements what ``AsyncEngine`` drives (``add_request``, ``step``, ``abort``,
``stats``, ...), so the gRPC service, metrics, health and drain work unchanged and the
router sees a kubeshard replica. One ``og.Generator`` per request holds its KV cache;
a step is schedule → execute → update: admit waiting requests up to ``max_num_seqs``,
advance every running generator by one token, then detokenize, check the stops and
emit. Logprobs and top-n alternatives come from the step's logits (log-softmax of the
row the token is picked from, read before the generator moves on).

What ONNX Runtime GenAI's search cannot do is refused when the request arrives
(``check``, a ``RequestError`` naming the field): typical-p, min-p, frequency and
presence penalties, logit bias, grammars, adapters, several sequences, prompt details
and ignoring EOS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from kubeshard_shard.engine.detokenizer import IncrementalDetokenizer
from kubeshard_shard.engine.llm_engine import EngineStats, FinishInfo, TokenOutput, TopToken
from kubeshard_shard.engine.request import RequestError
from kubeshard_shard.engine.sequence import FinishReason, SamplingParams
from kubeshard_shard.engine.step_counters import StepCounters
from kubeshard_shard.engine.stopping import stop_reason
from kubeshard_shard.tokenizer import ModelTokenizer


class Refusals:
    """Stands in for the engine's grammar cache: ONNX Runtime GenAI here has none."""

    def compile(self, spec) -> None:
        raise RequestError("grammar: structured output is not supported by the onnx runtime")


class _NoLora:
    """Stands in for the model runner the gRPC service asks about LoRA: none here."""

    lora = None


@dataclass(eq=False)
class _Request:
    key: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival: float = field(default_factory=time.monotonic)
    generator: object = None
    first_scheduled: Optional[float] = None
    generated: int = 0
    cumulative_logprob: float = 0.0
    max_stop_len: int = 0


def log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


class OnnxEngine:
    def __init__(self, model_dir: Path, tokenizer: ModelTokenizer, max_num_seqs: int) -> None:
        import onnxruntime_genai as og

        self._og = og
        self.model = og.Model(str(model_dir))
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.grammars = Refusals()
        self.runner = _NoLora()
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.requests: dict[int, _Request] = {}
        self.counters = StepCounters()

    # ---- what the gRPC service checks first ------------------------------------------
    @staticmethod
    def check(params: SamplingParams) -> None:
        refused = {
            "typical_p": params.typical_p is not None,
            "min_p": params.min_p is not None,
            "frequency_penalty": bool(params.frequency_penalty),
            "presence_penalty": bool(params.presence_penalty),
            "logit_bias": bool(params.logit_bias),
            "n": params.n > 1,
            "grammar": params.grammar is not None,
            "adapter": params.adapter is not None,
            "decoder_input_details": params.prefill_details,
            "ignore_eos": params.ignore_eos,
        }
        for name, bad in refused.items():
            if bad:
                raise RequestError(f"{name} is not supported by the onnx runtime (ONNX Runtime GenAI)")

    @staticmethod
    def check_adapter(name: Optional[str]) -> None:
        if name:
            raise RequestError("adapter: LoRA adapters are not supported by the onnx runtime")

    # ---- requests -----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> int:
        key = self.counters.new_key()
        detok = IncrementalDetokenizer(self.tokenizer.tokenizer, list(prompt_ids), self.tokenizer.special_ids,
                                       params.skip_special_tokens, params.spaces_between_special_tokens)
        request = _Request(key, request_id, list(prompt_ids), params, detok,
                           max_stop_len=max(map(len, params.stop_sequences), default=0))
        self.requests[key] = request
        self.waiting.append(request)
        return key

    def abort(self, key: int) -> bool:
        request = self.requests.pop(key, None)
        if request is None:
            return False
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        request.generator = None  # frees its KV cache
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def ready(self) -> bool:
        return self.has_work()

    def wait_hint(self) -> float:
        return 0.05

    def wake_with(self, wake: Callable[[], None]) -> None:
        return None

    def stats(self) -> EngineStats:
        return EngineStats(waiting=len(self.waiting), running=len(self.running), **self.counters.totals())

    # ---- one step: schedule, execute, update -----------------------------------------
    def step(self) -> list[TokenOutput]:
        started = time.perf_counter()
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self._start(self.waiting.pop(0)))
        outputs = []
        for request in list(self.running):
            # the logits the next token is picked from (after it, get_logits is the next step's)
            logits = np.asarray(request.generator.get_logits(), dtype=np.float32).reshape(-1)
            request.generator.generate_next_token()
            token_id = int(request.generator.get_next_tokens()[0])
            outputs.append(self._update(request, token_id, log_softmax(logits)))
        self.counters.step_done(started)
        return outputs

    def _start(self, request: _Request):
        p = request.params
        params = self._og.GeneratorParams(self.model)
        options = {"max_length": len(request.prompt_ids) + p.max_new_tokens, "do_sample": p.do_sample,
                   "batch_size": 1}
        if p.min_new_tokens:
            options["min_length"] = len(request.prompt_ids) + p.min_new_tokens
        if p.repetition_penalty is not None:
            options["repetition_penalty"] = p.repetition_penalty
        if p.do_sample:
            # ONNX Runtime GenAI's own defaults (top_k 50) would filter what kubeshard leaves alone
            options.update(temperature=p.temperature, top_p=p.top_p if p.top_p is not None else 1.0,
                           top_k=p.top_k if p.top_k is not None else self.tokenizer.tokenizer.get_vocab_size())
            if p.seed is not None:
                options["random_seed"] = p.seed % 2**31
        params.set_search_options(**options)
        request.generator = self._og.Generator(self.model, params)
        request.generator.append_tokens(np.asarray(request.prompt_ids, dtype=np.int32))
        request.first_scheduled = time.monotonic()
        return request

    def _update(self, request: _Request, token_id: int, logprobs: np.ndarray) -> TokenOutput:
        p = request.params
        request.generated += 1
        self.counters.token_generated()
        scale = p.temperature if p.do_sample and p.temperature else 1.0
        lps = logprobs if scale == 1.0 else log_softmax(logprobs * (1.0 / scale))
        logprob = float(lps[token_id]) if token_id < lps.shape[0] else float("nan")
        request.cumulative_logprob += logprob
        text = request.detok.add(token_id)
        reason = self._stop_reason(request, token_id, text)
        if reason is not None:
            text += request.detok.flush()
        top = []
        if p.top_n_tokens:
            best = np.argpartition(-lps, p.top_n_tokens)[:p.top_n_tokens]
            top = [TopToken(int(t), self.tokenizer.token_text(int(t)), float(lps[t]),
                            int(t) in self.tokenizer.special_ids)
                   for t in sorted(best, key=lambda t: -lps[t])]
        finish = None
        if reason is not None:
            finish = self._finish(request, reason)
        return TokenOutput(request.key, token_id, text, logprob, token_id in self.tokenizer.special_ids,
                           request.generated - 1, top, None, finish, 0, finish is not None)

    def _stop_reason(self, request: _Request, token_id: int, text: str) -> Optional[FinishReason]:
        p = request.params
        reason = stop_reason(p, self.tokenizer.eos_ids, request.generated, token_id, text, request.detok.text,
                             request.max_stop_len, early=request.generated < p.min_new_tokens)
        if reason is None and request.generator.is_done():
            return FinishReason.LENGTH
        return reason

    def _finish(self, request: _Request, reason: FinishReason) -> FinishInfo:
        self.requests.pop(request.key, None)
        self.running.remove(request)
        request.generator = None
        now = time.monotonic()
        first = request.first_scheduled or now
        return FinishInfo(reason=reason, generated_tokens=request.generated,
                          prompt_tokens=len(request.prompt_ids), cached_prompt_tokens=0,
                          seed=request.params.seed if request.params.do_sample else None,
                          queue_time_ns=int((first - request.arrival) * 1e9),
                          inference_time_ns=int((now - first) * 1e9), preemptions=0,
                          cumulative_logprob=request.cumulative_logprob)
