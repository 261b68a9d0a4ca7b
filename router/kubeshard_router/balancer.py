"""Replica choice: prefix affinity by consistent hashing, with bounded load.

Requests whose prompts share their first ``affinity_blocks`` full KV blocks hash to the
same point on a ring of replicas, so they land where the engine's prefix cache already
holds those blocks. A replica is skipped while its outstanding requests exceed
``load_factor`` times the mean (Mirrokni et al., "Consistent Hashing with Bounded
Loads"); the walk then continues around the ring, so overflow of one prefix also goes to
a consistent second replica. Prompts shorter than one block carry no reusable prefix and
go to the replica with the fewest outstanding requests.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from array import array
from typing import Iterator, Optional, Protocol, Sequence, TypeVar


class Balanceable(Protocol):
    address: str
    outstanding: int


R = TypeVar("R", bound=Balanceable)

MODES = ("prefix", "least-outstanding", "round-robin")


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Virtual-node ring over replica addresses; the same addresses give the same ring
    in every router instance."""

    def __init__(self, nodes: Sequence[str], vnodes: int = 64) -> None:
        points = sorted((_hash64(f"{node}#{i}".encode()), node) for node in nodes for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._nodes = [n for _, n in points]
        self.size = len(set(nodes))

    def walk(self, key: int) -> Iterator[str]:
        """Distinct nodes in ring order, starting at the first point at or after ``key``."""
        if not self._nodes:
            return
        start = bisect.bisect_left(self._hashes, key)
        seen: set[str] = set()
        n = len(self._nodes)
        for i in range(n):
            node = self._nodes[(start + i) % n]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == self.size:
                    return


class Balancer:
    def __init__(self, *, mode: str = "prefix", affinity_blocks: int = 4,
                 load_factor: float = 1.25, vnodes: int = 64) -> None:
        if mode not in MODES:
            raise ValueError(f"balance mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.affinity_blocks = affinity_blocks
        self.load_factor = load_factor
        self.vnodes = vnodes
        self._rings: dict[tuple[str, ...], HashRing] = {}
        self._turn = 0

    def prefix_key(self, input_ids: Sequence[int], block_size: int,
                   adapter: Optional[str] = None) -> Optional[int]:
        """Hash of the first ``affinity_blocks`` full blocks (and the LoRA adapter: its KV
        differs from the base model's), or None without one full block."""
        if self.mode != "prefix" or block_size <= 0:
            return None
        blocks = min(len(input_ids) // block_size, self.affinity_blocks)
        if blocks == 0:
            return None
        data = array("I", input_ids[: blocks * block_size]).tobytes()
        return _hash64(data if adapter is None else adapter.encode() + b"\0" + data)

    def _ring(self, replicas: Sequence[Balanceable]) -> HashRing:
        names = tuple(sorted(r.address for r in replicas))
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) > 64:
                self._rings.clear()
            ring = self._rings[names] = HashRing(names, self.vnodes)
        return ring

    def pick(self, replicas: Sequence[R], key: Optional[int], exclude: Sequence[R] = ()) -> Optional[R]:
        candidates = [r for r in replicas if r not in exclude] if exclude else list(replicas)
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        self._turn += 1
        if self.mode == "round-robin":
            return candidates[self._turn % len(candidates)]
        if key is None:
            return self._least_outstanding(candidates)
        by_address = {r.address: r for r in candidates}
        total = sum(r.outstanding for r in candidates)
        cap = math.ceil(self.load_factor * (total + 1) / len(candidates))
        for address in self._ring(candidates).walk(key):
            replica = by_address[address]
            if replica.outstanding < cap:
                return replica
        return self._least_outstanding(candidates)  # unreachable: someone is below the mean

    def _least_outstanding(self, candidates: list[R]) -> R:
        n = len(candidates)
        start = self._turn % n  # rotate among ties
        best = candidates[start]
        for i in range(1, n):
            r = candidates[(start + i) % n]
            if r.outstanding < best.outstanding:
                best = r
        return best
