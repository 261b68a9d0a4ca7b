"""The operator on the real control plane, installed by the chart with its own RBAC.

The tests after `test_tiny_becomes_ready` share one single-shard InferenceService
(`tiny`) and run in file order: scaling, drift repair, a rolling update, an operator
restart, then deletion. Sharing it keeps the suite's runtime modest on two cores.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis

from e2e.operator.conftest import (
    apply, groups, inference_service, isvc, kubectl_json, pod_ready, wait_phase,
)
from e2e.waiting import wait_for

pytestmark = pytest.mark.e2e


# -- the install --------------------------------------------------------------------------


def test_operator_and_router_run_with_the_charts_rbac(cluster, kubeshard):
    ns, full = kubeshard.namespace, kubeshard.fullname
    operators = kubeshard.pods("operator")
    routers = kubeshard.pods("router")
    assert len(operators) == 2 and all(pod_ready(p) for p in operators)
    assert len(routers) == 1 and all(pod_ready(p) for p in routers)
    assert {p["spec"]["serviceAccountName"] for p in operators} == {f"{full}-operator"}
    assert {p["spec"]["serviceAccountName"] for p in routers} == {f"{full}-router"}

    def can(sa: str, *args: str) -> bool:
        out = cluster.kubectl("auth", "can-i", *args,
                              f"--as=system:serviceaccount:{ns}:{full}-{sa}", check=False)
        return out.stdout.strip() == "yes"

    # What each one needs ...
    assert can("operator", "patch", "statefulsets.apps", "-n", "default")
    assert can("operator", "delete", "pods", "-n", "default")
    assert can("operator", "patch", "inferenceservices.kubeshard.io/status", "-n", "default")
    assert can("router", "watch", "inferenceservices.kubeshard.io", "-A")
    assert can("router", "list", "endpointslices.discovery.k8s.io", "-A")
    # ... and nothing more.
    assert not can("operator", "get", "secrets", "-n", ns)
    assert not can("operator", "create", "deployments.apps", "-n", "default")
    assert not can("operator", "delete", "inferenceservices.kubeshard.io", "-n", "default")
    assert not can("router", "list", "pods", "-A")
    assert not can("router", "get", "secrets", "-n", ns)
    assert not can("router", "patch", "inferenceservices.kubeshard.io", "-n", "default")


def test_only_one_operator_replica_acts(cluster, kubeshard):
    def both_peers():
        # each replica announces itself in the peering object soon after it starts
        peering = kubectl_json(cluster, "get", "clusterkopfpeering", kubeshard.component("operator"))
        status = peering.get("status") or {}
        return status if len(status) == 2 else None

    peers = wait_for(both_peers, 60, what="both operator replicas in the peering object")
    assert len({p["priority"] for p in peers.values()}) == 2  # no tie: one wins

    def acting():
        """Which operator pods act now. With mandatory peering kopf starts paused and
        logs "Resuming operations" once it is the highest-priority peer; a pod that was
        acting and then sees a higher peer logs "Pausing operations in favour of". A
        standby that starts second stays paused without a word, so count the resumes."""
        states = []
        for pod in kubeshard.pods("operator"):
            log = cluster.pod_logs(kubeshard.namespace, pod["metadata"]["name"])
            states.append(log.rfind("Resuming operations") > log.rfind("Pausing operations in favour of"))
        return states if len(states) == 2 and sum(states) == 1 else None

    assert wait_for(acting, 60, what="exactly one operator pod acting")
    time.sleep(5)
    assert acting(), "the acting operator pod changed or a second one started acting"


# -- admission ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, message", [
    ({"sharding": {"shards": 0}}, "spec.sharding.shards must be at least 1"),
    ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
     "spec.autoscaling.minReplicas must be less than or equal to spec.autoscaling.maxReplicas"),
    ({"sharding": {"strategy": "pipeline"}}, 'supported values: "tensor", "zero3"'),
    ({"model": None}, "spec.model.source is required"),
    ({"resources": {"memory": "-1Gi"}}, "spec.resources.memory must be a non-negative quantity"),
    ({"resources": {"cpu": -2}}, "spec.resources.cpu must be a non-negative quantity"),
    ({"resources": {"gpu": -1}}, "spec.resources.gpu must not be negative"),
    ({"cache": {"activations": {"urlSecretRef": {"key": "url"}}}},
     "spec.cache.activations.urlSecretRef.name: Required value"),
    ({"cache": {"activations": {"urlSecretRef": {"name": "Team_Redis"}}}},
     "spec.cache.activations.urlSecretRef.name in body should match"),
    ({"model": {"source": "/models/m", "adapterRoot": "loras"}},
     "spec.model.adapterRoot must be pvc://CLAIM/PATH, file:///ABS/PATH or an absolute host path"),
], ids=["shards-0", "min-over-max", "unknown-strategy", "no-model", "negative-memory",
        "negative-cpu", "negative-gpu", "url-secret-without-name", "url-secret-bad-name",
        "adapter-root-relative"])
def test_bad_specs_are_refused_with_a_clear_message(cluster, kubeshard, namespace, spec,
                                                    message, tmp_path):
    body = inference_service("bad", namespace, tmp_path)
    for key, value in spec.items():
        if value is None:
            body["spec"].pop(key)
        else:
            body["spec"][key] = value
    out = apply(cluster, body, check=False)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert isvc(cluster, namespace, "bad") is None


def test_an_unsatisfiable_spec_is_reported_in_conditions(cluster, kubeshard, namespace,
                                                         demo_model_dir):
    """No node has 64 GPUs: the operator reports it and keeps running (no crash loop)."""
    apply(cluster, inference_service("greedy", namespace, demo_model_dir,
                                     resources={"cpu": "100m", "memory": "64Mi", "gpu": 64}))
    try:
        def reported():
            status = (isvc(cluster, namespace, "greedy") or {}).get("status") or {}
            conds = {c["type"]: c for c in status.get("conditions") or ()}
            c = conds.get("PodsSchedulable")
            return c if c and c["status"] == "False" else None

        cond = wait_for(reported, 120, what="PodsSchedulable=False on greedy")
        assert cond["reason"] == "Unschedulable"
        assert "nvidia.com/gpu" in cond["message"]
        assert isvc(cluster, namespace, "greedy")["status"]["phase"] == "Pending"
        assert all(pod_ready(p) for p in kubeshard.pods("operator"))
        restarts = [c["restartCount"] for p in kubeshard.pods("operator")
                    for c in p["status"]["containerStatuses"]]
        assert restarts == [0, 0]
    finally:
        cluster.kubectl("-n", namespace, "delete", "inferenceservice", "greedy",
                        "--timeout=120s", check=False, timeout=150)


# -- a sharded model, end to end -------------------------------------------------------------

STREAM_CLIENT = r"""
import json, sys, urllib.request
url, body = sys.argv[1], json.dumps({"inputs": "The capital of France is",
                                     "parameters": {"max_new_tokens": 8}}).encode()
