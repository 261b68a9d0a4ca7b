"""The engine step: schedule -> execute -> update, nothing else.

``LLMEngine`` is single-threaded and synchronous; ``AsyncEngine`` runs it in a thread
for the gRPC server. Outputs are plain dataclasses, one per generated token.

An engine drives one or more *lanes*: a lane is a scheduler with its own KV pool. A
single process or a tensor-parallel group has one lane; a zero3 group has one per rank
(data parallel), all scheduled here on the leader and executed in lockstep. How a
step's inputs (one per lane) are computed is the ``StepExecutor``'s business: the
group's sharding strategy, handed to the engine at construction.

With a ``Speculator`` (``engine.speculative``), decoding sequences get proposals after
scheduling and their verification rows are settled in the update.

With an activation cache (``activations.coordinator``), a new request whose prompt
prefix may be in Redis waits aside while its blocks are fetched, then joins its lane's
queue and finds them in the prefix cache; the cache settles its transfers before each
step and hears of every prompt computed, off the step itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from kubeshard_shard.activations.coordinator import ActivationCache, ActivationCacheStats
from kubeshard_shard.engine.block_manager import BlockManager
from kubeshard_shard.engine.detokenizer import IncrementalDetokenizer
from kubeshard_shard.engine.grammar import GrammarCache
from kubeshard_shard.engine.lane import Lane
from kubeshard_shard.engine.model_runner import ModelRunner, StepInputs, StepPlan
from kubeshard_shard.engine.rejection import verify
from kubeshard_shard.engine.sampler import Sampler, token_logprobs
from kubeshard_shard.engine.scheduler import Scheduler
from kubeshard_shard.engine.speculative import SpeculativeStats, Speculator
from kubeshard_shard.engine.stopping import stop_reason
from kubeshard_shard.engine.step_counters import StepCounters
from kubeshard_shard.engine.request import RequestError
from kubeshard_shard.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from kubeshard_shard.models.lora import AdapterError
from kubeshard_shard.tokenizer import ModelTokenizer


@dataclass(frozen=True)
class TopToken:
    token_id: int
    text: str
    logprob: float
    special: bool


@dataclass(frozen=True)
class PrefillToken:
    token_id: int
    text: str
    logprob: float | None
    top: list[TopToken] = field(default_factory=list)


@dataclass(frozen=True)
class FinishInfo:
    reason: FinishReason
    generated_tokens: int
    prompt_tokens: int
    cached_prompt_tokens: int
    seed: int | None
    queue_time_ns: int
    inference_time_ns: int
    preemptions: int
    cumulative_logprob: float = 0.0


@dataclass(frozen=True)
class TokenOutput:
    request_key: int
    token_id: int
    text: str
    logprob: float
    special: bool
    index: int
    top: list[TopToken] = field(default_factory=list)
    prefill: list[PrefillToken] | None = None
    finish: FinishInfo | None = None  # the end of this sequence
    sequence: int = 0                 # which of the request's n sequences
    done: bool = False                # the last output of the request (every sequence finished)


@dataclass
class EngineStats:
    """One snapshot of an engine for Stats and /metrics: its queues, its KV blocks and
    prefix cache, its step and token totals, and per lane, adapter and cache details."""

    waiting: int = 0
    running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions_total: int = 0
    generated_tokens_total: int = 0
    steps_total: int = 0
    last_step_seconds: float = 0.0
    step_seconds_total: float = 0.0
    comm_seconds_total: float = 0.0
    # per-lane figures when the engine drives several lanes (zero3 ranks)
    lanes: list["EngineStats"] = field(default_factory=list)
    # LoRA: adapters of running and of waiting requests, and how many may be loaded
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    max_loras: int = 0
    activation_cache: ActivationCacheStats | None = None
    speculative: SpeculativeStats | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def lane_stats(lane: Lane) -> EngineStats:
    bm, sch = lane.block_manager, lane.scheduler
    return EngineStats(
        waiting=len(sch.waiting), running=len(sch.running), kv_blocks_total=bm.num_blocks,
        kv_blocks_used=bm.num_used_blocks, kv_blocks_free=bm.num_free_blocks,
        kv_blocks_cached=bm.num_cached_free_blocks, prefix_cache_queries=bm.prefix_queries,
        prefix_cache_hits=bm.prefix_hits, preemptions_total=sch.preemptions_total)


class StepExecutor(Protocol):
    """Computes one step: the inputs of every lane in, the logits of every lane out."""

    def execute(self, runner: ModelRunner, inputs: list[StepInputs | None]) -> list[torch.Tensor | None]: ...

    @property
    def comm_seconds(self) -> float:
        """Seconds spent in group communication so far (0 for a group of one)."""


class _SequenceState:
    __slots__ = ("seq", "detok", "max_stop_len", "lane", "request")

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer, lane: Lane, request: "_Request") -> None:
        self.lane = lane
        self.seq = seq
        self.detok = detok
        self.request = request
        self.max_stop_len = max((len(s) for s in seq.params.stop_sequences), default=0)


class _Request:
    """One request: its first sequence, and once that one has computed the prompt, the
    other n - 1 (``forked``)."""

    __slots__ = ("key", "states", "forked", "unfinished")

    def __init__(self, key: int) -> None:
        self.key = key
        self.states: list[_SequenceState] = []
        self.forked = False
        self.unfinished = 0


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: ModelTokenizer, lanes: list[Lane],
                 executor: StepExecutor, cache: ActivationCache | None = None,
                 speculator: Speculator | None = None, kernels=None) -> None:
        self.runner = runner
        self.cache = cache
        self.speculator = speculator  # its lookahead must be the lanes' schedulers' (Lane.create)
        self.tokenizer = tokenizer
        self.lanes = lanes
        self.executor = executor
        vocab_size = runner.model.config.vocab_size
        self.sampler = Sampler(tokenizer.eos_ids, vocab_size, kernels)
        self.grammars = GrammarCache(tokenizer.tokenizer_json, tokenizer.eos_ids, vocab_size)
        self.requests: dict[int, _Request] = {}
        self.counters = StepCounters()

    # single-lane conveniences (tests, tools)
    @property
    def scheduler(self) -> Scheduler:
        return self.lanes[0].scheduler

    @property
    def block_manager(self) -> BlockManager:
        return self.lanes[0].block_manager

    # ---- requests ----------------------------------------------------------------
    def _pick_lane(self, prompt_ids: list[int]) -> Lane:
        """Least-loaded lane; among lanes within one request of the least load, the one
        holding the longest cached prefix of this prompt."""
        if len(self.lanes) == 1:
            return self.lanes[0]
        least = min(self._load(s) for s in self.lanes)
        candidates = [s for s in self.lanes if self._load(s) <= least + 1]
        return max(candidates,
                   key=lambda s: (s.block_manager.count_cached_prefix(prompt_ids), -self._load(s), -s.index))

    def check_adapter(self, name: str | None):
        """The adapter a request names (None: the base model); RequestError when unknown."""
        if name is None:
            return None
        lora = self.runner.lora
        if lora is None:
            raise RequestError(f"adapter {name!r}: this server serves no LoRA adapters (start it with "
                               "--lora-adapter NAME=PATH or --enable-lora)")
        try:
            return lora.resolve(name)
        except AdapterError as exc:
            raise RequestError(str(exc)) from None

    def _new_sequence(self, request: _Request, lane: Lane, request_id: str, prompt_ids: list[int],
                      params: SamplingParams, index: int) -> _SequenceState:
        seq = Sequence(request_id, list(prompt_ids), params, index=index)
        seq.key = request.key
        adapter = self.check_adapter(params.adapter)
        if adapter is not None:
            lora = self.runner.lora
            seq.adapter_slot, seq.hash_root = lora.slot_of[adapter.name], adapter.hash_root
            lora.in_use[adapter.name] = lora.in_use.get(adapter.name, 0) + 1
        if params.grammar is not None:
            seq.matcher = self.grammars.matcher(params.grammar)
        detok = IncrementalDetokenizer(self.tokenizer.tokenizer, seq.prompt_ids, self.tokenizer.special_ids,
                                       params.skip_special_tokens, params.spaces_between_special_tokens)
        state = _SequenceState(seq, detok, lane, request)
        request.states.append(state)
        request.unfinished += 1
        return state

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> int:
        """Queues a validated request; returns its key for ``abort`` and outputs. A request
        of n sequences starts with one; the others follow once it has computed the prompt."""
        key = self.counters.new_key()
        request = _Request(key)
        lane = self._pick_lane(list(prompt_ids))
        state = self._new_sequence(request, lane, request_id, prompt_ids, params, 0)
        if params.prefill_details:
            state.seq.prefill_logprobs = [None] * len(prompt_ids)
            if params.prefill_top_n_tokens:
                state.seq.prefill_top = [[] for _ in prompt_ids]
        request.forked = params.n == 1
        self.requests[key] = request
        self._queue(lane, state.seq)
        return key

    def _fork(self, request: _Request) -> None:
        """Starts the other n - 1 sequences of a request whose first sequence has just
        computed its prompt: they hold its full prompt blocks by reference and go to
        the front of its lane's queue."""
        first = request.states[0]
        request.forked = True
        p = first.seq.params
        children = [self._new_sequence(request, first.lane, first.seq.request_id, first.seq.prompt_ids, p, i)
                    for i in range(1, p.n)]
        for child in reversed(children):
            first.lane.block_manager.share_prompt(first.seq, child.seq)
            first.lane.scheduler.add(child.seq, front=True)

    def _queue(self, lane: Lane, seq: Sequence) -> None:
        if self.cache is None or not self.cache.hold(lane, seq):
            lane.scheduler.add(seq)

    def _load(self, lane: Lane) -> int:
        """Requests on a lane, those waiting for their prefix from Redis included."""
        return lane.load + (self.cache.held_on(lane) if self.cache is not None else 0)

    def abort(self, key: int) -> bool:
        request = self.requests.pop(key, None)
        if request is None:
            return False
        for state in request.states:
            if state.seq.status is SequenceStatus.FINISHED:
                continue
            state.seq.aborted = True
            state.seq.status = SequenceStatus.FINISHED
            state.lane.scheduler.remove(state.seq)
            if self.cache is not None:
                self.cache.forget(state.seq)
            self._release_adapter(state.seq)
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter_slot and seq.params.adapter:
            self.runner.lora.in_use[seq.params.adapter] -= 1

    def adapter_load(self) -> tuple[list[str], list[str]]:
        """Adapters of the running and of the waiting sequences (vllm:lora_requests_info)."""
        running, waiting = set(), set()
        for lane in self.lanes:
            running.update(s.params.adapter for s in lane.scheduler.running if s.params.adapter)
            waiting.update(s.params.adapter for s in lane.scheduler.waiting if s.params.adapter)
        return sorted(running), sorted(waiting)

    def has_work(self) -> bool:
        """Requests in flight, or activation-cache transfers not settled."""
        return any(s.scheduler.num_unfinished for s in self.lanes) or (self.cache is not None and self.cache.busy())

    def ready(self) -> bool:
        """Whether ``step`` has something to do now (else the only work left waits on
        Redis or on other ranks; sleep at most ``wait_hint`` seconds)."""
        return any(s.scheduler.num_unfinished for s in self.lanes) or (self.cache is not None and self.cache.ready())

    def wait_hint(self) -> float:
        return self.cache.wait_hint() if self.cache is not None else 0.05

    def wake_with(self, wake: Callable[[], None]) -> None:
        """``wake`` is called (from any thread) when background work makes ``ready`` true."""
        if self.cache is not None:
            self.cache.wake_with(wake)

    def stats(self) -> EngineStats:
        per = [lane_stats(s) for s in self.lanes]
        total = EngineStats(**self.counters.totals(), comm_seconds_total=self.executor.comm_seconds)
        for name in ("waiting", "running", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free",
                     "kv_blocks_cached", "prefix_cache_queries", "prefix_cache_hits", "preemptions_total"):
            setattr(total, name, sum(getattr(p, name) for p in per))
        if len(per) > 1:
            total.lanes = per
        if self.runner.lora is not None:
            total.running_adapters, total.waiting_adapters = self.adapter_load()
            total.max_loras = self.runner.lora.max_loras
        if self.cache is not None:
            total.waiting += self.cache.num_held
            total.activation_cache = self.cache.stats()
        if self.speculator is not None:
            total.speculative = self.speculator.stats()
        return total

    # ---- the step ------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        started = time.perf_counter()
        if self.cache is not None:
            if not self.ready():  # a synchronous caller: nothing to do but wait for the cache
                self.cache.wait(self.cache.wait_hint())
            for lane, seq in self.cache.tick():  # requests whose prefix arrived (or will not) join their lane
                lane.scheduler.add(seq)
        scheds = [s.scheduler.schedule() for s in self.lanes]
        if all(sched.is_empty for sched in scheds):
            return []
        if self.speculator is not None:
            for lane, sched in zip(self.lanes, scheds):
                self.speculator.propose(lane.index, [(seq, n) for seq, n in zip(sched.decodes, sched.lookaheads)
                                                     if n > 0])
        plans = [None if sched.is_empty else self.runner.prepare(sched) for sched in scheds]
        logits = self.executor.execute(self.runner, [None if p is None else p.inputs for p in plans])
        outputs: list[TokenOutput] = []
        for lane, sched, plan, lg in zip(self.lanes, scheds, plans, logits):
            if plan is not None:
                outputs.extend(self._update(lane, sched, plan, lg))
        self.counters.step_done(started)
        return outputs

    def _update(self, lane: Lane, sched, plan: StepPlan, logits: torch.Tensor) -> list[TokenOutput]:
        bm = lane.block_manager
        for seq in sched.decodes:
            if seq.spec_tokens:
                continue  # settled with its verification below
            seq.num_computed_tokens += 1
            bm.cache_full_blocks(seq)
        for seq, n in sched.prefills:
            before = seq.num_computed_tokens
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)
            if self.cache is not None and before < seq.num_prompt_tokens <= seq.num_computed_tokens:
                self.cache.prefilled(lane, seq)
        self._record_prompt_logprobs(plan, logits)

        n_sample = len(plan.sample_seqs)
        sampled = self.sampler(logits[:n_sample], plan.sample_seqs) if n_sample else []
        outputs = []
        for seq, tok in zip(plan.sample_seqs, sampled):
            request = self.requests.get(seq.key)
            if request is None or seq.aborted:  # aborted during the step
                continue
            if not request.forked:
                self._fork(request)
            outputs.append(self._append_token(request.states[seq.index], tok))
        for seq, row, count in plan.verify:
            outputs.extend(self._settle_verification(bm, seq, logits[row:row + count]))
        return outputs

    def _settle_verification(self, bm: BlockManager, seq: Sequence, logits: torch.Tensor) -> list[TokenOutput]:
        """Appends what a speculative step emits for ``seq``: its kept proposals and one
        more token, each computed position counted first, stopping where it stops."""
        proposed, position = len(seq.spec_tokens), seq.num_tokens - 1
        request = self.requests.get(seq.key)
        outputs: list[TokenOutput] = []
        if request is not None and not seq.aborted:
            tokens = verify(logits, seq, self.sampler.kernels)
            self.speculator.verified(seq, position, proposed, len(tokens) - 1)
            state = request.states[seq.index]
            for tok in tokens:
                seq.num_computed_tokens += 1
                out = self._append_token(state, tok)
                outputs.append(out)
                if out.finish is not None:
                    break
            if seq.status is not SequenceStatus.FINISHED:
                bm.cache_full_blocks(seq)
        seq.spec_tokens, seq.spec_probs = [], None
        return outputs

    def _record_prompt_logprobs(self, plan: StepPlan, logits: torch.Tensor) -> None:
        for seq, row, count, first_token in plan.prompt_rows:
            k = seq.params.prefill_top_n_tokens
            values, top = token_logprobs(logits[row:row + count], seq.token_ids[first_token:first_token + count],
                                         k, self.sampler.kernels)
            seq.prefill_logprobs[first_token:first_token + count] = values
            if k:
                seq.prefill_top[first_token:first_token + count] = top

    def _top_tokens(self, pairs: list[tuple[int, float]]) -> list[TopToken]:
        special = self.tokenizer.special_ids
        return [TopToken(t, self.tokenizer.token_text(t), lp, t in special) for t, lp in pairs]

    def _stop_reason(self, state: _SequenceState, token_id: int, text: str) -> FinishReason | None:
        seq, params = state.seq, state.seq.params
        if seq.matcher is not None:
            # a grammar that accepted end-of-sequence (or cannot go on) ends the sequence
            if not seq.matcher.accept_token(token_id) or seq.matcher.is_terminated():
                return FinishReason.EOS_TOKEN
        # before min_new_tokens nothing but the length ends a sequence (a grammar decides its own end)
        early = seq.matcher is None and seq.num_output_tokens < params.min_new_tokens
        return stop_reason(params, self.tokenizer.eos_ids, seq.num_output_tokens, token_id, text, state.detok.text,
                           state.max_stop_len, early)

    def _append_token(self, state: _SequenceState, tok) -> TokenOutput:
        seq = state.seq
        seq.token_ids.append(tok.token_id)
        seq.cumulative_logprob += tok.logprob
        self.counters.token_generated()
        special = tok.token_id in self.tokenizer.special_ids
        text = state.detok.add(tok.token_id)
        params = seq.params
        reason = self._stop_reason(state, tok.token_id, text)
        if reason is not None:
            text += state.detok.flush()
        top = self._top_tokens(tok.top)
        prefill = None
        if not seq.seen_first_output:
            seq.seen_first_output = True
            if params.prefill_details and seq.index == 0:
                tops = seq.prefill_top or [[] for _ in seq.prompt_ids]
                prefill = [PrefillToken(t, self.tokenizer.token_text(t), lp, self._top_tokens(alts) if lp is not None
                                        else [])
                           for t, lp, alts in zip(seq.prompt_ids, seq.prefill_logprobs, tops)]
        finish = self._finish(state, reason) if reason is not None else None
        done = finish is not None and state.request.unfinished == 0 and state.request.forked
        return TokenOutput(seq.key, tok.token_id, text, tok.logprob, special, seq.num_output_tokens - 1,
                           top, prefill, finish, seq.index, done)

    def _finish(self, state: _SequenceState, reason: FinishReason) -> FinishInfo:
        seq = state.seq
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        state.lane.scheduler.remove(seq)
        request = state.request
        request.unfinished -= 1
        self._release_adapter(seq)
        if request.unfinished == 0 and request.forked:
            del self.requests[seq.key]
        now = time.monotonic()
        first = seq.first_scheduled_time or now
        return FinishInfo(
            reason=reason, generated_tokens=seq.num_output_tokens, prompt_tokens=seq.num_prompt_tokens,
            cached_prompt_tokens=seq.num_cached_tokens,
            seed=seq.params.seed_of(seq.index) if seq.params.do_sample else None,
            queue_time_ns=int((first - seq.arrival_time) * 1e9), inference_time_ns=int((now - first) * 1e9),
            preemptions=seq.preemptions, cumulative_logprob=seq.cumulative_logprob,
        )

