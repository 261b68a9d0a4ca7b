"""One reconcile pass of one InferenceService: observe, plan, desired children, apply,
report.

- observe (observe.py): list the children once into a `Snapshot`;
- restart the multi-shard groups whose shard restarted (a group lives and dies whole);
- scale to zero (idle.py): with minReplicas 0, an idle model goes to 0 through /scale;
- plan (rollout.py): which groups to create and delete for spec.replicas;
- desired children (children.py): the steps to apply and delete, pure;
- apply: make those steps, in order;
- report (status.py): write status from what was observed and planned.

Level-triggered and idempotent: each pass reads the object and its children afresh and
converges them on the spec, so a pass interrupted anywhere (operator restart, API error)
is finished by the next one. Children are applied with server-side apply, which restores
anything a person deleted or edited by hand.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from kubeshard_operator import naming as n
from kubeshard_operator.builders import owner_reference, service_url, template_hash
from kubeshard_operator.children import Apply, GroupChange, Step, desired_children
from kubeshard_operator.config import OperatorConfig
from kubeshard_operator.idle import idle_verdict, may_scale_to_zero, parse_iso
from kubeshard_operator.kube import Kube, KubeError
from kubeshard_operator.load import LoadReader
from kubeshard_operator.observe import Snapshot, members, observe
from kubeshard_operator.rollout import GroupView, Plan, needs_group_restart, plan_groups
from kubeshard_operator.spec import InferenceServiceSpec, SpecError, parse_spec
from kubeshard_operator.status import Observed, compute_status

# (body, type "Normal"|"Warning", reason, message) -> None: posts a Kubernetes Event.
EventSink = Callable[[Mapping[str, Any], str, str, str], None]
Logger = logging.Logger | logging.LoggerAdapter


def _now_iso(clock: Callable[[], float]) -> str:
    return dt.datetime.fromtimestamp(clock(), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    def __init__(self, kube: Kube, cfg: OperatorConfig, events: EventSink,
                 clock: Callable[[], float] = time.time, load: Optional[LoadReader] = None):
        self.kube = kube
        self.cfg = cfg
        self.events = events
        self.clock = clock
        # The routers' live load (None: nothing to read it from, so never idle).
        self.load = load

    def reconcile(self, namespace: str, name: str, logger: Logger) -> Optional[str]:
        """Returns the phase written to status, or None if the object is gone/deleting."""
        body = self.kube.get("InferenceService", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        generation = int(body["metadata"].get("generation") or 0)
        try:
            spec = parse_spec(name, namespace, body.get("spec") or {})
        except SpecError as e:
            logger.warning("InferenceService %s/%s cannot be served: %s", namespace, name, e)
            obs = Observed(generation=generation,
                           replicas=int((body.get("spec") or {}).get("replicas") or 0),
                           current_hash="", groups=[], plan=Plan(), url=None,
                           error=("InvalidSpec", str(e)))
            return self._write_status(body, obs)

        current_hash = template_hash(spec, self.cfg)
        seen = observe(self.kube, namespace, name, body["metadata"]["uid"])
        seen = self._restart_broken_groups(body, seen, logger)
        zero = self._scale_to_zero_if_idle(body, spec, logger)
        if zero is not None:
            spec = dataclasses.replace(spec, replicas=0)
        # The groups wanted are spec.replicas, which a person, the HPA, the router's
        # activator (from zero) or the idle check above (to zero) set through /scale.
        plan = plan_groups(spec.replicas, current_hash, seen.groups)
        steps = desired_children(spec, self.cfg, owner_reference(body), seen, plan,
                                 current_hash)
        error: Optional[tuple[str, str]] = None
        try:
            self._apply(spec, steps, body, logger)
        except KubeError as e:
            logger.error("applying the children of %s/%s failed: %s", namespace, name, e)
            error = ("ApplyFailed", e.message or str(e))
        a = spec.autoscaling
        obs = Observed(generation=generation, replicas=spec.replicas,
                       current_hash=current_hash, groups=seen.groups, plan=plan,
                       url=service_url(spec, self.cfg), error=error, scaled_to_zero=zero,
                       idle_seconds=a.idle_seconds if a is not None and a.min_replicas == 0
                       else None)
        return self._write_status(body, obs)

    def _scale_to_zero_if_idle(self, body: Mapping[str, Any], spec: InferenceServiceSpec,
                               logger: Logger) -> Optional[tuple[str, str]]:
        """Sets the InferenceService to 0 through /scale when it has been idle for
        idleSeconds; returns the ScaledToZero condition's (reason, message) if it did.

        The patch carries the resourceVersion this pass read: if the router's activator
        (or the HPA, or a person) changed the replicas since, the API server refuses it
        and the next pass decides again on fresh counts."""
        if self.load is None or not may_scale_to_zero(spec.autoscaling, spec.replicas):
            return None
        conditions = {c.get("type"): c for c in (body.get("status") or {}).get("conditions") or ()}
        available = conditions.get("Available") or {}
        since = parse_iso(available.get("lastTransitionTime")) \
            if available.get("status") == "True" else None
        load = self.load.read(spec.name)
        why = idle_verdict(spec.autoscaling, spec.replicas, load, since, self.clock())
        if why is None:
            return None
        meta = body["metadata"]
        try:
            self.kube.merge_patch("InferenceService", spec.namespace, spec.name,
                                  {"metadata": {"resourceVersion": meta.get("resourceVersion")},
                                   "spec": {"replicas": 0}}, subresource="scale")
        except KubeError as e:
            if e.status == 409:
                logger.info("%s/%s changed while scaling it to zero; deciding again next pass",
                            spec.namespace, spec.name)
            else:
                logger.error("scaling %s/%s to zero failed: %s", spec.namespace, spec.name, e)
            return None
        message = f"scaled {spec.namespace}/{spec.name} to zero: {why}"
        logger.info(message)
        self.events(body, "Normal", "ScaledToZero", message)
        return ("Idle", why)

    # -- steps ---------------------------------------------------------------------------

    def _apply(self, spec: InferenceServiceSpec, steps: Sequence[Step],
               body: Mapping[str, Any], logger: Logger) -> None:
        for step in steps:
            if isinstance(step, Apply):
                self.kube.apply(step.manifest)
            else:
                self.kube.delete(step.kind, spec.namespace, step.name,
                                 propagation=step.propagation, uid=step.uid)
            if step.done is not None:
                self._announce(spec, step.done, body, logger)

    def _announce(self, spec: InferenceServiceSpec, change: GroupChange,
                  body: Mapping[str, Any], logger: Logger) -> None:
        logger.info("%s group %s of %s/%s", change.action, change.index, spec.namespace,
                    spec.name)
        self.events(body, "Normal", change.reason, f"{change.action} group {change.name}")

    def _restart_broken_groups(self, body: Mapping[str, Any], seen: Snapshot,
                               logger: Logger) -> Snapshot:
        """Deletes every pod of a multi-shard group whose shard restarted (with backoff);
        returns the snapshot with those groups not ready."""
        now = self.clock()
        groups: list[GroupView] = []
        for g in seen.groups:
            sts = seen.statefulsets[g.index]
            if g.ready and g.restarts:
                # Healthy again: the next failure starts the backoff from the bottom.
                self._annotate(sts, {n.ANNOTATION_RESTARTS: "0"})
            if not needs_group_restart(g, now, self.cfg.group_restart_backoff_min,
                                       self.cfg.group_restart_backoff_max):
                groups.append(g)
                continue
            for pod in members(sts, seen.pods):
                if not pod["metadata"].get("deletionTimestamp"):
                    self.kube.delete("Pod", sts["metadata"]["namespace"],
                                     pod["metadata"]["name"], uid=pod["metadata"]["uid"])
            restarts = g.restarts + 1
            self._annotate(sts, {n.ANNOTATION_RESTARTS: str(restarts),
                                 n.ANNOTATION_LAST_RESTART: f"{now:.0f}"})
            message = (f"a shard of group {sts['metadata']['name']} restarted; restarting "
                       f"all {g.shards} shards together (restart {restarts})")
            logger.warning(message)
            self.events(body, "Warning", "GroupRestarted", message)
            # The group is not ready from here on, whatever the stale pod list says.
            groups.append(dataclasses.replace(g, pods=(), restarts=restarts,
                                              last_restart=now))
        return dataclasses.replace(seen, groups=groups)

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
