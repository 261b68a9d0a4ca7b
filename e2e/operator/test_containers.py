"""What only real containers show: the images run as non-root on a read-only root
filesystem and serve, and memory limits are enforced (an over-limit shard is
OOM-killed and its group restarted), and NetworkPolicy is enforced. Runs on the local
cluster's real node and on kind."""

from __future__ import annotations

import json
import textwrap
import uuid

import pytest

from e2e.kube import apply as apply_yaml
from e2e.kube import get, is_ready, project_image
from e2e.operator.conftest import apply, inference_service, kubectl_json, pod_ready
from e2e.waiting import wait_for
from kubeshard_shard.engine import kernels
from kubeshard_shard.hardware import CpuFeatures

pytestmark = pytest.mark.e2e


def _non_root_read_only(cluster, namespace: str, pod: str, container: str | None = None) -> None:
    probe = cluster.exec(namespace, pod, "python3", "-c", textwrap.dedent("""
        import os
        print("uid", os.getuid())
        for path in ("/", "/opt/kubeshard"):
            try:
                open(os.path.join(path, "kubeshard-write-probe"), "w").close()
                print("wrote", path)
            except OSError as e:
                print("refused", path, e.strerror)
    """), container=container)
    lines = probe.stdout.splitlines()
    assert "uid 10001" in lines, probe.stdout
    assert "refused / Read-only file system" in lines, probe.stdout
    assert "refused /opt/kubeshard Read-only file system" in lines, probe.stdout


def test_operator_and_router_images_run_non_root_and_read_only(cluster, kubeshard):
    for component in ("operator", "router"):
        pod = next(p for p in kubeshard.pods(component) if pod_ready(p))
        image = pod["spec"]["containers"][0]["image"]
        assert image == project_image(component)
        _non_root_read_only(cluster, kubeshard.namespace, pod["metadata"]["name"])


SHARD_AND_ROUTER = """
apiVersion: v1
kind: Pod
metadata: {{name: shard, labels: {{app: shard}}}}
spec:
  securityContext: {{runAsNonRoot: true, runAsUser: 10001, runAsGroup: 10001}}
  containers:
  - name: shard
    image: {shard_image}
    args: [serve-shard, --model, /models/tiny, --model-id, tiny, --port, "50051",
           --max-total-tokens, "128", --kv-cache-memory, 32Mi, --num-threads, "1"]
    securityContext: {{readOnlyRootFilesystem: true, allowPrivilegeEscalation: false,
                      capabilities: {{drop: [ALL]}}}}
    resources: {{limits: {{memory: 1Gi}}}}
    readinessProbe: {{grpc: {{port: 50051}}, periodSeconds: 2}}
    volumeMounts:
    - {{name: model, mountPath: /models/tiny, readOnly: true}}
    - {{name: tmp, mountPath: /tmp}}
  volumes:
  - {{name: model, hostPath: {{path: "{model}", type: Directory}}}}
  - {{name: tmp, emptyDir: {{}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: router}}
spec:
  securityContext: {{runAsNonRoot: true, runAsUser: 10001, runAsGroup: 10001}}
  containers:
  - name: router
    image: {router_image}
    args: [--host=0.0.0.0, --port=8080, --no-redis, "--backend=tiny={shard_ip}:50051"]
    securityContext: {{readOnlyRootFilesystem: true, allowPrivilegeEscalation: false,
                      capabilities: {{drop: [ALL]}}}}
    readinessProbe: {{httpGet: {{path: /health, port: 8080}}, periodSeconds: 2}}
    volumeMounts: [{{name: tmp, mountPath: /tmp}}]
  volumes: [{{name: tmp, emptyDir: {{}}}}]
"""

CLIENT = r"""
import json, sys, urllib.request
base = sys.argv[1]
print("health", urllib.request.urlopen(base + "/health", timeout=10).status)
body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 4}}).encode()
req = urllib.request.Request(base + "/generate", body, {"Content-Type": "application/json"})
print("generate", json.load(urllib.request.urlopen(req, timeout=60))["generated_text"] != "")
"""


