"""The chart's Grafana dashboard (charts/kubeshard/dashboards/kubeshard.json): every
metric and label it queries exists in what a live router and a live shard server export
after requests, and its ConfigMap renders (with the sidecar's label) only when enabled."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import start_router
from tests.support.helm import CHART, template
from tests.support.shard_process import start_shard

DASHBOARD = CHART / "dashboards" / "kubeshard.json"

# Counted only when something fails, is refused or wakes a model: declared by the exporter
# (HELP/TYPE lines) but without samples after a few good requests.
ONLY_ON_TROUBLE = {"tgi_request_failure", "kubeshard_router_backend_errors_total", "kubeshard_router_retries_total",
                   "kubeshard_router_rate_limited_total", "kubeshard_router_scale_up_calls_total",
                   "kubeshard_router_redis_errors_total"}
# Labels the scrape adds (Kubernetes service discovery), not the exporter.
SCRAPE_LABELS = {"pod"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan"}
NAME = r"(?<![\w:.$])[A-Za-z_:][\w:]*"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions(board: dict) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"])
    return exprs


def _strip(expr: str) -> str:
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals
    e = re.sub(r"\$\w+", "", e)                            # Grafana variables
    e = re.sub(r"\[[^\]]*\]", "", e)                       # range selectors
    return e


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana ``label_values``) reads."""
    lv = re.fullmatch(r"\s*label_values\(\s*([\w:]+)\s*,\s*\w+\s*\)\s*", expr)
    if lv:
        return {lv.group(1)}
    e = _strip(expr)
    e = re.sub(r"\{[^}]*\}", "", e)                                           # label matchers
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(NAME, e):
        if m.group().lower() in KEYWORDS or e[m.end():].lstrip().startswith("("):
            continue  # a function or an operator keyword
        names.add(m.group())
    return names


def labels_used(expr: str) -> dict[str, set[str]]:
    """{metric: labels} from the expression's label matchers, plus every ``by (...)``
    label, which each metric of the expression must carry (``le``: histogram buckets)."""
    e = _strip(expr)
    used: dict[str, set[str]] = {}
    for m in re.finditer(rf"({NAME})\s*\{{([^}}]*)\}}", e):
        used.setdefault(m.group(1), set()).update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m.group(2)))
    grouped = {lab.strip() for g in re.findall(r"\bby\s*\(([^)]*)\)", e) for lab in g.split(",") if lab.strip()}
    for name in metric_names(expr):
        used.setdefault(name, set()).update(grouped - SCRAPE_LABELS)
    return used


def exported(text: str) -> tuple[dict[str, set[str]], set[str]]:
    """Sample names (with the labels they carry) and every sample name a declared
    family may have, from a Prometheus exposition."""
    samples: dict[str, set[str]] = {}
    declared: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                "unknown": ("",), "summary": ("_sum", "_count", "")}
    for family in text_string_to_metric_families(text):
        declared.update(family.name + s for s in suffixes.get(family.type, ("",)))
        for s in family.samples:
            samples.setdefault(s.name, set()).update(s.labels)
    return samples, declared


def test_the_expression_parser():
    expr = ('histogram_quantile(0.99, sum by (le, model) (rate(kubeshard_router_ttft_bucket{model=~"$model"}'
            '[$__rate_interval]))) / on(model) group_left vllm:num_requests_running offset 5m')
    assert metric_names(expr) == {"kubeshard_router_ttft_bucket", "vllm:num_requests_running"}
    assert labels_used(expr)["kubeshard_router_ttft_bucket"] == {"le", "model"}
    assert metric_names("label_values(vllm:num_requests_running, model_name)") == {"vllm:num_requests_running"}
    assert metric_names('sum(rate(x_total{a="rate(y)"}[5m])) * 100') == {"x_total"}


