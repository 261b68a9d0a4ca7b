"""The finalizer's job: remove a deleted model's Redis keys.

Keys are namespaced `kubeshard:{model}:{revision}:...` by the router (and the shards'
activation cache); deleting a model removes them for every revision it served. Every
call is bounded (socket timeouts and an overall deadline) so an unreachable Redis delays
deletion by a few tries, never forever.

The URL may name one Redis server or any node of a Redis Cluster (found out with `INFO
cluster`). On a Cluster every primary is scanned (a SCAN sees only the node it runs on)
and the keys go slot by slot, with one UNLINK per slot on the node that holds it (a
multi-key command across slots is refused with CROSSSLOT).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

# Characters that mean something in a Redis MATCH pattern.
_GLOB = re.compile(r"([*?\[\]\\])")
BATCH = 500


def model_key_pattern(model: str) -> str:
    escaped = _GLOB.sub(r"\\\1", model)
    return f"kubeshard:{escaped}:*"


def delete_model_keys(url: str, model: str, *, timeout: float = 3.0,
                      deadline: float = 60.0) -> int:
    """Deletes every key of `model` (all revisions); returns how many went.

    Raises redis.RedisError (or OSError) when Redis cannot be reached, a Cluster is not
    usable, or the deadline passes, so the caller can retry or give up."""
    options = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False)
    end = time.monotonic() + deadline
    client = redis.Redis.from_url(url, **options)
    try:
        if not _is_cluster(client):
            return _delete(client, model, end, deadline, slot_of=None)
    finally:
        client.close()
    try:
        cluster = RedisCluster.from_url(url, **options)
    except RedisClusterException as exc:  # not a RedisError: the caller's retry would miss it
        raise redis.ConnectionError(f"the Redis Cluster at {redact(url)} is not usable: {exc}") from exc
    try:
        return sum(_delete(node.redis_connection, model, end, deadline, slot_of=cluster.keyslot)
                   for node in cluster.get_primaries())
    except RedisClusterException as exc:
        raise redis.ConnectionError(f"the Redis Cluster at {redact(url)} failed: {exc}") from exc
    finally:
        cluster.close()


def _is_cluster(client: redis.Redis) -> bool:
    try:
        return int(client.info("cluster").get("cluster_enabled", 0)) == 1
    except redis.ResponseError:  # a server that does not know INFO cluster is no Cluster
        return False


def _delete(node: redis.Redis, model: str, end: float, deadline: float, slot_of) -> int:
    """SCANs one server (or one Cluster primary) and UNLINKs the model's keys in
    batches; on a Cluster (``slot_of``) one UNLINK per slot, pipelined."""
    removed = 0
    batch: list[bytes] = []

    def flush() -> int:
        if not batch:
            return 0
        if slot_of is None:
            n = node.unlink(*batch)
        else:
            by_slot: dict[int, list[bytes]] = defaultdict(list)
            for key in batch:
                by_slot[slot_of(key)].append(key)
            pipe = node.pipeline(transaction=False)
            for keys in by_slot.values():
                pipe.unlink(*keys)
            n = sum(pipe.execute())
        batch.clear()
        return n

    # SCAN, not KEYS: never blocks the server on a large keyspace. UNLINK frees memory
    # in the background.
    for key in node.scan_iter(match=model_key_pattern(model), count=BATCH):
        batch.append(key)
        if len(batch) >= BATCH:
            removed += flush()
        if time.monotonic() > end:
            raise redis.TimeoutError(f"removing the keys of {model!r} took over {deadline} s")
    return removed + flush()


def redact(url: str) -> str:
    """The URL without its password, for logs and events."""
    return re.sub(r"//([^:/@]*):[^@]*@", r"//\1:***@", url)
