"""One reconcile pass of one InferenceService: observe, plan, apply, report.

Level-triggered and idempotent: each pass reads the object and its children afresh and
converges them on the spec, so a pass interrupted anywhere (operator restart, API error)
is finished by the next one. Children are applied with server-side apply, which restores
anything a person deleted or edited by hand.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any, Callable, Mapping, Optional

from kubeshard_operator import naming as n
from kubeshard_operator.builders import (
    build_headless_service, build_hpa, build_leader_service, build_pdb, build_statefulset,
    owner_reference, service_url, template_hash,
)
from kubeshard_operator.config import OperatorConfig
from kubeshard_operator.kube import Kube, KubeError
from kubeshard_operator.rollout import GroupView, Plan, PodView, needs_group_restart, plan_groups
from kubeshard_operator.spec import InferenceServiceSpec, SpecError, parse_spec
from kubeshard_operator.status import Observed, compute_status, pod_problem

# (body, type "Normal"|"Warning", reason, message) -> None: posts a Kubernetes Event.
EventSink = Callable[[Mapping[str, Any], str, str, str], None]


def _now_iso(clock: Callable[[], float]) -> str:
    return dt.datetime.fromtimestamp(clock(), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller")
               for ref in obj["metadata"].get("ownerReferences") or ())


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


def group_view(sts: Mapping[str, Any], pods: list[Mapping[str, Any]]) -> GroupView:
    meta = sts["metadata"]
    ann = meta.get("annotations") or {}
    last = ann.get(n.ANNOTATION_LAST_RESTART)
    owned = [p for p in pods if any(ref.get("uid") == meta["uid"]
                                    for ref in p["metadata"].get("ownerReferences") or ())]
    return GroupView(
        index=int(meta["labels"][n.LABEL_GROUP]),
        template_hash=meta["labels"].get(n.LABEL_HASH, ""),
        shards=int((sts.get("spec") or {}).get("replicas") or 0),
        pods=tuple(pod_view(p) for p in owned),
        terminating=bool(meta.get("deletionTimestamp")),
        restarts=int(ann.get(n.ANNOTATION_RESTARTS, "0") or 0),
        last_restart=float(last) if last else None,
    )


class Reconciler:
    def __init__(self, kube: Kube, cfg: OperatorConfig, events: EventSink,
                 clock: Callable[[], float] = time.time):
        self.kube = kube
        self.cfg = cfg
        self.events = events
        self.clock = clock

    def reconcile(self, namespace: str, name: str,
                  logger: logging.Logger | logging.LoggerAdapter) -> Optional[str]:
        """Returns the phase written to status, or None if the object is gone/deleting."""
        body = self.kube.get("InferenceService", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        generation = int(body["metadata"].get("generation") or 0)
        try:
            spec = parse_spec(name, namespace, body.get("spec") or {})
        except SpecError as e:
            logger.warning("InferenceService %s/%s cannot be served: %s", namespace, name, e)
            obs = Observed(generation, int((body.get("spec") or {}).get("replicas") or 0),
                           "", [], Plan(), None, ("InvalidSpec", str(e)))
            return self._write_status(body, obs)

        current_hash = template_hash(spec, self.cfg)
        uid = body["metadata"]["uid"]
        owner = owner_reference(body)
        statefulsets = [s for s in self.kube.list("StatefulSet", namespace,
                                                  {n.LABEL_ISVC: name})
                        if _owned_by(s, uid) and n.LABEL_GROUP in s["metadata"]["labels"]]
        pods = self.kube.list("Pod", namespace, n.shard_selector(name))
        groups = [group_view(s, pods) for s in statefulsets]
        by_index = {int(s["metadata"]["labels"][n.LABEL_GROUP]): s for s in statefulsets}

        self._restart_broken_groups(body, groups, by_index, pods, logger)
        plan = plan_groups(spec.replicas, current_hash, groups)
        error: Optional[tuple[str, str]] = None
        try:
            self._apply(spec, owner, current_hash, groups, plan, by_index, body, logger)
        except KubeError as e:
            logger.error("applying the children of %s/%s failed: %s", namespace, name, e)
            error = ("ApplyFailed", e.message or str(e))
        obs = Observed(generation, spec.replicas, current_hash, groups, plan,
                       service_url(spec, self.cfg), error)
        return self._write_status(body, obs)

    # -- steps ---------------------------------------------------------------------------

    def _apply(self, spec: InferenceServiceSpec, owner: dict, current_hash: str,
               groups: list[GroupView], plan, by_index: dict, body, logger) -> None:
        ns = spec.namespace
        self.kube.apply(build_leader_service(spec, owner))
        self.kube.apply(build_pdb(spec, owner))
        hpa = build_hpa(spec, owner)
        if hpa is not None:
            self.kube.apply(hpa)
        else:
            self.kube.delete("HorizontalPodAutoscaler", ns, spec.name)

        doomed = set(plan.delete)
        for index in plan.delete:
            sts = by_index[index]
            # Foreground: the StatefulSet stays (terminating) until its pods are gone, so
            # its index is not reused while old pods still hold their names.
            self.kube.delete("StatefulSet", ns, sts["metadata"]["name"],
                             propagation="Foreground", uid=sts["metadata"]["uid"])
            self.kube.delete("Service", ns, n.group_name(spec.name, index))
            logger.info("removed group %s of %s/%s", index, ns, spec.name)
            self.events(body, "Normal", "GroupRemoved",
                        f"removed group {n.group_name(spec.name, index)}")
        keep = [g for g in groups if not g.terminating and g.index not in doomed]
        for g in keep:
            self.kube.apply(build_headless_service(spec, g.index, owner))
            if g.template_hash == current_hash:
                # Re-applying the same template repairs hand edits; stale groups are left
                # as they are until the rollout replaces them.
                self.kube.apply(build_statefulset(spec, self.cfg, g.index, owner, current_hash))
        for index in plan.create:
            self.kube.apply(build_headless_service(spec, index, owner))
            self.kube.apply(build_statefulset(spec, self.cfg, index, owner, current_hash))
            logger.info("created group %s of %s/%s", index, ns, spec.name)
            self.events(body, "Normal", "GroupCreated",
                        f"created group {n.group_name(spec.name, index)}")

        # Headless Services whose group is gone (a StatefulSet deleted outside a plan).
        wanted = {g.index for g in keep} | set(plan.create) | \
            {g.index for g in groups if g.terminating}
        for svc in self.kube.list("Service", ns, {n.LABEL_ISVC: spec.name}):
            group = svc["metadata"]["labels"].get(n.LABEL_GROUP)
            if group is not None and int(group) not in wanted and \
                    _owned_by(svc, owner["uid"]):
                self.kube.delete("Service", ns, svc["metadata"]["name"])

    def _restart_broken_groups(self, body, groups: list[GroupView], by_index: dict,
                               pods: list[dict], logger) -> None:
        now = self.clock()
        for i, g in enumerate(groups):
            sts = by_index[g.index]
            if g.ready and g.restarts:
                # Healthy again: the next failure starts the backoff from the bottom.
                self._annotate(sts, {n.ANNOTATION_RESTARTS: "0"})
            if not needs_group_restart(g, now, self.cfg.group_restart_backoff_min,
                                       self.cfg.group_restart_backoff_max):
                continue
            uid = sts["metadata"]["uid"]
            members = [p for p in pods if any(r.get("uid") == uid for r in
                                              p["metadata"].get("ownerReferences") or ())]
            for pod in members:
                if not pod["metadata"].get("deletionTimestamp"):
                    self.kube.delete("Pod", sts["metadata"]["namespace"],
                                     pod["metadata"]["name"], uid=pod["metadata"]["uid"])
            self._annotate(sts, {n.ANNOTATION_RESTARTS: str(g.restarts + 1),
                                 n.ANNOTATION_LAST_RESTART: f"{now:.0f}"})
            message = (f"a shard of group {sts['metadata']['name']} restarted; restarting "
                       f"all {g.shards} shards together (restart {g.restarts + 1})")
            logger.warning(message)
            self.events(body, "Warning", "GroupRestarted", message)
            # The group is not ready from here on, whatever the stale pod list says.
            groups[i] = GroupView(g.index, g.template_hash, g.shards,
                                  (), False,
                                  g.restarts + 1, now)

    def _annotate(self, sts: Mapping[str, Any], annotations: dict[str, str]) -> None:
        meta = sts["metadata"]
        self.kube.merge_patch("StatefulSet", meta["namespace"], meta["name"],
                              {"metadata": {"annotations": annotations}})

    def _write_status(self, body: Mapping[str, Any], obs: Observed) -> str:
        old = body.get("status") or {}
        new = compute_status(obs, body["metadata"]["name"], old, _now_iso(self.clock))
        new = {k: v for k, v in new.items() if v is not None}
        if any(old.get(k) != v for k, v in new.items()):
            self.kube.merge_patch("InferenceService", body["metadata"]["namespace"],
                                  body["metadata"]["name"], {"status": new},
                                  subresource="status")
        return new["phase"]

