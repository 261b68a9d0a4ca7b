"""Serverless on the real control plane: the custom metrics API behind the aggregator,
the controller-manager's HPA scaling on it, scale to zero when idle, and the router
waking a model on its first request with nothing lost.

Clients run in pods (python:3.12) and reach the router through its Service, as users
do; they print one JSON line per request. The tests run in file order and share the
chart release of the `kubeshard` fixture; the ones that change it (two routers, Redis
stopped) put it back.
"""

from __future__ import annotations

import json
import uuid

import pytest

from e2e.operator.conftest import apply, groups, inference_service, isvc, kubectl_json, pod_ready, wait_phase
from e2e.waiting import wait_for

# A first start may load slowly on two busy cores: beyond pytest.ini's 900 s per test.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

METRICS = "/apis/custom.metrics.k8s.io/v1beta2"
# Deterministic requests would be answered from the response cache, not by the model.
NO_CACHE = {"Cache-Control": "no-cache, no-store"}
ENGINE = {"maxTotalTokens": 4096, "kvCacheMemory": "64Mi"}
FIRST_START = 600


def model(name: str, namespace: str, model_dir, **spec) -> dict:
    """The tiny demo model in bfloat16: float32 on CPU would compile the decode kernel in a
    pod whenever the node has none built for the working tree's kernel source (minutes
    here while that source changes); these tests are about scaling, not kernels."""
    return inference_service(name, namespace, model_dir, engine=ENGINE,
                             model={"source": f"file://{model_dir}", "dtype": "bfloat16"}, **spec)

# Requests from a pod: {"url", "concurrency", "requests" per worker or "seconds" to keep
# going, "body", "headers", "stream"}; one JSON line per request, then DONE.
CLIENT = r"""
import json, sys, threading, time, urllib.request
cfg = json.loads(sys.argv[1])
lock = threading.Lock()
def out(**kw):
    with lock:
        print(json.dumps(kw), flush=True)
def one(w, i):
    body = json.dumps(cfg["body"]).encode()
    headers = {"Content-Type": "application/json", **cfg.get("headers", {})}
    req = urllib.request.Request(cfg["url"], body, headers)
    t0 = time.time()
    try:
        with urllib.request.urlopen(req, timeout=cfg.get("timeout", 300)) as resp:
            if cfg.get("stream"):
                tokens, error = 0, None
                for line in resp:
                    line = line.decode().strip()
                    if line.startswith("data:") and line != "data: [DONE]":
                        event = json.loads(line[5:])
                        if "error" in event:
                            error = event["error"]
                        tokens += 1
                out(w=w, i=i, status=resp.status, tokens=tokens, error=error, s=time.time() - t0)
            else:
                data = json.loads(resp.read())
                text = data.get("generated_text") if isinstance(data, dict) else data[0]["generated_text"]
                out(w=w, i=i, status=resp.status, text=text, s=time.time() - t0)
    except urllib.error.HTTPError as e:
        out(w=w, i=i, status=e.code, error=e.read().decode()[:300], s=time.time() - t0)
    except Exception as e:
        out(w=w, i=i, status=0, error=repr(e)[:300], s=time.time() - t0)
def worker(w):
    end = time.time() + cfg.get("seconds", 0)
    i = 0
    while i < cfg.get("requests", 1) or time.time() < end:
        one(w, i)
        i += 1
threads = [threading.Thread(target=worker, args=(w,)) for w in range(cfg["concurrency"])]
for t in threads: t.start()
for t in threads: t.join()
print("DONE", flush=True)
"""


def start_client(cluster, namespace: str, **cfg) -> str:
    pod = f"client-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("-n", namespace, "run", pod, "--image=python:3.12", "--restart=Never",
                    "--command", "--", "python3", "-c", CLIENT, json.dumps(cfg))
    return pod


def client_results(cluster, namespace: str, pod: str, timeout: float = 300) -> list[dict]:
    def finished():
        obj = kubectl_json(cluster, "-n", namespace, "get", "pod", pod)
        return obj["status"].get("phase") in ("Succeeded", "Failed") and obj

    obj = wait_for(finished, timeout, interval=1, what=f"client pod {pod} to finish")
    logs = cluster.pod_logs(namespace, pod)
    assert obj["status"]["phase"] == "Succeeded" and "DONE" in logs, logs[-3000:]
    return [json.loads(line) for line in logs.splitlines() if line.startswith("{")]


def long_stream(router_url: str, model: str, tokens: int = 3500) -> dict:
    """A streaming completion that runs to `tokens` whatever the random model says."""
    return {"url": f"{router_url}/v1/completions", "stream": True, "headers": NO_CACHE, "body": {
        "model": model, "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True,
        "stream": True, "temperature": 0}}


