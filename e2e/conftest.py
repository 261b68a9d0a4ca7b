"""pytest fixtures for end-to-end tests against a real Kubernetes API server.

Fixture API (a contract: other tests code against it)
----------------------------------------------------

``cluster`` (session scope) -> ``e2e.cluster.Cluster``
    Starts the local cluster once per session (or joins one that is
    already up, e.g. from ``make cluster``; a cluster pytest started is stopped when the
    last session using it ends). If ``KUBESHARD_E2E_KUBECONFIG`` is set, uses that
    cluster instead (kind, or any other) and starts nothing. A cluster this session
    starts has one node, the real kubelet with containerd and runc (see README),
    advertising ``KUBESHARD_CLUSTER_GPUS`` fake ``nvidia.com/gpu`` (default 0).

    cluster.kubeconfig        path (str) of an admin kubeconfig
    cluster.bin_dir           Path of the folder holding kubectl and helm
    cluster.is_local          True for the local cluster
    cluster.local_config      its ClusterConfig, else None
    cluster.kubectl(*args, input=None, check=True, timeout=60) -> subprocess.CompletedProcess
    cluster.helm(*args, check=True, timeout=300)               -> subprocess.CompletedProcess
        text mode, output captured; with check, a non-zero exit raises
        e2e.cluster.CommandFailed (an AssertionError) carrying stdout and stderr.
    cluster.api_client()      -> kubernetes.client.ApiClient as the cluster admin
    cluster.pod_logs(namespace, pod, container=None, *, previous=False) -> str
        the container's log ("" when it has none yet); container defaults to the
        pod's default container.
    cluster.exec(namespace, pod, *argv, container=None, check=True, timeout=60)
        run a command in a running container (kubectl exec).
    cluster.pod_pids(namespace, pod) -> list[int]   (local only) live container pids,
        from the CRI.

``namespace`` (function scope) -> str
    A fresh namespace (``e2e-<test name>-<random>``) whose ``default`` service
    account and ``kube-root-ca.crt`` exist; deleted after the test (not waited for).

A test using ``cluster`` that fails carries the cluster's state in its report (pods,
unwell pods' container states and log tails, warning events: ``e2e.diagnostics``).

Helpers: ``from e2e.waiting import wait_for`` —
``wait_for(fn, timeout, interval=0.5, what="...")`` calls fn until it returns a truthy
value (returned), and on timeout raises AssertionError naming ``what`` and the last
value or exception seen.

On the local cluster, the host reaches pod IPs directly (as a node does), Services are
reachable from pods by DNS name, and pods run as containers of the images hack/images.sh
builds (see README, "Local Kubernetes control plane", for what differs from a real
cluster).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

from e2e.cluster import Cluster
from e2e.cluster.handle import CommandFailed
from e2e.waiting import wait_for


@pytest.fixture(scope="session")
def cluster():
    kubeconfig = os.environ.get("KUBESHARD_E2E_KUBECONFIG")
    if kubeconfig:
        from e2e.cluster.tools import find_bin_dir

        try:
            bin_dir = find_bin_dir(build=False)
        except FileNotFoundError:
            bin_dir = Path("/usr/local/bin")  # kubectl and helm from PATH
        yield Cluster(kubeconfig, bin_dir, is_local=False)
        return
    from e2e.cluster.sharing import acquire, release

    # Sizes apply when this session starts the cluster (a running one is joined as is).
    local, handle = acquire(node_gpus=int(os.environ.get("KUBESHARD_CLUSTER_GPUS", "0")))
    try:
        yield handle
    finally:
        release(local)


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest):
    base = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{base}-{uuid.uuid4().hex[:5]}"
    cluster.kubectl("create", "namespace", name)
    # and its kube-root-ca.crt: a pod made before the controller publishes it waits on a
    # failed mount of its service-account volume, retried with a growing delay
    for kind, obj in (("serviceaccount", "default"), ("configmap", "kube-root-ca.crt")):
        wait_for(lambda: cluster.kubectl("get", kind, obj, "-n", name, check=False).returncode == 0,
                 timeout=60, what=f"the {kind} {obj} of namespace {name}")
    try:
        yield name
    finally:
        try:
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False, timeout=30)
        except CommandFailed:
            pass


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cluster_lifecycle: stops and restarts the local cluster; always runs last")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that takes the session's cluster down must come after every test using it.
    items.sort(key=lambda item: item.get_closest_marker("cluster_lifecycle") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # A test on a cluster that fails carries the cluster's state (e2e/diagnostics.py),
    # read before its namespace is deleted: on kind in CI, nothing else is left after.
    outcome = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("cluster")
    if report.failed and report.when in ("setup", "call") and isinstance(cluster, Cluster):
        from e2e.diagnostics import cluster_report

        report.sections.append(("cluster state at the failure", cluster_report(cluster)))
