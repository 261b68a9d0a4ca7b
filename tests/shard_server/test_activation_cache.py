"""The activation cache against a real Redis: in-process engines on the tiny demo model.

Greedy output is the same whether a prefix came from Redis, from the local prefix cache
or was computed; a fresh engine skips the prefill of a prefix it finds in Redis; Redis
flushed, stopped or slow mid-run, a corrupt or truncated entry, or an entry from another
model, dtype or layout never changes a token and never holds a request longer than the
configured wait.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import pytest
import redis
import torch

from kubeshard_shard.activations import codec
from kubeshard_shard.activations.layout import KVLayout
from kubeshard_shard.config import ActivationCacheConfig
from tests.support.activation_cache import engine, generate, populate, writes_land_before_the_next_test  # noqa: F401 - autouse fixture
from tests.support.engine import build_engine, greedy, hf_greedy, random_prompts
from tests.support.redis_server import RedisServer
from tests.support.slow_proxy import SlowProxy

PREFIX = random_prompts(1, 1000, (200, 200), seed=11)[0]   # 12 full blocks of 16, and 8 tokens
TAILS = random_prompts(4, 1000, (3, 9), seed=12)
BLOCK_BYTES = 2 * 2 * 16 * 4 * 16 * 4   # layers, K/V, block size, KV heads, head dim, float32


def entry_keys(url, model_prefix="kubeshard:") -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return sorted(k for k in client.scan_iter(match=model_prefix + "*:kv:float32:*", count=1000))
    finally:
        client.close()


def test_greedy_identical_from_redis_local_cache_or_computed(demo_model, redis_url):
    model = demo_model()
    prompts = [PREFIX + t for t in TAILS]
    want = [hf_greedy(model, p, 8) for p in prompts]

    computed = build_engine(model, kv="16MiB").engine
    assert generate(computed, prompts[:1]) == want[:1]

    first = engine(model, redis_url)
    assert populate(first, prompts[:1]) == want[:1]            # computed, then written
    assert first.stats().activation_cache.blocks_written == 12
    assert generate(first, prompts[1:2]) == want[1:2]          # the local prefix cache
    assert first.stats().activation_cache.hit_blocks == 0

    # a replica that never saw it; waiting up to 10 s for Redis (the default 1 s passed
    # with the fetch still running in a CI run under load: a miss, and this test failed)
    fresh = engine(model, redis_url, timeout_s=10.0)
    assert generate(fresh, prompts[1:]) == want[1:]            # three at once: one fetch
    stats = fresh.stats()
    a = stats.activation_cache
    assert (a.lookups, a.hits, a.hit_blocks, a.tokens_saved) == (1, 1, 12, 192)
    assert a.bytes_read == 12 * (codec.HEADER_BYTES + BLOCK_BYTES)
    assert stats.prefix_cache_hits >= 3 * 12


def test_only_prefixes_seen_min_hits_times_are_written(demo_model, redis_url):
    model = demo_model()
    eng = engine(model, redis_url, min_hits=2)
    populate(eng, [PREFIX + TAILS[0]])
    assert entry_keys(redis_url) == [] and eng.stats().activation_cache.blocks_written == 0
    populate(eng, [PREFIX + TAILS[1]])                          # the second prompt holding the prefix
    assert len(entry_keys(redis_url)) == 12
    populate(eng, [PREFIX + TAILS[2]])                          # already stored: not written again
    assert eng.stats().activation_cache.blocks_written == 12


def test_keys_name_model_revision_dtype_block_size_layout_and_share_a_slot(demo_model, redis_url):
    model = demo_model()
    populate(engine(model, redis_url), [PREFIX + TAILS[0]])
    keys = [k.decode() for k in entry_keys(redis_url)]
    assert len(keys) == 12
    prefix = f"kubeshard:{model.name}:main:kv:float32:b16:full:{{"
    assert all(k.startswith(prefix) for k in keys)
    tags = {k.split("{", 1)[1].split("}", 1)[0] for k in keys}
    assert len(tags) == 1                                       # one Cluster slot for the whole chain
    value = redis.Redis.from_url(redis_url).get(keys[0])
    assert value[:4] == b"KSKV" and len(value) == codec.HEADER_BYTES + BLOCK_BYTES


def test_corrupt_and_truncated_entries_are_ignored_and_counted(demo_model, redis_url):
    model = demo_model()
    layout = _layout(model)
    populate(engine(model, redis_url), [PREFIX + TAILS[0]])
    client = redis.Redis.from_url(redis_url)
    chain = _chain_keys(layout, PREFIX)
    value = bytearray(client.get(chain[5]))
    value[-100] ^= 0x40                                         # one flipped bit in block 5's K/V
    client.set(chain[5], bytes(value))
    client.set(chain[9], client.get(chain[9])[:-8])             # block 9 truncated
    fresh = engine(model, redis_url)
    assert generate(fresh, [PREFIX + TAILS[1]]) == [hf_greedy(model, PREFIX + TAILS[1], 8)]
    a = fresh.stats().activation_cache
    assert (a.hit_blocks, a.rejected) == (5, 1)                 # the chain stops at the bad block
    client.set(chain[5], bytes(value[:30]))                     # shorter than a header
    fresh = engine(model, redis_url)
    assert generate(fresh, [PREFIX + TAILS[2]]) == [hf_greedy(model, PREFIX + TAILS[2], 8)]
    assert fresh.stats().activation_cache.rejected == 1
    client.close()


def test_entries_of_another_model_dtype_or_layout_are_never_used(demo_model, redis_url):
    model, other = demo_model(), demo_model(seed=1)             # same shapes, other weights
    ours = _layout(model)
    hashes = _chain_hashes(PREFIX)
    client = redis.Redis.from_url(redis_url)
    populate(engine(other, redis_url), [PREFIX + TAILS[0]])
    genuine_other = [client.get(k) for k in _chain_keys(_layout(other), PREFIX)]
    block = torch.randn(ours.block_shape)
    planted = {
        "another model": genuine_other,
        "another revision": [codec.encode(replace(ours, revision="v2"), h, block) for h in hashes],
        "another layout": [codec.encode(replace(ours, sharding="tp2.r0", num_kv_heads=2), h,
                                        torch.randn(replace(ours, num_kv_heads=2).block_shape)) for h in hashes],
        "another block": [codec.encode(ours, h, block) for h in hashes[1:] + hashes[:1]],
    }
    for name, values in planted.items():
        client.flushall()
        for key, value in zip(_chain_keys(ours, PREFIX), values):
            client.set(key, value)
        fresh = engine(model, redis_url)
        assert generate(fresh, [PREFIX + TAILS[1]]) == [hf_greedy(model, PREFIX + TAILS[1], 8)], name
        a = fresh.stats().activation_cache
        assert (a.hit_blocks, a.rejected) == (0, 1), name
    # another dtype: other key names altogether; float32 entries planted under them are refused
    bf16 = _layout(model, torch.bfloat16)
    assert set(_chain_keys(bf16, PREFIX)).isdisjoint(_chain_keys(ours, PREFIX))
    client.flushall()
    for key, value in zip(_chain_keys(bf16, PREFIX), genuine_other):
        client.set(key, value)
    fresh = engine(model, redis_url, dtype="bfloat16")
    generate(fresh, [PREFIX + TAILS[1]])
    assert (fresh.stats().activation_cache.hit_blocks, fresh.stats().activation_cache.rejected) == (0, 1)
    client.close()


def test_entries_of_another_weight_quantization_or_kv_dtype_are_never_used(demo_model, redis_url):
    """The pool's bytes depend on the weights' quantization (int8, int4 and its group
    size) and on the dtype the model computes in when the pool stores another one
    (--kv-cache-dtype): such replicas use other keys, and an entry of one planted under
    another's keys is refused by its header."""
    model = demo_model()
    variants = {"float32": {}, "int8": dict(quantize="int8"), "int4g32": dict(quantize="int4"),
                "int4g64": dict(quantize="int4", quantize_group_size=64),
                "bf16 pool of a float32 model": dict(kv_cache_dtype="bfloat16"),
                "bfloat16": dict(dtype="bfloat16")}
    engines = {name: engine(model, redis_url, **kw) for name, kw in variants.items()}
    layouts = {name: e.cache.worker.layout for name, e in engines.items()}
    assert [lay.variant for lay in layouts.values()] == [
        "float32", "float32-wint8", "float32-wint4g32", "float32-wint4g64", "bfloat16-from-float32", "bfloat16"]
    assert len({lay.prefix for lay in layouts.values()}) == len({lay.digest for lay in layouts.values()}) == 6
    prompts = [PREFIX + t for t in TAILS]
    written = {name: populate(e, prompts[:1]) for name, e in engines.items()}   # every variant writes its own
    client = redis.Redis.from_url(redis_url)
    entries = {name: [client.get(k) for k in _chain_keys(lay, PREFIX)] for name, lay in layouts.items()}
    assert all(len(v) == 12 and None not in v for v in entries.values())

    # the same variant on a fresh replica: its own entries, the tokens it computes
    same = engine(model, redis_url, quantize="int4")
    assert generate(same, prompts[:1]) == written["int4g32"]
    assert same.stats().activation_cache.hit_blocks == 12
    # another variant's genuine entries planted under a replica's own keys: refused
    for ours, theirs in (("float32", "int8"), ("float32", "int4g32"), ("int8", "float32"),
                         ("int4g32", "int4g64"), ("bfloat16", "bf16 pool of a float32 model"),
                         ("bf16 pool of a float32 model", "bfloat16")):
        client.flushall()
        for key, value in zip(_chain_keys(layouts[ours], PREFIX), entries[theirs]):
            client.set(key, value)
        fresh = engine(model, redis_url, **variants[ours])
        want = written[ours] if ours != "float32" else [hf_greedy(model, prompts[0], 8)]
        assert generate(fresh, prompts[:1]) == want, (ours, theirs)
        a = fresh.stats().activation_cache
        assert (a.hit_blocks, a.rejected) == (0, 1), (ours, theirs)
    client.close()


