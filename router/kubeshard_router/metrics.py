"""Prometheus metrics: TGI's ``tgi_*`` names where the meaning is the same (so TGI
dashboards work), ``kubeshard_router_*`` for the rest.

Each app has its own registry. TGI's counters carry no ``_total`` suffix, so they are
exposed by a small collector under their exact names. Gauges (queue sizes, in-flight,
ready replicas, Redis up) are read from live state at scrape time, so the request path
only ever touches counters and histograms, once per request.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 120.0, 300.0)
TOKEN_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15,
                      0.25, 0.5, 1.0, 2.5)
LENGTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class ExactCounter(Collector):
    """A monotonically increasing count exposed under its exact (TGI) name."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, labels: tuple[str, ...]) -> float:
        return self._values.get(labels, 0.0)

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "unknown")
        for labels, value in list(self._values.items()):
            metric.add_sample(self.name, dict(zip(self.labelnames, labels)), value)
        yield metric


class _Gauges(Collector):
    def __init__(self, read: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        yield from self._read()


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        m = ("model",)

        def by_model(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, m, registry=r, buckets=buckets)

        # TGI's names.
        self.tgi_request_count = ExactCounter("tgi_request_count", "Requests received", m)
        self.tgi_request_success = ExactCounter("tgi_request_success", "Requests that succeeded", m)
        self.tgi_request_failure = ExactCounter("tgi_request_failure", "Requests that failed",
                                                ("model", "err"))
        for c in (self.tgi_request_count, self.tgi_request_success, self.tgi_request_failure):
            r.register(c)
        self.tgi_request_duration = by_model(
            "tgi_request_duration", "End-to-end request duration (s)", DURATION_BUCKETS)
        self.tgi_request_queue_duration = by_model(
            "tgi_request_queue_duration", "Time waiting in the router and engine queues (s)",
            DURATION_BUCKETS)
        self.tgi_request_inference_duration = by_model(
            "tgi_request_inference_duration", "Engine inference time (s)", DURATION_BUCKETS)
        self.tgi_request_mean_time_per_token_duration = by_model(
            "tgi_request_mean_time_per_token_duration", "Mean time per generated token (s)",
            TOKEN_TIME_BUCKETS)
        self.tgi_request_input_length = by_model(
            "tgi_request_input_length", "Prompt tokens per request", LENGTH_BUCKETS)
        self.tgi_request_generated_tokens = by_model(
            "tgi_request_generated_tokens", "Generated tokens per request", LENGTH_BUCKETS)
        # kubeshard's own.
        p = "kubeshard_router_"
        self.requests = Counter(p + "requests", "HTTP requests by model, route and status",
                                ("model", "route", "status"), registry=r)
        self.ttft = by_model(p + "time_to_first_token_seconds", "Time to first token (s)",
                             DURATION_BUCKETS)
        self.tpot = by_model(p + "time_per_output_token_seconds",
                             "Time per output token after the first (s)", TOKEN_TIME_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "End-to-end latency (s)",
                             ("model", "cache"), registry=r, buckets=DURATION_BUCKETS)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens", m, registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", m, registry=r)
        self.cache_hits = Counter(p + "cache_hits", "Responses served from the Redis cache", m, registry=r)
        self.cache_misses = Counter(p + "cache_misses", "Cacheable requests not found in the cache",
                                    m, registry=r)
        self.backend_errors = Counter(p + "backend_errors", "Errors from replica leaders by gRPC code",
                                      ("model", "code"), registry=r)
        self.retries = Counter(p + "retries", "Requests retried on another replica", m, registry=r)
        self.redis_errors = Counter(p + "redis_errors", "Redis operations that failed or timed out",
                                    ("op",), registry=r)
        self.rate_limited = Counter(p + "rate_limited", "Requests refused by rate limits", ("key",),
                                    registry=r)
        self.scale_up_calls = Counter(p + "scale_up_calls", "Scale-up hook calls", m, registry=r)
        self.client_disconnects = Counter(p + "client_disconnects", "Streams cancelled by their client",
                                          m, registry=r)

        self._per_model: dict[str, ModelMetrics] = {}

    def count_request(self, model: str, route: str, status: int) -> None:
        """One HTTP request answered (``model`` is ``-`` when none was resolved)."""
        self.requests.labels(model, route, str(status)).inc()

    def model(self, name: str) -> "ModelMetrics":
        """The per-model children, bound once (label lookups cost more than observations)."""
        bound = self._per_model.get(name)
        if bound is None:
            bound = self._per_model[name] = ModelMetrics(self, name)
        return bound

    def add_gauges(self, read: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        self.registry.register(_Gauges(read))


class ModelMetrics:
    __slots__ = ("labels", "duration", "queue_duration", "inference_duration", "time_per_token",
                 "input_length", "generated_tokens", "ttft", "tpot", "e2e_hit", "e2e_miss", "e2e_off",
                 "e2e_bypass", "prompt_tokens", "generation_tokens")

    def __init__(self, m: RouterMetrics, model: str) -> None:
        self.labels = (model,)
        self.duration = m.tgi_request_duration.labels(model)
        self.queue_duration = m.tgi_request_queue_duration.labels(model)
        self.inference_duration = m.tgi_request_inference_duration.labels(model)
        self.time_per_token = m.tgi_request_mean_time_per_token_duration.labels(model)
        self.input_length = m.tgi_request_input_length.labels(model)
        self.generated_tokens = m.tgi_request_generated_tokens.labels(model)
        self.ttft = m.ttft.labels(model)
        self.tpot = m.tpot.labels(model)
        self.e2e_hit = m.e2e.labels(model, "hit")
        self.e2e_miss = m.e2e.labels(model, "miss")
        self.e2e_off = m.e2e.labels(model, "off")
        self.e2e_bypass = m.e2e.labels(model, "bypass")
        self.prompt_tokens = m.prompt_tokens.labels(model)
        self.generation_tokens = m.generation_tokens.labels(model)

    def e2e(self, cache: str):
        return {"hit": self.e2e_hit, "miss": self.e2e_miss, "bypass": self.e2e_bypass}.get(cache, self.e2e_off)
