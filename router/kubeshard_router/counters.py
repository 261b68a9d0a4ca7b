"""Per-model in-flight and queued counts of this router instance, published to Redis.

Each router instance writes ``kubeshard:{model}:{revision}:load:{router_id}``, a hash
``{"in_flight": n, "queued": m}`` with a TTL of ``ttl_s``, every ``interval_s`` (and not
at all on the request path). A router that dies stops refreshing its keys and its
counts vanish when they expire, so the sum over live routers (``read_load``) is what the
autoscaler reads. Queued counts include requests held while a model scales from zero.
"""

from __future__ import annotations

import asyncio
import logging
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


def load_key(model: str, revision: str, router_id: str) -> str:
    return f"kubeshard:{model}:{revision}:load:{router_id}"


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

        async def write(r: aioredis.Redis) -> None:
            pipe = r.pipeline(transaction=False)
            for load in loads:
                key = load_key(load.model, load.revision, self.router_id)
                pipe.hset(key, mapping={"in_flight": load.in_flight, "queued": load.queued})
                pipe.expire(key, self.ttl_s)
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
            keys = [load_key(l.model, l.revision, self.router_id) for l in self.snapshot()]
            if keys:
                await self.store.run("counters", lambda r: r.delete(*keys))
        except (StoreUnavailable, Exception):
            pass
