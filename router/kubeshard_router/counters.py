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
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import redis.asyncio as aioredis

from kubeshard_router.redis_store import RedisStore, StoreUnavailable

log = logging.getLogger("kubeshard.router.counters")


@dataclass(frozen=True, slots=True)
class ModelLoad:
    model: str
    revision: str
    in_flight: int
    queued: int
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


async def read_load(client: aioredis.Redis, model: str, revision: str) -> tuple[int, int]:
    """Sums (in_flight, queued) of one model over every live router instance."""
    in_flight = queued = 0
    async for key in client.scan_iter(match=f"kubeshard:{model}:{revision}:load:*", count=100):
        values = await client.hmget(key, "in_flight", "queued")
        in_flight += int(values[0] or 0)
        queued += int(values[1] or 0)
    return in_flight, queued


class LoadPublisher:
    def __init__(self, store: RedisStore, router_id: str, snapshot: Callable[[], Iterable[ModelLoad]],
                 *, interval_s: float, ttl_s: int) -> None:
        self.store = store
        self.router_id = router_id
        self.snapshot = snapshot
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="load publisher")

    async def publish_once(self) -> None:
        loads = list(self.snapshot())
        if not loads:
            return
        expires = time.time() + self.ttl_s

        async def write(r: aioredis.Redis) -> None:
            pipe = r.pipeline(transaction=False)
            for load in loads:
                key = load_key(load.model, load.revision, self.router_id)
                pipe.hset(key, mapping=load.fields())
                pipe.expire(key, self.ttl_s)
                index = index_key(load.model)
                pipe.zadd(index, {f"{load.revision}|{self.router_id}": expires})
                pipe.zremrangebyscore(index, "-inf", time.time())
                pipe.expire(index, self.ttl_s)
            await pipe.execute()

        await self.store.run("counters", write)

    async def _run(self) -> None:
        while True:
            try:
                await self.publish_once()
            except StoreUnavailable:
                pass
            except Exception:
                log.exception("publishing load counters failed")
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        # Remove this replica's counts at once rather than waiting for expiry.
        try:
            loads = list(self.snapshot())
            if loads:
                async def remove(r: aioredis.Redis) -> None:
                    pipe = r.pipeline(transaction=False)
                    for l in loads:
                        pipe.delete(load_key(l.model, l.revision, self.router_id))
                        pipe.zrem(index_key(l.model), f"{l.revision}|{self.router_id}")
                    await pipe.execute()
                await self.store.run("counters", remove)
        except (StoreUnavailable, Exception):
            pass