def test_an_int8_kv_pool_turns_the_cache_off(demo_model, redis_url, caplog):
    with caplog.at_level("WARNING", logger="kubeshard_shard.server.factory"):
        eng = engine(demo_model(), redis_url, kv_cache_dtype="int8")
    assert eng.cache is None
    assert "activation cache off: an int8 KV pool" in caplog.text


def test_redis_flushed_or_stopped_mid_run(demo_model, redis_server, redis_url):
    model = demo_model()
    prompts = [PREFIX + t for t in TAILS]
    want = [hf_greedy(model, p, 8) for p in prompts]
    populate(engine(model, redis_url), prompts[:1])
    fresh = engine(model, redis_url)
    assert generate(fresh, prompts[:1]) == want[:1]
    redis.Redis.from_url(redis_url).flushall()
    other = random_prompts(2, 1000, (40, 60), seed=13)
    assert generate(fresh, [other[0]]) == [hf_greedy(model, other[0], 8)]     # a lookup finds nothing
    redis_server.stop()
    want_other = hf_greedy(model, other[1], 8)
    started = time.monotonic()
    assert generate(fresh, prompts[1:] + [other[1]]) == want[1:] + [want_other]
    assert time.monotonic() - started < 30
    a = fresh.stats().activation_cache
    assert not a.redis_up and a.errors >= 1
    redis_server.start()
    time.sleep(1.1)                                              # the retry interval
    new = random_prompts(1, 1000, (40, 60), seed=15)[0]
    assert generate(fresh, [new]) == [hf_greedy(model, new, 8)]
    assert fresh.stats().activation_cache.redis_up