def test_shard_server_image_serves_a_mounted_model_read_only(cluster, namespace, demo_model_dir):
    """The shard image loads the tiny demo model from a hostPath volume and answers gRPC
    (the router image in front of it proves it, with both read-only and non-root)."""
    apply_yaml(cluster, namespace, SHARD_AND_ROUTER.split("---")[0].format(
        shard_image=project_image("shard-server"), router_image=project_image("router"),
        model=demo_model_dir, shard_ip="unused"))
    shard = wait_for(lambda: (p := get(cluster, namespace, "pod", "shard")) and is_ready(p) and p,
                     timeout=240, what="the shard pod to answer its gRPC readiness probe")
    # the image has no compiler: its CPU kernels are the ones built into it (engine.kernels),
    # the highest x86-64 level this node's CPU runs
    level = next(level for level, needs in kernels.LEVELS if needs <= CpuFeatures.detect().flags)
    shard_log = cluster.pod_logs(namespace, "shard")
    assert f"CPU kernels: the {level} build" in shard_log and "decode kernel on" in shard_log, shard_log
    apply_yaml(cluster, namespace, SHARD_AND_ROUTER.split("---")[1].format(
        shard_image=project_image("shard-server"), router_image=project_image("router"),
        model=demo_model_dir, shard_ip=shard["status"]["podIP"]))
    wait_for(lambda: is_ready(get(cluster, namespace, "pod", "router")), timeout=120,
             what="the router pod to report /health 200 for the shard")
    _non_root_read_only(cluster, namespace, "shard")
    _non_root_read_only(cluster, namespace, "router")
    client = f"client-{uuid.uuid4().hex[:5]}"
    router_ip = get(cluster, namespace, "pod", "router")["status"]["podIP"]
    cluster.kubectl("-n", namespace, "run", client, "--image=python:3.11", "--restart=Never",
                    "--command", "--", "python3", "-c", CLIENT, f"http://{router_ip}:8080")
    wait_for(lambda: get(cluster, namespace, "pod", client)["status"].get("phase") == "Succeeded",
             timeout=120, what=f"{client} to call the router")
    logs = cluster.pod_logs(namespace, client)
    assert "health 200" in logs and "generate True" in logs, logs


def test_a_shard_over_its_memory_limit_is_oom_killed_and_its_group_restarted(
        cluster, kubeshard, namespace, demo_model_dir):
    """torch alone needs more than 200 MiB: the kernel kills a shard at its cgroup's
    limit, the kubelet reports OOMKilled, and the operator restarts the whole two-shard
    group (a process group cannot take one rank back)."""
    apply(cluster, inference_service("starved", namespace, demo_model_dir,
                                     sharding={"shards": 2, "strategy": "tensor"},
                                     resources={"cpu": "250m", "memory": "200Mi"}))
    try:
        def oom_killed():
            items = kubectl_json(cluster, "-n", namespace, "get", "pods",
                                 "-l", "kubeshard.io/inference-service=starved")["items"]
            for pod in items:
                for status in pod["status"].get("containerStatuses") or ():
                    for state in (status.get("lastState") or {}, status.get("state") or {}):
                        term = state.get("terminated") or {}
                        if term.get("reason") == "OOMKilled":
                            return pod, term
            return None

        pod, term = wait_for(oom_killed, 240, what="a starved shard container to be OOMKilled")
        assert term["exitCode"] == 137, term
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["memory"] == "200Mi", limits

        def restarted():
            events = kubectl_json(cluster, "-n", namespace, "get", "events",
                                  "--field-selector", "involvedObject.name=starved")["items"]
            return [e for e in events if e["reason"] == "GroupRestarted"] or None

        events = wait_for(restarted, 180, what="a GroupRestarted event for starved")
        assert "starved-g0" in json.dumps(events)
    finally:
        cluster.kubectl("-n", namespace, "delete", "inferenceservice", "starved",
                        "--timeout=120s", check=False, timeout=150)