def test_the_dashboard_covers_what_the_issue_asks():
    board = dashboard()
    titles = " | ".join(p["title"].lower() for p in board["panels"])
    for topic in ("requests", "time to first token", "time per output token", "queue", "running batch",
                  "kv cache", "prefix-cache hit rate", "cache hits", "replicas"):
        assert topic in titles, topic
    names = set().union(*map(metric_names, expressions(board)))
    assert any(n.startswith("tgi_") for n in names) and any(n.startswith("kubeshard_router_") for n in names)
    assert any(n.startswith("vllm:") for n in names) and any(n.startswith("kubeshard_engine_") for n in names)
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    assert all(t["datasource"]["uid"] == "${datasource}" for p in board["panels"] for t in p.get("targets", []))


@pytest.mark.slow
def test_every_metric_the_dashboard_queries_is_exported(demo_model, redis_server):
    redis_server.start()
    shard = start_shard(demo_model("llama"), "--num-threads", "1", "--kv-cache-memory", "64MiB", metrics=True)
    router = start_router("--backend", f"tiny={shard.address}", "--redis-url", redis_server.url)
    try:
        with httpx.Client(base_url=router.url, timeout=120) as c:
            body = {"inputs": "The dashboard test asks the same thing twice",
                    "parameters": {"max_new_tokens": 4}}
            first, second = c.post("/generate", json=body), c.post("/generate", json=body)
            assert first.headers["x-kubeshard-cache"] == "miss" and second.headers["x-kubeshard-cache"] == "hit"
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
            with c.stream("POST", "/v1/chat/completions", json=chat) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()
            router_text = c.get("/metrics").text
        engine_text = httpx.get(f"http://127.0.0.1:{shard.metrics_port}/metrics", timeout=30).text
    finally:
        router.stop()
        shard.stop()

    samples, declared = exported(router_text)
    engine_samples, engine_declared = exported(engine_text)
    samples.update(engine_samples)
    declared |= engine_declared

    missing, silent, unlabelled = [], [], []
    for expr in expressions(dashboard()):
        for name, labels in labels_used(expr).items():
            if name not in declared:
                missing.append(name)
            elif name not in samples:
                if name not in ONLY_ON_TROUBLE:
                    silent.append(name)
            elif not labels <= samples[name]:
                unlabelled.append(f"{name} lacks {sorted(labels - samples[name])}")
    assert missing == [], "queried by the dashboard, exported by neither the router nor the engine"
    assert silent == [], "declared but without samples after requests"
    assert unlabelled == []


def dashboard_maps(rendered: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ConfigMap"
            and d["metadata"]["labels"].get("app.kubernetes.io/component") == "dashboard"]


def test_the_dashboard_configmap_renders_only_when_enabled():
    assert dashboard_maps(template().stdout) == []

    (cm,) = dashboard_maps(template("--set", "dashboards.enabled=true").stdout)
    assert cm["metadata"]["name"] == "t-kubeshard-dashboard" and cm["metadata"]["namespace"] == "serving"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in cm["metadata"]
    assert json.loads(cm["data"]["kubeshard.json"]) == dashboard()  # byte-faithful: {{model}} legends untouched

    (cm,) = dashboard_maps(template("--set", "dashboards.enabled=true", "--set", "dashboards.label=my_dashboards",
                                    "--set-string", "dashboards.labelValue=kubeshard",
                                    "--set", "dashboards.namespace=monitoring",
                                    "--set", "dashboards.annotations.grafana_folder=LLM").stdout)
    assert cm["metadata"]["labels"]["my_dashboards"] == "kubeshard" and "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}


@pytest.mark.parametrize("flag", ["dashboards.enabled=maybe", "dashboards.label=not a label",
                                  "dashboards.namespace=Not_A_Namespace", "dashboards.typo=1"])
def test_the_schema_refuses_bad_dashboard_values(flag):
    out = template("--set", flag, check=False)
    assert out.returncode != 0 and "dashboards" in out.stderr, out.stderr