def test_a_redis_with_a_password(demo_model, caplog):
    """The URL's password authenticates every connection; a wrong one is a Redis failure
    like any other (requests compute, nothing waits); the password is never logged."""
    password = f"pw-{uuid.uuid4().hex}"
    server = RedisServer(password=password)
    server.start()
    try:
        model = demo_model()
        prompts = [PREFIX + t for t in TAILS[:2]]
        want = [hf_greedy(model, p, 8) for p in prompts]
        with caplog.at_level("INFO", logger="kubeshard_shard"):
            first = engine(model, server.url)
            assert populate(first, prompts[:1]) == want[:1]
            assert first.stats().activation_cache.blocks_written == 12
            fresh = engine(model, server.url)
            assert generate(fresh, prompts[1:]) == want[1:]
            assert fresh.stats().activation_cache.hit_blocks == 12
            wrong = engine(model, server.url.replace(password, "not-it"))
            assert generate(wrong, prompts[1:]) == want[1:]
            a = wrong.stats().activation_cache
            assert a.hit_blocks == 0 and a.errors >= 1 and not a.redis_up
        assert "redis://***@127.0.0.1" in caplog.text
        assert password not in caplog.text and "not-it" not in caplog.text
        with pytest.raises(ValueError, match="--redis-url") as info:
            ActivationCacheConfig(redis_url=f"http://:{password}@127.0.0.1:{server.port}/0")
        assert password not in str(info.value)
    finally:
        server.close()


