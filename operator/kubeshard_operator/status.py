"""Pure: what the operator observed -> the InferenceService's status.

Phases (status.phase):
  Pending       no shard is running yet (creating, scheduling, or unschedulable)
  Loading       shards run but no group is ready (model loading, rendezvous)
  Ready         at least spec.replicas groups are ready
  Degraded      some, but fewer than spec.replicas, groups are ready
  ScaledToZero  spec.replicas is 0 (the ScaledToZero condition says since when and why)
  Failed        no group is ready and something needs a person: the spec cannot be
                served (conditions say which field), a child cannot be applied, or the
                shards crash or cannot pull their image
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from kubeshard_operator import naming as n
from kubeshard_operator.rollout import GroupView, Plan

# Container states that need a person rather than patience.
FATAL_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile learned, in the shape status needs."""

    generation: int
    replicas: int  # groups wanted: spec.replicas
    current_hash: str
    groups: Sequence[GroupView]
    plan: Plan
    url: Optional[str]
    # Why the reconcile could not do its job (invalid spec, apply refused), if it failed.
    error: Optional[tuple[str, str]] = None  # (reason, message)
    # This pass scaled the InferenceService to zero: (reason, message) of ScaledToZero.
    scaled_to_zero: Optional[tuple[str, str]] = None
    # spec.autoscaling.idleSeconds when it may scale to zero (minReplicas 0), else None.
    idle_seconds: Optional[int] = None


