"""The router's live parts, wired once per app: their start and stop, and the gauges read from them."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Iterable, Optional, Union

from prometheus_client.metrics_core import GaugeMetricFamily

from kubeshard_router.activation import Activator, LoggingScaleUpHook, ScaleUpHook
from kubeshard_router.admin import AdminPolicy
from kubeshard_router.auth import ApiKeys, KeyFileWatcher, SecretKeyWatcher
from kubeshard_router.backends.registry import Registry
from kubeshard_router.backends.runtime_adapters import RuntimeAdapters
from kubeshard_router.backends.source import BackendSource
from kubeshard_router.balancer import Balancer
from kubeshard_router.cache import ResponseCache
from kubeshard_router.config import RouterConfig
from kubeshard_router.counters import LoadPublisher, ModelLoad
from kubeshard_router.dispatch import Dispatcher
from kubeshard_router.generation import GenerationService
from kubeshard_router.intake import Intake
from kubeshard_router.metrics import RouterMetrics
from kubeshard_router.ratelimit import RateLimiter
from kubeshard_router.redis_store import RedisStore

log = logging.getLogger("kubeshard.router")


def platform_hook(sources: list[BackendSource]) -> ScaleUpHook:
    """The scale-up hook of the first source that can scale its models (Kubernetes: the
    InferenceService's /scale); else one that only logs (static backends)."""
    for source in sources:
        make = getattr(source, "scale_up_hook", None)
        if make is not None:
            return make()
    return LoggingScaleUpHook()


class RouterState:
    def __init__(self, config: RouterConfig, sources: list[BackendSource], *,
                 hook: Optional[ScaleUpHook] = None, balance_mode: str = "prefix") -> None:
        self.config = config
        self.sources = sources
        self.metrics = RouterMetrics()
        self.store: Optional[RedisStore] = None
        if config.redis_url:
            self.store = RedisStore(config.redis_url, timeout_s=config.redis_timeout_s,
                                    retry_s=config.redis_retry_s,
                                    on_error=lambda op: self.metrics.redis_errors.labels(op).inc())
        self.registry = Registry(config, runtime_adapters=RuntimeAdapters(self.store))
        self.balancer = Balancer(mode=balance_mode, affinity_blocks=config.affinity_blocks,
                                 load_factor=config.load_factor)
        self.activator = Activator(hook or platform_hook(sources), max_waiting=config.max_queue_per_model,
                                   timeout_s=config.activation_timeout_s,
                                   on_scale_up=lambda m: self.metrics.scale_up_calls.labels(m).inc())
        self.dispatcher = Dispatcher(self.registry, self.balancer, self.activator, self.metrics, config)
        cache: Optional[ResponseCache] = None
        if self.store is not None:
            cache = ResponseCache(self.store, ttl_s=config.cache_ttl_s,
                                  max_entry_bytes=config.cache_max_entry_bytes)
        self.generation = GenerationService(self.dispatcher, cache, self.metrics)
        self.ratelimiter = RateLimiter(self.store)
        self.publisher: Optional[LoadPublisher] = None
        if self.store is not None:
            self.publisher = LoadPublisher(config.redis_url, config.router_id, self.load_snapshot,
                                           interval_s=config.counters_interval_s, ttl_s=config.counters_ttl_s)
        self.api_keys: Optional[ApiKeys] = None
        self._key_watchers: list[Union[KeyFileWatcher, SecretKeyWatcher]] = []
        if config.api_keys_file or config.api_keys_secret:
            self.api_keys = ApiKeys()
            if config.api_keys_file:
                self._key_watchers.append(KeyFileWatcher(config.api_keys_file, self.api_keys))
            if config.api_keys_secret:
                namespace, name = config.api_keys_secret.split("/")
                self._key_watchers.append(SecretKeyWatcher(namespace, name, self.api_keys))
        self.intake = Intake(config, self.registry, self.activator, self.generation, self.ratelimiter,
                             self.metrics, self.api_keys)
        self.admin = AdminPolicy(config, self.api_keys)
        # The token of GET /internal/load (load_api.py); read once, a bad path fails start-up.
        self.load_token: Optional[str] = None
        if config.load_token_file:
            self.load_token = Path(config.load_token_file).read_text().strip() or None
            if self.load_token is None:
                raise ValueError(f"load_token_file {config.load_token_file!r} is empty")
        self._draining = False
        self.started_at = time.time()
        self.metrics.add_gauges(self._gauges)

    # lifecycle ---------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """Shutting down: /readyz answers 503 and new generations are refused, while the
        ones in flight finish."""
        return self._draining

    def start_draining(self) -> bool:
        """Stops taking new requests; True the first time (for the log line)."""
        first, self._draining = not self._draining, True
        return first

    async def start(self) -> None:
        for watcher in self._key_watchers:
            await asyncio.to_thread(watcher.load)  # a bad key source fails start-up loudly
            watcher.start()
        for source in self.sources:
            await source.start(self.registry)
        self.dispatcher.watchdog.start()
        if self.publisher is not None:
            self.publisher.start()

    def static_models(self) -> list[str]:
        return [m for s in self.sources for m in s.static_models()]

    async def wait_static_ready(self) -> None:
        await self.registry.wait_info(self.static_models())

    async def stop(self) -> None:
        for source in self.sources:
            await source.stop()
        for watcher in self._key_watchers:
            await watcher.close()
        if self.publisher is not None:
            await self.publisher.close()
        await self.dispatcher.watchdog.close()
        await self.activator.close()
        await self.registry.close()
        if self.store is not None:
            await self.store.close()

    # observability -----------------------------------------------------------------------

    def load_snapshot(self) -> Iterable[ModelLoad]:
        for model in list(self.registry.models.values()):
            tokens = model.load.snapshot()
            yield ModelLoad(model.name, model.revision, model.admission.in_flight,
                            model.admission.queued + self.activator.held(model.name),
                            tokens.tokens_in_flight, tokens.tokens_per_second, tokens.last_request_at)

    def _gauges(self) -> Iterable[GaugeMetricFamily]:
        queue = GaugeMetricFamily("tgi_queue_size", "Requests waiting in the router queue", labels=["model"])
        batch = GaugeMetricFamily("tgi_batch_current_size", "Requests in flight to replicas", labels=["model"])
        in_flight = GaugeMetricFamily("kubeshard_router_in_flight", "Requests in flight", labels=["model"])
        queued = GaugeMetricFamily("kubeshard_router_queued", "Requests queued, including those held "
                                   "for activation", labels=["model"])
        ready = GaugeMetricFamily("kubeshard_router_ready_replicas", "Ready replicas", labels=["model"])
        replicas = GaugeMetricFamily("kubeshard_router_replicas", "Known replicas", labels=["model"])
        outstanding = GaugeMetricFamily("kubeshard_router_replica_outstanding", "Requests outstanding "
                                        "per replica", labels=["model", "replica"])
        # The autoscaler's token signals (load.LoadTracker), for prometheus-adapter users.
        tokens = GaugeMetricFamily("kubeshard_router_tokens_in_flight", "Prompt tokens plus the new tokens "
                                   "still reserved by the requests this router holds", labels=["model"])
        rate = GaugeMetricFamily("kubeshard_router_tokens_per_second", "Output tokens per second over the "
                                 "last ten seconds", labels=["model"])
        for m in list(self.registry.models.values()):
            waiting = self.activator.held(m.name)
            load = m.load.snapshot()
            tokens.add_metric([m.name], load.tokens_in_flight)
            rate.add_metric([m.name], load.tokens_per_second)
            queue.add_metric([m.name], m.admission.queued + waiting)
            batch.add_metric([m.name], m.admission.in_flight)
            in_flight.add_metric([m.name], m.admission.in_flight)
            queued.add_metric([m.name], m.admission.queued + waiting)
            ready.add_metric([m.name], len(m.ready_replicas))
            replicas.add_metric([m.name], len(m.replicas))
            for r in list(m.replicas.values()):
                outstanding.add_metric([m.name, r.address], r.outstanding)
        redis_up = GaugeMetricFamily("kubeshard_router_redis_up", "1 when Redis answers, 0 when not, "
                                     "absent without Redis")
        if self.store is not None:
            redis_up.add_metric([], 1.0 if self.store.up else 0.0)
        return [queue, batch, in_flight, queued, ready, replicas, outstanding, tokens, rate, redis_up]