def test_slow_redis_bounds_the_wait(demo_model, redis_server, redis_url):
    model = demo_model()
    prompts = [PREFIX + t for t in TAILS[:2]]
    populate(engine(model, redis_url), prompts[:1])
    proxy = SlowProxy(redis_server.port)
    try:
        want = [hf_greedy(model, prompts[1], 8)]
        fresh = engine(model, proxy.url, timeout_s=0.3)
        time.sleep(0.5)                                          # connected while fast
        proxy.delay = 20.0                                       # then every reply takes 20 s
        started = time.monotonic()
        assert generate(fresh, prompts[1:]) == want
        assert time.monotonic() - started < 10                   # the 0.3 s wait, not the 20 s reply
        a = fresh.stats().activation_cache
        assert a.timeouts + a.errors >= 1 and a.hit_blocks == 0 and not a.redis_up
        generate(fresh, [PREFIX + TAILS[2]])                     # right after: Redis is skipped, no wait
        assert fresh.stats().activation_cache.lookups == a.lookups
    finally:
        proxy.close()


def test_aborted_while_waiting_for_its_prefix(demo_model, redis_server, redis_url):
    model = demo_model()
    populate(engine(model, redis_url), [PREFIX + TAILS[0]])
    proxy = SlowProxy(redis_server.port)
    try:
        fresh = engine(model, proxy.url, timeout_s=2.0)
        proxy.delay = 0.5
        key = fresh.add_request("a", PREFIX + TAILS[1], greedy(4))
        assert fresh.cache.num_held == 1
        assert fresh.abort(key) and fresh.cache.num_held == 0
        assert generate(fresh, [PREFIX + TAILS[2]]) == [hf_greedy(model, PREFIX + TAILS[2], 8)]
    finally:
        proxy.close()


def test_byte_budget_drops_the_oldest_entries(demo_model, redis_url):
    model = demo_model()
    block_entry = codec.HEADER_BYTES + _layout(model).block_bytes
    eng = engine(model, redis_url, max_bytes=20 * block_entry)
    for seed in range(4):                                        # 4 prompts of 12 blocks: 48 > 20
        populate(eng, random_prompts(1, 1000, (200, 200), seed=100 + seed))
    client = redis.Redis.from_url(redis_url)
    stored = sum(len(client.get(k)) for k in entry_keys(redis_url))
    assert 0 < stored <= 20 * block_entry
    newest = _chain_keys(_layout(model), random_prompts(1, 1000, (200, 200), seed=103)[0])
    assert all(client.exists(k) for k in newest)                 # the latest prompt's chain survives
    client.close()


