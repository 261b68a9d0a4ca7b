"""Small kubectl helpers shared by e2e tests (apply YAML, read objects as dicts, wait)."""

from __future__ import annotations

import json
import textwrap

from e2e.cluster import Cluster
from e2e.waiting import wait_for


def apply(cluster: Cluster, namespace: str | None, manifest: str, check: bool = True):
    args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
    return cluster.kubectl(*args, input=textwrap.dedent(manifest), check=check)


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
