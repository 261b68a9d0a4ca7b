"""N-gram (prompt-lookup) proposals for speculative decoding: no extra model.

When a sequence's last ``n`` tokens appeared earlier in its own tokens (prompt or
output), the tokens that followed them then are a good guess for what follows now:
answers that copy from the prompt (editing code, extracting fields, quoting) repeat
long runs of it. The longest suffix from ``max_n`` down to ``min_n`` that has an earlier
match wins; among its matches, the most recent one (the nearest context).
"""

from __future__ import annotations

import numpy as np

from kubeshard_shard.engine.sequence import Sequence


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (``min_n`` to ``max_n`` tokens long); [] when none occurs."""
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
                follow = tokens[end + 1:end + 1 + k]
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
