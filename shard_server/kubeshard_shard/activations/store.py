"""The activation cache's Redis: one server or a Redis Cluster, never a dependency.

``RedisTier`` finds out on first use whether its URL points at a Cluster node (``INFO
cluster``) and then talks to the Cluster through any node it was given. Every call has
a socket timeout; a failure marks Redis down for ``retry_s`` (calls are skipped at once
meanwhile, so a dead Redis costs nothing), counts an error and logs one line per outage.
A failure is anything a call raises: redis-py's errors, socket errors, and the Cluster
client's own exceptions (``RedisClusterException``, ``SlotNotCoveredError``), which are
not ``RedisError``s; none of them reaches the engine.

- ``fetch_chain`` reads a chain's entries with pipelined MGETs of a few blocks each, in
  one round trip (a chain's keys share one Cluster slot), and hands each value over as
  soon as its bytes are in (read straight from the socket into one reused buffer,
  ``resp``), so checking and copying a block overlaps with the transfer of the next;
- ``count_and_probe`` counts the prompts that held each block (HINCRBY in the chain's
  counter hash, one 8-byte field per block) and checks which blocks already have
  entries on every rank (EXISTS); the counter lives a shorter TTL than entries, and the
  fields it adds are charged to the byte budget;
- ``put`` writes entries with a TTL and charges them to the model's byte budget: an index
  (sorted by write time) and a byte counter; when the counter passes the budget, the
  oldest entries and counters go (and index members whose TTL ran out are dropped
  uncounted).

An index member is ``<bytes>|<key>`` (an entry) or ``<bytes>.<nonce>|<key>`` (a charge
for a counter's new fields: one counter is charged again as prompts add fields). A
counter's member is scored as if written ``ttl - count ttl`` earlier, so it turns stale
when its key expires, and goes first when the budget is short.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ResponseError
from redis.retry import Retry

from kubeshard_shard.activations.resp import read_mget_replies

log = logging.getLogger(__name__)

T = TypeVar("T")
MGET_BLOCKS = 8  # blocks per MGET of a chain read: a reply is processed while the next arrives


class TierUnavailable(Exception):
    """Redis is down, slow, or skipped while it is marked down."""


@dataclass(frozen=True)
class Budget:
    bytes_key: str
    index_key: str
    max_bytes: int


def redact(url: str) -> str:
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


class RedisTier:
    def __init__(self, url: str, timeout_s: float, retry_s: float = 1.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._client: redis.Redis | RedisCluster | None = None
        self.cluster = False
        self.up = True
        self._down_until = 0.0
        self.errors = 0

    # ---- connection and outages ------------------------------------------------------
    @property
    def available(self) -> bool:
        return self.up or time.monotonic() >= self._down_until

    def _options(self) -> dict:
        return dict(socket_timeout=self.timeout_s, socket_connect_timeout=min(self.timeout_s, 1.0),
                    retry=Retry(NoBackoff(), 0), health_check_interval=0)

    def _connect(self) -> redis.Redis | RedisCluster:
        with self._lock:
            if self._client is None:
                plain = redis.Redis.from_url(self.url, **self._options())
                try:
                    enabled = int(plain.info("cluster").get("cluster_enabled", 0))
                except ResponseError:  # a server that does not know INFO cluster is no Cluster
                    enabled = 0
                if enabled:
                    plain.close()
                    self._client = RedisCluster.from_url(self.url, **self._options())
                    self.cluster = True
                else:
                    self._client = plain
            return self._client

    def run(self, op: str, fn: Callable[[redis.Redis | RedisCluster], T]) -> T:
        """``fn(client)``, or TierUnavailable when Redis is down, slow or skipped."""
        if not self.available:
            raise TierUnavailable("redis is marked down")
        try:
            result = fn(self._connect())
        except Exception as exc:  # noqa: BLE001 - RedisError, OSError, and the Cluster client's own
            # (RedisClusterException, SlotNotCoveredError: plain Exceptions): never past the tier
            self._failed(op, exc)
            raise TierUnavailable(f"{type(exc).__name__}: {exc}") from None
        if not self.up:
            self.up = True
            log.info("activation cache: Redis at %s is back", redact(self.url))
        return result

    def too_slow(self, op: str, waited_s: float) -> None:
        """A caller gave up waiting: skip Redis for ``retry_s`` as after a failure."""
        self._failed(op, TimeoutError(f"no answer within {waited_s:.2f}s"))

    def _failed(self, op: str, exc: BaseException) -> None:
        self.errors += 1
        self._down_until = time.monotonic() + self.retry_s
        if self.cluster:  # the topology may have changed: find it again next time
            with self._lock:
                client, self._client = self._client, None
            if client is not None:
                try:
                    client.close()
                except Exception:
                    pass
        if self.up:
            self.up = False
            log.warning("activation cache: Redis at %s failed (%s: %s); requests compute their prefixes, "
                        "retrying in %.1fs", redact(self.url), op, exc, self.retry_s)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken Cluster client
                pass

    # ---- operations ------------------------------------------------------------------
    def fetch_chain(self, keys: list[str], on_value: Callable[[int, memoryview | None], bool],
                    max_value: int) -> None:
        """Calls ``on_value(i, value or None)`` for the chain's keys in order until it
        answers False; a value is a view valid only during the call (an empty one when
        it is longer than ``max_value``). Every key shares the first key's Cluster slot."""
        def fetch(client) -> None:
            node = client.get_node_from_key(keys[0]).redis_connection if self.cluster else client
            _stream_mget(node, keys, on_value, max_value)

        self.run("fetch", fetch)

    def count_and_probe(self, seen_key: str, fields: list[bytes], rank_keys: list[list[str]], count_ttl_s: int,
                        budget: Budget | None = None, ttl_s: int = 0,
                        field_bytes: int = 0) -> tuple[list[int], list[bool]]:
        """Adds one to each block's prompt count (the counter lives ``count_ttl_s``);
        returns the counts and whether every rank already has the block (``rank_keys[i]``:
        block i's key on each rank). New fields are charged ``field_bytes`` each to the
        budget, whose index lives ``ttl_s``."""
        def call(client):
            pipe = client.pipeline(transaction=False)
            for f in fields:
                pipe.hincrby(seen_key, f, 1)
            pipe.expire(seen_key, count_ttl_s)
            for keys in rank_keys:
                pipe.exists(*keys)
            out = pipe.execute()
            n = len(fields)
            counts = [int(c) for c in out[:n]]
            added = sum(1 for c in counts if c == 1) * field_bytes
            if budget is not None and added:
                # scored as if written earlier: stale when the counter expires, the first to go
                pipe = client.pipeline(transaction=False)
                member = f"{added}.{os.urandom(4).hex()}|{seen_key}"
                _charge(pipe, budget, {member: time.time() - (ttl_s - count_ttl_s)}, added, ttl_s)
                if int(pipe.execute()[-2]) > budget.max_bytes:
                    _trim(client, budget, ttl_s)
            return counts, [int(e) == len(k) for e, k in zip(out[n + 1:], rank_keys)]

        return self.run("count", call)

    def put(self, entries: list[tuple[str, bytes]], ttl_s: int, budget: Budget | None) -> int:
        """Writes the entries; returns their bytes."""
        total = sum(len(v) for _, v in entries)

        def call(client) -> int:
            pipe = client.pipeline(transaction=False)
            for key, value in entries:
                pipe.set(key, value, ex=ttl_s)
            if budget is not None:
                now = time.time()
                # a chain's tail scores older than its head: it goes first
                _charge(pipe, budget, {f"{len(v)}|{k}": now - i * 1e-5 for i, (k, v) in enumerate(entries)},
                        total, ttl_s)
            out = pipe.execute()
            if budget is not None and int(out[-2]) > budget.max_bytes:
                _trim(client, budget, ttl_s)
            return total

        return self.run("put", call)