def pod_problem(pod: Mapping[str, Any]) -> Optional[str]:
    """A one-line reason a pod cannot become ready, or None while it just waits."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == "Unschedulable":
            return f"Unschedulable: {cond.get('message', '').strip()}"
    statuses = list(status.get("initContainerStatuses") or ()) + \
        list(status.get("containerStatuses") or ())
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in FATAL_REASONS:
            # a crash loop's own message is the kubelet's back-off ("back-off 5m0s restarting
            # failed container=..."): the run that crashed says why
            crashed = _last_termination(cs) if reason == "CrashLoopBackOff" else None
            detail = crashed or waiting.get("message") or _last_termination(cs) or ""
            return f"{reason}: {detail}".strip().rstrip(":")
    return None


def _last_termination(cs: Mapping[str, Any]) -> Optional[str]:
    term = (cs.get("lastState") or {}).get("terminated") or {}
    if not term:
        return None
    message = (term.get("message") or "").strip().splitlines()
    tail = message[-1] if message else ""
    return f"exit code {term.get('exitCode')} ({term.get('reason', '')}) {tail}".strip()


def phase_of(obs: Observed) -> str:
    live = [g for g in obs.groups if not g.terminating]
    ready = sum(1 for g in live if g.ready)
    problems = [p.problem for g in live for p in g.pods if p.problem]
    if obs.error is not None:
        return "Failed"
    if obs.replicas == 0:
        return "ScaledToZero"
    if ready >= obs.replicas:
        return "Ready"
    if ready > 0:
        return "Degraded"
    if any(not p.startswith("Unschedulable") for p in problems):
        return "Failed"
    if any(p.running for g in live for p in g.pods):
        return "Loading"
    return "Pending"


def _condition(type_: str, ok: bool, reason: str, message: str,
               generation: int) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason,
            "message": message, "observedGeneration": generation}


def conditions_of(obs: Observed) -> list[dict[str, Any]]:
    live = [g for g in obs.groups if not g.terminating]
    ready = sum(1 for g in live if g.ready)
    stale = [g for g in live if g.template_hash != obs.current_hash]
    gen, want = obs.generation, obs.replicas
    out: list[dict[str, Any]] = []

    if obs.error is not None:
        reason, message = obs.error
        out.append(_condition("Reconciled", False, reason, message, gen))
    else:
        out.append(_condition("Reconciled", True, "Applied",
                              "all children match the spec", gen))

    if want == 0:
        out.append(_condition("Ready", False, "ScaledToZero",
                              "spec.replicas is 0; the next request scales it up", gen))
    elif ready >= want and not stale:
        out.append(_condition("Ready", True, "GroupsReady",
                              f"{ready} of {want} groups ready", gen))
    else:
        out.append(_condition("Ready", False, "GroupsNotReady",
                              f"{ready} of {want} groups ready", gen))

    out.append(_condition("Available", ready > 0,
                          "MinimumReplicasAvailable" if ready else "NoReadyGroup",
                          f"{ready} group(s) answer requests", gen))

    if stale:
        out.append(_condition("Progressing", True, "RollingUpdate",
                              f"{len(stale)} group(s) still run an older template", gen))
    elif len(live) != want or not obs.plan.idle:
        action = "ScalingDown" if len(live) > want else "ScalingUp"
        out.append(_condition("Progressing", True, action,
                              f"{len(live)} group(s), scaling to {want}", gen))
    elif ready < want:
        out.append(_condition("Progressing", True, "Loading",
                              f"{want - ready} group(s) loading or restarting", gen))
    else:
        out.append(_condition("Progressing", False, "Complete",
                              "every group runs the current template", gen))

    unschedulable = [p.problem for g in live for p in g.pods
                     if p.problem and p.problem.startswith("Unschedulable")]
    failing = [f"{p.name}: {p.problem}" for g in live for p in g.pods
               if p.problem and not p.problem.startswith("Unschedulable")]
    if unschedulable:
        out.append(_condition("PodsSchedulable", False, "Unschedulable",
                              unschedulable[0][len("Unschedulable: "):], gen))
    else:
        out.append(_condition("PodsSchedulable", True, "Scheduled",
                              "every shard pod has a node", gen))
    if failing:
        out.append(_condition("ShardsHealthy", False, "ShardFailing", failing[0], gen))
    else:
        out.append(_condition("ShardsHealthy", True, "NoFailures",
                              "no shard crashes or fails to start", gen))
    return out


def zero_condition(obs: Observed, old: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """ScaledToZero: True since the InferenceService went to zero, saying why (the idle
    time that made the operator scale it, or a zero set by hand); False while it serves."""
    gen = obs.generation
    if obs.replicas == 0:
        previous = next((c for c in old if c.get("type") == "ScaledToZero"), None)
        if obs.scaled_to_zero is not None:
            reason, message = obs.scaled_to_zero
        elif previous is not None and previous.get("status") == "True":
            reason, message = previous.get("reason", "Idle"), previous.get("message", "")
        else:
            reason, message = "ReplicasZero", "spec.replicas is 0; the next request scales it up"
        return _condition("ScaledToZero", True, reason, message, gen)
    if obs.idle_seconds is not None:
        return _condition("ScaledToZero", False, "Serving",
                          f"scales to zero after {obs.idle_seconds} s without a request", gen)
    return _condition("ScaledToZero", False, "Serving", "spec.autoscaling.minReplicas is not 0", gen)


def merge_conditions(old: Sequence[Mapping[str, Any]], new: Sequence[dict[str, Any]],
                     now: str) -> list[dict[str, Any]]:
    """Keeps lastTransitionTime of conditions whose status did not change."""
    previous = {c.get("type"): c for c in old}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        if before is not None and before.get("status") == cond["status"] \
                and before.get("lastTransitionTime"):
            cond = {**cond, "lastTransitionTime": before["lastTransitionTime"]}
        else:
            cond = {**cond, "lastTransitionTime": now}
        merged.append(cond)
    return merged


def compute_status(obs: Observed, isvc: str, old_status: Mapping[str, Any],
                   now: str) -> dict[str, Any]:
    live = sorted((g for g in obs.groups if not g.terminating), key=lambda g: g.index)
    return {
        "phase": phase_of(obs),
        "observedGeneration": obs.generation,
        "replicas": len(live),
        "readyReplicas": sum(1 for g in live if g.ready),
        "updatedReplicas": sum(1 for g in live if g.template_hash == obs.current_hash),
        "selector": n.selector_string(n.shard_selector(isvc)),
        "url": obs.url,
        "templateHash": obs.current_hash or None,
        "groups": [{
            "name": n.group_name(isvc, g.index),
            "index": g.index,
            "shards": g.shards,
            "readyShards": g.ready_shards,
            "ready": g.ready,
            "current": g.template_hash == obs.current_hash,
        } for g in live],
        "conditions": merge_conditions(
            old_status.get("conditions") or (),
            conditions_of(obs) + [zero_condition(obs, old_status.get("conditions") or ())], now),
    }
