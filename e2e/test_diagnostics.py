"""The cluster report a failed e2e test carries (e2e/diagnostics.py), read from real pods
on the real node: one crashing, one that no node takes, one well."""

from __future__ import annotations

import pytest

from e2e import diagnostics
from e2e.cluster import Cluster
from e2e.diagnostics import cluster_report, container_problem
from e2e.kube import apply, get, pod
from e2e.waiting import wait_for

pytestmark = pytest.mark.e2e


def test_the_report_names_unwell_pods_with_their_logs_and_events(cluster: Cluster, namespace: str):
    apply(cluster, namespace,
          pod("crash", """
              containers:
              - name: main
                image: busybox:1.36
                command: [sh, -c, "echo crash-marker-$((6 * 7)); exit 3"]
          """),
          pod("stuck", """
              nodeSelector: {kubeshard.test/no-such-node: "true"}
              containers: [{name: main, image: busybox:1.36, command: [sleep, "3600"]}]
          """),
          pod("fine", """
              terminationGracePeriodSeconds: 1
              containers: [{name: main, image: busybox:1.36, command: [sleep, "3600"]}]
          """))

    def restarted():
        statuses = get(cluster, namespace, "pod", "crash")["status"].get("containerStatuses") or []
        return statuses and statuses[0].get("restartCount", 0) >= 1

    wait_for(restarted, timeout=90, what="the crashing pod's first restart")
    wait_for(lambda: get(cluster, namespace, "pod", "fine")["status"].get("phase") == "Running", timeout=60,
             what="the well pod running")
    report = cluster_report(cluster)

    crash = report.split(f"--- pod {namespace}/crash", 1)[1].split("\n--- pod", 1)[0]
    assert "main:" in crash and "exit code 3" in crash and "restarted" in crash, crash
    assert "crash-marker-42" in crash, crash  # its log (this run's or the one before)
    stuck = report.split(f"--- pod {namespace}/stuck", 1)[1].split("\n--- pod", 1)[0]
    assert "phase Pending" in stuck and "PodScheduled=False" in stuck, stuck
    assert f"--- pod {namespace}/fine" not in report  # listed, not detailed
    assert "fine" in report.split("\n--- pod", 1)[0]
    assert "FailedScheduling" in report  # the warning events


def test_a_container_that_ran_well_is_no_problem():
    assert container_problem({"name": "m", "ready": True, "restartCount": 0, "state": {"running": {}}}) is None
    assert container_problem({"name": "m", "ready": False, "restartCount": 0,
                              "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}) is None
    assert container_problem({"name": "m", "ready": False, "restartCount": 0, "state": {"running": {}}}) \
        == "running, not ready"
    assert container_problem({"name": "m", "ready": False, "restartCount": 2,
                              "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                              "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}) \
        == "waiting: CrashLoopBackOff; restarted 2x, last exit: OOMKilled, exit code 137"


def test_a_kubectl_read_that_times_out_becomes_a_line_not_an_exception(cluster: Cluster, monkeypatch):
    # the report runs inside pytest's report hook: an exception there would replace the
    # failure it describes with an internal error
    monkeypatch.setattr(diagnostics, "READ_TIMEOUT", 0.001)
    report = cluster_report(cluster)
    assert "$ kubectl get pods -A -o wide" in report
    assert "did not finish within" in report, report
