"""Verification of proposed tokens: which of them the target model keeps, and the
token that follows the last one kept.

The target model scores a sequence's newest token and its ``k`` proposals in one
forward pass, giving ``k + 1`` rows of logits: row ``i`` is the target's distribution
``p_i`` for the token after proposal ``i`` (row 0: after the newest token).

- Greedy requests keep proposals while each equals the argmax of its row, then emit
  the argmax of the next row: exactly the tokens greedy decoding gives one at a time.
- Sampled requests use rejection sampling (Leviathan et al., Chen et al. 2023):
  proposal ``d_i`` drawn from ``q_i`` is kept with probability ``min(1, p_i(d) /
  q_i(d))``; at the first refusal a token is drawn from the normalized residual
  ``max(0, p_i - q_i)``; when all are kept, a bonus token is drawn from ``p_k``. Every
  emitted token is then distributed exactly as sampling from ``p`` one token at a time.
  Proposals that are certain (n-gram lookups, greedy drafts) have ``q_i`` a point mass:
  kept with probability ``p_i(d)``, and the residual is ``p_i`` without ``d``.

``p`` is what the sampler draws from: logit bias, temperature, then the top-k / top-p /
typical-p / min-p filters. Draws use the request's own seeded generator, so a seed
reproduces the output. The log-probability reported per token is the sampler's
(temperature-scaled, before the filters).
"""

from __future__ import annotations

import torch

from kubeshard_shard.engine.sampler import (SampledToken, apply_logit_bias, best_and_lse, filter_logits,
                                           top_logprobs)
from kubeshard_shard.engine.sequence import Sequence


def target_probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The distribution ``p`` a sampled request draws from, per row of ``logits``
    (already temperature-scaled and biased)."""
    return torch.stack([torch.softmax(filter_logits(row, seq.params), dim=-1) for row in logits])


def race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from ``probs`` (the sampler's exponential race)."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / q).argmax())


def accept_or_resample(p: torch.Tensor, q: torch.Tensor | None, draft: int, generator: torch.Generator
                       ) -> int | None:
    """One rejection-sampling decision at one position: None when ``draft`` is kept,
    else the token drawn from the residual. ``q`` None: the draft was certain."""
    target = float(p[draft])
    proposal = 1.0 if q is None else float(q[draft])
    u = float(torch.rand((), generator=generator))
    if proposal > 0 and u < min(1.0, target / proposal):
        return None
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    if float(residual.sum()) <= 0.0:  # p <= q everywhere cannot refuse; kept for rounding
        residual = p
    return race(residual / residual.sum(), generator)


def verify(logits: torch.Tensor, seq: Sequence, kernels=None) -> list[SampledToken]:
    """The tokens a speculative step emits for ``seq``: the kept proposals, then one more
    (``logits``: the ``k + 1`` rows of its newest token and its proposals; ``kernels``:
    the CPU kernels' module, as ``Sampler`` takes it)."""
    drafts, params = seq.spec_tokens, seq.params
    logits = logits.float()
    if params.logit_bias:
        for row in logits:
            apply_logit_bias(row, seq)
    if params.do_sample and params.temperature != 1.0:
        logits = logits / params.temperature
    best, lse = best_and_lse(logits, kernels)
    if not params.do_sample:
        best = best.tolist()
        kept = 0
        while kept < len(drafts) and best[kept] == drafts[kept]:
            kept += 1
        chosen = drafts[:kept] + [best[kept]]
    else:
        if seq.generator is None:
            seq.generator = torch.Generator(device=logits.device).manual_seed(params.seed_of(seq.index))
        p = target_probs(logits, seq)
        chosen = []
        for i, draft in enumerate(drafts):
            q = None if seq.spec_probs is None else seq.spec_probs[i].to(p.device)
            other = accept_or_resample(p[i], q, draft, seq.generator)
            if other is not None:
                chosen.append(other)
                break
            chosen.append(draft)
        else:
            chosen.append(race(p[len(drafts)], seq.generator))
    n = len(chosen)
    rows = torch.arange(n, device=logits.device)
    picked = (logits[rows, torch.tensor(chosen, device=logits.device)] - lse[:n]).tolist()
    top_n = params.top_n_tokens
    alternatives = top_logprobs(logits[:n], lse[:n], top_n) if top_n else [[] for _ in chosen]
    return [SampledToken(t, lp, alt) for t, lp, alt in zip(chosen, picked, alternatives)]
