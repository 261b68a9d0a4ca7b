"""The finalizer's job: remove a deleted model's Redis keys.

Keys are namespaced `kubeshard:{model}:{revision}:...` by the router; deleting a model
removes them for every revision it served. Every call is bounded (socket timeouts and an
overall deadline) so an unreachable Redis delays deletion by a few tries, never forever.
"""

from __future__ import annotations

import re
import time

import redis

# Characters that mean something in a Redis MATCH pattern.
_GLOB = re.compile(r"([*?\[\]\\])")
BATCH = 500


def model_key_pattern(model: str) -> str:
    escaped = _GLOB.sub(r"\\\1", model)
    return f"kubeshard:{escaped}:*"


def delete_model_keys(url: str, model: str, *, timeout: float = 3.0,
                      deadline: float = 60.0) -> int:
    """Deletes every key of `model` (all revisions); returns how many went.

    Raises redis.RedisError (or OSError) when Redis cannot be reached or the deadline
    passes, so the caller can retry or give up."""
    client = redis.Redis.from_url(url, socket_timeout=timeout,
                                  socket_connect_timeout=timeout, retry_on_timeout=False)
    end = time.monotonic() + deadline
    removed = 0
    try:
        batch: list[bytes] = []
        # SCAN, not KEYS: never blocks the server on a large keyspace. UNLINK frees
        # memory in the background.
        for key in client.scan_iter(match=model_key_pattern(model), count=BATCH):
            batch.append(key)
            if len(batch) >= BATCH:
                removed += client.unlink(*batch)
                batch.clear()
            if time.monotonic() > end:
                raise redis.TimeoutError(f"removing the keys of {model!r} took over {deadline} s")
        if batch:
            removed += client.unlink(*batch)
    finally:
        client.close()
    return removed


def redact(url: str) -> str:
    """The URL without its password, for logs and events."""
    return re.sub(r"//([^:/@]*):[^@]*@", r"//\1:***@", url)
