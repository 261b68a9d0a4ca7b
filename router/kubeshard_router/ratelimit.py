"""Per-API-key rate limits: requests per minute and tokens per minute.

Two token buckets per key (requests; tokens = prompt + max new tokens) live in one Redis
hash ``kubeshard:ratelimit:{key name}`` shared by every router instance, and one Lua
script refills, checks and charges both atomically, using Redis' own clock. When a
request ends with fewer tokens than it reserved, the difference is refunded in the
background. While Redis is unreachable the same buckets run in this process, so limits
still hold (per router instance) and no client sees a Redis error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from kubeshard_router.errors import RateLimited
from kubeshard_router.redis_store import RedisStore, StoreUnavailable

CHECK = """
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local r = tonumber(b[1])
local tk = tonumber(b[2])
local ts = tonumber(b[3])
if ts == nil or r == nil or tk == nil then r = rpm; tk = tpm; ts = now end
local dt = math.max(0, now - ts)
if rpm > 0 then r = math.min(rpm, r + dt * rpm / 60) end
if tpm > 0 then tk = math.min(tpm, tk + dt * tpm / 60) end
if rpm > 0 and r < 1 then return {0, tostring((1 - r) * 60 / rpm), 'requests'} end
if tpm > 0 and cost > tpm then return {0, '60', 'too_large'} end
if tpm > 0 and tk < cost then return {0, tostring((cost - tk) * 60 / tpm), 'tokens'} end
if rpm > 0 then r = r - 1 end
if tpm > 0 then tk = tk - cost end
redis.call('HSET', KEYS[1], 'r', tostring(r), 't', tostring(tk), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], 120)
return {1, '0', ''}
"""

REFUND = """
local tpm = tonumber(ARGV[1])
local tk = tonumber(redis.call('HGET', KEYS[1], 't'))
if tk == nil then return 0 end
redis.call('HSET', KEYS[1], 't', tostring(math.min(tpm, tk + tonumber(ARGV[2]))))
return 1
"""


def bucket_key(key_name: str) -> str:
    return f"kubeshard:ratelimit:{key_name}"


@dataclass(slots=True)
class _Bucket:
    requests: float
    tokens: float
    ts: float


class LocalBuckets:
    """The same two buckets in process memory (the fallback while Redis is away)."""

    def __init__(self) -> None:
        self._buckets: dict[str, _Bucket] = {}

    def check(self, key: str, rpm: int, tpm: int, cost: int) -> tuple[bool, float, str]:
        now = time.monotonic()
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(float(rpm), float(tpm), now)
        dt = max(0.0, now - b.ts)
        b.ts = now
        if rpm > 0:
            b.requests = min(rpm, b.requests + dt * rpm / 60)
        if tpm > 0:
            b.tokens = min(tpm, b.tokens + dt * tpm / 60)
        if rpm > 0 and b.requests < 1:
            return False, (1 - b.requests) * 60 / rpm, "requests"
        if tpm > 0 and cost > tpm:
            return False, 60.0, "too_large"
        if tpm > 0 and b.tokens < cost:
            return False, (cost - b.tokens) * 60 / tpm, "tokens"
        if rpm > 0:
            b.requests -= 1
        if tpm > 0:
            b.tokens -= cost
        return True, 0.0, ""

    def refund(self, key: str, tpm: int, tokens: int) -> None:
        b = self._buckets.get(key)
        if b is not None:
            b.tokens = min(tpm, b.tokens + tokens)


class RateLimiter:
    def __init__(self, store: Optional[RedisStore]) -> None:
        self.store = store
        self.local = LocalBuckets()
        if store is not None:
            self._check = store.client.register_script(CHECK)
            self._refund = store.client.register_script(REFUND)

    async def check(self, key_name: str, rpm: int, tpm: int, cost_tokens: int) -> None:
        """Charges one request and ``cost_tokens`` tokens, or raises RateLimited."""
        if rpm <= 0 and tpm <= 0:
            return
        key = bucket_key(key_name)
        allowed, retry_after, reason = None, 0.0, ""
        if self.store is not None:
            try:
                res = await self.store.run("ratelimit", lambda r: self._check(
                    keys=[key], args=[rpm, tpm, cost_tokens], client=r))
                allowed = bool(int(res[0]))
                retry_after = float(res[1])
                reason = res[2].decode() if isinstance(res[2], bytes) else str(res[2])
            except StoreUnavailable:
                allowed = None
        if allowed is None:
            allowed, retry_after, reason = self.local.check(key, rpm, tpm, cost_tokens)
        if allowed:
            return
        if reason == "requests":
            raise RateLimited(f"Rate limit exceeded for this API key: {rpm} requests per minute",
                              retry_after)
        if reason == "too_large":
            raise RateLimited(f"Rate limit exceeded for this API key: this request needs {cost_tokens} "
                              f"tokens (prompt + max new tokens), more than the key's {tpm} tokens per "
                              f"minute; lower `max_new_tokens`/`max_tokens`", retry_after)
        raise RateLimited(f"Rate limit exceeded for this API key: {tpm} tokens per minute "
                          f"(this request reserves {cost_tokens})", retry_after)

    def refund(self, key_name: str, tpm: int, tokens: int) -> None:
        if tpm <= 0 or tokens <= 0:
            return
        key = bucket_key(key_name)
        self.local.refund(key, tpm, tokens)
        if self.store is not None:
            self.store.fire("ratelimit_refund", lambda r: self._refund(keys=[key], args=[tpm, tokens], client=r))