PROBE = r"""
import socket, sys, time
# A policy engine admits a new pod some seconds after it starts (its IP joins the
# allowed set on the pod's event), so each target gets 20 s to open.
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    verdict, deadline = None, time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            verdict = "open"
            break
        except (ConnectionRefusedError, TimeoutError) as e:  # the policy's REJECT or DROP
            verdict = "blocked"
        except OSError as e:  # anything else (a name that does not resolve, ...) is no verdict
            verdict = "error:" + type(e).__name__
        time.sleep(1)
    print(target, verdict, flush=True)
"""


def _probe(cluster, namespace: str, labels: dict[str, str], *targets: str) -> dict[str, str]:
    """target -> "open" | "blocked", as seen from a new pod with these labels (deleted
    after: one labelled as the router must not stay to be counted as one)."""
    name = f"probe-{uuid.uuid4().hex[:5]}"
    apply_yaml(cluster, namespace, json.dumps({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "probe", "image": "python:3.11", "command": ["python3", "-c", PROBE, *targets]}]},
    }))
    try:
        wait_for(lambda: get(cluster, namespace, "pod", name)["status"].get("phase") in ("Succeeded", "Failed"),
                 timeout=120, what=f"probe pod {name} to finish")
        out = {}
        for line in cluster.pod_logs(namespace, name).splitlines():
            target, verdict = line.split()[:2]
            out[target] = verdict
        return out
    finally:
        cluster.kubectl("-n", namespace, "delete", "pod", name, "--wait=false", check=False)


def test_network_policy_keeps_other_pods_from_redis_and_the_shards(cluster, kubeshard, demo_model_dir):
    """The chart's NetworkPolicies: Redis takes only the router and the operator, shard gRPC
    only the router. A pod with other labels, in the release namespace or another, is
    refused; one labelled as the router gets through (so the refusals are the policy's)."""
    ns = kubeshard.namespace
    apply(cluster, inference_service("guarded", ns, demo_model_dir))
    try:
        obj = wait_for(lambda: (lambda o: o if ((o or {}).get("status") or {}).get("readyReplicas") == 1
                                else None)(kubectl_json(cluster, "-n", ns, "get", "inferenceservice", "guarded")),
                       300, what="InferenceService guarded to be ready")
        assert obj["status"]["phase"] == "Ready"
        shard_ip = next(p["status"]["podIP"] for p in kubectl_json(
            cluster, "-n", ns, "get", "pods", "-l", "kubeshard.io/inference-service=guarded")["items"])
        # The Service's address (kube-proxy's DNAT, then the policy on the Redis pod).
        redis_ip = kubectl_json(cluster, "-n", ns, "get", "service", kubeshard.component("redis"))["spec"]["clusterIP"]
        redis = f"{redis_ip}:6379"
        shard = f"{shard_ip}:50051"
        router = kubeshard.pods("router")[0]["metadata"]["labels"]
        router_labels = {k: v for k, v in router.items() if k.startswith("app.kubernetes.io/")
                         and k in ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                                   "app.kubernetes.io/component")}
        assert _probe(cluster, ns, {"app": "intruder"}, redis, shard) == {redis: "blocked", shard: "blocked"}
        other = f"intruders-{uuid.uuid4().hex[:5]}"
        cluster.kubectl("create", "namespace", other)
        try:
            assert _probe(cluster, other, router_labels, redis, shard) == {redis: "blocked", shard: "blocked"}
        finally:
            cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
        assert _probe(cluster, ns, router_labels, redis, shard) == {redis: "open", shard: "open"}
    finally:
        cluster.kubectl("-n", ns, "delete", "inferenceservice", "guarded", "--timeout=120s",
                        check=False, timeout=150)