def test_prompt_counters_are_short_lived_small_and_charged_to_the_budget(demo_model, redis_url):
    """One-off prompts (min_hits 2: nothing is written) leave only their counters: one
    hash per chain with an 8-byte field per block, living COUNT_TTL_S (not the entries'
    hour), charged to the model's byte budget, which drops the oldest when short."""
    from kubeshard_shard.activations.layout import count_field
    from kubeshard_shard.activations.worker import COUNT_FIELD_BYTES, COUNT_TTL_S

    model = demo_model()
    per_prompt = 12 * COUNT_FIELD_BYTES                          # 200 tokens: 12 full blocks
    eng = engine(model, redis_url, min_hits=2, max_bytes=3 * per_prompt)
    prompts = random_prompts(5, 1000, (200, 200), seed=300)
    for p in prompts:
        generate(eng, [p])                                       # returns once its blocks are counted
    client = redis.Redis.from_url(redis_url)
    layout = _layout(model)
    chains = {layout.seen_key(_chain_hashes(p)[0]).encode(): _chain_hashes(p) for p in prompts[-3:]}
    assert sorted(client.scan_iter(match="kubeshard:*:seen:*")) == sorted(chains)   # the newest three
    for key, hashes in chains.items():
        assert 0 < client.ttl(key) <= COUNT_TTL_S < 3600
        assert client.hgetall(key) == {count_field(h): b"1" for h in hashes}       # 12 fields of 8 bytes
    bytes_key, _index = layout.budget_keys()
    assert int(client.get(bytes_key)) == 3 * per_prompt
    assert entry_keys(redis_url) == []
    client.close()


def test_reserved_blocks_return_to_the_pool(demo_model, redis_url):
    model = demo_model()
    populate(engine(model, redis_url), [PREFIX + TAILS[0]])
    fresh = engine(model, redis_url)
    total = fresh.block_manager.num_blocks
    generate(fresh, [PREFIX + TAILS[1], random_prompts(1, 1000, (300, 300), seed=14)[0]])
    bm = fresh.block_manager
    assert bm.num_free_blocks == total and not fresh.cache.busy()
    assert bm.count_cached(bm.prompt_hashes(_seq(PREFIX + [1]))) == 12


def _layout(model, dtype=torch.float32) -> KVLayout:
    return KVLayout(model.name, "main", dtype, 16, 2, 4, 16)    # the tiny demo model: 2 layers, 4 KV heads of 16


def _seq(tokens):
    from kubeshard_shard.engine.sequence import SamplingParams, Sequence

    return Sequence("x", list(tokens), SamplingParams(max_new_tokens=1))