req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
tokens = 0
with urllib.request.urlopen(req, timeout=60) as resp:
    for line in resp:
        line = line.decode().strip()
        if line.startswith("data:"):
            event = json.loads(line[5:])
            print(json.dumps(event), flush=True)
            tokens += event.get("token") is not None
sys.exit(0 if tokens else 3)
"""


def stream_through_router(cluster, namespace: str, url: str) -> list[dict]:
    """POSTs to the router's Service from a pod (Service DNS, as a client would)."""
    pod = f"client-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("-n", namespace, "run", pod, "--image=python:3.12", "--restart=Never",
                    "--command", "--", "python3", "-c", STREAM_CLIENT, url)

    def finished():
        obj = kubectl_json(cluster, "-n", namespace, "get", "pod", pod)
        return obj["status"].get("phase") in ("Succeeded", "Failed") and obj

    obj = wait_for(finished, 120, what=f"client pod {pod} to finish")
    logs = cluster.pod_logs(namespace, pod)
    assert obj["status"]["phase"] == "Succeeded", logs
    return [json.loads(line) for line in logs.splitlines() if line.startswith("{")]


def test_two_shards_become_ready_and_stream_through_the_router(cluster, kubeshard, namespace,
                                                               demo_model_dir):
    # a quarter CPU each: on kind (`make kind-smoke`) the node's 2 CPUs also hold the
    # requests of the control plane's pods, and two half-CPU shards would not fit
    apply(cluster, inference_service("sharded", namespace, demo_model_dir,
                                     sharding={"shards": 2, "strategy": "tensor"},
                                     resources={"cpu": "250m", "memory": "1Gi"}))
    try:
        check_sharded(cluster, kubeshard, namespace, demo_model_dir)
    finally:
        cluster.kubectl("-n", namespace, "delete", "inferenceservice", "sharded",
                        "--timeout=120s", check=False, timeout=150)


