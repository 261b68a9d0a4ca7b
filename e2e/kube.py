"""Small kubectl helpers shared by e2e tests (apply YAML, read objects as dicts, wait)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import yaml

from e2e.cluster import Cluster
from e2e.waiting import wait_for

CHART = Path(__file__).resolve().parents[1] / "charts" / "kubeshard" / "Chart.yaml"


def project_image(component: str) -> str:
    """The image of one of kubeshard's parts ("operator", "router", "shard-server") as
    the chart names it: hack/images.sh builds it, `make e2e-kind` loads it into kind."""
    return f"ghcr.io/kubeshard/{component}:{yaml.safe_load(CHART.read_text())['appVersion']}"


def apply(cluster: Cluster, namespace: str | None, *manifests: str, check: bool = True):
    """``kubectl apply`` of the manifests (YAML, each dedented) as one stream."""
    args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
    stream = "---\n".join(textwrap.dedent(m) for m in manifests)
    return cluster.kubectl(*args, input=stream, check=check)


def _nested(yaml: str, indent: str) -> str:
    """A YAML block (any indent) re-indented to sit under a key at ``indent``."""
    return textwrap.indent(textwrap.dedent(yaml).strip("\n") + "\n", indent)


def pod(name: str, spec: str) -> str:
    """A Pod manifest named ``name``; ``spec`` is its PodSpec as YAML."""
    return f"apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n" + _nested(spec, "  ")


def deployment(name: str, replicas: int, pod_spec: str) -> str:
    """A Deployment manifest named ``name`` of ``replicas`` pods labelled ``app: <name>``,
    each with ``pod_spec`` (YAML) as its PodSpec."""
    return (f"apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: {name}}}\nspec:\n"
            f"  replicas: {replicas}\n"
            f"  selector: {{matchLabels: {{app: {name}}}}}\n"
            f"  template:\n"
            f"    metadata: {{labels: {{app: {name}}}}}\n"
            f"    spec:\n" + _nested(pod_spec, "      "))


def get(cluster: Cluster, namespace: str, *what: str) -> dict:
    return json.loads(cluster.kubectl("get", *what, "-n", namespace, "-o", "json").stdout)


def pods(cluster: Cluster, namespace: str, selector: str) -> list[dict]:
    return get(cluster, namespace, "pods", "-l", selector)["items"]


def is_ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
    return pod.get("status", {}).get("phase") == "Running" and conds.get("Ready") == "True"


def run_to_completion(cluster: Cluster, namespace: str, name: str, timeout: float = 90) -> str:
    """Wait for a restartPolicy: Never pod to finish; return its log, fail if it failed."""
    phase = wait_for(
        lambda: get(cluster, namespace, "pod", name)["status"].get("phase") in ("Succeeded", "Failed")
        and get(cluster, namespace, "pod", name)["status"]["phase"],
        timeout=timeout, what=f"pod {name} to finish")
    logs = cluster.pod_logs(namespace, name)
    assert phase == "Succeeded", f"pod {name} {phase}; its log:\n{logs}"
    return logs
