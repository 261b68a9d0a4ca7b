"""The balancer alone: prefix keys, ring stability, bounded load, exclusion, plain modes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from kubeshard_router.balancer import Balancer, HashRing


@dataclass(eq=False)
class R:
    address: str
    outstanding: int = 0


def replicas(n: int) -> list[R]:
    return [R(f"10.0.0.{i}:50051") for i in range(n)]


def test_prefix_key_uses_only_full_leading_blocks():
    b = Balancer(affinity_blocks=2)
    base = list(range(100, 132))  # two full blocks of 16
    assert b.prefix_key(base[:15], 16) is None  # no full block: no reusable prefix
    one_block = b.prefix_key(base[:16], 16)
    assert one_block is not None
    assert b.prefix_key(base[:16] + [1, 2, 3], 16) == one_block  # the partial block is ignored
    two = b.prefix_key(base, 16)
    assert two != one_block
    # Tokens after the first `affinity_blocks` blocks do not change the key.
    assert b.prefix_key(base + [7] * 40, 16) == two
    assert b.prefix_key(base[:31] + [999], 16) != two


def test_same_prefix_goes_to_same_replica_and_different_prefixes_spread():
    b = Balancer()
    rs = replicas(4)
    chosen = Counter()
    for p in range(64):
        prompt = [p * 1000 + i for i in range(64)]
        key = b.prefix_key(prompt, 16)
        first = b.pick(rs, key)
        for _ in range(5):
            assert b.pick(rs, key) is first  # idle replicas: affinity is exact
        chosen[first.address] += 1
    assert len(chosen) == 4  # 64 prefixes use every replica
    assert min(chosen.values()) >= 6


def test_ring_is_the_same_in_every_router_replica():
    a = HashRing(["a:1", "b:1", "c:1"], vnodes=32)
    b = HashRing(["c:1", "a:1", "b:1"], vnodes=32)
    keys = [k * 0x9E3779B97F4A7C15 % (1 << 64) for k in range(200)]
    assert [next(a.walk(k)) for k in keys] == [next(b.walk(k)) for k in keys]
    assert sorted(a.walk(keys[0])) == ["a:1", "b:1", "c:1"]  # a walk visits each node once


def test_removing_a_replica_moves_only_its_keys():
    b = Balancer()
    rs = replicas(4)
    keys = [b.prefix_key([k] * 16, 16) for k in range(300)]
    before = {k: b.pick(rs, k).address for k in keys}
    gone = rs[1]
    after = {k: b.pick([r for r in rs if r is not gone], k).address for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone.address for k in moved)


def test_bounded_load_skips_a_hot_replica_then_returns():
    b = Balancer(load_factor=1.25)
    rs = replicas(4)
    key = b.prefix_key(list(range(64)), 16)
    home = b.pick(rs, key)
    home.outstanding = 10  # far above 1.25 x the mean
    other = b.pick(rs, key)
    assert other is not home
    # The overflow goes to a consistent second choice, so it too builds a warm cache.
    assert all(b.pick(rs, key) is other for _ in range(5))
    home.outstanding = 0
    assert b.pick(rs, key) is home


def test_bound_allows_some_imbalance():
    b = Balancer(load_factor=2.0)
    rs = replicas(3)
    key = b.prefix_key(list(range(16)), 16)
    home = b.pick(rs, key)
    home.outstanding = 1  # cap = ceil(2.0 x (1 + 1) / 3) = 2: one request over the mean is fine
    assert b.pick(rs, key) is home
    home.outstanding = 2  # cap = ceil(2.0 x 3 / 3) = 2: at the cap, skipped
    assert b.pick(rs, key) is not home


def test_short_prompts_go_to_least_outstanding():
    b = Balancer()
    rs = replicas(3)
    rs[0].outstanding, rs[1].outstanding, rs[2].outstanding = 4, 1, 3
    assert b.pick(rs, None) is rs[1]


def test_least_outstanding_rotates_among_ties():
    b = Balancer()
    rs = replicas(3)
    assert {b.pick(rs, None).address for _ in range(9)} == {r.address for r in rs}


def test_exclude_skips_tried_replicas():
    b = Balancer()
    rs = replicas(3)
    key = b.prefix_key(list(range(32)), 16)
    first = b.pick(rs, key)
    second = b.pick(rs, key, exclude=[first])
    third = b.pick(rs, key, exclude=[first, second])
    assert len({first.address, second.address, third.address}) == 3
    assert b.pick(rs, key, exclude=rs) is None
    assert b.pick([], key) is None


def test_round_robin_and_least_outstanding_modes_ignore_prefixes():
    rr = Balancer(mode="round-robin")
    rs = replicas(4)
    key = rr.prefix_key(list(range(64)), 16)
    assert key is None  # no affinity in plain modes
    assert len({rr.pick(rs, key).address for _ in range(8)}) == 4
    lo = Balancer(mode="least-outstanding")
    rs[2].outstanding = -1
    assert lo.pick(rs, lo.prefix_key(list(range(64)), 16)) is rs[2]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="balance mode"):
        Balancer(mode="random")
