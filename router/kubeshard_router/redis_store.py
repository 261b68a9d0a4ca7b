"""The router's Redis connection: bounded timeouts, no client retries, a circuit breaker.

Redis is an accelerator, never a dependency. Every operation runs under a short
timeout; a failure marks Redis down for ``retry_s`` (operations are skipped at once
meanwhile, so a dead Redis costs no latency), counts a metric and logs one line per
outage. After ``retry_s`` the next operation tries again, and a success logs the
recovery.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

log = logging.getLogger("kubeshard.router.redis")

T = TypeVar("T")


class StoreUnavailable(Exception):
    """Redis is down, slow, or skipped while the circuit is open."""


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"***@{host}", parts.path, parts.query, parts.fragment))


class RedisStore:
    def __init__(self, url: str, *, timeout_s: float, retry_s: float,
                 on_error: Optional[Callable[[str], None]] = None, max_background: int = 4096) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._on_error = on_error
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=64, timeout=timeout_s,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._pool = pool
        self.client = aioredis.Redis(connection_pool=pool)
        self._down_until = 0.0
        self.up = True
        self._background: set[asyncio.Task] = set()
        self._max_background = max_background

    @property
    def skipping(self) -> bool:
        return not self.up and time.monotonic() < self._down_until

    async def run(self, op: str, fn: Callable[[aioredis.Redis], Awaitable[T]],
                  timeout_s: Optional[float] = None) -> T:
        """Runs ``fn(client)`` under the timeout; raises StoreUnavailable on any failure."""
        if self.skipping:
            raise StoreUnavailable("redis is down")
        try:
            async with asyncio.timeout(timeout_s or self.timeout_s):
                result = await fn(self.client)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(op, exc)
            raise StoreUnavailable(str(exc) or type(exc).__name__) from None
        if not self.up:
            self.up = True
            log.info("Redis at %s is back: caching, shared counters and rate limits resume",
                     redact_url(self.url))
        return result

    def fire(self, op: str, fn: Callable[[aioredis.Redis], Awaitable[Any]]) -> None:
        """Runs an operation in the background (fire and forget), dropping it when too many
        are already pending (a slow Redis must not pile up work)."""
        if self.skipping or len(self._background) >= self._max_background:
            return
        task = asyncio.create_task(self._quiet(op, fn))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _quiet(self, op: str, fn: Callable[[aioredis.Redis], Awaitable[Any]]) -> None:
        try:
            await self.run(op, fn)
        except StoreUnavailable:
            pass

    def _failed(self, op: str, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self.retry_s
        if self._on_error is not None:
            self._on_error(op)
        if self.up:
            self.up = False
            log.warning("Redis at %s unavailable during %s (%s: %s): serving without cache, shared "
                        "counters and shared rate limits; retrying every %gs", redact_url(self.url),
                        op, type(exc).__name__, exc, self.retry_s)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        try:
            await self.client.aclose()
            await self._pool.disconnect()
        except Exception:
            pass
