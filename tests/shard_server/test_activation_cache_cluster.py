"""The activation cache on a broken Redis Cluster (real redis-server nodes on loopback):
whatever the Cluster client raises (``RedisClusterException``, ``SlotNotCoveredError``,
connection errors to a dead node) stays in the cache's background work. The engine
steps on, every request completes with the tokens it would compute, Redis is marked
down and the failure counted."""

from __future__ import annotations

import time

import pytest
import torch

from kubeshard_shard.activations.layout import KVLayout
from kubeshard_shard.engine.block_manager import hash_block
from tests.support.engine import hf_greedy, random_prompts
from tests.support.activation_cache import engine, generate, populate, writes_land_before_the_next_test  # noqa: F401 - autouse fixture
from tests.support.redis_cluster import RedisCluster

PREFIXES = random_prompts(6, 1000, (160, 160), seed=31)     # 10 full blocks each
TAILS = random_prompts(3, 1000, (3, 7), seed=32)


@pytest.fixture
def cluster():
    c = RedisCluster(3)
    yield c
    c.close()


def test_a_cluster_whose_slots_are_not_covered(demo_model, cluster):
    """Nodes in cluster mode that were never given slots: the client refuses to start
    (RedisClusterException), on the fetch and on the count after the prefill."""
    cluster.start(create=False)
    model = demo_model()
    eng = engine(model, cluster.url, retry_s=0.0)            # retry at once: every call meets the broken Cluster
    prompts = [PREFIXES[0] + TAILS[0], PREFIXES[1] + TAILS[1]]
    started = time.monotonic()
    assert generate(eng, prompts) == [hf_greedy(model, p, 8) for p in prompts]
    assert generate(eng, prompts[:1]) == [hf_greedy(model, prompts[0], 8)]      # again: the engine still serves
    assert time.monotonic() - started < 60
    eng.cache.worker.drain()
    a = eng.stats().activation_cache
    assert not a.redis_up and a.errors >= 2 and a.hit_blocks == 0 and a.blocks_written == 0


def _root(prefix: list[int]) -> int:
    return hash_block(None, prefix[:16])


def test_a_cluster_node_killed_mid_run(demo_model, cluster):
    cluster.start()
    model = demo_model()
    layout = KVLayout(model.name, "main", torch.float32, 16, 2, 4, 16)
    nodes = [cluster.node_of(layout.key(_root(p), _root(p))) for p in PREFIXES]
    dead = next(n for n in nodes if n != cluster.ports[0])     # the seed node stays: the client starts from it
    on_dead = [p for p, n in zip(PREFIXES, nodes) if n == dead]
    alive = [p for p, n in zip(PREFIXES, nodes) if n != dead]
    assert on_dead and alive

    first = engine(model, cluster.url, retry_s=0.0)
    populate(first, [p + TAILS[0] for p in PREFIXES])
    assert first.stats().activation_cache.blocks_written == 6 * 10
    cluster.kill(dead)

    fresh = engine(model, cluster.url, retry_s=0.0)
    started = time.monotonic()
    prompt = alive[0] + TAILS[1]
    assert generate(fresh, [prompt]) == [hf_greedy(model, prompt, 8)]           # a live node: a hit
    assert fresh.stats().activation_cache.hit_blocks == 10
    prompts = [p + TAILS[1] for p in on_dead] + [p + TAILS[2] for p in alive]
    assert generate(fresh, prompts) == [hf_greedy(model, p, 8) for p in prompts]
    # the populating engine counts a new prompt whose chain lives on the dead node
    new = next(p for p in random_prompts(30, 1000, (160, 160), seed=33)
               if cluster.node_of(layout.key(_root(p), _root(p))) == dead)
    assert generate(first, [new]) == [hf_greedy(model, new, 8)]
    assert time.monotonic() - started < 120
    first.cache.worker.drain()
    assert fresh.stats().activation_cache.errors >= 1 and first.stats().activation_cache.errors >= 1