def check_sharded(cluster, kubeshard, namespace, demo_model_dir):
    obj = wait_phase(cluster, namespace, "sharded", "Ready", 1, timeout=300)
    status = obj["status"]
    assert status["replicas"] == 1 and status["groups"][0]["readyShards"] == 2
    assert status["url"] == f"{kubeshard.router_url}/models/sharded"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    sts = groups(cluster, namespace, "sharded")[0]
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["podManagementPolicy"] == "Parallel"

    table = cluster.kubectl("-n", namespace, "get", "infsvc", "sharded").stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "SHARDS", "REPLICAS", "READY", "PHASE",
                                "URL", "AGE"]
    row = table[1].split()
    assert row[:2] == ["sharded", f"file://{demo_model_dir}"]
    assert row[2:6] == ["2", "1", "1", "Ready"] and row[6] == status["url"]

    events = stream_through_router(cluster, namespace,
                                   f"{kubeshard.router_url}/models/sharded/generate_stream")
    tokens = [e for e in events if e.get("token")]
    assert len(tokens) >= 1
    assert events[-1].get("generated_text") is not None  # TGI's last event carries the text

    check_group_restarts_as_a_whole(cluster, namespace)


def check_group_restarts_as_a_whole(cluster, namespace):
    """A rank that dies takes its group with it: both pods are recreated, not just the
    dead rank's container restarted in place."""
    def shard_pods():
        items = kubectl_json(cluster, "-n", namespace, "get", "pods",
                             "-l", "kubeshard.io/inference-service=sharded")["items"]
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in items
                if not p["metadata"].get("deletionTimestamp")}

    before = shard_pods()
    assert sorted(before) == ["sharded-g0-0", "sharded-g0-1"]
    assert cluster.kill_pod(namespace, "sharded-g0-1") >= 1

    def both_replaced():
        now = shard_pods()
        return len(now) == 2 and set(now.values()).isdisjoint(before.values()) and now

    wait_for(both_replaced, 120, what="both shards of the group to be recreated")
    events = kubectl_json(cluster, "-n", namespace, "get", "events",
                          "--field-selector", "involvedObject.name=sharded")["items"]
    assert any(e["reason"] == "GroupRestarted" for e in events)
    wait_phase(cluster, namespace, "sharded", "Ready", 1, timeout=300)


# -- one InferenceService through its life ---------------------------------------------------


@pytest.fixture(scope="module")
def life(cluster, kubeshard, demo_model_dir):
    """A namespace with the single-shard `tiny`, shared by the ordered tests below."""
    namespace = f"life-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    apply(cluster, inference_service("tiny", namespace, demo_model_dir))
    yield namespace
    cluster.kubectl("-n", namespace, "delete", "inferenceservices", "--all", "--timeout=120s",
                    check=False, timeout=150)
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def scale(cluster, namespace: str, replicas: int) -> None:
    cluster.kubectl("-n", namespace, "scale", "inferenceservice", "tiny",
                    f"--replicas={replicas}")


