"""Names and labels of an InferenceService's children: the one place that spells them.

The router depends on two of them (see the router's Kubernetes discovery): the leader
Service carries `kubeshard.io/inference-service=<name>` and `kubeshard.io/role=leader`,
and its gRPC port is named `grpc`.
"""

from __future__ import annotations

LABEL_ISVC = "kubeshard.io/inference-service"
LABEL_GROUP = "kubeshard.io/group"
LABEL_ROLE = "kubeshard.io/role"
LABEL_HASH = "kubeshard.io/template-hash"
# Set by the StatefulSet controller on every pod (Kubernetes >= 1.28): the pod's ordinal,
# which is its rank. The leader Service selects rank 0 of every group with it.
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"

ANNOTATION_RESTARTS = "kubeshard.io/group-restarts"
ANNOTATION_LAST_RESTART = "kubeshard.io/last-group-restart"

MANAGED_BY = "kubeshard-operator"
COMPONENT_SHARD = "shard"
FIELD_MANAGER = "kubeshard-operator"

# The custom metrics API's metrics of an InferenceService (metrics_api.py serves them),
# and which one the HPA reads for each spec.autoscaling.metric.
CUSTOM_METRICS = ("concurrency", "queue_depth", "tokens_in_flight", "tokens_per_second")
HPA_METRIC = {"concurrency": "concurrency", "queueDepth": "queue_depth",
              "tokensInFlight": "tokens_in_flight"}

GRPC_PORT = 50051
METRICS_PORT = 9400
RENDEZVOUS_PORT = 29500


def group_name(isvc: str, index: int) -> str:
    """StatefulSet and headless Service of group `index`; pods are `<this>-<rank>`."""
    return f"{isvc}-g{index}"


def leader_service_name(isvc: str) -> str:
    return isvc


def common_labels(isvc: str) -> dict[str, str]:
    """Labels on every child: the standard app.kubernetes.io set plus the owner's name."""
    return {
        "app.kubernetes.io/name": "kubeshard",
        "app.kubernetes.io/instance": isvc,
        "app.kubernetes.io/part-of": "kubeshard",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_ISVC: isvc,
    }


def shard_selector(isvc: str) -> dict[str, str]:
    """Every shard pod of the InferenceService, whatever its group: PDB, /scale, HPA."""
    return {LABEL_ISVC: isvc, "app.kubernetes.io/component": COMPONENT_SHARD}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def group_selector(isvc: str, index: int) -> dict[str, str]:
    return {LABEL_ISVC: isvc, LABEL_GROUP: str(index)}


def leader_selector(isvc: str) -> dict[str, str]:
    return {**shard_selector(isvc), LABEL_POD_INDEX: "0"}
