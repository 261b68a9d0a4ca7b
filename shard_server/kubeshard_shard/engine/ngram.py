"""N-gram (prompt-lookup) proposals for speculative decoding: no extra model.

When a sequence's last ``n`` tokens appeared earlier in its own tokens (prompt or
output), the tokens that followed them then are a good guess for what follows now:
answers that copy from the prompt (editing code, extracting fields, quoting) repeat
long runs of it. The longest suffix from ``max_n`` down to ``min_n`` that has an earlier
match wins; among its matches, the most recent one (the nearest context).

A match shorter than ``SHORT_MATCH`` tokens proposes at most ``SHORT_MATCH_TOKENS``: a
repeated token or two (a space, a quote, a newline, ``", "``) bridges the places where a
copied answer leaves its source for a token or two and rejoins it, but says little about
what follows further on. Replayed on the default model's greedy answers at every position
(bench/results/ngram-replay-avx2.md, AVX2 EPYC, 2026-12-06): on copy-heavy answers the
first proposal after a one-token match was kept 52% of the time and the third 9%, after
two tokens 50% and 16%, after three or four 70% and 54%, after five or more the sixth
still 58-73%; on free chat after one token 14% and 3%. A verification row costs a few
percent of a one-row step there (7 rows: 1.27x one), so a proposal kept less than about
one time in six costs more than it brings.
"""

from __future__ import annotations

import numpy as np

from kubeshard_shard.engine.sequence import Sequence


SHORT_MATCH = 3
SHORT_MATCH_TOKENS = 2


def latest_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int] | None:
    """(n, end): the longest suffix of ``tokens`` (``min_n`` to ``max_n`` tokens long) that
    occurred earlier, and where its latest earlier occurrence ends; None when none did."""
    total = len(tokens)
    if total < min_n + 1:
        return None
    # candidate ends of an earlier occurrence: positions before the last holding its token
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        for end in ends[::-1]:  # the most recent match first
            start = end - n + 1
            if start >= 0 and np.array_equal(tokens[start:end + 1], suffix):
                return n, int(end)
    return None


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (``latest_match``); [] when none occurs. A match shorter than
    ``SHORT_MATCH`` tokens (and than ``max_n``: the longest looked for counts as long)
    proposes at most ``SHORT_MATCH_TOKENS``."""
    found = latest_match(tokens, min_n, max_n) if k >= 1 else None
    if found is None:
        return []
    n, end = found  # end < len(tokens) - 1: at least one token follows it
    take = k if n >= min(SHORT_MATCH, max_n) else min(k, SHORT_MATCH_TOKENS)
    return tokens[end + 1:end + 1 + take].tolist()


class NgramProposer:
    """Proposes from each sequence's own tokens (``lookup``)."""

    name = "ngram"
    free = True  # a proposal costs nothing to make: only its verification row costs

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, lane_index: int, batch: list[tuple[Sequence, int]]) -> None:
        for seq, k in batch:
            seq.spec_tokens = lookup(np.asarray(seq.token_ids, dtype=np.int64), k, self.min_n, self.max_n)
            seq.spec_probs = None

    def verified(self, seq: Sequence, position: int, proposed: int, emitted: int) -> None:
        pass  # nothing to keep between steps
