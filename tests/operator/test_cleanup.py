"""The finalizer's Redis cleanup against a real redis-server."""

import time

import pytest
import redis

from kubeshard_operator.cleanup import delete_model_keys, model_key_pattern, redact

from tests.support.ports import free_port


def test_removes_every_revision_of_the_model_and_nothing_else(redis_url):
    r = redis.Redis.from_url(redis_url)
    for i in range(1200):  # more than one SCAN/UNLINK batch
        r.set(f"kubeshard:tiny:main:cache:{i}", "x")
    r.set("kubeshard:tiny:v2:inflight:router-1", 3)
    r.set("kubeshard:tiny-2:main:cache:a", "keep")  # a model whose name extends ours
    r.set("kubeshard:other:main:cache:a", "keep")
    assert delete_model_keys(redis_url, "tiny") == 1201
    assert sorted(r.keys("*")) == [b"kubeshard:other:main:cache:a",
                                   b"kubeshard:tiny-2:main:cache:a"]


def test_glob_characters_in_a_model_name_match_literally(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.set("kubeshard:a*:main:x", 1)
    r.set("kubeshard:abc:main:x", 1)
    assert model_key_pattern("a*") == "kubeshard:a\\*:*"
    assert delete_model_keys(redis_url, "a*") == 1
    assert r.exists("kubeshard:abc:main:x")


def test_unreachable_redis_fails_fast_instead_of_blocking():
    port = free_port()  # nobody listens on it
    started = time.monotonic()
    with pytest.raises((redis.RedisError, OSError)):
        delete_model_keys(f"redis://127.0.0.1:{port}/0", "tiny", timeout=0.5)
    assert time.monotonic() - started < 5


def test_redact_hides_passwords():
    assert redact("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"


@pytest.fixture
def cluster():
    from tests.support.redis_cluster import RedisCluster

    c = RedisCluster(3)
    yield c
    c.close()


def test_a_redis_cluster_is_cleaned_on_every_primary_slot_by_slot(cluster):
    """A real three-node Cluster: a SCAN sees one node, an UNLINK of keys in several
    slots is refused (CROSSSLOT); every key of the model goes, on every node."""
    cluster.start()
    r = redis.RedisCluster.from_url(cluster.url)
    ours = [f"kubeshard:tiny:main:cache:{i}" for i in range(1200)]              # every slot's neighbourhood
    ours += [f"kubeshard:tiny:main:kv:float32:b16:full:{{{t:016x}}}:{b:032x}"   # chains: one slot each
             for t in range(5) for b in range(40)]
    ours += ["kubeshard:tiny:v2:inflight:router-1", "kubeshard:tiny:kv:budget:{abc}:bytes"]
    keep = ["kubeshard:tiny-2:main:cache:a", "kubeshard:other:main:cache:a", "kubeshard:other:main:kv:x:{7}:1"]
    for key in ours + keep:
        r.set(key, "x")
    before = cluster.keys()
    assert sum(1 for keys in before.values() if any(k.startswith(b"kubeshard:tiny:") for k in keys)) == 3
    assert delete_model_keys(cluster.url, "tiny") == len(ours)
    left = sorted(k for keys in cluster.keys().values() for k in keys)
    assert left == sorted(k.encode() for k in keep)
    r.close()


def test_a_cluster_with_slots_not_covered_fails_as_a_redis_error(cluster):
    """The Cluster client's own exception is not a RedisError: the finalizer's retry
    and give-up path would miss it."""
    cluster.start(create=False)
    started = time.monotonic()
    with pytest.raises(redis.RedisError, match="not usable"):
        delete_model_keys(cluster.url, "tiny", timeout=0.5)
    assert time.monotonic() - started < 10
