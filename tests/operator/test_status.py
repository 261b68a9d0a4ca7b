from kubeshard_operator.rollout import GroupView, Plan, PodView
from kubeshard_operator.status import Observed, compute_status, merge_conditions, pod_problem


def group(index, ready=True, hash_="h", problem=None, running=True):
    pods = tuple(PodView(name=f"p{index}-{r}", ready=ready, restarts=0, problem=problem,
                         running=running) for r in range(2))
    return GroupView(index=index, template_hash=hash_, shards=2, pods=pods)


def status(replicas, groups, error=None, plan=None):
    obs = Observed(generation=3, replicas=replicas, current_hash="h", groups=groups,
                   plan=plan or Plan(), url="http://r/models/m", error=error)
    return compute_status(obs, "m", {}, "2026-01-01T00:00:00Z")


def cond(st, type_):
    return next(c for c in st["conditions"] if c["type"] == type_)


def test_ready_when_every_group_is_ready():
    st = status(2, [group(0), group(1)])
    assert st["phase"] == "Ready" and st["readyReplicas"] == 2 and st["replicas"] == 2
    assert st["selector"] == "app.kubernetes.io/component=shard,kubeshard.io/inference-service=m"
    assert st["observedGeneration"] == 3 and st["url"] == "http://r/models/m"
    assert cond(st, "Ready")["status"] == "True"
    assert cond(st, "Progressing")["reason"] == "Complete"


def test_degraded_loading_pending_and_scaled_to_zero():
    assert status(2, [group(0), group(1, ready=False)])["phase"] == "Degraded"
    assert status(1, [group(0, ready=False)])["phase"] == "Loading"
    assert status(1, [group(0, ready=False, running=False)])["phase"] == "Pending"
    assert status(1, [])["phase"] == "Pending"
    assert status(0, [])["phase"] == "ScaledToZero"


def test_unschedulable_is_pending_with_a_condition_not_a_failure():
    st = status(1, [group(0, ready=False, running=False,
                          problem="Unschedulable: 0/1 nodes: Insufficient nvidia.com/gpu")])
    assert st["phase"] == "Pending"
    c = cond(st, "PodsSchedulable")
    assert c["status"] == "False" and "nvidia.com/gpu" in c["message"]


def test_crash_loops_fail_only_while_nothing_serves():
    crash = "CrashLoopBackOff: exit code 1"
    assert status(1, [group(0, ready=False, problem=crash)])["phase"] == "Failed"
    st = status(2, [group(0), group(1, ready=False, problem=crash)])
    assert st["phase"] == "Degraded"
    assert cond(st, "ShardsHealthy")["reason"] == "ShardFailing"


def test_invalid_spec_is_failed_with_the_reason():
    st = status(1, [], error=("InvalidSpec", "spec.sharding.shards must be at least 1"))
    assert st["phase"] == "Failed"
    assert cond(st, "Reconciled")["message"] == "spec.sharding.shards must be at least 1"


def test_rollout_in_progress_is_reported():
    st = status(1, [group(0, hash_="old"), group(1, ready=False)])
    assert st["phase"] == "Ready"  # the old group still serves
    assert cond(st, "Progressing")["reason"] == "RollingUpdate"
    assert cond(st, "Ready")["status"] == "False"
    assert st["updatedReplicas"] == 1


def test_transition_times_survive_unchanged_conditions():
    old = [{"type": "Ready", "status": "True", "lastTransitionTime": "t0"}]
    new = [{"type": "Ready", "status": "True"}, {"type": "Available", "status": "True"}]
    merged = merge_conditions(old, new, "t1")
    assert [c["lastTransitionTime"] for c in merged] == ["t0", "t1"]
    flipped = merge_conditions(old, [{"type": "Ready", "status": "False"}], "t2")
    assert flipped[0]["lastTransitionTime"] == "t2"


def test_pod_problem_reads_scheduling_and_container_states():
    unschedulable = {"status": {"conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}]}}
    assert pod_problem(unschedulable).startswith("Unschedulable: 0/1 nodes")
    crash = {"status": {"containerStatuses": [{
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 3, "reason": "Error",
                                     "message": "loading\nValueError: shards=3 does not divide 4 heads"}}}]}}
    problem = pod_problem(crash)
    assert problem.startswith("CrashLoopBackOff") and "does not divide" in problem
    # as a kubelet reports it: the back-off in the waiting message, the cause in the last run
    crash["status"]["containerStatuses"][0]["state"]["waiting"]["message"] = (
        "back-off 5m0s restarting failed container=shard pod=m-g0-0_ns(1181926f)")
    assert pod_problem(crash) == "CrashLoopBackOff: exit code 3 (Error) ValueError: shards=3 does not divide 4 heads"
    pulling = {"status": {"containerStatuses": [{
        "state": {"waiting": {"reason": "ErrImagePull", "message": "pull access denied for nope/shard"}}}]}}
    assert pod_problem(pulling) == "ErrImagePull: pull access denied for nope/shard"
    assert pod_problem({"status": {"phase": "Running"}}) is None
