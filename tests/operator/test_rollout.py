from kubeshard_operator.rollout import (
    GroupView, PodView, needs_group_restart, plan_groups, restart_backoff,
)

H, OLD = "new", "old"


def group(index, hash_=H, ready=True, shards=2, terminating=False, restarts=0, last=None,
          pod_restarts=0):
    pods = tuple(PodView(name=f"g{index}-{r}", ready=ready,
                         restarts=pod_restarts if r == 1 else 0) for r in range(shards))
    return GroupView(index=index, template_hash=hash_, shards=shards, pods=pods,
                     terminating=terminating, restarts=restarts, last_restart=last)


def test_scale_up_creates_the_lowest_free_indexes():
    plan = plan_groups(3, H, [group(1)])
    assert plan.create == [0, 2] and plan.delete == []


def test_scale_down_removes_the_highest_index_first():
    plan = plan_groups(1, H, [group(0), group(1), group(2)])
    assert plan.delete == [2, 1] and plan.create == []


def test_scale_to_zero_removes_every_group():
    plan = plan_groups(0, H, [group(0), group(1, OLD)])
    assert sorted(plan.delete) == [0, 1] and plan.create == []


def test_steady_state_plans_nothing():
    assert plan_groups(2, H, [group(0), group(1)]).idle


def test_rollout_surges_one_group_before_removing_an_old_one():
    groups = [group(0, OLD), group(1, OLD)]
    plan = plan_groups(2, H, groups)
    assert plan.create == [2] and plan.delete == []
    # the surge group loads: nothing else happens
    groups.append(group(2, H, ready=False))
    assert plan_groups(2, H, groups).idle
    # the surge group is ready: the highest old group goes, and the next surge starts
    groups[2] = group(2, H)
    plan = plan_groups(2, H, groups)
    assert plan.delete == [1] and plan.create == [3]


def test_rollout_keeps_ready_groups_at_or_above_replicas():
    """Simulates a whole rollout and checks the ready count after every step."""
    groups = {0: group(0, OLD), 1: group(1, OLD), 2: group(2, OLD)}
    for _ in range(20):
        plan = plan_groups(3, H, list(groups.values()))
        if plan.idle:
            break
        for i in plan.delete:
            del groups[i]
        for i in plan.create:
            groups[i] = group(i, H, ready=False)
        assert sum(g.ready for g in groups.values()) >= 3  # maxUnavailable 0
        assert len(groups) <= 4  # one surge at most
        # next tick: created groups finish loading
        groups = {i: group(i, g.template_hash) for i, g in groups.items()}
    assert all(g.template_hash == H for g in groups.values())
    assert len(groups) == 3


def test_not_ready_old_groups_go_at_once():
    plan = plan_groups(1, H, [group(0, OLD, ready=False)])
    assert plan.delete == [0] and plan.create == [1]


def test_terminating_groups_hold_their_index():
    plan = plan_groups(1, H, [group(0, terminating=True)])
    assert plan.create == [1] and plan.delete == []


def test_group_restart_after_a_shard_restarted_with_backoff():
    g = group(0, ready=False, pod_restarts=1)
    assert needs_group_restart(g, now=100, minimum=10, maximum=300)
    recently = group(0, ready=False, pod_restarts=1, restarts=2, last=95)
    assert not needs_group_restart(recently, now=100, minimum=10, maximum=300)
    assert needs_group_restart(recently, now=95 + 20, minimum=10, maximum=300)
    assert not needs_group_restart(group(0), now=100, minimum=10, maximum=300)
    single = GroupView(index=0, template_hash=H, shards=1,
                       pods=(PodView(name="g0-0", ready=False, restarts=2),))
    assert not needs_group_restart(single, now=100, minimum=10, maximum=300)


def test_backoff_grows_and_is_capped():
    assert [restart_backoff(i, 10, 60) for i in range(6)] == [0, 10, 20, 40, 60, 60]
