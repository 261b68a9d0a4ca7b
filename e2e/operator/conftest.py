"""Fixtures of the operator and chart e2e tests: one shared `helm install` of the chart.

Installing the chart costs most of a test's time on two cores, so every test of this
folder shares one release (session scope) and makes its own InferenceServices in
namespaces of its own.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

from e2e.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kubeshard"
CRDS = ROOT / "crds"
RELEASE = "ks"
# Quick reconciles and no router HPA keep the suite short on two cores; two operator
# replicas show that peering lets one act.
INSTALL_VALUES = [
    "--set", "operator.replicaCount=2",
    "--set", "operator.reconcileInterval=3",
    "--set", "router.autoscaling.enabled=false",
    "--set", "router.replicaCount=1",
    "--set", "redis.maxMemory=64mb",
    "--set", "router.runtimeLora=true",  # test_runtime_lora.py
    # Requests held at zero wait out a cold start that compiles the decode kernel.
    "--set", "router.extraArgs={--activation-timeout=300}",
]


@dataclass
class Release:
    cluster: Any
    namespace: str
    name: str = RELEASE

    @property
    def fullname(self) -> str:
        return f"{self.name}-kubeshard"

    def component(self, name: str) -> str:
        """The name of the chart's objects for one component (router, redis, operator, ...)."""
        return f"{self.fullname}-{name}"

    @property
    def router_url(self) -> str:
        return f"http://{self.component('router')}.{self.namespace}.svc:8080"

    def pods(self, component: str) -> list[dict]:
        out = self.cluster.kubectl(
            "-n", self.namespace, "get", "pods", "-o", "json",
            "-l", f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component={component}")
        return json.loads(out.stdout)["items"]


def kubectl_json(cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def pod_ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", ()))


@pytest.fixture(scope="session")
def kubeshard(cluster):
    """The chart installed with its own CRDs and RBAC; uninstalled at the end."""
    namespace = f"kubeshard-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("apply", "--server-side", "-f", str(CRDS))
    cluster.kubectl("create", "namespace", namespace)
    cluster.helm("install", RELEASE, str(CHART), "-n", namespace, *INSTALL_VALUES,
                 "--wait", "--timeout", "5m", timeout=360)
    release = Release(cluster, namespace)
    try:
        yield release
    finally:
        # While the operator still runs, so no finalizer is left behind to block the
        # deletion of a namespace.
        cluster.kubectl("delete", "inferenceservices", "--all", "-A", "--timeout=120s",
                        check=False, timeout=150)
        cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait", check=False, timeout=180)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The tiny llama demo checkpoint on the node's disk, mounted by hostPath."""
    from kubeshard_shard.demo_model import cached_demo_model
    from kubeshard_shard.paths import cache_root

    return Path(cached_demo_model(cache_root() / "demo-models", arch="llama", size="tiny", seed=0))


def inference_service(name: str, namespace: str, model_dir: Path, **spec: Any) -> dict:
    body = {
        "apiVersion": "kubeshard.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"source": f"file://{model_dir}"},
            "sharding": {"shards": 1},
            # A request only (shards get no CPU limit): small enough that three groups fit
            # beside the chart and kind's control plane (about 0.9 CPU) on a 2-CPU node.
            "resources": {"cpu": "200m", "memory": "1Gi"},
            "engine": {"maxTotalTokens": 256, "kvCacheMemory": "64Mi"},
            "pod": {"terminationGracePeriodSeconds": 5},
        },
    }
    for key, value in spec.items():
        body["spec"][key] = value
    return body


def apply(cluster, obj: dict, check: bool = True) -> subprocess.CompletedProcess:
    return cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj), check=check)


def isvc(cluster, namespace: str, name: str) -> Optional[dict]:
    out = cluster.kubectl("-n", namespace, "get", "inferenceservice", name, "-o", "json",
                          check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def wait_phase(cluster, namespace: str, name: str, phase: str, ready: int,
               timeout: float = 240) -> dict:
    def check():
        obj = isvc(cluster, namespace, name)
        status = (obj or {}).get("status") or {}
        if status.get("phase") == phase and status.get("readyReplicas") == ready and \
                status.get("observedGeneration") == obj["metadata"]["generation"]:
            return obj
        return None

    return wait_for(check, timeout,
                    what=f"InferenceService {namespace}/{name} {phase} with {ready} ready groups")


def groups(cluster, namespace: str, name: str) -> dict[int, dict]:
    """index -> StatefulSet of the InferenceService's groups (terminating ones excluded)."""
    items = kubectl_json(cluster, "-n", namespace, "get", "statefulsets",
                         "-l", f"kubeshard.io/inference-service={name}")["items"]
    return {int(s["metadata"]["labels"]["kubeshard.io/group"]): s for s in items
            if not s["metadata"].get("deletionTimestamp")}