def test_tiny_becomes_ready(cluster, life):
    obj = wait_phase(cluster, life, "tiny", "Ready", 1)
    assert sorted(groups(cluster, life, "tiny")) == [0]
    for kind, name in [("service", "tiny"), ("service", "tiny-g0"),
                       ("poddisruptionbudget", "tiny")]:
        child = kubectl_json(cluster, "-n", life, "get", kind, name)
        owner = child["metadata"]["ownerReferences"][0]
        assert owner["uid"] == obj["metadata"]["uid"] and owner["controller"] is True
    leader = kubectl_json(cluster, "-n", life, "get", "service", "tiny")
    assert leader["metadata"]["labels"]["kubeshard.io/role"] == "leader"


def test_kubectl_scale_adds_a_group_and_removes_the_higher_one(cluster, life):
    scale(cluster, life, 2)
    obj = wait_phase(cluster, life, "tiny", "Ready", 2)
    assert sorted(g["index"] for g in obj["status"]["groups"]) == [0, 1]
    assert all(g["ready"] for g in obj["status"]["groups"])
    slices = kubectl_json(cluster, "-n", life, "get", "endpointslices",
                          "-l", "kubernetes.io/service-name=tiny")["items"]
    ready = [e for s in slices for e in s.get("endpoints") or ()
             if (e.get("conditions") or {}).get("ready")]
    assert len(ready) == 2  # one leader per group behind the leader Service

    scale(cluster, life, 1)
    wait_for(lambda: sorted(groups(cluster, life, "tiny")) == [0], 120,
             what="group 1 to be removed")
    assert wait_phase(cluster, life, "tiny", "Ready", 1)["status"]["replicas"] == 1


def test_deleted_children_are_restored(cluster, life):
    before = {kind: kubectl_json(cluster, "-n", life, "get", kind, name)["metadata"]["uid"]
              for kind, name in [("statefulset", "tiny-g0"), ("service", "tiny"),
                                 ("service", "tiny-g0"), ("poddisruptionbudget", "tiny")]}
    cluster.kubectl("-n", life, "delete", "statefulset", "tiny-g0", "--wait=false")
    cluster.kubectl("-n", life, "delete", "service", "tiny", "tiny-g0")
    cluster.kubectl("-n", life, "delete", "poddisruptionbudget", "tiny")

    def restored():
        now = {}
        for kind, name in [("statefulset", "tiny-g0"), ("service", "tiny"),
                           ("service", "tiny-g0"), ("poddisruptionbudget", "tiny")]:
            out = cluster.kubectl("-n", life, "get", kind, name, "-o", "json", check=False)
            if out.returncode != 0:
                return None
            meta = json.loads(out.stdout)["metadata"]
            if meta.get("deletionTimestamp"):
                return None
            now[kind + "/" + name] = meta["uid"]
        return now

    now = wait_for(restored, 60, what="the deleted children to come back")
    assert set(now.values()).isdisjoint(before.values())  # new objects, same names
    # A hand edit is reverted as well (server-side apply owns the field).
    cluster.kubectl("-n", life, "patch", "service", "tiny", "--type=merge",
                    "-p", '{"spec":{"selector":{"kubeshard.io/group":"9"}}}')
    wait_for(lambda: "kubeshard.io/group" not in kubectl_json(
        cluster, "-n", life, "get", "service", "tiny")["spec"]["selector"], 60,
        what="the leader Service selector to be repaired")
    wait_phase(cluster, life, "tiny", "Ready", 1)


def leader_endpoints(cluster, namespace: str) -> int:
    slices = kubectl_json(cluster, "-n", namespace, "get", "endpointslices",
                          "-l", "kubernetes.io/service-name=tiny")["items"]
    return sum(1 for s in slices for e in s.get("endpoints") or ()
               if (e.get("conditions") or {}).get("ready"))