def metric(cluster, namespace: str, name: str, metric_name: str) -> str:
    out = cluster.kubectl("get", "--raw", f"{METRICS}/namespaces/{namespace}/"
                                          f"inferenceservices.kubeshard.io/{name}/{metric_name}")
    items = json.loads(out.stdout)["items"]
    assert len(items) == 1 and items[0]["describedObject"]["name"] == name, items
    return items[0]["value"]


def wait_metrics_api(cluster) -> None:
    cluster.kubectl("wait", "--for=condition=Available", "apiservice/v1beta2.custom.metrics.k8s.io",
                    "--timeout=180s", timeout=190)


def spec_replicas(cluster, namespace: str, name: str) -> int:
    return int((isvc(cluster, namespace, name) or {}).get("spec", {}).get("replicas", -1))


def condition(obj: dict, type_: str) -> dict:
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


def engine_requests(cluster, namespace: str, pod_ip: str) -> float:
    """Requests a group's leader finished, from its Prometheus endpoint (read from a pod)."""
    script = ("import urllib.request,sys;print(urllib.request.urlopen("
              f"'http://{pod_ip}:9400/metrics', timeout=10).read().decode())")
    pod = f"scrape-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("-n", namespace, "run", pod, "--image=python:3.12", "--restart=Never",
                    "--command", "--", "python3", "-c", script)
    wait_for(lambda: kubectl_json(cluster, "-n", namespace, "get", "pod", pod)["status"].get("phase")
             in ("Succeeded", "Failed"), 60, what=f"scrape pod {pod}")
    logs = cluster.pod_logs(namespace, pod)
    cluster.kubectl("-n", namespace, "delete", "pod", pod, "--wait=false", check=False)
    if "# TYPE kubeshard_engine_requests" not in logs:  # a failed scrape is not "no requests"
        raise AssertionError(f"scraping {pod_ip}:9400 failed: {logs[-1000:]}")
    total = 0.0
    for line in logs.splitlines():
        if line.startswith("kubeshard_engine_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def leader_ip(cluster, namespace: str, name: str, group: int) -> str:
    pod = kubectl_json(cluster, "-n", namespace, "get", "pod", f"{name}-g{group}-0")
    return pod["status"]["podIP"]


# -- the metrics API -----------------------------------------------------------------------


def test_the_custom_metrics_api_serves_the_live_concurrency(cluster, kubeshard, namespace,
                                                            demo_model_dir):
    apply(cluster, model("live", namespace, demo_model_dir,
                         autoscaling={"minReplicas": 1, "maxReplicas": 1}))
    wait_phase(cluster, namespace, "live", "Ready", 1, timeout=FIRST_START)
    wait_metrics_api(cluster)
    discovery = json.loads(cluster.kubectl("get", "--raw", METRICS).stdout)
    assert {r["name"] for r in discovery["resources"]} == {
        f"inferenceservices.kubeshard.io/{m}"
        for m in ("concurrency", "queue_depth", "tokens_in_flight", "tokens_per_second")}
    assert wait_for(lambda: metric(cluster, namespace, "live", "concurrency") == "0", 60,
                    what="concurrency 0 before any request")

    client = start_client(cluster, namespace, concurrency=3,
                          **long_stream(kubeshard.router_url, "live"))
    wait_for(lambda: metric(cluster, namespace, "live", "concurrency") == "3", 120, interval=0.5,
             what="concurrency 3 while three streams are open")
    assert int(metric(cluster, namespace, "live", "tokens_in_flight")) > 0
    results = client_results(cluster, namespace, client)
    assert [(r["status"], r["error"]) for r in results] == [(200, None)] * 3
    wait_for(lambda: metric(cluster, namespace, "live", "concurrency") == "0", 60,
             what="concurrency back to 0 after the streams ended")
    # The HPA reads the same value through the aggregator.
    hpa = kubectl_json(cluster, "-n", namespace, "get", "hpa", "live")
    assert hpa["spec"]["metrics"][0]["object"]["metric"]["name"] == "concurrency"
    assert wait_for(lambda: any(c["type"] == "ScalingActive" and c["status"] == "True" for c in
                                kubectl_json(cluster, "-n", namespace, "get", "hpa", "live")
                                .get("status", {}).get("conditions", ())), 60,
                    what="the HPA to read the metric (ScalingActive=True)")


def test_an_unknown_metric_is_refused_at_admission(cluster, kubeshard, namespace, tmp_path):
    out = apply(cluster, inference_service("bad", namespace, tmp_path,
                                           autoscaling={"maxReplicas": 2, "metric": "gpuTemperature"}),
                check=False)
    assert out.returncode != 0
    assert "spec.autoscaling.metric" in out.stderr and '"tokensInFlight"' in out.stderr, out.stderr


# -- the HPA --------------------------------------------------------------------------------


def test_the_hpa_scales_out_under_load_and_back_in(cluster, kubeshard, namespace, demo_model_dir):
    apply(cluster, model("elastic", namespace, demo_model_dir,
                         autoscaling={"minReplicas": 1, "maxReplicas": 2, "target": 2,
                                      "scaleDownStabilizationSeconds": 15}))
    wait_phase(cluster, namespace, "elastic", "Ready", 1, timeout=FIRST_START)
    wait_metrics_api(cluster)
    load = start_client(cluster, namespace, concurrency=6, seconds=600,
                        **long_stream(kubeshard.router_url, "elastic", tokens=300))
    try:
        wait_for(lambda: spec_replicas(cluster, namespace, "elastic") == 2, 120, interval=1,
                 what="the HPA to ask for a second group")
        wait_phase(cluster, namespace, "elastic", "Ready", 2, timeout=FIRST_START)
        ip = leader_ip(cluster, namespace, "elastic", 1)
        # a new group gets requests as the load's streams end and start again: on a busy
        # node (kind's, the earlier tests' pods still going) that took over 120 s once
        wait_for(lambda: engine_requests(cluster, namespace, ip) > 0, 240, interval=2,
                 what="the second group to finish requests of the load")
    finally:
        cluster.kubectl("-n", namespace, "delete", "pod", load, "--grace-period=0", "--force",
                        check=False)
    wait_for(lambda: spec_replicas(cluster, namespace, "elastic") == 1, 240, interval=2,
             what="the HPA to scale back to minReplicas once the load stopped")
    wait_for(lambda: sorted(groups(cluster, namespace, "elastic")) == [0], 120,
             what="the second group to go")


# -- scale to zero and back ------------------------------------------------------------------

GREEDY = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}


