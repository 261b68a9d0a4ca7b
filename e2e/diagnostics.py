"""What a failed e2e test shows of the cluster it ran on (e2e/conftest.py adds it to the
failure's report): every pod and its phase, then for each pod that is not well (a
container not ready, restarted, waiting or terminated with an error) its containers'
states and the last lines of their logs (the previous run's too, after a restart), then
the cluster's latest warning events. On kind in CI, where the cluster is deleted when the
suite ends, this is all that is left to read after a failure.

Everything is read with kubectl against the test's cluster; a read that fails is
reported in place, never raised (it must not hide the failure it describes).
"""

from __future__ import annotations

import json
import subprocess

from e2e.cluster import Cluster, CommandFailed

READ_TIMEOUT = 20  # seconds a kubectl read may take


def _kubectl(cluster: Cluster, *args: str) -> str:
    """kubectl's output, or a line saying why there is none."""
    try:
        out = cluster.kubectl(*args, check=False, timeout=READ_TIMEOUT)
    except (OSError, subprocess.SubprocessError, CommandFailed) as exc:  # CommandFailed: it timed out
        return f"(kubectl {' '.join(args)}: {str(exc).strip()[:500]})"
    if out.returncode != 0:
        return f"(kubectl {' '.join(args)} exited {out.returncode}: {out.stderr.strip()[-500:]})"
    return out.stdout


def container_problem(status: dict) -> str | None:
    """What is wrong with one container (a status of the pod's containerStatuses or
    initContainerStatuses), or None when it runs ready, or ended with exit code 0."""
    state, last = status.get("state") or {}, status.get("lastState") or {}
    restarts = status.get("restartCount", 0)
    said = []
    if "waiting" in state:
        waiting = state["waiting"]
        said.append(f"waiting: {waiting.get('reason', '?')}" + (f" ({waiting['message']})"
                                                                 if waiting.get("message") else ""))
    if "terminated" in state and state["terminated"].get("exitCode", 0) != 0:
        t = state["terminated"]
        said.append(f"terminated: {t.get('reason', '?')}, exit code {t.get('exitCode')}")
    if restarts:
        t = last.get("terminated") or {}
        said.append(f"restarted {restarts}x" + (f", last exit: {t.get('reason', '?')}, exit code {t.get('exitCode')}"
                                                 if t else ""))
    if "running" in state and not status.get("ready", False) and not said:
        said.append("running, not ready")
    return "; ".join(said) or None


def _problems(pod: dict) -> list[tuple[str, str, int]]:
    """(container, what is wrong, its restarts; -1 when it never started, so has no log)
    for each unwell container of a pod, and ("", phase/reason, -1) for a pod that failed
    or is pending with no container status to say why (unschedulable, say)."""
    status = pod.get("status") or {}
    out = []
    for s in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        problem = container_problem(s)
        if problem:
            restarts = s.get("restartCount", 0)
            never_ran = "waiting" in (s.get("state") or {}) and restarts == 0
            out.append((s["name"], problem, -1 if never_ran else restarts))
    if not out and status.get("phase") in ("Failed", "Pending", "Unknown"):
        conditions = "; ".join(f"{c['type']}={c['status']}" + (f" ({c['message']})" if c.get("message") else "")
                               for c in status.get("conditions") or [] if c.get("status") != "True")
        out.append(("", f"phase {status.get('phase')}" + (f": {status['reason']}" if status.get("reason") else "")
                    + (f"; {conditions}" if conditions else ""), -1))
    return out


def cluster_report(cluster: Cluster, *, max_pods: int = 8, log_lines: int = 40, events: int = 30) -> str:
    """The report a failed test carries: see the module docstring. At most ``max_pods``
    unwell pods get details (those of the tests' namespaces before the system's)."""
    parts = ["$ kubectl get pods -A -o wide", _kubectl(cluster, "get", "pods", "-A", "-o", "wide").rstrip()]
    listing = _kubectl(cluster, "get", "pods", "-A", "-o", "json")
    try:
        items = json.loads(listing)["items"]
    except (ValueError, KeyError):
        items = []
        parts.append(listing.strip())
    unwell = [(p, problems) for p in items if (problems := _problems(p))]
    unwell.sort(key=lambda pair: pair[0]["metadata"]["namespace"] in ("kube-system", "local-path-storage"))
    for p, problems in unwell[:max_pods]:
        ns, name = p["metadata"]["namespace"], p["metadata"]["name"]
        parts.append(f"\n--- pod {ns}/{name} on {p.get('spec', {}).get('nodeName') or 'no node'}")
        for container, problem, restarts in problems:
            parts.append(f"{container or '(pod)'}: {problem}")
            if restarts < 0:
                continue
            parts.append(f"  last {log_lines} log lines:")
            parts.append(_kubectl(cluster, "logs", name, "-n", ns, "-c", container, f"--tail={log_lines}").rstrip()
                         or "  (empty)")
            if restarts:
                parts.append(f"  the run before (--previous), last {log_lines} lines:")
                parts.append(_kubectl(cluster, "logs", name, "-n", ns, "-c", container, "--previous",
                                      f"--tail={log_lines}").rstrip() or "  (empty)")
    if len(unwell) > max_pods:
        parts.append(f"\n({len(unwell) - max_pods} more unwell pods not shown)")
    warnings = _kubectl(cluster, "get", "events", "-A", "--field-selector", "type=Warning",
                        "--sort-by=.lastTimestamp").rstrip().splitlines()
    parts.append(f"\n$ kubectl get events -A --field-selector type=Warning (the last {events})")
    parts.extend(warnings[:1] + warnings[1:][-events:] if warnings else ["(none)"])
    return "\n".join(parts)