def _stream_mget(node: redis.Redis, keys: list[str], on_value: Callable[[int, memoryview | None], bool],
                 max_value: int) -> None:
    """Sends every MGET in one write and hands each value over as it arrives (a view
    valid during the call; ``resp.read_mget_replies``). A stop, an error or a value over
    ``max_value`` bytes drops the connection rather than reading the rest."""
    pool = node.connection_pool
    conn = pool.get_connection()
    groups = [keys[i:i + MGET_BLOCKS] for i in range(0, len(keys), MGET_BLOCKS)]
    in_sync = False
    try:
        conn.send_packed_command(conn.pack_commands([("MGET", *g) for g in groups]))
        sock = getattr(conn, "_sock", None)
        if sock is not None:
            in_sync = read_mget_replies(sock, [len(g) for g in groups], max_value, on_value)
            return
        index = 0  # a connection without a plain socket: redis-py's parser
        for done, _ in enumerate(groups, start=1):
            reply = conn.read_response()
            if isinstance(reply, ResponseError):
                raise reply
            for value in reply:
                if not on_value(index, None if value is None else memoryview(value)):
                    return  # the rest is not needed: drop the connection rather than read it
                index += 1
        in_sync = True
    finally:
        if not in_sync:
            conn.disconnect()
        pool.release(conn)


def _charge(pipe, budget: Budget, members: dict[str, float], total: int, ttl_s: int) -> None:
    """Queues index members worth ``total`` bytes; the reply before last is the
    model's bytes after."""
    pipe.zadd(budget.index_key, members)
    pipe.expire(budget.index_key, ttl_s)
    pipe.incrby(budget.bytes_key, total)
    pipe.expire(budget.bytes_key, ttl_s)


def _size(member: bytes) -> int:
    return int(member.split(b"|", 1)[0].split(b".", 1)[0])


def _trim(client, budget: Budget, ttl_s: int) -> None:
    """Drops index members whose entries (or counters) expired, then the oldest, until
    the model's bytes fit its budget (bounded work per call)."""
    stale = client.zrangebyscore(budget.index_key, "-inf", time.time() - ttl_s, start=0, num=1024)
    _drop(client, budget, stale, delete=False)
    total = int(client.get(budget.bytes_key) or 0)
    for _ in range(32):
        if total <= budget.max_bytes:
            return
        oldest = client.zrange(budget.index_key, 0, 63)
        if not oldest:
            client.set(budget.bytes_key, 0, ex=ttl_s)
            return
        pick, freed = [], 0
        for member in oldest:
            pick.append(member)
            freed += _size(member)
            if total - freed <= budget.max_bytes:
                break
        total = _drop(client, budget, pick, delete=True)


def _drop(client, budget: Budget, members: list[bytes], delete: bool) -> int:
    """Removes index members (and their entries); returns the model's bytes after."""
    if not members:
        return int(client.get(budget.bytes_key) or 0)
    pipe = client.pipeline(transaction=False)
    for m in members:
        pipe.zrem(budget.index_key, m)
    removed = [m for m, n in zip(members, pipe.execute()) if int(n)]  # another writer may have taken some
    pipe = client.pipeline(transaction=False)
    if delete:
        for m in removed:
            pipe.unlink(m.split(b"|", 1)[1])
    pipe.decrby(budget.bytes_key, sum(_size(m) for m in removed))
    return int(pipe.execute()[-1])