def router_pods(kubeshard) -> list[dict]:
    return [p for p in kubeshard.pods("router") if not p["metadata"].get("deletionTimestamp")]


@pytest.fixture
def two_routers(cluster, kubeshard):
    deploy = f"deployment/{kubeshard.component('router')}"
    cluster.kubectl("-n", kubeshard.namespace, "scale", deploy, "--replicas=2")
    wait_for(lambda: len([p for p in router_pods(kubeshard) if pod_ready(p)]) == 2, 180,
             what="two ready routers")
    try:
        yield
    finally:
        cluster.kubectl("-n", kubeshard.namespace, "scale", deploy, "--replicas=1")


def test_idle_scales_to_zero_and_twenty_requests_at_zero_all_succeed(cluster, kubeshard, namespace,
                                                                     demo_model_dir, two_routers):
    # Up for an hour of idleness while the reference answer is taken, then 10 s.
    body = model("sleepy", namespace, demo_model_dir,
                 autoscaling={"minReplicas": 0, "maxReplicas": 2, "idleSeconds": 3600})
    apply(cluster, body)
    wait_phase(cluster, namespace, "sleepy", "Ready", 1, timeout=FIRST_START)
    url = f"{kubeshard.router_url}/models/sleepy/generate"
    reference = client_results(cluster, namespace, start_client(
        cluster, namespace, concurrency=1, url=url, body=GREEDY, headers=NO_CACHE))
    assert reference[0]["status"] == 200 and reference[0]["text"], reference
    body["spec"]["autoscaling"]["idleSeconds"] = 10
    apply(cluster, body)

    obj = wait_phase(cluster, namespace, "sleepy", "ScaledToZero", 0, timeout=180)
    zero = condition(obj, "ScaledToZero")
    assert zero["status"] == "True" and zero["reason"] == "Idle" and "idleSeconds is 10" in zero["message"]
    wait_for(lambda: not kubectl_json(cluster, "-n", namespace, "get", "pods",
                                      "-l", "kubeshard.io/inference-service=sleepy")["items"], 120,
             what="every shard pod of sleepy gone")
    generation = isvc(cluster, namespace, "sleepy")["metadata"]["generation"]

    # 20 at once, through the Service, so both routers see requests at zero.
    results = client_results(cluster, namespace, start_client(
        cluster, namespace, concurrency=20, url=url, body=GREEDY, headers=NO_CACHE))
    assert len(results) == 20
    assert [r["status"] for r in results] == [200] * 20, [r for r in results if r["status"] != 200]
    assert {r["text"] for r in results} == {reference[0]["text"]}  # the right tokens
    # Both routers held requests and asked; one patch took the model from zero (the HPA
    # may add a group for the 20 after that).
    scaled = [line for p in router_pods(kubeshard)
              for line in cluster.pod_logs(kubeshard.namespace, p["metadata"]["name"]).splitlines()
              if f"scaled {namespace}/sleepy from zero to one replica" in line]
    assert len(scaled) == 1, scaled
    assert isvc(cluster, namespace, "sleepy")["metadata"]["generation"] > generation
    # And with no more requests it goes back to zero: nothing stays scaled up.
    wait_phase(cluster, namespace, "sleepy", "ScaledToZero", 0, timeout=180)

    check_a_router_killed_while_holding_requests(cluster, kubeshard, namespace, url)


