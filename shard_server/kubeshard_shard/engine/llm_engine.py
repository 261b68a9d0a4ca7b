"""The engine step: schedule -> execute -> update, nothing else.

``LLMEngine`` is single-threaded and synchronous; ``AsyncEngine`` runs it in a thread
for the gRPC server. Outputs are plain dataclasses, one per generated token.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kubeshard_shard.engine.block_manager import BlockManager
from kubeshard_shard.engine.detokenizer import IncrementalDetokenizer
from kubeshard_shard.engine.model_runner import ModelRunner, StepInputs, StepPlan
from kubeshard_shard.engine.sampler import Sampler
from kubeshard_shard.engine.scheduler import Scheduler
from kubeshard_shard.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
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
    finish: FinishInfo | None = None


@dataclass
class EngineStats:
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

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class _RequestState:
    __slots__ = ("seq", "detok", "stop_sequences", "max_stop_len")

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer) -> None:
        self.seq = seq
        self.detok = detok
        self.stop_sequences = seq.params.stop_sequences
        self.max_stop_len = max((len(s) for s in self.stop_sequences), default=0)


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: ModelTokenizer, block_manager: BlockManager,
                 max_batch_tokens: int, max_num_seqs: int,
                 execute: Callable[[StepInputs], torch.Tensor] | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        self.scheduler = Scheduler(block_manager, max_batch_tokens, max_num_seqs)
        self.sampler = Sampler()
        # How a step's inputs are executed: locally by default; a sharded group
        # broadcasts them to its peers first.
        self.execute = execute or runner.run
        self.requests: dict[int, _RequestState] = {}
        self._next_key = 0
        self.generated_tokens_total = 0
        self.steps_total = 0
        self.last_step_seconds = 0.0

    # ---- requests ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> int:
        """Queues a validated request; returns its key for ``abort`` and outputs."""
        key = self._next_key
        self._next_key += 1
        seq = Sequence(request_id, list(prompt_ids), params)
        seq.key = key
        if params.prefill_details:
            seq.prefill_logprobs = [None] * len(prompt_ids)
        detok = IncrementalDetokenizer(self.tokenizer.tokenizer, seq.prompt_ids, self.tokenizer.special_ids)
        self.requests[key] = _RequestState(seq, detok)
        self.scheduler.add(seq)
        return key

    def abort(self, key: int) -> bool:
        state = self.requests.pop(key, None)
        if state is None:
            return False
        state.seq.aborted = True
        state.seq.status = SequenceStatus.FINISHED
        self.scheduler.remove(state.seq)
        return True

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_used_blocks, kv_blocks_free=bm.num_free_blocks,
            kv_blocks_cached=bm.num_cached_free_blocks, prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits, preemptions_total=self.scheduler.preemptions_total,
            generated_tokens_total=self.generated_tokens_total, steps_total=self.steps_total,
            last_step_seconds=self.last_step_seconds,
        )

    # ---- the step ------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        plan = self.runner.prepare(sched)
        logits = self.execute(plan.inputs)
        outputs = self._update(sched, plan, logits)
        self.steps_total += 1
        self.last_step_seconds = time.perf_counter() - started
        return outputs

    def _update(self, sched, plan: StepPlan, logits: torch.Tensor) -> list[TokenOutput]:
        for seq in sched.decodes:
            seq.num_computed_tokens += 1
            self.block_manager.cache_full_blocks(seq)
        for seq, n in sched.prefills:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        self._record_prompt_logprobs(plan, logits)

        n_sample = len(plan.sample_seqs)
        sampled = self.sampler(logits[:n_sample], plan.sample_seqs) if n_sample else []
        outputs = []
        for seq, tok in zip(plan.sample_seqs, sampled):
            state = self.requests.get(seq.key)
            if state is None:  # aborted during the step
                continue
            outputs.append(self._append_token(state, tok))
        return outputs

    def _record_prompt_logprobs(self, plan: StepPlan, logits: torch.Tensor) -> None:
        for seq, row, count, first_token in plan.prompt_rows:
            rows = torch.log_softmax(logits[row:row + count].float(), dim=-1)
            targets = torch.tensor(seq.token_ids[first_token:first_token + count], dtype=torch.long,
                                   device=rows.device)
            values = rows.gather(1, targets[:, None])[:, 0].tolist()
            seq.prefill_logprobs[first_token:first_token + count] = values

    def _append_token(self, state: _RequestState, tok) -> TokenOutput:
        seq = state.seq
        seq.token_ids.append(tok.token_id)
        self.generated_tokens_total += 1
        special = tok.token_id in self.tokenizer.special_ids
        text = state.detok.add(tok.token_id)
        params = seq.params
        reason = None
        if tok.token_id in self.tokenizer.eos_ids and not params.ignore_eos:
            reason = FinishReason.EOS_TOKEN
        elif state.stop_sequences and text:
            tail = state.detok.text[-(state.max_stop_len + len(text)):]
            if any(s in tail for s in state.stop_sequences):
                reason = FinishReason.STOP_SEQUENCE
        if reason is None and seq.num_output_tokens >= params.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            text += state.detok.flush()
        top = [TopToken(t, self.tokenizer.token_text(t), lp, t in self.tokenizer.special_ids) for t, lp in tok.top]
        prefill = None
        if not seq.seen_first_output:
            seq.seen_first_output = True
            if params.prefill_details:
                prefill = [PrefillToken(t, self.tokenizer.token_text(t), lp)
                           for t, lp in zip(seq.prompt_ids, seq.prefill_logprobs)]
        finish = self._finish(state, reason) if reason is not None else None
        return TokenOutput(seq.key, tok.token_id, text, tok.logprob, special, seq.num_output_tokens - 1,
                           top, prefill, finish)

    def _finish(self, state: _RequestState, reason: FinishReason) -> FinishInfo:
        seq = state.seq
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        self.scheduler.remove(seq)
        del self.requests[seq.key]
        now = time.monotonic()
        first = seq.first_scheduled_time or now
        return FinishInfo(
            reason=reason, generated_tokens=seq.num_output_tokens, prompt_tokens=seq.num_prompt_tokens,
            cached_prompt_tokens=seq.num_cached_tokens, seed=seq.params.seed if seq.params.do_sample else None,
            queue_time_ns=int((first - seq.arrival_time) * 1e9), inference_time_ns=int((now - first) * 1e9),
            preemptions=seq.preemptions,
        )


def replace_params(params: SamplingParams, **changes) -> SamplingParams:
    return dataclasses.replace(params, **changes)
