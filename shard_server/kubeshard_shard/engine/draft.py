"""Draft-model proposals for speculative decoding: a smaller model of the same
tokenizer guesses ``k`` tokens, one at a time, that the target then verifies at once.

The draft keeps its own paged KV pool per lane, addressed by the *target's* block
tables: position ``t`` of a sequence sits in the same slot in both pools, so the draft
needs no allocator of its own (the target's scheduler reserves the slots of the ``k``
proposals before they are made). ``seq.draft_computed`` counts the leading positions
whose draft K/V are valid; each proposal round first catches the draft up to the
newest token (a prompt the first time, one or two tokens later), then runs ``k - 1``
single-token steps. After verification only the positions of kept tokens stay valid.

Greedy requests take the draft's argmax; sampled ones draw from the draft's own
distribution (same temperature and filters as the target's) and keep it in
``seq.spec_probs`` for rejection sampling (``engine.rejection``).

The draft runs on the group's leader only, unsharded: it is small, and the target's
verification pass is an ordinary step for every rank of either strategy.
"""

from __future__ import annotations

import torch

from kubeshard_shard.engine.model_runner import ModelRunner, StepInputs, decode_tables, slots_of
from kubeshard_shard.engine.rejection import race, target_probs
from kubeshard_shard.engine.sequence import Sequence


# A catch-up this short (the newest token and the proposals kept, after a verification)
# goes as decode rows; a longer one (a prompt) as a prefill chunk.
CATCH_UP_ROWS = 16


class DraftProposer:
    name = "draft"
    free = False  # every proposal is one step of the draft model

    def __init__(self, runners: list[ModelRunner]) -> None:
        self.runners = runners  # one per lane: the draft model over that lane's draft pool

    def propose(self, lane_index: int, batch: list[tuple[Sequence, int]]) -> None:
        runner = self.runners[lane_index]
        for seq, _ in batch:
            seq.spec_tokens, seq.spec_probs = [], None
        probs: dict[int, list[torch.Tensor]] = {}
        active = list(batch)
        step = 0
        while active:
            logits = runner.run(self._catch_up(runner, active) if step == 0 else self._next(runner, active, step))
            for (seq, _), row in zip(active, logits):
                token, q = self._pick(seq, row)
                seq.spec_tokens.append(token)
                if q is not None:
                    probs.setdefault(id(seq), []).append(q)
            if step == 0:
                for seq, _ in active:
                    seq.draft_computed = seq.num_tokens
            step += 1
            active = [(seq, k) for seq, k in active if k > step]
        for seq, _ in batch:
            rows = probs.get(id(seq))
            seq.spec_probs = torch.stack(rows) if rows else None

    def verified(self, seq: Sequence, position: int, proposed: int, emitted: int) -> None:
        """After verification: the draft's K/V stay valid through the newest token
        (``position``) and the proposals that were kept and fed back in."""
        seq.draft_computed = position + min(emitted, proposed)

    # ---- one draft forward pass ------------------------------------------------------
    @staticmethod
    def _catch_up(runner: ModelRunner, batch: list[tuple[Sequence, int]]) -> StepInputs:
        """Every sequence's tokens the draft has not seen, up to its newest, continuing its
        cached context; the logits of each sequence's newest token. A few tokens (after a
        verification) go as decode rows, which the paged kernel serves; a prompt goes as a
        chunk (see ``ModelRunner.prepare``)."""
        bs = runner.block_size
        pending = []  # (sequence, first unseen position, end, as decode rows)
        for seq, _ in batch:
            start, end = min(seq.draft_computed, seq.num_tokens - 1), seq.num_tokens
            pending.append((seq, start, end, runner.decode_kernel is not None and end - start <= CATCH_UP_ROWS))
        pending.sort(key=lambda p: not p[3])  # decode rows lead the step (stable: batch order within each kind)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        tables, lens = [], []
        chunks, context = [], []
        newest: dict[int, int] = {}  # id(sequence) -> the row of its newest token
        for seq, start, end, as_rows in pending:
            if as_rows:
                tables.extend([seq.block_table] * (end - start))
                lens.extend(range(start + 1, end + 1))
            else:
                chunks.append((len(ids), end - start, start))
                context.append(torch.tensor(slots_of(seq.block_table, 0, start, bs), dtype=torch.long) if start
                               else None)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(slots_of(seq.block_table, start, end, bs))
            newest[id(seq)] = len(ids) - 1
        block_tables, context_lens, max_len = decode_tables(tables, lens)
        return StepInputs(input_ids=torch.tensor(ids, dtype=torch.long), positions=torch.tensor(pos, dtype=torch.long),
                          slot_mapping=torch.tensor(slots, dtype=torch.long),
                          logits_indices=torch.tensor([newest[id(seq)] for seq, _ in batch], dtype=torch.long),
                          num_decode=len(lens), block_tables=block_tables, context_lens=context_lens,
                          max_context_len=max_len, prefill_chunks=chunks, context_slots=context)

    @staticmethod
    def _next(runner: ModelRunner, batch: list[tuple[Sequence, int]], step: int) -> StepInputs:
        """The last proposal of every sequence, one decode token each."""
        bs = runner.block_size
        ids, pos, slots, tables, lens = [], [], [], [], []
        for seq, _ in batch:
            p = seq.num_tokens - 1 + step
            ids.append(seq.spec_tokens[-1])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            tables.append(seq.block_table)
            lens.append(p + 1)
        block_tables, context_lens, max_len = decode_tables(tables, lens)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long), positions=torch.tensor(pos, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            logits_indices=torch.arange(len(ids), dtype=torch.long), num_decode=len(ids),
            block_tables=block_tables, context_lens=context_lens, max_context_len=max_len)

    @staticmethod
    def _pick(seq: Sequence, row: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        params = seq.params
        row = row.float()
        if not params.do_sample:
            return int(row.argmax()), None
        if seq.generator is None:
            seq.generator = torch.Generator(device=row.device).manual_seed(params.seed_of(seq.index))
        q = target_probs((row / params.temperature)[None], seq)[0]
        return race(q, seq.generator), q
