"""StubBackend: a TEST DOUBLE of a shard-group leader, for router-only tests and the
router overhead benchmark. It is not a model: it serves the real gRPC contract
(``kubeshard.v1.TextGeneration``) with a small real byte-level BPE tokenizer and a
deterministic "generator" (greedy: a function of the prompt; sampled: of the seed), and
lets a test inject failures (unavailable before the first token, failure after k tokens,
overload, hangs) and observe cancellations. Tests of the real engine use
``kubeshard serve-shard`` instead.

Run standalone (for the benchmark): ``python -m tests.support.stub_backend --port 50051``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
from dataclasses import dataclass, field
from typing import Optional

import grpc
from grpc import aio
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kubeshard_proto import pb, pb_grpc

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role ' + m['role'] + ' is not supported by this template') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = [
    "the quick brown fox jumps over the lazy dog and the cat sleeps in the warm sun",
    "kubernetes schedules pods onto nodes while the router streams tokens to clients",
    "a language model predicts the next token from the tokens that came before it",
    "prefix caching reuses the key value blocks of prompts that share a beginning",
    "hello world this is a small corpus for a tiny byte level tokenizer used in tests",
    "system user assistant you are a helpful assistant answer briefly and clearly",
] * 20


@functools.lru_cache(maxsize=1)
def stub_tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok.to_str()


def stub_tokenizer_config() -> dict:
    return {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
            "chat_template": CHAT_TEMPLATE}


@functools.lru_cache(maxsize=1)
def _word_ids() -> tuple[list[int], dict[int, str]]:
    tok = Tokenizer.from_str(stub_tokenizer_json())
    words = []
    texts = {}
    for token, tid in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        text = tok.decode([tid])
        if token.startswith("Ġ") and text[1:].isalpha() and len(text) > 2:
            words.append(tid)
            texts[tid] = text
    return words, texts


@dataclass
class StubBehaviour:
    """What the stub does; tests change it between requests."""

    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    fail_next: int = 0             # the next N calls: UNAVAILABLE before any token
    fail_after_tokens: Optional[int] = None  # every call: UNAVAILABLE after k tokens
    hang_after_tokens: Optional[int] = None  # every call: stop producing after k tokens
    exhausted: bool = False        # every call: RESOURCE_EXHAUSTED
    invalid: Optional[str] = None  # every call: INVALID_ARGUMENT with this message
    eos_after: Optional[int] = None  # emit EOS after this many tokens (unless ignore_eos)
    serving: bool = True


@dataclass
class StubCounters:
    """What the stub saw: Generate calls, those running now, cancelled and completed, and
    (with keep_requests) each request as it came."""

    generate_calls: int = 0
    active: int = 0
    cancelled: int = 0
    completed: int = 0
    requests: list = field(default_factory=list)


class StubService(pb_grpc.TextGenerationServicer):
    def __init__(self, *, model_id: str, revision: str, max_input_tokens: int, max_total_tokens: int,
                 max_concurrent_requests: int, block_size: int, behaviour: StubBehaviour,
                 counters: StubCounters, keep_requests: bool) -> None:
        self.model_id, self.revision = model_id, revision
        self.max_input_tokens, self.max_total_tokens = max_input_tokens, max_total_tokens
        self.max_concurrent_requests, self.block_size = max_concurrent_requests, block_size
        self.behaviour, self.counters, self.keep_requests = behaviour, counters, keep_requests
        self.tokenizer = Tokenizer.from_str(stub_tokenizer_json())
        self.eos_id = self.tokenizer.token_to_id("</s>")
        self.words, self.word_text = _word_ids()

    async def Info(self, request, context):
        return pb.InfoResponse(
            model_id=self.model_id, revision=self.revision, architecture="StubForCausalLM",
            dtype="float32", device_type="cpu", max_input_tokens=self.max_input_tokens,
            max_total_tokens=self.max_total_tokens, max_batch_tokens=8192,
            max_concurrent_requests=self.max_concurrent_requests, block_size=self.block_size,
            num_kv_blocks=1024, strategy="tensor", shards=1,
            vocab_size=self.tokenizer.get_vocab_size(), eos_token_ids=[self.eos_id],
            tokenizer_json=stub_tokenizer_json().encode(),
            tokenizer_config_json=json.dumps(stub_tokenizer_config()).encode(), version="stub")

    async def Health(self, request, context):
        return pb.HealthResponse(serving=self.behaviour.serving,
                                 message="" if self.behaviour.serving else "stub told not to serve")

    async def Stats(self, request, context):
        return pb.StatsResponse(running=self.counters.active)

    async def Generate(self, request: pb.GenerateRequest, context):
        b, c = self.behaviour, self.counters
        c.generate_calls += 1
        if self.keep_requests:
            c.requests.append(request)
        if b.fail_next > 0:
            b.fail_next -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stub: injected failure before first token")
        if b.exhausted:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "stub: max_concurrent_requests reached")
        if b.invalid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, b.invalid)
        ids = list(request.input_ids) or self.tokenizer.encode(request.inputs).ids
        s = request.sampling
        seed = s.seed if s.HasField("seed") else random.getrandbits(63)
        rng = random.Random(seed) if s.do_sample else None
        base = sum(ids) + len(ids)
        stops = list(request.stopping.stop_sequences)
        c.active += 1
        text = ""
        try:
            if b.first_token_delay_s:
                await asyncio.sleep(b.first_token_delay_s)
            n = request.stopping.max_new_tokens
            for i in range(n):
                if b.fail_after_tokens is not None and i == b.fail_after_tokens:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "stub: injected failure mid-stream")
                if b.hang_after_tokens is not None and i == b.hang_after_tokens:
                    await asyncio.sleep(3600)
                if i and b.token_delay_s:
                    await asyncio.sleep(b.token_delay_s)
                eos = (b.eos_after is not None and i == b.eos_after and not request.stopping.ignore_eos)
                if eos:
                    tid, piece, special = self.eos_id, "</s>", True
                else:
                    k = rng.randrange(len(self.words)) if rng else (base + 7 * i) % len(self.words)
                    tid = self.words[k]
                    piece, special = self.word_text[tid], False
                    text += piece
                token = pb.Token(id=tid, text=piece, logprob=-0.25 - 0.01 * i, special=special, index=i)
                if request.top_n_tokens:
                    token.top_tokens.extend(
                        pb.TopToken(id=self.words[(tid + j) % len(self.words)],
                                    text=self.word_text[self.words[(tid + j) % len(self.words)]],
                                    logprob=-0.25 - 0.5 * j) for j in range(request.top_n_tokens))
                if i == 0 and request.prefill_details:
                    token.prefill.extend(pb.PrefillToken(id=t, text=self.tokenizer.decode([t])) if j == 0
                                         else pb.PrefillToken(id=t, text=self.tokenizer.decode([t]),
                                                              logprob=-1.0) for j, t in enumerate(ids))
                reason = None
                if eos:
                    reason = pb.FINISH_REASON_EOS_TOKEN
                elif any(text.endswith(x) for x in stops):
                    reason = pb.FINISH_REASON_STOP_SEQUENCE
                elif i == n - 1:
                    reason = pb.FINISH_REASON_LENGTH
                if reason is not None:
                    token.finish.CopyFrom(pb.FinishDetails(
                        reason=reason, generated_tokens=i + 1, prompt_tokens=len(ids),
                        seed=seed if s.do_sample else None, queue_time_ns=1000, inference_time_ns=1000 * (i + 1)))
                    yield token
                    c.completed += 1
                    return
                yield token
        except (asyncio.CancelledError, GeneratorExit):
            # a call cancelled while this generator waits is CancelledError; one cancelled
            # while it is parked at a yield is closed (GeneratorExit): a CI run missed those
            c.cancelled += 1
            raise
        finally:
            c.active -= 1


class StubBackend:
    """A stub leader on a loopback port, in the caller's event loop."""

    def __init__(self, *, model_id: str = "stub", revision: str = "r1", max_input_tokens: int = 200,
                 max_total_tokens: int = 256, max_concurrent_requests: int = 4096,
                 block_size: int = 16, keep_requests: bool = True) -> None:
        self.behaviour = StubBehaviour()
        self.counters = StubCounters()
        self.service = StubService(model_id=model_id, revision=revision,
                                   max_input_tokens=max_input_tokens, max_total_tokens=max_total_tokens,
                                   max_concurrent_requests=max_concurrent_requests, block_size=block_size,
                                   behaviour=self.behaviour, counters=self.counters,
                                   keep_requests=keep_requests)
        self.server: Optional[aio.Server] = None
        self.port = 0
        self.host = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self, port: int = 0, host: Optional[str] = None) -> "StubBackend":
        self.host = host or self.host
        self.server = aio.server(options=[("grpc.max_concurrent_streams", 100_000),
                                          ("grpc.so_reuseport", 0)])
        pb_grpc.add_TextGenerationServicer_to_server(self.service, self.server)
        self.port = self.server.add_insecure_port(f"{self.host}:{port or self.port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None


async def _main(args: argparse.Namespace) -> None:
    stub = StubBackend(max_input_tokens=args.max_input_tokens, max_total_tokens=args.max_total_tokens,
                       keep_requests=False)
    stub.behaviour.token_delay_s = args.token_delay
    stub.behaviour.first_token_delay_s = args.first_token_delay
    await stub.start(args.port)
    print(f"stub backend on {stub.address}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="StubBackend (test double of a shard leader)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--first-token-delay", type=float, default=0.0)
    parser.add_argument("--max-input-tokens", type=int, default=4000)
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    try:
        import uvloop
        uvloop.run(_main(parser.parse_args()))
    except KeyboardInterrupt:
        pass
