"""Turns a scheduled step into tensors and runs the model on them.

``prepare`` (leader only) flattens the step into a ``StepInputs``: plain tensors that a
sharded group can broadcast to its other ranks, which then call ``run`` on the same
inputs. ``run`` writes the step's K/V into the paged cache and returns the logits of
the rows that need them (the last token of every sequence that samples, every token of
a speculative verification, plus the prompt positions of requests that asked for
prompt log-probabilities).

Token order in a step: plain decodes (one token each, the decode kernel's rows), then
speculative verifications (a decoding sequence's newest token and its proposals, as a
chunk over its cached context), then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kubeshard_shard.engine import fused_decode
from kubeshard_shard.engine.attention import AttentionMetadata, KVCache, PagedAttention, PrefillChunk
from kubeshard_shard.engine.scheduler import SchedulerOutput
from kubeshard_shard.engine.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64
    logits_indices: torch.Tensor   # [R] int64 rows of the step whose logits are needed
    num_decode: int = 0
    block_tables: torch.Tensor | None = None   # [num_decode, max_blocks] int32
    context_lens: torch.Tensor | None = None   # [num_decode] int32
    max_context_len: int = 0
    # (query_start, query_len, context_len) per prefill chunk; context slots below
    prefill_chunks: list[tuple[int, int, int]] = field(default_factory=list)
    context_slots: list[torch.Tensor | None] = field(default_factory=list)
    # LoRA slot of each token (None: all base model)
    lora_slots: list[int] | None = None


@dataclass
class StepPlan:
    """What the leader needs to interpret the logits of a step."""

    inputs: StepInputs
    sample_seqs: list[Sequence]          # rows 0..len-1 of the logits, in order
    # (sequence, first logits row, number of rows) of each speculative verification
    verify: list[tuple[Sequence, int, int]] = field(default_factory=list)
    # (sequence, first logits row, number of rows, first prompt token index they predict)
    prompt_rows: list[tuple[Sequence, int, int, int]] = field(default_factory=list)


def slots_of(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV slots of positions [start, end) of a sequence with block table ``table``."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def decode_tables(tables: list[list[int]], lens: list[int]
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """The decode rows' block tables (padded with block 0 to the longest), their context
    lengths and the longest; (None, None, 0) when there are none."""
    if not tables:
        return None, None, 0
    width = max(len(t) for t in tables)
    return (torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), max(lens))


class ModelRunner:
    def __init__(self, model, cache: KVCache, device: torch.device, decode_kernel: Callable | None = None,
                 lora=None) -> None:
        self.model = model
        self.lora = lora  # the AdapterRegistry when LoRA is on (models.lora)
        self.cache = cache
        self.device = device
        self.decode_kernel = decode_kernel  # the compiled CPU decode attention, or None
        self.block_size = cache.block_size
        # decode-only steps through every layer in one kernel call, where the model qualifies
        self.fused = fused_decode.build(model, cache, decode_kernel, lora)

    def prepare(self, sched: SchedulerOutput) -> StepPlan:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []

        decodes = [seq for seq in sched.decodes if not seq.spec_tokens]
        verifies = [seq for seq in sched.decodes if seq.spec_tokens]
        if self.lora is not None:  # rows of one adapter side by side: each adapter is one slice (models.lora)
            decodes = sorted(decodes, key=lambda s: s.adapter_slot)
        tables, lens = [], []
        for seq in decodes:
            p = seq.num_tokens - 1
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            tables.append(seq.block_table)
            lens.append(p + 1)
            sample_rows.append(len(ids) - 1)
            sample_seqs.append(seq)

        chunks, context_slots = [], []
        verify_rows: list[tuple[Sequence, int, int]] = []  # (sequence, first token, tokens)
        for seq in verifies:
            start = seq.num_tokens - 1
            tokens = [seq.token_ids[start]] + seq.spec_tokens
            end = start + len(tokens)
            verify_rows.append((seq, len(ids), len(tokens)))
            if self.decode_kernel is not None:
                # Each token as a decode row over the sequence's block table (the step writes
                # every row's K/V before attention reads the pool), so the paged kernel
                # serves it; as a chunk, every layer would gather the whole context, concatenate
                # and mask (a verification step took 1.4-1.7x a decode step that way).
                tables.extend([seq.block_table] * len(tokens))
                lens.extend(range(start + 1, end + 1))
            else:
                chunks.append((len(ids), len(tokens), start))
                context_slots.append(_long(slots_of(seq.block_table, 0, start, bs)) if start else None)
            ids.extend(tokens)
            pos.extend(range(start, end))
            slots.extend(slots_of(seq.block_table, start, end, bs))

        prompt_plan: list[tuple[Sequence, list[int], int]] = []
        for seq, n in sched.prefills:
            start = seq.num_computed_tokens
            end = start + n
            q_start = len(ids)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(slots_of(seq.block_table, start, end, bs))
            chunks.append((q_start, n, start))
            context_slots.append(_long(slots_of(seq.block_table, 0, start, bs)) if start else None)
            if seq.params.prefill_details and seq.preemptions == 0:
                # positions start..last-1 predict prompt tokens start+1..last
                last = min(end, seq.num_prompt_tokens - 1)
                if last > start:
                    prompt_plan.append((seq, list(range(q_start, q_start + last - start)), start + 1))
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)

        rows = list(sample_rows)
        verify = []
        for seq, first, count in verify_rows:
            verify.append((seq, len(rows), count))
            rows.extend(range(first, first + count))
        prompt_rows = []
        for seq, chunk_rows, first_token in prompt_plan:
            prompt_rows.append((seq, len(rows), len(chunk_rows), first_token))
            rows.extend(chunk_rows)

        block_tables, context_lens, max_len = decode_tables(tables, lens)
        inputs = StepInputs(
            input_ids=_long(ids), positions=_long(pos), slot_mapping=_long(slots), logits_indices=_long(rows),
            num_decode=len(lens), block_tables=block_tables, context_lens=context_lens, max_context_len=max_len,
            prefill_chunks=chunks, context_slots=context_slots,
        )
        if self.lora is not None and (any(s.adapter_slot for s in sched.decodes)
                                      or any(s.adapter_slot for s, _ in sched.prefills)):
            per_token = ([s.adapter_slot for s in decodes]
                         + [s.adapter_slot for s, _, count in verify_rows for _ in range(count)]
                         + [s.adapter_slot for s, n in sched.prefills for _ in range(n)])
            inputs.lora_slots = per_token
        return StepPlan(inputs, sample_seqs, verify=verify, prompt_rows=prompt_rows)

    def metadata(self, inputs: StepInputs) -> AttentionMetadata:
        dev = self.device

        def to(t):
            return None if t is None else t.to(dev, non_blocking=True)

        return AttentionMetadata(
            slot_mapping=to(inputs.slot_mapping),
            num_decode=inputs.num_decode,
            block_tables=to(inputs.block_tables),
            context_lens=to(inputs.context_lens),
            max_context_len=inputs.max_context_len,
            prefills=[PrefillChunk(s, n, c, to(cs)) for (s, n, c), cs in zip(inputs.prefill_chunks,
                                                                           inputs.context_slots)],
        )

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        meta = self.metadata(inputs)
        input_ids = inputs.input_ids.to(self.device, non_blocking=True)
        positions = inputs.positions.to(self.device, non_blocking=True)
        if self.fused is not None and self.fused.serves(len(input_ids), meta.num_decode, len(meta.prefills),
                                                        adapters=inputs.lora_slots is not None):
            hidden = self.fused.run(input_ids, positions, meta, inputs.lora_slots)
        else:
            if self.lora is not None:
                self.lora.begin_step(inputs.lora_slots)
            hidden = self.model(input_ids, positions, PagedAttention(self.cache, meta, self.decode_kernel))
        hidden = hidden.index_select(0, inputs.logits_indices.to(self.device, non_blocking=True))
        return self.model.compute_logits(hidden)
