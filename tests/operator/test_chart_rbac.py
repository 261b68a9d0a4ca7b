"""What the chart's RBAC grants each service account, read from `helm template`:
exactly what each part needs. The metrics server's delegated authentication uses the
roles every aggregated API server binds (the ClusterRole system:auth-delegator, and
kube-system's Role extension-apiserver-authentication-reader through a RoleBinding in
kube-system), not a role of its own over ConfigMaps."""

from __future__ import annotations

import pytest

from tests.support.helm import rendered

RBAC_KINDS = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}


def grants(objects: list[dict], account: str, namespace: str = "serving") -> set[tuple]:
    """(where, apiGroup, resource, verb) for every rule the chart's own roles grant the
    service account; ("built-in", kind, name, where) for a role the cluster provides."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects
             if o["kind"] in ("Role", "ClusterRole")}
    out: set[tuple] = set()
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if {"kind": "ServiceAccount", "name": account, "namespace": namespace} not in binding["subjects"]:
            continue
        where = binding["metadata"].get("namespace", "cluster")
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], binding["metadata"].get("namespace") if ref["kind"] == "Role" else None,
                          ref["name"]))
        if role is None:
            out.add(("built-in", ref["kind"], ref["name"], where))
            continue
        for rule in role["rules"]:
            names = tuple(rule.get("resourceNames", ()))
            out |= {(where, group, resource, verb) + ((names,) if names else ())
                    for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}
    return out


def metrics_server_grants(where: str) -> set[tuple]:
    """All the metrics server may do: delegated auth's built-in roles, reading
    InferenceServices ``where`` (cluster-wide or one namespace), listing EndpointSlices."""
    return {
        ("built-in", "ClusterRole", "system:auth-delegator", "cluster"),
        ("built-in", "Role", "extension-apiserver-authentication-reader", "kube-system"),
        (where, "kubeshard.io", "inferenceservices", "get"),
        (where, "kubeshard.io", "inferenceservices", "list"),
        ("serving", "discovery.k8s.io", "endpointslices", "list"),
    }


def test_the_metrics_server_binds_the_built_in_roles_of_delegated_auth_and_reads_little_else():
    objects = rendered()
    assert grants(objects, "t-kubeshard-metrics") == metrics_server_grants("cluster")
    assert not [o for o in objects if o["kind"] in ("Role", "ClusterRole")
                for rule in o["rules"] if "configmaps" in rule["resources"]]
    (reader,) = [o for o in objects if o["metadata"].get("namespace") == "kube-system"]
    assert reader["kind"] == "RoleBinding" and reader["metadata"]["name"] == "t-kubeshard-metrics-auth-reader"


def test_watching_one_namespace_narrows_what_the_metrics_server_reads_there():
    objects = rendered("--set", "watchNamespace=models")
    assert grants(objects, "t-kubeshard-metrics") == metrics_server_grants("models")


def test_without_the_metrics_server_nothing_lands_in_kube_system():
    objects = rendered("--set", "metricsServer.enabled=false")
    assert [o for o in objects if o["metadata"].get("namespace") == "kube-system"] == []
    assert grants(objects, "t-kubeshard-metrics") == set()


@pytest.mark.parametrize("verb", ["create", "update", "patch", "delete"])
def test_the_router_may_scale_an_inference_service_and_not_change_it(verb):
    router = grants(rendered(), "t-kubeshard-router")
    assert ("cluster", "kubeshard.io", "inferenceservices/scale", "patch") in router
    assert ("cluster", "kubeshard.io", "inferenceservices", verb) not in router
    assert {g[2] for g in router} == {"inferenceservices", "inferenceservices/scale", "endpointslices"}
