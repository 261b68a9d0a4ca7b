"""Who the chart's shard NetworkPolicy lets in, read from `helm template`: the router on
gRPC and a peer engine's http port; the configured scrapers on the shard server's metrics
port (9400) and on a peer engine's http port, where its /metrics is (vLLM, SGLang, TGI);
nobody else."""

from __future__ import annotations

import json

from tests.support.helm import rendered

PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def shard_policy(*flags: str) -> dict:
    return next(o for o in rendered(*flags)
                if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "t-kubeshard-shards")


def ports(rule: dict) -> set:
    return {p["port"] for p in rule.get("ports", [])}


def test_scrapers_reach_the_shard_servers_and_the_peer_engines_metrics():
    rules = shard_policy("--set-json", f"networkPolicy.metricsFrom=[{json.dumps(PROMETHEUS)}]")["spec"]["ingress"]
    scrape = [r for r in rules if r["from"] == [PROMETHEUS]]
    assert len(scrape) == 1 and ports(scrape[0]) == {9400, "http"}
    router = [r for r in rules if any("podSelector" in f and "namespaceSelector" in f for f in r["from"])]
    assert len(router) == 1 and ports(router[0]) == {50051, "http"}


def test_without_scrapers_only_the_router_reaches_a_peer_engines_http_port():
    rules = shard_policy()["spec"]["ingress"]
    assert [ports(r) for r in rules if "http" in ports(r)] == [{50051, "http"}]
    assert all(9400 not in ports(r) for r in rules)
