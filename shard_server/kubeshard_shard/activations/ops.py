"""What the leader asks of its ranks' cache workers, and what they answer.

One ``CacheOps`` goes to every rank of a group in one message (the step channel's
CACHE command; a group of one hands it to its worker directly):

- ``fetches``: read a chain from Redis into blocks the leader reserved;
- ``writes``: copy pinned blocks out of the pool and write them to Redis;
- ``queries``: the ops whose status the leader wants now;
- ``releases``: ops the leader is done with (the worker forgets them).

A transfer names its lane: a tensor group's ranks all serve lane 0 (each moves its own
heads), a zero3 rank serves the lane of its own rank. Each rank answers one row: its
counters, then one status per query (``NOT_MINE``, ``RUNNING``, or the op's result:
blocks loaded for a fetch, 1 for a write whose blocks may be released).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NOT_MINE = -2
RUNNING = -1
COUNTERS = ("bytes_read", "bytes_written", "rejected", "errors", "blocks_written")

_MASK = (1 << 64) - 1


def _split(h: int) -> tuple[int, int]:
    """A 128-bit hash as two signed int64s."""
    hi, lo = h >> 64, h & _MASK
    return (hi - (1 << 64) if hi >= 1 << 63 else hi), (lo - (1 << 64) if lo >= 1 << 63 else lo)


def _join(hi: int, lo: int) -> int:
    return ((hi & _MASK) << 64) | (lo & _MASK)


@dataclass
class Transfer:
    op_id: int
    lane: int
    root: int                 # hash of the chain's first block (the Redis key's slot tag)
    block_ids: list[int]
    hashes: list[int]


@dataclass
class CacheOps:
    fetches: list[Transfer] = field(default_factory=list)
    writes: list[Transfer] = field(default_factory=list)
    queries: list[int] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.fetches or self.writes or self.queries or self.releases)

    def encode(self) -> torch.Tensor:
        out = [len(self.fetches), len(self.writes), len(self.queries), len(self.releases)]
        for t in (*self.fetches, *self.writes):
            out += [t.op_id, t.lane, *_split(t.root), len(t.block_ids)]
            for b, h in zip(t.block_ids, t.hashes):
                out += [b, *_split(h)]
        out += self.queries + self.releases
        return torch.tensor(out, dtype=torch.long)

    @classmethod
    def decode(cls, payload: torch.Tensor) -> "CacheOps":
        v = payload.tolist()
        nf, nw, nq, nr = v[:4]
        pos = 4
        transfers = []
        for _ in range(nf + nw):
            op_id, lane, hi, lo, n = v[pos:pos + 5]
            pos += 5
            rows = v[pos:pos + 3 * n]
            pos += 3 * n
            transfers.append(Transfer(op_id, lane, _join(hi, lo), rows[0::3],
                                      [_join(a, b) for a, b in zip(rows[1::3], rows[2::3])]))
        queries = v[pos:pos + nq]
        releases = v[pos + nq:pos + nq + nr]
        return cls(transfers[:nf], transfers[nf:], queries, releases)
