"""The activation cache on the real kubelet, with a Redis that requires a password.

The password never enters a pod spec: the InferenceService names a Secret
(spec.cache.activations.urlSecretRef) and the kubelet hands its URL to the shard
container, which writes the prompt's KV blocks to that Redis (and not to the chart's).
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import redis

from e2e.operator.conftest import apply, inference_service, kubectl_json, pod_ready, wait_phase
from e2e.waiting import wait_for

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6   # several 16-token blocks


def password_redis(namespace: str, password: str) -> list[dict]:
    """A Redis pod requiring ``password`` and its Service (the chart's Redis image)."""
    labels = {"app": "redis-auth"}
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "redis-auth", "namespace": namespace, "labels": labels},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 999, "runAsGroup": 999,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "redis", "image": "redis:7.4-alpine", "imagePullPolicy": "IfNotPresent",
                "args": ["--port", "6379", "--requirepass", password, "--save", "", "--appendonly", "no"],
                "ports": [{"containerPort": 6379}],
                "readinessProbe": {"tcpSocket": {"port": 6379}, "periodSeconds": 2},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            }],
            "volumes": [{"name": "data", "emptyDir": {}}],
        },
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "redis-auth", "namespace": namespace},
               "spec": {"selector": labels, "ports": [{"port": 6379, "targetPort": 6379}]}}
    return [pod, service]


def test_shards_use_a_password_redis_named_by_a_secret(cluster, kubeshard, namespace, demo_model_dir):
    password = uuid.uuid4().hex
    for obj in password_redis(namespace, password):
        apply(cluster, obj)
    apply(cluster, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "redis-url", "namespace": namespace},
                    "stringData": {"url": f"redis://:{password}@redis-auth.{namespace}.svc:6379/0"}})
    apply(cluster, inference_service("cached", namespace, demo_model_dir,
                                     cache={"activations": {"minHits": 1, "urlSecretRef": {"name": "redis-url"}}}))
    wait_for(lambda: pod_ready(kubectl_json(cluster, "-n", namespace, "get", "pod", "redis-auth")), 120,
             what="the password Redis to be ready")
    wait_phase(cluster, namespace, "cached", "Ready", 1, timeout=300)

    # the pod spec holds a reference, never the URL or its password
    pod = kubectl_json(cluster, "-n", namespace, "get", "pod", "cached-g0-0")
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["KUBESHARD_REDIS_URL"] == {"name": "KUBESHARD_REDIS_URL", "valueFrom": {
        "secretKeyRef": {"name": "redis-url", "key": "url"}}}
    assert password not in json.dumps(pod)

    with cluster.port_forward(kubeshard.namespace, f"service/{kubeshard.component('router')}", 8080) as port:
        reply = httpx.post(f"http://127.0.0.1:{port}/models/cached/generate", timeout=120,
                           json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
    assert reply.status_code == 200, reply.text

    with cluster.port_forward(namespace, "pod/redis-auth", 6379) as port:
        guarded = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        with pytest.raises(redis.AuthenticationError):
            guarded.ping()
        r = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=5)
        # the prefill's blocks are written after the answer, asynchronously
        keys = wait_for(lambda: r.keys("kubeshard:cached:*:kv:*") or None, 60,
                        what="the prompt's KV blocks in the password Redis")
        assert len(keys) >= 2
    with cluster.port_forward(kubeshard.namespace, f"service/{kubeshard.component('redis')}", 6379) as port:
        chart = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        # (the KV keys' `:kv:` segment: the router's load key there ends in its pod's name,
        # whose random suffix once ended in "kv")
        assert chart.keys("kubeshard:cached:*:kv:*") == []  # the Secret's Redis, not the operator's

    logs = cluster.pod_logs(namespace, "cached-g0-0")
    assert "activation cache on: redis://***@redis-auth" in logs, logs[-2000:]
    assert password not in logs
