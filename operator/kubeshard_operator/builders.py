"""Pure builders: a typed InferenceService spec -> the manifests of its children.

No I/O and no cluster here: every function returns a plain dict that the reconciler
applies with server-side apply, and that the unit tests inspect directly.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Optional

from kubeshard_operator import API_VERSION, KIND
from kubeshard_operator import naming as n
from kubeshard_operator.config import OperatorConfig
from kubeshard_operator import engine_pod, shard_pod
from kubeshard_operator.spec import InferenceServiceSpec


def owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    """Makes the InferenceService the controller of a child, so deleting it
    garbage-collects the child and nobody else adopts it."""
    meta = body["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(spec: InferenceServiceSpec, name: str, owner: Optional[Mapping[str, Any]],
              labels: Mapping[str, str], annotations: Optional[Mapping[str, str]] = None
              ) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": spec.namespace,
        "labels": {**n.common_labels(spec.name), **labels},
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    return meta


def pod_template(spec: InferenceServiceSpec, cfg: OperatorConfig, index: int) -> dict[str, Any]:
    """The pod template of a group: kubeshard's shards (its own engine, or onnx inside
    the shard server), or a peer engine's pod (engine_pod.py)."""
    if spec.runtime.is_peer:
        return engine_pod.pod_template(spec, cfg, index)
    return shard_pod.pod_template(spec, cfg, index)


def template_hash(spec: InferenceServiceSpec, cfg: OperatorConfig) -> str:
    """Identifies what the pods of a group run. Groups whose hash differs from the
    current one are replaced by the rollout. Built for group 0: the index enters the
    template only through names derived from it, so one hash covers every group."""
    material = {"shards": spec.sharding.shards, "template": pod_template(spec, cfg, 0)}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return digest[:10]


def build_statefulset(spec: InferenceServiceSpec, cfg: OperatorConfig, index: int,
                      owner: Optional[Mapping[str, Any]] = None,
                      template_hash_value: Optional[str] = None) -> dict[str, Any]:
    """One group (one replica of the model): `shards` pods started together, ordinal =
    rank."""
    name = n.group_name(spec.name, index)
    digest = template_hash_value or template_hash(spec, cfg)
    template = pod_template(spec, cfg, index)
    template["metadata"]["labels"][n.LABEL_HASH] = digest
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(spec, name, owner, {
            **n.group_selector(spec.name, index),
            "app.kubernetes.io/component": n.COMPONENT_SHARD,
            n.LABEL_HASH: digest,
        }),
        "spec": {
            "replicas": spec.pods_per_group,
            "serviceName": name,
            # All ranks start at once: rank 0 waits for its peers at the rendezvous, so
            # ordered start-up would deadlock the group.
            "podManagementPolicy": "Parallel",
            # The operator replaces whole groups; the StatefulSet must never roll its
            # pods one by one (a process group cannot take back a single rank).
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": n.group_selector(spec.name, index)},
            "template": template,
        },
    }


def build_headless_service(spec: InferenceServiceSpec, index: int,
                           owner: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Stable DNS names for a group's pods: `<group>-<rank>.<group>`; rank 0 is the
    rendezvous address of the others."""
    name = n.group_name(spec.name, index)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, name, owner, {
            **n.group_selector(spec.name, index), "app.kubernetes.io/component": "group"}),
        "spec": {
            "clusterIP": "None",
            # Ranks resolve the leader while it is still loading (not ready yet).
            "publishNotReadyAddresses": True,
            "selector": n.group_selector(spec.name, index),
            "ports": [
                {"name": "grpc", "port": n.GRPC_PORT, "targetPort": n.GRPC_PORT},
                {"name": "rendezvous", "port": n.RENDEZVOUS_PORT,
                 "targetPort": n.RENDEZVOUS_PORT},
            ],
        },
    }


def build_leader_service(spec: InferenceServiceSpec,
                         owner: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """One Service over rank 0 of every group. Its EndpointSlices list the ready
    replicas; the router watches them (labels and the `grpc` port name are its contract)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, n.leader_service_name(spec.name), owner, {
            n.LABEL_ROLE: "leader", "app.kubernetes.io/component": "leader"}),
        "spec": {
            "type": "ClusterIP",
            "selector": n.leader_selector(spec.name),
            "ports": [{"name": "grpc", "port": n.GRPC_PORT, "targetPort": "grpc",
                       "protocol": "TCP", "appProtocol": "grpc"}],
        },
    }


def build_pdb(spec: InferenceServiceSpec,
              owner: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """One shard down takes its whole group down, so voluntary disruptions (drains)
    take one pod at a time: the next eviction waits until that group is ready again."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(spec, spec.name, owner, {"app.kubernetes.io/component": "pdb"}),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": n.shard_selector(spec.name)},
        },
    }


def build_hpa(spec: InferenceServiceSpec,
              owner: Optional[Mapping[str, Any]] = None) -> Optional[dict[str, Any]]:
    """An HPA on the InferenceService's /scale subresource (never on a StatefulSet: the
    operator turns spec.replicas into groups). None without spec.autoscaling.

    The HPA cannot scale to zero; minReplicas 0 means the operator scales to zero when
    idle and the router's activator scales back to one. At zero the HPA is inert (the
    HPA controller leaves a target at zero replicas alone) until the router scales it up.

    The metric is an Object metric of the InferenceService from the operator's custom
    metrics API (metrics_api.py): the InferenceService's total, which the AverageValue
    target divides by the replicas, so `target` is per replica group."""
    a = spec.autoscaling
    if a is None:
        return None
    if a.metric == "cpu":
        metric: dict[str, Any] = {"type": "Resource", "resource": {
            "name": "cpu", "target": {"type": "Utilization", "averageUtilization": a.target}}}
    else:
        # Served by the operator's custom metrics API from the routers' own live counts:
        # the freshest load signal there is (scraped gauges lag).
        name = n.HPA_METRIC[a.metric]
        metric = {"type": "Object", "object": {
            "describedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": spec.name},
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": str(a.target)},
        }}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(spec, spec.name, owner, {"app.kubernetes.io/component": "hpa"}),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": spec.name},
            "minReplicas": max(1, a.min_replicas),
            "maxReplicas": a.max_replicas,
            "metrics": [metric],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": a.scale_up_stabilization_seconds},
                # A group takes long to load: scale down one group at a time.
                "scaleDown": {
                    "stabilizationWindowSeconds": a.scale_down_stabilization_seconds,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                },
            },
        },
    }


def service_url(spec: InferenceServiceSpec, cfg: OperatorConfig) -> str:
    """status.url: where clients send requests for this model. The router names a model
    after its InferenceService (metadata.name), so that is the path's model."""
    if cfg.router_url:
        return f"{cfg.router_url.rstrip('/')}/models/{spec.name}"
    svc = n.leader_service_name(spec.name)
    return f"grpc://{svc}.{spec.namespace}.svc:{n.GRPC_PORT}"
