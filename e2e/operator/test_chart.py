"""The Helm chart on the real control plane: lint, server-side dry run, `helm test`, and
the documented CRD upgrade path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from e2e.operator.conftest import CHART, CRDS, kubectl_json

pytestmark = pytest.mark.e2e


def test_helm_lint_passes(cluster):
    out = cluster.helm("lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values, kinds", [
    ([], {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering", "Deployment",
          "StatefulSet", "Service", "NetworkPolicy", "PodDisruptionBudget",
          "HorizontalPodAutoscaler", "Pod"}),
    # An external Redis, one watched namespace (Roles instead of ClusterRoles), API keys.
    (["--set", "redis.external.url=redis://:pw@redis.example:6379/0",
      "--set", "watchNamespace={ns}", "--set", "router.apiKeys.secretName=keys"],
     {"Role", "RoleBinding", "KopfPeering", "Secret", "Deployment", "NetworkPolicy"}),
], ids=["defaults", "external-redis-namespaced"])
def test_template_applies_with_server_side_dry_run(cluster, kubeshard, namespace, values, kinds):
    values = [v.replace("{ns}", namespace) for v in values]
    rendered = cluster.helm("template", "dry", str(CHART), "-n", namespace, *values).stdout
    docs = [doc for doc in yaml.safe_load_all(rendered) if doc]
    assert kinds <= {doc["kind"] for doc in docs}
    # kubectl refuses an object of another namespace than -n: the metrics server's
    # RoleBinding to kube-system's extension-apiserver-authentication-reader goes alone.
    by_namespace: dict[str, list[dict]] = {}
    for doc in docs:
        by_namespace.setdefault(doc["metadata"].get("namespace", namespace), []).append(doc)
    assert [d["roleRef"]["name"] for d in by_namespace["kube-system"]] == ["extension-apiserver-authentication-reader"]
    for ns, group in by_namespace.items():
        out = cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", "-", input=yaml.safe_dump_all(group))
        assert "(server dry run)" in out.stdout
        assert out.returncode == 0


def test_helm_test_calls_the_router_health(cluster, kubeshard):
    out = cluster.helm("test", kubeshard.name, "-n", kubeshard.namespace, "--timeout", "2m",
                       timeout=180, check=False)
    # A pod that succeeded is deleted by its hook policy (so no `helm test --logs`); a
    # failed one stays, and its log (each try's wget error) goes into the message.
    pod = kubeshard.component("test-health")
    logs = "" if out.returncode == 0 else cluster.kubectl("logs", pod, "-n", kubeshard.namespace,
                                                          check=False).stdout
    assert out.returncode == 0, f"helm test failed:\n{out.stdout}\n{out.stderr}\n--- {pod} log ---\n{logs}"
    test_suite = out.stdout[out.stdout.index("TEST SUITE:"):]
    assert pod in test_suite
    assert "Phase:          Succeeded" in test_suite


def test_crd_upgrade_path_is_server_side_apply(cluster, kubeshard, tmp_path: Path):
    """`helm upgrade` never touches crds/; `kubectl apply --server-side` does, in place."""
    crd = yaml.safe_load((CRDS / "kubeshard.io_inferenceservices.yaml").read_text())
    marker = "upgraded by the e2e test"
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"]["description"] = marker
    upgraded = tmp_path / "crds"
    upgraded.mkdir()
    (upgraded / "inferenceservices.yaml").write_text(yaml.safe_dump(crd))
    try:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(upgraded))
        live = kubectl_json(cluster, "get", "crd", "inferenceservices.kubeshard.io")
        live_schema = live["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert live_schema["properties"]["spec"]["description"] == marker
    finally:
        # Back to the repository's CRDs: the same command, run again, is idempotent.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    live = kubectl_json(cluster, "get", "crd", "inferenceservices.kubeshard.io")
    assert live["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "description"] != marker
    assert json.dumps(live["spec"]["names"]["shortNames"]) == '["infsvc"]'