def _chain_hashes(prefix: list[int]) -> list[int]:
    from kubeshard_shard.engine.block_manager import hash_block

    hashes, parent = [], None
    for i in range(len(prefix) // 16):
        parent = hash_block(parent, prefix[i * 16:(i + 1) * 16])
        hashes.append(parent)
    return hashes


def _chain_keys(layout: KVLayout, prefix: list[int]) -> list[str]:
    hashes = _chain_hashes(prefix)
    return [layout.key(hashes[0], h) for h in hashes]


def test_codec_round_trip_and_refusals():
    layout = KVLayout("m", "main", torch.float32, 16, 2, 4, 16)
    block = torch.randn(layout.block_shape)
    value = codec.encode(layout, 1234, block)
    assert len(value) == codec.HEADER_BYTES + layout.block_bytes
    assert torch.equal(codec.as_block(codec.decode(value, layout, 1234), layout), block)
    cases = {
        "truncated": (value[:-1], layout, 1234),
        "format": (b"XXXX" + value[4:], layout, 1234),
        "mismatch": (value, layout, 1235),
        "checksum": (value[:-1] + bytes([value[-1] ^ 1]), layout, 1234),
    }
    for reason, (v, lay, h) in cases.items():
        with pytest.raises(codec.EntryRejected) as err:
            codec.decode(v, lay, h)
        assert err.value.reason == reason
    for other in (replace(layout, model="n"), replace(layout, revision="v2"), replace(layout, sharding="tp2.r0")):
        with pytest.raises(codec.EntryRejected, match="mismatch"):
            codec.decode(value, other, 1234)
    half = replace(layout, dtype=torch.bfloat16)
    bf = codec.encode(half, 7, torch.randn(half.block_shape).to(torch.bfloat16))
    assert len(bf) == codec.HEADER_BYTES + layout.block_bytes // 2
    with pytest.raises(codec.EntryRejected, match="mismatch"):
        codec.decode(bf, layout, 7)


def test_layouts_and_keys():
    from kubeshard_shard.config import Placement
    from kubeshard_shard.distributed.strategy import make_strategy

    def layout(strategy: str, shards: int, rank: int, heads: int) -> KVLayout:
        s = make_strategy(Placement(strategy=strategy, shards=shards, rank=rank))
        return KVLayout.for_rank("m", "r1", torch.float32, 16, 2, heads, 16, s.splits_kv_heads, s.shards, s.rank)

    full = layout("zero3", 2, 1, 4)
    assert full.sharding == "full" == layout("tensor", 1, 0, 4).sharding
    tp = layout("tensor", 2, 1, 2)
    assert tp.sharding == "tp2.r1" and tp.of_rank(2, 0).sharding == "tp2.r0"
    root, h = (1 << 127) | 5, 99
    assert tp.key(root, h) == f"kubeshard:m:r1:kv:float32:b16:tp2.r1:{{{root >> 64:016x}}}:{h:032x}"
    assert tp.seen_key(root).startswith("kubeshard:m:r1:kv:b16:seen:{")
    assert all(k.startswith("kubeshard:m:kv:budget:{") for k in tp.budget_keys())


def test_cache_ops_cross_the_wire_unchanged():
    from kubeshard_shard.activations.ops import CacheOps, Transfer

    big = (1 << 128) - 1
    ops = CacheOps(fetches=[Transfer(1, 0, big, [3, 4], [big, 1 << 64])],
                   writes=[Transfer(2, 1, 7, [5], [(1 << 127) + 3])], queries=[1, 2], releases=[9])
    assert CacheOps.decode(ops.encode()) == ops
    assert CacheOps.decode(CacheOps().encode()).empty


def test_on_with_a_redis_url_and_its_flags_round_trip(demo_model):
    from kubeshard_shard.cli import build_parser
    from kubeshard_shard.config import EngineConfig

    assert build_engine(demo_model(), kv="16MiB").engine.cache is None          # no URL: off
    args = build_parser().parse_args(["serve-shard", "--model", str(demo_model()), "--redis-url", "redis://h:1/0",
                                      "--activation-cache-min-hits", "3", "--activation-cache-max-bytes", "64MiB",
                                      "--redis-key-model", "svc"])
    config = EngineConfig.from_args(args)
    assert config.activations.active and config.activations.max_bytes == 64 * 1024**2
    again = EngineConfig.from_args(build_parser().parse_args(["serve-shard", *config.to_flags()]))
    assert again.activations == config.activations
    off = build_parser().parse_args(["serve-shard", "--model", "m", "--redis-url", "redis://h:1/0",
                                     "--no-activation-cache"])
    assert not EngineConfig.from_args(off).activations.active
    for flags, field in ((["--activation-cache-max-bytes", "0.5"], "--activation-cache-max-bytes"),
                         (["--redis-url", "http://x"], "--redis-url"),
                         (["--redis-key-model", "a{b}"], "--redis-key-model")):
        with pytest.raises(ValueError, match=field):
            EngineConfig.from_args(build_parser().parse_args(["serve-shard", "--model", "m", "--redis-url",
                                                              "redis://h:1/0", *flags]))


def test_deleting_the_model_removes_its_entries(demo_model, redis_url):
    """What the operator's finalizer does when an InferenceService goes: every key of the
    activation cache (entries, prompt counters, byte budget) is under kubeshard:<name>:."""
    from kubeshard_operator.cleanup import delete_model_keys

    populate(engine(demo_model(), redis_url, key_model="tiny-svc"), [PREFIX + TAILS[0]])
    client = redis.Redis.from_url(redis_url)
    client.set("kubeshard:other:main:cache:x", "keep")
    ours = [k for k in client.scan_iter(match="kubeshard:tiny-svc:*")]
    assert len(ours) == 12 + 1 + 2                              # entries, the prompt counts, the budget
    assert delete_model_keys(redis_url, "tiny-svc") == len(ours)
    assert [k for k in client.scan_iter()] == [b"kubeshard:other:main:cache:x"]
    client.close()
