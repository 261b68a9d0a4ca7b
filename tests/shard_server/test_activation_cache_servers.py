"""The activation cache across real server processes: restarts, a real three-node Redis
Cluster on loopback, and 2-shard tensor and zero3 groups (real torch.distributed)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import redis
import torch

from kubeshard_proto import pb
from kubeshard_shard.activations.layout import KVLayout
from kubeshard_shard.engine.block_manager import hash_block
from tests.support.engine import hf_greedy, random_prompts
from tests.support.metrics import metric
from tests.support.redis_cluster import RedisCluster
from tests.support.shard_process import start_group, start_shard

PREFIX = random_prompts(1, 1000, (1000, 1000), seed=21)[0]   # 62 full blocks of 16, and 8 tokens
TAILS = random_prompts(4, 1000, (4, 9), seed=22)
FLAGS = ["--kv-cache-memory", "32MiB", "--max-total-tokens", "1200", "--activation-cache-min-hits", "1"]


def request(ids, n=6) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="ac", input_ids=ids, sampling=pb.SamplingParameters(),
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))


def generate(server, ids, n=6) -> tuple[list[int], pb.Token]:
    tokens = list(server.stub().Generate(request(ids, n), timeout=120))
    return [t.id for t in tokens], tokens[-1]


def wait_for_entries(url: str, count: int, timeout: float = 30) -> None:
    """Until ``count`` KV entries are in Redis (writes are asynchronous)."""
    client = redis.RedisCluster.from_url(url) if "cluster" in url else redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if len(list(client.scan_iter(match="kubeshard:*:kv:float32:*", count=1000))) >= count:
                return
            time.sleep(0.1)
    finally:
        client.close()
    raise AssertionError(f"fewer than {count} entries in Redis after {timeout}s")


@pytest.mark.slow
def test_a_fresh_server_skips_the_prefill_of_a_1000_token_prefix_in_redis(demo_model, redis_url):
    model = demo_model()
    first = start_shard(model, *FLAGS, "--redis-url", redis_url)
    try:
        generate(first, PREFIX + TAILS[0])
        wait_for_entries(redis_url, 62)
    finally:
        first.stop()

    fresh = start_shard(model, *FLAGS, "--redis-url", redis_url, metrics=True)   # a restart: empty local cache
    try:
        ids, last = generate(fresh, PREFIX + TAILS[1])
        assert ids == hf_greedy(model, PREFIX + TAILS[1], 6)
        assert last.finish.cached_prompt_tokens == 992
        stats = fresh.stats()
        a = stats.activation_cache
        assert (a.lookups, a.hits, a.hit_blocks, a.prefill_tokens_saved, a.rejected_entries) == (1, 1, 62, 992, 0)
        assert a.bytes_read > 62 * 16384 and a.redis_up
        page = SimpleNamespace(url=f"http://127.0.0.1:{fresh.metrics_port}")
        assert metric(page, "kubeshard_activation_cache_prefill_tokens_saved_total") == 992
        assert metric(page, "kubeshard_activation_cache_hit_blocks_total") == 62
        assert metric(page, "kubeshard_activation_cache_fetch_seconds_count") == 1
    finally:
        fresh.stop()


def test_off_by_flag(demo_model, redis_url):
    model = demo_model()
    off = start_shard(model, *FLAGS, "--redis-url", redis_url, "--no-activation-cache")
    try:
        generate(off, PREFIX + TAILS[0])
        assert not off.stats().HasField("activation_cache")
    finally:
        off.stop()
    assert redis.Redis.from_url(redis_url).dbsize() == 0


@pytest.fixture
def redis_cluster():
    cluster = RedisCluster(3)
    cluster.start()
    yield cluster
    cluster.close()


@pytest.mark.slow
def test_a_three_node_redis_cluster(demo_model, redis_cluster):
    model = demo_model()
    prefixes = [p[:200] for p in random_prompts(6, 1000, (200, 200), seed=23)]   # 12 blocks each
    first = start_shard(model, *FLAGS, "--redis-url", redis_cluster.url)
    try:
        for p in prefixes:
            generate(first, p + TAILS[0])
        wait_for_entries(redis_cluster.url + "#cluster", 6 * 12)
    finally:
        first.stop()
    by_node = {port: [k for k in keys if b":kv:float32:" in k] for port, keys in redis_cluster.keys().items()}
    tags = {port: {k.split(b"{")[1].split(b"}")[0] for k in keys} for port, keys in by_node.items()}
    assert sum(len(t) for t in tags.values()) == 6                 # each chain lives on exactly one node
    assert sum(1 for keys in by_node.values() if keys) >= 2        # and the chains spread over the nodes

    fresh = start_shard(model, *FLAGS, "--redis-url", redis_cluster.url)
    try:
        for p in prefixes[:3]:
            ids, last = generate(fresh, p + TAILS[1])
            assert ids == hf_greedy(model, p + TAILS[1], 6)
            assert last.finish.cached_prompt_tokens == 192
        a = fresh.stats().activation_cache
        assert (a.hits, a.hit_blocks, a.rejected_entries) == (3, 36, 0)
    finally:
        fresh.stop()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tensor", "zero3"])
def test_two_shard_groups_load_each_ranks_own_blocks(demo_model, redis_url, strategy):
    model = demo_model()
    prompts = [PREFIX[:400] + t for t in TAILS]
    want = [hf_greedy(model, p, 6) for p in prompts]
    group = start_group(model, strategy, 2, *FLAGS, "--redis-url", redis_url)
    try:
        assert generate(group.leader, prompts[0])[0] == want[0]
        wait_for_entries(redis_url, 25 * (2 if strategy == "tensor" else 1))   # tensor: each rank its heads
    finally:
        group.stop()
    keys = [k.decode() for k in redis.Redis.from_url(redis_url).scan_iter(match="kubeshard:*:kv:float32:*")]
    layouts = {k.split(":")[6] for k in keys}
    assert layouts == ({"tp2.r0", "tp2.r1"} if strategy == "tensor" else {"full"})

    fresh = start_group(model, strategy, 2, *FLAGS, "--redis-url", redis_url)
    try:
        results: dict[int, list[int]] = {}

        def run(i):
            results[i] = generate(fresh.leader, prompts[i])[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in (1, 2, 3)]   # zero3: on both ranks' lanes
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [results[i] for i in (1, 2, 3)] == want[1:]
        a = fresh.leader.stats().activation_cache
        assert a.hits >= 1 and a.hit_blocks >= 25 and a.rejected_entries == 0
        if strategy == "zero3":
            lanes = fresh.leader.stats().ranks
            assert all(r.prefix_cache_hits >= 25 for r in lanes if r.prefix_cache_queries)
    finally:
        fresh.stop()


@pytest.mark.slow
def test_a_tensor_group_uses_a_prefix_only_when_every_rank_has_it(demo_model, redis_url):
    model = demo_model()
    prompt = PREFIX[:400] + TAILS[0]
    group = start_group(model, "tensor", 2, *FLAGS, "--redis-url", redis_url)
    try:
        generate(group.leader, prompt)
        wait_for_entries(redis_url, 50)
    finally:
        group.stop()
    client = redis.Redis.from_url(redis_url)
    hashes, parent = [], None
    for i in range(25):
        parent = hash_block(parent, PREFIX[i * 16:(i + 1) * 16])
        hashes.append(parent)
    rank1 = KVLayout(model.name, "main", torch.float32, 16, 2, 2, 16, "tp2.r1")   # 2 of the 4 KV heads
    assert client.delete(rank1.key(hashes[0], hashes[10])) == 1   # rank 1 lost block 10; rank 0 has all 25
    client.close()
    fresh = start_group(model, "tensor", 2, *FLAGS, "--redis-url", redis_url)
    try:
        assert generate(fresh.leader, PREFIX[:400] + TAILS[1])[0] == hf_greedy(model, PREFIX[:400] + TAILS[1], 6)
        a = fresh.leader.stats().activation_cache
        assert (a.hit_blocks, a.miss_blocks) == (10, 15)          # only the blocks both ranks had
    finally:
        fresh.stop()
