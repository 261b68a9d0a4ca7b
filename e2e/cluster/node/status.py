"""Pod status (phase, conditions, IPs, container statuses) from the pod worker's state."""

from __future__ import annotations

from typing import Any

from .container import Container, now_iso


def phase(init: list[Container], main: list[Container], failed_init: bool, started: bool) -> str:
    if failed_init:
        return "Failed"
    if not started or not all(c.done for c in init):
        return "Pending"
    if main and all(c.done for c in main):
        ok = all(c.run is not None and c.run.exit_code == 0 for c in main)
        return "Succeeded" if ok else "Failed"
    if any(c.run is not None or c.last is not None for c in main):
        return "Running"
    return "Pending"


def _condition(kind: str, ok: bool, reason: str | None, since: dict[str, tuple[bool, str]]) -> dict:
    # lastTransitionTime changes only when the status flips.
    prev = since.get(kind)
    if prev is None or prev[0] != ok:
        since[kind] = (ok, now_iso())
    cond = {"type": kind, "status": "True" if ok else "False", "lastProbeTime": None,
            "lastTransitionTime": since[kind][1]}
    if reason and not ok:
        cond["reason"] = reason
    return cond


def build(pod: dict[str, Any], *, init: list[Container], main: list[Container], pod_ip: str | None,
          host_ip: str, start_time: str, sandbox_ready: bool, failed_init: bool,
          transitions: dict[str, tuple[bool, str]], image_ids: dict[str, str]) -> dict[str, Any]:
    ph = phase(init, main, failed_init, sandbox_ready)
    initialized = all(c.done for c in init) and not failed_init
    containers_ready = initialized and all(
        c.ready and c.run is not None and c.run.exit_code is None for c in main)
    gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
    gate_status = {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions") or []}
    ready = containers_ready and all(gate_status.get(g) == "True" for g in gates)
    if ph in ("Succeeded", "Failed"):
        ready = containers_ready = False
    not_ready = [c.name for c in main if not c.ready]
    conditions = [
        _condition("PodReadyToStartContainers", sandbox_ready, None, transitions),
        _condition("Initialized", initialized, "ContainersNotInitialized", transitions),
        _condition("ContainersReady", containers_ready, "ContainersNotReady", transitions),
        _condition("Ready", ready, "ContainersNotReady", transitions),
    ]
    if not containers_ready and not_ready:
        conditions[2]["message"] = conditions[3]["message"] = (
            f"containers with unready status: [{' '.join(not_ready)}]")
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond["type"] == "PodScheduled":
            conditions.append(cond)
    status: dict[str, Any] = {
        "phase": ph,
        "conditions": conditions,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "startTime": start_time,
        "initContainerStatuses": [c.status(image_ids.get(c.name, "")) for c in init] or None,
        "containerStatuses": [c.status(image_ids.get(c.name, "")) for c in main],
    }
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    if status["initContainerStatuses"] is None:
        del status["initContainerStatuses"]
    return status
