"""Observe: read an InferenceService's children once per pass, and view them as groups.

`observe` is the one place a pass lists the cluster; everything after it (planning,
desired children, status) works on the `Snapshot` it returns. Inputs that are not
children (say the time of the model's last request) belong in the snapshot too, so the
plan can use them without another read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kubeshard_operator import naming as n
from kubeshard_operator.kube import Kube
from kubeshard_operator.rollout import GroupView, PodView
from kubeshard_operator.status import pod_problem


@dataclass(frozen=True)
class Snapshot:
    """The children of one InferenceService as one pass read them (controlled by it)."""

    # Group index -> the group's StatefulSet.
    statefulsets: Mapping[int, Mapping[str, Any]]
    # Every shard pod of the InferenceService, whatever its group.
    pods: Sequence[Mapping[str, Any]]
    # Its Services: the leader Service and the groups' headless Services.
    services: Sequence[Mapping[str, Any]]
    # One view per StatefulSet, for planning and status.
    groups: Sequence[GroupView]


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """True when the object with `uid` is the controller of `obj`."""
    return any(ref.get("uid") == uid and ref.get("controller")
               for ref in obj["metadata"].get("ownerReferences") or ())


def members(sts: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods of `pods` that the StatefulSet `sts` owns."""
    uid = sts["metadata"]["uid"]
    return [p for p in pods if any(ref.get("uid") == uid
                                   for ref in p["metadata"].get("ownerReferences") or ())]


def pod_view(pod: Mapping[str, Any]) -> PodView:
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or ()
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or ())
    return PodView(
        name=pod["metadata"]["name"],
        ready=ready,
        restarts=sum(int(c.get("restartCount") or 0) for c in containers),
        finished=status.get("phase") in ("Failed", "Succeeded"),
        terminating=bool(pod["metadata"].get("deletionTimestamp")),
        problem=pod_problem(pod),
        running=status.get("phase") == "Running",
    )


def group_view(sts: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> GroupView:
    meta = sts["metadata"]
    ann = meta.get("annotations") or {}
    last = ann.get(n.ANNOTATION_LAST_RESTART)
    return GroupView(
        index=int(meta["labels"][n.LABEL_GROUP]),
        template_hash=meta["labels"].get(n.LABEL_HASH, ""),
        shards=int((sts.get("spec") or {}).get("replicas") or 0),
        pods=tuple(pod_view(p) for p in members(sts, pods)),
        terminating=bool(meta.get("deletionTimestamp")),
        restarts=int(ann.get(n.ANNOTATION_RESTARTS, "0") or 0),
        last_restart=float(last) if last else None,
    )


def observe(kube: Kube, namespace: str, name: str, uid: str) -> Snapshot:
    """Lists the StatefulSets, pods and Services of InferenceService `name` (uid `uid`)."""
    statefulsets = [s for s in kube.list("StatefulSet", namespace, {n.LABEL_ISVC: name})
                    if owned_by(s, uid) and n.LABEL_GROUP in s["metadata"]["labels"]]
    pods = kube.list("Pod", namespace, n.shard_selector(name))
    services = [s for s in kube.list("Service", namespace, {n.LABEL_ISVC: name})
                if owned_by(s, uid)]
    return Snapshot(
        statefulsets={int(s["metadata"]["labels"][n.LABEL_GROUP]): s for s in statefulsets},
        pods=pods,
        services=services,
        groups=[group_view(s, pods) for s in statefulsets],
    )
