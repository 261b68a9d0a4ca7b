"""Prometheus metrics of one model server, on their own port.

Load figures are read from the engine's latest stats snapshot at scrape time (no work
on the engine's hot path). Names: ours under ``kubeshard_engine_*``, plus the ``vllm:*``
names that Kubernetes inference gateways and dashboards already read from model servers.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kubeshard_shard.activations.coordinator import FETCH_BUCKETS, ActivationCacheStats
from kubeshard_shard.engine.llm_engine import EngineStats
from kubeshard_shard.engine.speculative import SpeculativeStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class _StatsCollector(Collector):
    def __init__(self, model: str, stats: Callable[[], EngineStats]) -> None:
        self.model = model
        self.stats = stats

    def collect(self):
        s = self.stats()
        labels = ["model_name"]
        values = [self.model]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.running)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_cache_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1); older vLLM name.",
                    s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prompt blocks looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt blocks found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Sequences preempted for lack of KV blocks.", s.preemptions_total)
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generated_tokens_total)

        if s.max_loras:
            # vLLM's LoRA gauge that gateways read: labels name the adapters; the value is the time
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters.",
                                     labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            lora.add_metric([",".join(s.running_adapters), ",".join(s.waiting_adapters), str(s.max_loras)],
                            time.time())
            yield lora
        yield gauge("kubeshard_engine_waiting_requests", "Requests waiting to be scheduled.", s.waiting)
        yield gauge("kubeshard_engine_running_requests", "Requests in the running batch.", s.running)
        blocks = GaugeMetricFamily("kubeshard_engine_kv_blocks", "KV-cache blocks by state.",
                                   labels=labels + ["state"])
        blocks.add_metric(values + ["used"], s.kv_blocks_used)
        blocks.add_metric(values + ["free"], s.kv_blocks_free)
        blocks.add_metric(values + ["cached"], s.kv_blocks_cached)
        yield blocks
        yield gauge("kubeshard_engine_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", s.kv_cache_usage)
        yield gauge("kubeshard_engine_prefix_cache_hit_ratio", "Prefix-cache hits over lookups since start.",
                    s.prefix_cache_hit_rate)
        yield counter("kubeshard_engine_prefix_cache_queries", "Prompt blocks looked up.", s.prefix_cache_queries)
        yield counter("kubeshard_engine_prefix_cache_hits", "Prompt blocks found.", s.prefix_cache_hits)
        yield counter("kubeshard_engine_preemptions", "Sequences preempted.", s.preemptions_total)
        yield counter("kubeshard_engine_generated_tokens", "Tokens generated.", s.generated_tokens_total)
        yield counter("kubeshard_engine_steps", "Engine steps run.", s.steps_total)
        yield counter("kubeshard_group_comm_seconds", "Time the leader spent in shard-group collectives "
                      "(waits included).", s.comm_seconds_total)
        if s.activation_cache is not None:
            yield from _activation_cache_metrics(s.activation_cache, gauge, counter, labels, values)
        if s.speculative is not None:
            yield from _speculative_metrics(s.speculative, gauge, counter, labels, values)


def _speculative_metrics(sp: SpeculativeStats, gauge, counter, labels, values):
    """vLLM's speculative-decoding counters (the names its dashboards read)."""
    yield counter("vllm:spec_decode_num_drafts", "Verification steps (one per sequence per step).", sp.drafts)
    yield counter("vllm:spec_decode_num_draft_tokens", "Tokens proposed.", sp.draft_tokens)
    yield counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens kept.", sp.accepted_tokens)
    per = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                              "Drafts whose proposal at this position was kept.", labels=labels + ["position"])
    for position, n in enumerate(sp.accepted_per_position):
        per.add_metric(values + [str(position)], n)
    yield per
    yield gauge("kubeshard_engine_spec_decode_mean_acceptance_length",
                "Tokens emitted per verification step since start (kept proposals + 1).", sp.mean_acceptance_length)


def _activation_cache_metrics(a: ActivationCacheStats, gauge, counter, labels, values):
    p = "kubeshard_activation_cache"
    yield counter(f"{p}_lookups", "Requests whose prompt prefix was looked up in Redis.", a.lookups)
    yield counter(f"{p}_hits", "Lookups that loaded at least one KV block from Redis.", a.hits)
    yield counter(f"{p}_misses", "Lookups that loaded nothing.", a.lookups - a.hits)
    yield counter(f"{p}_hit_blocks", "KV blocks loaded from Redis and used.", a.hit_blocks)
    yield counter(f"{p}_miss_blocks", "KV blocks looked up and not loaded.", a.miss_blocks)
    yield counter(f"{p}_prefill_tokens_saved", "Prompt tokens not computed thanks to Redis.", a.tokens_saved)
    yield counter(f"{p}_read_bytes", "Bytes read from Redis (all ranks).", a.bytes_read)
    yield counter(f"{p}_written_bytes", "Bytes written to Redis (all ranks).", a.bytes_written)
    yield counter(f"{p}_written_blocks", "KV blocks written to Redis (all ranks).", a.blocks_written)
    yield counter(f"{p}_rejected_entries", "Entries refused (truncated, mismatched or corrupt; all ranks).",
                  a.rejected)
    yield counter(f"{p}_redis_errors", "Failed or timed-out Redis calls (all ranks).", a.errors)
    yield counter(f"{p}_timeouts", "Lookups whose requests went on without them.", a.timeouts)
    yield gauge(f"{p}_redis_up", "1 when the leader's last Redis call succeeded.", 1.0 if a.redis_up else 0.0)
    h = HistogramMetricFamily(f"{p}_fetch_seconds", "From a lookup to its blocks in the KV pool.", labels=labels)
    cumulative, buckets = 0, []
    for bound, n in zip((*FETCH_BUCKETS, float("inf")), a.fetch_buckets):
        cumulative += n
        buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
    h.add_metric(values, buckets, a.fetch_seconds_sum)
    yield h


class EngineMetrics:
    def __init__(self, model: str, stats: Callable[[], EngineStats]) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(model, stats))
        label = ["model_name"]
        self.step_seconds = Histogram("kubeshard_engine_step_seconds", "Duration of one engine step.", label,
                                      buckets=STEP_BUCKETS, registry=self.registry).labels(model)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=LATENCY_BUCKETS, registry=self.registry).labels(model)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", label,
                             buckets=LATENCY_BUCKETS, registry=self.registry).labels(model)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token of a request.",
                              label, buckets=STEP_BUCKETS, registry=self.registry).labels(model)
        self.prompt_tokens = Counter("kubeshard_engine_prompt_tokens", "Prompt tokens of finished requests.", label,
                                     registry=self.registry).labels(model)
        self.requests = Counter("kubeshard_engine_requests", "Requests by outcome.", label + ["outcome"],
                                registry=self.registry)
        self._last_steps = 0

    def on_step(self, stats: EngineStats) -> None:
        if stats.steps_total != self._last_steps:
            self._last_steps = stats.steps_total
            self.step_seconds.observe(stats.last_step_seconds)

    def serve(self, host: str, port: int):
        """Starts the /metrics HTTP endpoint in a thread; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)
