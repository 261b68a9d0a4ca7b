"""The live load of a model as its routers count it: the one reader of the autoscaling
signal, used by the custom metrics API (metrics_api.py) and by scale-to-zero (idle.py).

Every router instance publishes its per-model load to Redis (the router's counters.py
holds the writer; the layout is the contract between the two):

    kubeshard:{model}:routers                      sorted set of "{revision}|{router_id}",
                                                   scored by when the entry expires
    kubeshard:{model}:{revision}:load:{router_id}  hash: in_flight, queued,
                                                   tokens_in_flight, tokens_per_second,
                                                   last_request_at (epoch seconds)

A dead router stops refreshing, so its entry scores in the past and its hash expires:
the sum over live entries is the model's load. With Redis away (or no router found in
it) the reader asks every ready pod of the router Service directly, at
``GET /internal/load`` with the shared bearer token, so autoscaling never depends on
Redis alone. `read` answers None only when neither source answers.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

import redis

from kubeshard_operator.kube import Kube

LOG = logging.getLogger("kubeshard_operator.load")
FIELDS = ("in_flight", "queued", "tokens_in_flight", "tokens_per_second", "last_request_at")


@dataclass(frozen=True)
class ModelLoad:
    """One model's load summed over its live routers."""

    in_flight: int = 0
    queued: int = 0
    tokens_in_flight: int = 0
    tokens_per_second: float = 0.0
    last_request_at: float = 0.0  # the latest over the routers; 0: none they remember
    routers: int = 0              # live router instances that reported the model
    source: str = "redis"         # "redis" or "routers" (the direct fallback)

    @property
    def concurrency(self) -> int:
        return self.in_flight + self.queued

    def metric(self, name: str) -> float:
        """The custom metric `name` (naming.CUSTOM_METRICS) of the model."""
        return {"concurrency": self.concurrency, "queue_depth": self.queued,
                "tokens_in_flight": self.tokens_in_flight,
                "tokens_per_second": self.tokens_per_second}[name]


def sum_loads(entries: Iterable[Mapping[str, object]], source: str) -> ModelLoad:
    """Sums per-router entries (dicts of FIELDS) into one ModelLoad."""
    total = dict.fromkeys(FIELDS, 0.0)
    count = 0
    for entry in entries:
        count += 1
        for key in FIELDS:
            value = float(entry.get(key) or 0)
            total[key] = max(total[key], value) if key == "last_request_at" else total[key] + value
    return ModelLoad(in_flight=int(total["in_flight"]), queued=int(total["queued"]),
                     tokens_in_flight=int(total["tokens_in_flight"]),
                     tokens_per_second=round(total["tokens_per_second"], 3),
                     last_request_at=total["last_request_at"], routers=count, source=source)


@dataclass(kw_only=True, eq=False)
class LoadReader:
    """Reads a model's load from Redis, else from the routers; each answer is kept for
    `cache_s` seconds, so the HPA, scale-to-zero and `kubectl get --raw` share reads."""

    redis_url: InitVar[Optional[str]]
    kube: Optional[Kube] = None
    router_service: Optional[tuple[str, str]] = None
    token_file: Optional[str] = None
    timeout_s: float = 0.5
    redis_retry_s: float = 5.0
    cache_s: float = 1.0
    clock: Callable[[], float] = time.time
    redis: Optional[redis.Redis] = field(init=False, repr=False)
    _redis_down_until: float = field(default=0.0, init=False, repr=False)
    _cache: dict[str, tuple[float, Optional[ModelLoad]]] = field(default_factory=dict, init=False,
                                                                 repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self, redis_url: Optional[str]) -> None:
        self.redis = (redis.Redis.from_url(redis_url, socket_timeout=self.timeout_s,
                                           socket_connect_timeout=self.timeout_s)
                      if redis_url else None)

    def read(self, model: str) -> Optional[ModelLoad]:
        now = self.clock()
        with self._lock:
            hit = self._cache.get(model)
        if hit is not None and now - hit[0] < self.cache_s:
            return hit[1]
        load = self._read_redis(model, now)
        if load is None or load.routers == 0:
            direct = self._read_routers(model)
            if direct is not None and (load is None or direct.routers > 0):
                load = direct
        with self._lock:
            self._cache[model] = (now, load)
        return load

    # -- Redis --------------------------------------------------------------------------

    def _read_redis(self, model: str, now: float) -> Optional[ModelLoad]:
        if self.redis is None or now < self._redis_down_until:
            return None
        try:
            members = self.redis.zrangebyscore(f"kubeshard:{model}:routers", now, "+inf",
                                               withscores=True)
            newest: dict[str, tuple[float, str]] = {}  # router -> (score, revision)
            for member, score in members:
                revision, _, router = member.decode().rpartition("|")
                if router not in newest or score > newest[router][0]:
                    newest[router] = (score, revision)
            pipe = self.redis.pipeline(transaction=False)
            for router, (_, revision) in sorted(newest.items()):
                pipe.hgetall(f"kubeshard:{model}:{revision}:load:{router}")
            hashes = pipe.execute() if newest else []
        except (redis.RedisError, OSError) as e:
            if now >= self._redis_down_until:
                LOG.warning("Redis unreachable (%s); asking the routers directly for %.0f s",
                            e, self.redis_retry_s)
            self._redis_down_until = now + self.redis_retry_s
            return None
        entries = [{k.decode(): v.decode() for k, v in h.items()} for h in hashes if h]
        return sum_loads(entries, "redis")

    # -- the routers, directly ------------------------------------------------------------

    def router_addresses(self) -> list[str]:
        """HOST:PORT of every ready router pod, from the router Service's EndpointSlices."""
        if self.kube is None or self.router_service is None:
            return []
        namespace, service = self.router_service
        out = []
        for sl in self.kube.list("EndpointSlice", namespace,
                                 {"kubernetes.io/service-name": service}):
            port = next((p.get("port") for p in sl.get("ports") or ()
                         if p.get("name") == "http"), None)
            if not port:
                continue
            for ep in sl.get("endpoints") or ():
                if (ep.get("conditions") or {}).get("ready") is False:
                    continue
                out += [f"{addr}:{port}" for addr in ep.get("addresses") or ()]
        return sorted(set(out))

    def _read_routers(self, model: str) -> Optional[ModelLoad]:
        if self.token_file is None:
            return None
        try:
            token = Path(self.token_file).read_text().strip()
            addresses = self.router_addresses()
        except Exception as e:  # the API server away, the token unreadable
            LOG.warning("cannot ask the routers for their load: %s", e)
            return None
        entries, answered = [], 0
        for address in addresses:
            request = urllib.request.Request(f"http://{address}/internal/load",
                                             headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                    body = json.loads(resp.read())
            except (OSError, ValueError) as e:
                LOG.warning("router %s did not report its load: %s", address, e)
                continue
            answered += 1
            entries += [m for m in body.get("models") or () if m.get("model") == model]
        if addresses and not answered:
            return None
        return sum_loads(entries, "routers")
