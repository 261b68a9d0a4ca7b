"""N-gram (prompt-lookup) proposals for speculative decoding: no extra model.

When a sequence's last ``n`` tokens appeared earlier in its own tokens (prompt or
output), the tokens that followed them then are a good guess for what follows now:
answers that copy from the prompt (editing code, extracting fields, quoting) repeat
long runs of it. The longest suffix from ``max_n`` down to ``min_n`` that has an earlier
match wins; among its matches, the most recent one (the nearest context).

A one-token match proposes at most ``ONE_TOKEN_MATCH_TOKENS``: a single repeated token
(a space, a quote, a newline) bridges the places where a copied answer leaves its
source for a token or two and rejoins it, but it says little about what follows further
on. With ``--speculative-ngram-min 1`` on the default model (AVX2 EPYC, 2026-12-05):
bench/results/speculative-rounds-avx2.md, 1 client on copy-heavy answers, 1.70x the
tokens/s of plain decoding against 1.56x from two-token matches; 8 clients on free chat
0.81x against 0.89x (uncapped, in a run before it, not kept: 1.66x and 0.72x).
In-process, per decoded token at 1 sequence on copy-heavy answers: 1.98x capped, 1.90x
uncapped.
"""

from __future__ import annotations

import numpy as np

from kubeshard_shard.engine.sequence import Sequence


ONE_TOKEN_MATCH_TOKENS = 2


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens (``ONE_TOKEN_MATCH_TOKENS`` after a one-token match) that
    followed the latest earlier occurrence of the longest suffix of ``tokens``
    (``min_n`` to ``max_n`` tokens long); [] when none occurs."""
    total = len(tokens)
    if k < 1 or total < min_n + 1:
        return []
    last = tokens[-1]
    # candidate ends of an earlier occurrence: positions before the last holding its token
    ends = np.flatnonzero(tokens[:-1] == last)
    if ends.size == 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        for end in ends[::-1]:  # the most recent match first
            start = end - n + 1
            if start < 0:
                continue
            if np.array_equal(tokens[start:end + 1], suffix):
                follow = tokens[end + 1:end + 1 + (k if n > 1 else min(k, ONE_TOKEN_MATCH_TOKENS))]
                if follow.size:
                    return follow.tolist()
    return []


class NgramProposer:
    """Proposes from each sequence's own tokens (``lookup``)."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, lane_index: int, batch: list[tuple[Sequence, int]]) -> None:
        for seq, k in batch:
            seq.spec_tokens = lookup(np.asarray(seq.token_ids, dtype=np.int64), k, self.min_n, self.max_n)
            seq.spec_probs = None

    def verified(self, seq: Sequence, position: int, proposed: int, emitted: int) -> None:
        pass  # nothing to keep between steps