def check_a_router_killed_while_holding_requests(cluster, kubeshard, namespace, url):
    """Requests held at zero by two routers; one router dies before the model is up: its
    own clients see an error, the other's all succeed, and the model goes back to zero."""
    victim, survivor = sorted(router_pods(kubeshard), key=lambda p: p["metadata"]["name"])[:2]
    # The replica may not start before the kill (a fast start would serve the victim's
    # requests first): its pods wait for a node label that the test adds after it.
    may_run = "e2e.kubeshard.io/may-run"
    cluster.kubectl("-n", namespace, "patch", "inferenceservice", "sleepy", "--type=merge", "-p",
                    json.dumps({"spec": {"pod": {"nodeSelector": {may_run: namespace}}}}))
    clients = {}
    for role, pod, held in (("victim", victim, "5"), ("survivor", survivor, "10")):
        clients[role] = start_client(cluster, namespace, concurrency=5, body=GREEDY, headers=NO_CACHE,
                                     url=f"http://{pod['status']['podIP']}:8080/models/sleepy/generate")
        # Held: the routers' queued requests, summed by the metrics API.
        wait_for(lambda: metric(cluster, namespace, "sleepy", "queue_depth") == held, 120, interval=0.5,
                 what=f"{held} requests held at zero")
    # The routers asked for a replica (the HPA may add the second for the 15 held requests).
    wait_for(lambda: spec_replicas(cluster, namespace, "sleepy") >= 1, 30, interval=0.5,
             what="the routers to take sleepy from zero")
    name = victim["metadata"]["name"]
    assert cluster.kill_pod(kubeshard.namespace, name) >= 1  # a crash: no drain
    cluster.kubectl("label", "nodes", "--all", f"{may_run}={namespace}")
    try:
        lost = client_results(cluster, namespace, clients["victim"])
        kept = client_results(cluster, namespace, clients["survivor"])
    finally:
        cluster.kubectl("label", "nodes", "--all", f"{may_run}-")
    assert len(lost) == 5 and all(r["status"] != 200 for r in lost), lost
    assert [r["status"] for r in kept] == [200] * 5, kept
    wait_phase(cluster, namespace, "sleepy", "ScaledToZero", 0, timeout=180)


# -- Redis away -----------------------------------------------------------------------------


def test_autoscaling_follows_the_load_with_redis_stopped(cluster, kubeshard, namespace, demo_model_dir):
    apply(cluster, model("direct", namespace, demo_model_dir,
                         autoscaling={"minReplicas": 1, "maxReplicas": 2, "target": 1}))
    wait_phase(cluster, namespace, "direct", "Ready", 1, timeout=FIRST_START)
    wait_metrics_api(cluster)
    redis = f"statefulset/{kubeshard.component('redis')}"
    cluster.kubectl("-n", kubeshard.namespace, "scale", redis, "--replicas=0")
    try:
        wait_for(lambda: not kubeshard.pods("redis"), 120, what="Redis to stop")
        client = start_client(cluster, namespace, concurrency=3,
                              **long_stream(kubeshard.router_url, "direct"))
        # The routers' own counts, asked directly, still reach the metrics API and the HPA.
        wait_for(lambda: metric(cluster, namespace, "direct", "concurrency") == "3", 120,
                 interval=0.5, what="concurrency 3 with Redis stopped")
        wait_for(lambda: spec_replicas(cluster, namespace, "direct") == 2, 120, interval=1,
                 what="the HPA to scale out on the routers' direct counts")
        results = client_results(cluster, namespace, client)
        assert [r["status"] for r in results] == [200] * 3, results
    finally:
        cluster.kubectl("-n", kubeshard.namespace, "scale", redis, "--replicas=1")
        wait_for(lambda: any(pod_ready(p) for p in kubeshard.pods("redis")), 180, what="Redis back")
