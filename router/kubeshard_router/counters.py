"""Per-model load of this router instance, published to Redis for the autoscaler.

Each router instance writes ``kubeshard:{model}:{revision}:load:{router_id}``, a hash

    in_flight          requests generating on a replica
    queued             requests waiting for a slot or held while the model wakes from zero
    tokens_in_flight   prompt tokens plus the new tokens still reserved, of both
    tokens_per_second  output tokens per second over the last ten seconds
    last_request_at    epoch seconds of the last request (0: none since start)

with a TTL of ``ttl_s``, every ``interval_s`` (never on the request path), and adds
``{revision}|{router_id}`` to the model's index ``kubeshard:{model}:routers``, a sorted
set scored by when the entry expires, so a reader finds every live router's hash of a
model (whatever revision it serves) without scanning the keyspace. A router that dies
stops refreshing: its hash expires with the TTL and its index entry scores in the past,
so the sum over live routers is the load. The operator's metrics server and its
scale-to-zero read these (``kubeshard_operator.load`` is the reader; the key layout is
the contract between the two).

The publisher has its own connection with a timeout of a second: it runs in the
background, so a slow moment of Redis may delay it without tripping the request path's
circuit breaker (``RedisStore``), which would switch the response cache off meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Callable, Iterable

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from kubeshard_router.redis_store import redact_url

log = logging.getLogger("kubeshard.router.counters")


@dataclass(frozen=True, slots=True)
class ModelLoad:
    model: str
    revision: str
    in_flight: int = 0
    queued: int = 0
    tokens_in_flight: int = 0
    tokens_per_second: float = 0.0
    last_request_at: float = 0.0

    def fields(self) -> dict[str, int | float]:
        return {"in_flight": self.in_flight, "queued": self.queued,
                "tokens_in_flight": self.tokens_in_flight,
                "tokens_per_second": self.tokens_per_second,
                "last_request_at": self.last_request_at}


def load_key(model: str, revision: str, router_id: str) -> str:
    return f"kubeshard:{model}:{revision}:load:{router_id}"


def index_key(model: str) -> str:
    return f"kubeshard:{model}:routers"


def index_member(revision: str, router_id: str) -> str:
    """A router's entry for one revision in its model's index (the operator splits it at
    the last '|')."""
    return f"{revision}|{router_id}"


async def read_load(client: aioredis.Redis, model: str, revision: str) -> tuple[int, int]:
    """Sums (in_flight, queued) of one model over every live router instance."""
    in_flight = queued = 0
    async for key in client.scan_iter(match=f"kubeshard:{model}:{revision}:load:*", count=100):
        values = await client.hmget(key, "in_flight", "queued")
        in_flight += int(values[0] or 0)
        queued += int(values[1] or 0)
    return in_flight, queued


@dataclass(eq=False)
class LoadPublisher:
    """Writes this router's per-model load (``snapshot()``) to Redis every ``interval_s``,
    each entry living ``ttl_s`` seconds unless written again."""

    url: str
    router_id: str
    snapshot: Callable[[], Iterable[ModelLoad]]
    _: KW_ONLY
    interval_s: float
    ttl_s: int
    timeout_s: float = 1.0
    up: bool = field(default=True, init=False)  # the last write reached Redis
    client: aioredis.Redis = field(init=False, repr=False)
    _task: asyncio.Task | None = field(default=None, init=False, repr=False)
    _published: set[tuple[str, str]] = field(default_factory=set, init=False, repr=False)  # (model, revision)

    def __post_init__(self) -> None:
        self.client = aioredis.Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                              socket_connect_timeout=self.timeout_s,
                                              retry=Retry(NoBackoff(), 0), health_check_interval=0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="load publisher")

    async def publish_once(self) -> None:
        loads = list(self.snapshot())
        # A model (or revision) this router no longer serves: its entry goes now, not at
        # expiry. When an InferenceService is deleted the operator removes the model's keys,
        # but a publish between that and this router noticing the deletion writes them again.
        serving = {(load.model, load.revision) for load in loads}
        gone = self._published - serving
        if not loads and not gone:
            return
        expires = time.time() + self.ttl_s
        pipe = self.client.pipeline(transaction=False)
        for model, revision in gone:
            self._withdraw(pipe, model, revision)
        for load in loads:
            key = load_key(load.model, load.revision, self.router_id)
            pipe.hset(key, mapping=load.fields())
            pipe.expire(key, self.ttl_s)
            index = index_key(load.model)
            pipe.zadd(index, {index_member(load.revision, self.router_id): expires})
            pipe.zremrangebyscore(index, "-inf", time.time())
            pipe.expire(index, self.ttl_s)
        async with asyncio.timeout(self.timeout_s * 2):
            await pipe.execute()
        self._published = serving

    async def _run(self) -> None:
        while True:
            try:
                await self.publish_once()
                if not self.up:
                    self.up = True
                    log.info("load counters reach Redis at %s again", redact_url(self.url))
            except (RedisError, OSError, TimeoutError) as exc:
                if self.up:
                    self.up = False
                    log.warning("load counters cannot reach Redis at %s (%s: %s); the metrics "
                                "server asks this router directly meanwhile", redact_url(self.url),
                                type(exc).__name__, exc)
            except Exception:
                log.exception("publishing load counters failed")
            await asyncio.sleep(self.interval_s)

    def _withdraw(self, pipe, model: str, revision: str) -> None:
        """Queues the removal of this router's load entry for (model, revision)."""
        pipe.delete(load_key(model, revision, self.router_id))
        pipe.zrem(index_key(model), index_member(revision, self.router_id))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        # Remove this replica's counts at once rather than waiting for expiry.
        try:
            loads = list(self.snapshot())
            if loads:
                pipe = self.client.pipeline(transaction=False)
                for l in loads:
                    self._withdraw(pipe, l.model, l.revision)
                async with asyncio.timeout(self.timeout_s):
                    await pipe.execute()
        except Exception:
            pass
        try:
            await self.client.aclose()
        except Exception:
            pass
