"""The local launcher's group bookkeeping, changed only through ShardGroup's and
Launcher's own methods: restarts with back-off, serving again, the count starting over
after a healthy while, and a stop request."""

from __future__ import annotations

from kubeshard_shard.local_launcher import (RESTART_RESET_S, Launcher, ShardGroup, restart_backoff)


def group() -> ShardGroup:
    return ShardGroup(index=1, leader_port=12345, plan=None)  # the plan is only read to start processes


def test_a_broken_group_restarts_after_its_backoff():
    g = group()
    g.launched([])
    assert not g.restart_pending and g.leader_ready(0.0) is False   # first start: not "again"
    assert g.broke(10.0) == restart_backoff(1) and g.restarts == 1
    assert g.restart_pending
    assert not g.restart_due(10.0 + restart_backoff(1) - 0.01)
    assert g.restart_due(10.0 + restart_backoff(1))
    assert not g.restart_pending and not g.restart_due(100.0)


def test_backoff_grows_then_the_count_starts_over_after_a_healthy_while():
    g = group()
    waits = [g.broke(t) for t in (0.0, 1.0, 2.0)]
    assert waits == [restart_backoff(1), restart_backoff(2), restart_backoff(3)] and waits[0] < waits[2]
    g.restart_due(1e9)
    g.launched([])
    assert g.leader_ready(100.0) is True            # serving again, said once
    assert g.leader_ready(101.0) is False and g.restarts == 3
    assert g.leader_ready(100.0 + RESTART_RESET_S) is False and g.restarts == 0
    assert g.broke(500.0) == restart_backoff(1)     # from the bottom again


def test_a_stop_request_ends_supervision():
    launcher = Launcher()
    assert not launcher.stopping
    launcher.request_stop()
    assert launcher.stopping and launcher.supervise() == 0