def test_engine_limit_change_rolls_groups_one_by_one(cluster, life):
    scale(cluster, life, 2)
    before = wait_phase(cluster, life, "tiny", "Ready", 2)
    old_hash = before["status"]["templateHash"]
    cluster.kubectl("-n", life, "patch", "inferenceservice", "tiny", "--type=merge",
                    "-p", '{"spec":{"engine":{"maxTotalTokens":200}}}')
    min_ready, max_groups, seen = 99, 0, set()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        obj = isvc(cluster, life, "tiny")
        status = obj.get("status") or {}
        live = groups(cluster, life, "tiny")
        seen |= set(live)
        max_groups = max(max_groups, len(live))
        min_ready = min(min_ready, leader_endpoints(cluster, life))
        if status.get("observedGeneration") == obj["metadata"]["generation"] and \
                status.get("phase") == "Ready" and status.get("readyReplicas") == 2 and \
                status.get("updatedReplicas") == 2 and len(live) == 2 and \
                status.get("templateHash") != old_hash:
            break
        time.sleep(0.3)
    else:
        pytest.fail(f"the rollout did not finish; last status {status}")
    assert min_ready >= 1, "ready replicas reached zero during the rollout"
    assert max_groups <= 3, "more than one surge group at a time"
    assert len(seen) == 4  # two old groups, two new ones, replaced one at a time
    for sts in groups(cluster, life, "tiny").values():
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--max-total-tokens") + 1] == "200"


def test_operator_restarted_mid_reconcile_converges(cluster, kubeshard, life):
    before = {i: s["metadata"]["uid"] for i, s in groups(cluster, life, "tiny").items()}
    assert len(before) == 2
    old_pods = {p["metadata"]["name"] for p in kubeshard.pods("operator")}
    scale(cluster, life, 3)
    # Kill the operators while they act on the change.
    time.sleep(0.5)
    cluster.kubectl("-n", kubeshard.namespace, "delete", "pods", "--wait=false",
                    "-l", "app.kubernetes.io/component=operator")

    def replaced():
        pods = kubeshard.pods("operator")
        fresh = [p for p in pods if p["metadata"]["name"] not in old_pods and pod_ready(p)]
        return len(fresh) == 2 and fresh

    wait_for(replaced, 180, what="two new operator pods")
    obj = wait_phase(cluster, life, "tiny", "Ready", 3)
    after = groups(cluster, life, "tiny")
    assert len(after) == 3 and obj["status"]["replicas"] == 3
    # Groups that existed were kept as they were, not recreated.
    assert {i: after[i]["metadata"]["uid"] for i in before} == before
    services = kubectl_json(cluster, "-n", life, "get", "services",
                            "-l", "kubeshard.io/inference-service=tiny")["items"]
    assert sorted(s["metadata"]["name"] for s in services) == \
        sorted(["tiny"] + [f"tiny-g{i}" for i in after])


def test_delete_removes_every_child_and_the_models_redis_keys(cluster, kubeshard, life):
    with cluster.port_forward(kubeshard.namespace, f"service/{kubeshard.component('redis')}", 6379) as port:
        check_delete_removes_every_child_and_the_models_redis_keys(
            cluster, life, redis.Redis(host="127.0.0.1", port=port, socket_timeout=5))


def check_delete_removes_every_child_and_the_models_redis_keys(cluster, life, r):
    r.set("kubeshard:tiny:main:cache:e2e", "x")
    r.set("kubeshard:tiny:other-rev:inflight:e2e", 1)
    r.set("kubeshard:someone-else:main:cache:e2e", "keep")
    try:
        cluster.kubectl("-n", life, "delete", "inferenceservice", "tiny", "--timeout=120s",
                        timeout=150)

        def gone():
            left = []
            for kind in ("statefulsets", "services", "poddisruptionbudgets", "pods"):
                items = kubectl_json(cluster, "-n", life, "get", kind,
                                     "-l", "kubeshard.io/inference-service=tiny")["items"]
                left += [f"{kind}/{i['metadata']['name']}" for i in items]
            return not left or None

        wait_for(gone, 120, what="every child of tiny to be garbage-collected")
        # The operator deletes the keys; a router that published its load once more before
        # its watch saw the Service go takes its own entry out at its next publish.
        wait_for(lambda: r.keys("kubeshard:tiny:*") == [] or None, 30,
                 what="tiny's Redis keys to be gone")
        assert r.get("kubeshard:someone-else:main:cache:e2e") == b"keep"
    finally:
        r.delete("kubeshard:someone-else:main:cache:e2e")
