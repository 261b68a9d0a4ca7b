"""Batched token selection: logit bias, grammar masks, minimum length, penalties,
temperature, top-k/top-p/typical-p/min-p, seeded draws.

Rows with a grammar (structured output) get their masks in one bitmask per step,
applied to all of them in one call; rows without one are untouched, so constrained and
free requests share a batch.

Greedy rows take the argmax. Sampled rows draw with the exponential-race trick
(argmax of p / q with q ~ Exp(1)), where q comes from the request's own generator:
the draw of one request depends only on its seed and its own distribution, never on
what else is in the batch. Results reach the host in one transfer per step.

A token's log-probability is its logit less its row's log-sum-exp (``best_and_lse``),
so no step computes a log_softmax over the vocabulary to read one value of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubeshard_shard.engine.grammar import StepMasks, apply_masks
from kubeshard_shard.engine.sequence import SamplingParams, Sequence


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def best_and_lse(logits: torch.Tensor, kernels=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (its first largest logit, as torch's) and log-sum-exp: in one
    pass of the CPU kernels (``csrc/logits.cpp``) where they serve, else torch's ops."""
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return kernels.argmax_logsumexp(logits.contiguous())
    return logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)


def top_logprobs(logits: torch.Tensor, lse: torch.Tensor, n: int) -> list[list[tuple[int, float]]]:
    """Each row's ``n`` most likely tokens with their log-probabilities (logit less the
    row's log-sum-exp ``lse``), most likely first."""
    top = torch.topk(logits, min(n, logits.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(top.indices.tolist(), (top.values - lse[:, None]).tolist())]


def token_logprobs(logits: torch.Tensor, targets: list[int], top_n: int = 0, kernels=None
                   ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Each row's log-probability of its target token, and (top_n > 0) the row's top_n
    tokens with theirs, as the sampler computes a generated token's: the logit less the
    row's log-sum-exp. The prompt's log-probabilities (TGI's decoder_input_details) are
    these, each prompt token the target of the row before it."""
    logits = logits.float()
    _, lse = best_and_lse(logits, kernels)
    ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
    values = (logits.gather(1, ids[:, None])[:, 0] - lse).tolist()
    return values, top_logprobs(logits, lse, top_n) if top_n else []


def apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    p = seq.params
    if p.repetition_penalty not in (None, 1.0):
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
        score = row.index_select(0, seen)
        score = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
        row.index_copy_(0, seen, score)
    if p.frequency_penalty or p.presence_penalty:
        out = seq.output_ids
        if out:
            ids = torch.tensor(out, dtype=torch.long, device=row.device)
            counts = torch.zeros_like(row).index_add_(0, ids, torch.ones(len(out), device=row.device))
            row -= counts * (p.frequency_penalty or 0.0) + (counts > 0).to(row.dtype) * (p.presence_penalty or 0.0)


def apply_logit_bias(row: torch.Tensor, seq: Sequence) -> None:
    if seq.bias_tensors is None:
        ids, values = zip(*seq.params.logit_bias)
        seq.bias_tensors = (torch.tensor(ids, dtype=torch.long, device=row.device),
                            torch.tensor(values, dtype=row.dtype, device=row.device))
    row.index_add_(0, *seq.bias_tensors)


def filter_logits(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """top-k, top-p, typical-p (the Hugging Face warpers' semantics) and min-p filters on
    one row of temperature-scaled logits; removed entries become -inf."""
    neg_inf = float("-inf")
    if p.top_k is not None and 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, neg_inf)
    if p.typical_p is not None and p.typical_p < 1.0:
        logp = torch.log_softmax(row, dim=-1)
        probs = logp.exp()
        entropy = -(logp * probs).nansum()
        shifted = (-logp - entropy).abs()
        sorted_scores, order = torch.sort(shifted)
        cumulative = torch.softmax(row.index_select(0, order), dim=-1).cumsum(0)
        last = int((cumulative < p.typical_p).sum().clamp(max=row.numel() - 1))
        remove_sorted = sorted_scores > sorted_scores[last]
        remove = torch.zeros_like(remove_sorted).scatter(0, order, remove_sorted)
        row = row.masked_fill(remove, neg_inf)
    if p.top_p is not None and p.top_p < 1.0:
        sorted_logits, order = torch.sort(row)  # ascending
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(0)
        remove_sorted = cumulative <= (1 - p.top_p)
        remove_sorted[-1] = False  # keep at least the most likely token
        remove = torch.zeros_like(remove_sorted).scatter(0, order, remove_sorted)
        row = row.masked_fill(remove, neg_inf)
    if p.min_p:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), neg_inf)
    return row


class Sampler:
    def __init__(self, eos_ids: frozenset[int] = frozenset(), vocab_size: int = 0, kernels=None) -> None:
        self.eos_ids = tuple(sorted(eos_ids))
        self.masks = StepMasks(vocab_size) if vocab_size else None
        self.kernels = kernels  # the CPU kernels' module (best_and_lse, apply_masks), or None

    def _too_early(self, seq: Sequence) -> list[int]:
        """Token ids a sequence may not sample yet (before min_new_tokens). A grammar
        decides its own end, so a constrained row is left alone."""
        p = seq.params
        if seq.num_output_tokens >= p.min_new_tokens or seq.matcher is not None:
            return []
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids)))

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        logits = logits.float()
        params = [s.params for s in seqs]
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias:
                apply_logit_bias(logits[i], seq)
            if p.min_new_tokens:
                banned = self._too_early(seq)
                if banned:
                    logits[i, banned] = float("-inf")
            if p.has_penalties:
                apply_penalties(logits[i], seq)
        if self.masks is not None:
            filled = self.masks.fill(seqs)
            if filled is not None:
                apply_masks(logits, *filled, self.kernels)
        temps = [p.temperature if p.do_sample else 1.0 for p in params]
        if any(t != 1.0 for t in temps):
            logits = logits / torch.tensor(temps, device=logits.device)[:, None]
        chosen, lse = best_and_lse(logits, self.kernels)
        for i, (seq, p) in enumerate(zip(seqs, params)):
            if not p.do_sample:
                continue
            row = filter_logits(logits[i], p)
            probs = torch.softmax(row, dim=-1)
            if seq.generator is None:
                seq.generator = torch.Generator(device=logits.device).manual_seed(p.seed_of(seq.index))
            race = torch.empty_like(probs).exponential_(generator=seq.generator)
            chosen[i] = (probs / race).argmax()

        chosen_logprobs = logits.gather(1, chosen[:, None])[:, 0] - lse
        top_n = max(p.top_n_tokens for p in params)
        top = top_logprobs(logits, lse, top_n) if top_n else []
        ids, lps = chosen.tolist(), chosen_logprobs.tolist()
        return [SampledToken(ids[i], lps[i], top[i][:p.top_n_tokens] if p.top_n_tokens else [])
                for i, p in enumerate(params)]
