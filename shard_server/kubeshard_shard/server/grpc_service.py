"""The gRPC ``kubeshard.v1.TextGeneration`` service of a shard-group leader.

It validates and tokenizes each request, streams the engine's tokens as ``Token``
messages, and maps failures to status codes with messages that name the problem:
INVALID_ARGUMENT (bad request), RESOURCE_EXHAUSTED (too many in flight), UNAVAILABLE
(loading, stopping, or a lost peer) and INTERNAL (the engine failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass

import grpc

from kubeshard_proto import pb, pb_grpc
from kubeshard_shard import __version__
from kubeshard_shard.engine.async_engine import AsyncEngine, EngineFailed, EngineOverloaded, EngineUnavailable
from kubeshard_shard.server.factory import ServedModel
from kubeshard_shard.server.fresh_thread import run_in_fresh_thread
from kubeshard_shard.engine.llm_engine import EngineStats, TokenOutput
from kubeshard_shard.engine.request import MAX_SEQUENCES, RequestError, check_prompt, make_sampling_params
from kubeshard_shard.engine.sequence import FinishReason, GrammarSpec, SamplingParams
from kubeshard_shard.models.lora import Adapter, AdapterError, LoraCommand, RuntimeLoadsOff
from kubeshard_shard.server.metrics import EngineMetrics

log = logging.getLogger(__name__)

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
}


@dataclass
class GroupInfo:
    strategy: str = "tensor"
    shards: int = 1


def grammar_spec(request: pb.GenerateRequest) -> GrammarSpec | None:
    if not request.HasField("grammar"):
        return None
    kind = request.grammar.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(list(request.grammar.choice.choices)))
    return GrammarSpec(kind, getattr(request.grammar, kind))


def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    s, st = request.sampling, request.stopping

    def opt(msg, name):
        return getattr(msg, name) if msg.HasField(name) else None

    def flag(name: str) -> bool:
        return getattr(request, name) if request.HasField(name) else True

    return make_sampling_params(
        max_new_tokens=st.max_new_tokens,
        do_sample=s.do_sample,
        temperature=opt(s, "temperature"),
        top_k=opt(s, "top_k"),
        top_p=opt(s, "top_p"),
        typical_p=opt(s, "typical_p"),
        repetition_penalty=opt(s, "repetition_penalty"),
        frequency_penalty=opt(s, "frequency_penalty"),
        presence_penalty=opt(s, "presence_penalty"),
        seed=opt(s, "seed"),
        stop_sequences=list(st.stop_sequences),
        ignore_eos=st.ignore_eos,
        top_n_tokens=request.top_n_tokens,
        prefill_details=request.prefill_details,
        prefill_top_n_tokens=request.prefill_top_n_tokens,
        min_p=opt(s, "min_p"),
        logit_bias=dict(s.logit_bias),
        stop_token_ids=list(st.stop_token_ids),
        min_new_tokens=st.min_new_tokens,
        skip_special_tokens=flag("skip_special_tokens"),
        spaces_between_special_tokens=flag("spaces_between_special_tokens"),
        n=request.n or 1,
        grammar=grammar_spec(request),
        adapter=request.adapter or None,
        speculative=s.speculative if s.HasField("speculative") else True,
    )


def adapter_message(a) -> pb.AdapterInfo:
    return pb.AdapterInfo(name=a.name, source=a.source, rank=a.rank, target_modules=a.target_modules)


def _top(t) -> pb.TopToken:
    return pb.TopToken(id=t.token_id, text=t.text, logprob=t.logprob, special=t.special)


def token_message(out: TokenOutput) -> pb.Token:
    msg = pb.Token(id=out.token_id, text=out.text, logprob=out.logprob, special=out.special, index=out.index,
                   sequence=out.sequence)
    if out.top:
        msg.top_tokens.extend(_top(t) for t in out.top)
    if out.prefill is not None:
        for p in out.prefill:
            item = pb.PrefillToken(id=p.token_id, text=p.text, top_tokens=[_top(t) for t in p.top])
            if p.logprob is not None:
                item.logprob = p.logprob
            msg.prefill.append(item)
    if out.finish is not None:
        f = out.finish
        msg.finish.CopyFrom(pb.FinishDetails(
            reason=FINISH_REASONS[f.reason], generated_tokens=f.generated_tokens, prompt_tokens=f.prompt_tokens,
            cached_prompt_tokens=f.cached_prompt_tokens, queue_time_ns=f.queue_time_ns,
            inference_time_ns=f.inference_time_ns, preemptions=f.preemptions,
            cumulative_logprob=f.cumulative_logprob))
        if f.seed is not None:
            msg.finish.seed = f.seed
    return msg


def stats_message(s: EngineStats) -> pb.StatsResponse:
    msg = _stats(s)
    msg.ranks.extend(_stats(r) for r in s.lanes)
    a = s.activation_cache
    if a is not None:
        msg.activation_cache.CopyFrom(pb.ActivationCacheStats(
            lookups=a.lookups, hits=a.hits, misses=a.lookups - a.hits, hit_blocks=a.hit_blocks,
            miss_blocks=a.miss_blocks, prefill_tokens_saved=a.tokens_saved, bytes_read=a.bytes_read,
            bytes_written=a.bytes_written, blocks_written=a.blocks_written, rejected_entries=a.rejected,
            redis_errors=a.errors, timeouts=a.timeouts, fetch_seconds_sum=a.fetch_seconds_sum,
            fetch_count=a.fetch_count, redis_up=a.redis_up))
    return msg


def _stats(s: EngineStats) -> pb.StatsResponse:
    return pb.StatsResponse(
        waiting=s.waiting, running=s.running, kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used,
        kv_blocks_free=s.kv_blocks_free, kv_blocks_cached=s.kv_blocks_cached,
        prefix_cache_hit_rate=s.prefix_cache_hit_rate, prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits, preemptions_total=s.preemptions_total,
        generated_tokens_total=s.generated_tokens_total, steps_total=s.steps_total)


class TextGenerationService(pb_grpc.TextGenerationServicer):
    """Answers UNAVAILABLE until ``attach`` hands it a loaded engine."""

    def __init__(self, model_id: str, revision: str, group: GroupInfo) -> None:
        self.model_id, self.revision, self.group = model_id, revision, group
        self.served: ServedModel | None = None
        self.engine: AsyncEngine | None = None
        self.metrics: EngineMetrics | None = None
        self.not_serving_reason = "the model is loading"

    def attach(self, served: ServedModel, engine: AsyncEngine, metrics: EngineMetrics | None) -> None:
        self.served, self.engine, self.metrics = served, engine, metrics

    def serving(self) -> tuple[bool, str]:
        if self.engine is None:
            return False, self.not_serving_reason
        if not self.engine.alive:
            return False, f"the engine is not running: {self.engine.error or 'stopped'}"
        return True, ""

    def _prompt(self, request: pb.GenerateRequest, params: SamplingParams) -> list[int]:
        served = self.served
        if request.input_ids:
            ids = list(request.input_ids)
        else:
            if not request.inputs:
                raise RequestError("the prompt is empty: set `inputs` (text) or `input_ids`")
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = served.tokenizer.encode(request.inputs, add_special_tokens=add_special)
        if request.HasField("truncate"):
            if request.truncate < 1:
                raise RequestError(f"truncate must be >= 1, got {request.truncate}")
            ids = ids[-request.truncate:]
        check_prompt(ids, params, served.limits, served.model_config.vocab_size)
        return ids

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        ok, reason = self.serving()
        if not ok:
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        started = time.monotonic()
        try:
            params = sampling_params(request)
            if self.served.check_request is not None:  # what this runtime cannot do
                self.served.check_request(params)
            prompt = self._prompt(request, params)
        except RequestError as exc:
            self._count("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:  # NOT_FOUND: the router tries a replica that has the adapter (and reloads it here)
            self.served.engine.check_adapter(params.adapter)
        except RequestError as exc:
            self._count("invalid")
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        try:
            if params.grammar is not None:  # compiled (and cached) off the event loop; errors name the grammar
                await asyncio.to_thread(self.served.engine.grammars.compile, params.grammar)
        except RequestError as exc:
            self._count("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        first = None
        generated = 0
        finished = False
        try:
            # aclosing: the engine's stream ends (and aborts the request) here, not whenever
            # the garbage collector finalizes it
            async with contextlib.aclosing(self.engine.generate(request.request_id, prompt, params)) as outputs:
                async for out in outputs:
                    if first is None:
                        first = time.monotonic()
                    generated += 1
                    if out.done:  # counted before the last message: the client may close the stream on it
                        finished = True
                        self._finished(started, first, generated / params.n, out)
                    yield token_message(out)
        except EngineOverloaded as exc:
            self._count("overloaded")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineUnavailable as exc:
            self._count("unavailable")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except EngineFailed as exc:
            self._count("failed")
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        # the client went away (or its deadline passed) mid-stream: grpc.aio cancels the task
        # while it awaits the engine, but closes this generator (GeneratorExit at the yield)
        # while it awaits sending a message
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self._count("cancelled")
            raise

    def _finished(self, started: float, first: float, per_sequence: float, last: TokenOutput) -> None:
        if self.metrics is None:
            return
        done = time.monotonic()
        self.metrics.ttft.observe(first - started)
        self.metrics.e2e.observe(done - started)
        if per_sequence > 1:
            self.metrics.tpot.observe((done - first) / (per_sequence - 1))
        self.metrics.prompt_tokens.inc(last.finish.prompt_tokens)
        self._count("finished")

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(self.metrics.model, outcome).inc()

    async def Info(self, request, context):
        served = self.served
        if served is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.not_serving_reason)
        cfg, mc = served.config, served.model_config
        return pb.InfoResponse(
            model_id=self.model_id, revision=self.revision, architecture=mc.architecture,
            dtype=str(served.dtype).removeprefix("torch."), device_type=served.device.type,
            max_input_tokens=served.limits.max_input_tokens, max_total_tokens=served.limits.max_total_tokens,
            max_batch_tokens=cfg.max_batch_tokens, max_concurrent_requests=cfg.max_concurrent_requests,
            block_size=cfg.block_size, num_kv_blocks=served.num_kv_blocks, strategy=self.group.strategy,
            shards=self.group.shards, vocab_size=mc.vocab_size, eos_token_ids=sorted(served.tokenizer.eos_ids),
            tokenizer_json=served.tokenizer.tokenizer_json,
            tokenizer_config_json=served.tokenizer.tokenizer_config_json, version=__version__,
            rank_parameter_bytes=served.rank_parameter_bytes,
            max_sequences_per_request=MAX_SEQUENCES if served.runtime == "kubeshard" else 1,
            runtime=served.runtime, adapters=[adapter_message(a) for a in self._adapters()])

    def _adapters(self) -> list:
        lora = self.served.engine.runner.lora if self.served is not None else None
        return [lora.by_name[n] for n in lora.names()] if lora is not None else []

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext):
        if self.served is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.not_serving_reason)
        runner = self.served.engine.runner
        if runner.lora is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "this server loads no LoRA adapters at run time: start it with --lora-root DIR")
        if not request.name or not request.source:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LoadAdapter needs a name and a source folder")
        if request.name in runner.lora.by_name:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"adapter {request.name!r} is already loaded")
        lora = runner.lora
        try:
            source = lora.runtime_source(request.source)
            single = self.served.strategy.shards == 1

            def read():  # off the event loop (reading the files and restacking the buffers take a
                # while), in a thread that ends: see fresh_thread; a group adds it in _load_on_group
                adapter = lora.read(request.name, source)
                if single:
                    lora.add(adapter)
                return adapter

            adapter = await run_in_fresh_thread(read, "lora-load")
            if not single:  # between two steps, on every rank at once (Strategy.lora_command)
                await self.engine.call(lambda: self._load_on_group(adapter, source))
        except FileExistsError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except RuntimeLoadsOff as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except (AdapterError, OSError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:  # the engine stopped, or the group's collective failed
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"adapter {request.name!r} was not loaded: {exc}")
        log.info("LoRA adapter %s loaded from %s (rank %d)", adapter.name, adapter.source, adapter.rank)
        return adapter_message(adapter)

    def _load_on_group(self, adapter: Adapter, source: str) -> None:
        """The leader's side of a group's runtime load (in the engine thread, so no step
        sees one rank with the adapter and another without): every other rank reads and
        adds it, then the leader adds the one it read; when a rank refuses, the ranks that
        took it drop it again and the load fails naming them."""
        lora, strategy = self.served.engine.runner.lora, self.served.strategy
        rows = strategy.lora_command(LoraCommand("load", adapter.name, source), [1, 0])
        refused = [rank for rank, (done, _) in enumerate(rows) if rank and not done]
        if not refused:
            slot = lora.add(adapter)
            refused = [rank for rank, (_, other) in enumerate(rows) if rank and other != slot]
            if refused:  # cannot happen while every rank adds and removes in the same order
                lora.remove(adapter.name)
        if refused:
            strategy.lora_command(LoraCommand("unload", adapter.name), [1, 0])
            ranks = ", ".join(map(str, refused))
            raise AdapterError(f"adapter {adapter.name!r}: rank {ranks} of the group could not load {source} "
                               "(its log says why); no rank keeps it")

    def _unload_on_group(self, name: str) -> None:
        """The leader's side of a group's unload (in the engine thread): the leader refuses
        first (unknown, or serving requests), before any other rank is told."""
        self.served.engine.runner.lora.remove(name)
        self.served.strategy.lora_command(LoraCommand("unload", name), [1, 0])

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext):
        lora = self.served.engine.runner.lora if self.served is not None else None
        if lora is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.name!r} is not loaded")
        try:
            if self.served.strategy.shards == 1:
                lora.remove(request.name)
            else:
                await self.engine.call(lambda: self._unload_on_group(request.name))
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except EngineUnavailable as exc:  # before RuntimeError, its base
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.UnloadAdapterResponse()

    async def Health(self, request, context):
        ok, reason = self.serving()
        return pb.HealthResponse(serving=ok, message=reason, adapters=[a.name for a in self._adapters()])

    async def Stats(self, request, context):
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.not_serving_reason)
        return stats_message(self.engine.stats)
