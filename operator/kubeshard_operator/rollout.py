"""Pure group planning: which groups to create or delete, and which to restart.

A *group* is one StatefulSet of `shards` pods serving one replica. Groups whose
template hash equals the spec's current hash are *current*, the others *stale*.

- Scaling adds groups at the lowest free index and removes the highest indexes first.
- A change to the pods rolls group by group with one surge group: a current group is
  created first, and a stale group is removed only while the ready groups left behind
  are at least `replicas` (maxSurge 1, maxUnavailable 0, counted in groups). Stale groups
  that are not ready serve nobody and go at once.
- A group whose shard restarted is restarted whole (its pods deleted together), with an
  exponential backoff so a model that cannot load does not churn pods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass(frozen=True)
class PodView:
    """What the reconciler observed of one shard pod: enough to tell readiness, restarts
    and the problem its status reports."""

    name: str
    ready: bool
    restarts: int
    # Failed or Succeeded: the container is gone for good (restartPolicy aside).
    finished: bool = False
    terminating: bool = False
    # Why the pod cannot run, for status: "Unschedulable: 0/1 nodes ...", "ImagePullBackOff: ..."
    problem: Optional[str] = None
    # The pod is Running and its container started (loading or serving).
    running: bool = False


@dataclass(frozen=True)
class GroupView:
    """What the reconciler observed of one group: its StatefulSet (index, pod template hash,
    shard count), its pods, and the restarts its annotations record."""

    index: int
    template_hash: str
    shards: int
    pods: tuple[PodView, ...] = ()
    terminating: bool = False
    # Group restarts so far and the time (epoch seconds) of the last one, from annotations.
    restarts: int = 0
    last_restart: Optional[float] = None

    @property
    def ready(self) -> bool:
        live = [p for p in self.pods if not p.terminating]
        return not self.terminating and len(live) == self.shards and all(p.ready for p in live)

    @property
    def ready_shards(self) -> int:
        return sum(1 for p in self.pods if p.ready and not p.terminating)


@dataclass
class Plan:
    create: list[int] = field(default_factory=list)
    delete: list[int] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        return not self.create and not self.delete


def plan_groups(replicas: int, current_hash: str, groups: Sequence[GroupView]) -> Plan:
    plan = Plan()
    live = [g for g in groups if not g.terminating]
    current = sorted((g for g in live if g.template_hash == current_hash),
                     key=lambda g: g.index)
    stale = sorted((g for g in live if g.template_hash != current_hash),
                   key=lambda g: g.index, reverse=True)

    # Surplus current groups (scale down): the highest indexes go first.
    surplus = max(0, len(current) - replicas)
    if surplus:
        gone = current[-surplus:]
        plan.delete += [g.index for g in reversed(gone)]
        current = current[:-surplus]

    ready_current = sum(1 for g in current if g.ready)
    kept_stale: list[GroupView] = []
    for g in (s for s in stale if not s.ready):
        plan.delete.append(g.index)  # serves nobody: replacing it costs no capacity
    ready_stale = [g for g in stale if g.ready]  # highest index first
    remaining = len(ready_stale)
    for g in ready_stale:
        if ready_current + remaining - 1 >= replicas:
            plan.delete.append(g.index)
            remaining -= 1
        else:
            kept_stale.append(g)

    wanted = replicas - len(current)
    if kept_stale:
        # Rolling: at most one group above `replicas` in total.
        room = replicas + 1 - (len(current) + len(kept_stale))
        wanted = min(wanted, max(0, room))
    taken = {g.index for g in groups}
    index = 0
    while wanted > 0:
        if index not in taken:
            plan.create.append(index)
            wanted -= 1
        index += 1
    return plan


def restart_backoff(restarts: int, minimum: float, maximum: float) -> float:
    """Seconds to wait after the `restarts`-th group restart before the next one."""
    if restarts <= 0:
        return 0.0
    return min(maximum, minimum * 2 ** (restarts - 1))


def needs_group_restart(group: GroupView, now: float, minimum: float, maximum: float) -> bool:
    """True when a shard of the group restarted or died and the group's pods should all
    be deleted together (the StatefulSet then recreates them as one fresh group).

    A rank cannot rejoin a running process group, so one restarted rank leaves the group
    useless until every rank starts over. The shard server makes every rank exit when a
    peer dies, so a restart count above zero anywhere means the group broke."""
    if group.terminating or group.shards <= 1:
        # A group of one is just a pod: the kubelet restarting its container in place
        # is already a whole-group restart.
        return False
    broken = any((p.restarts > 0 or p.finished) and not p.terminating for p in group.pods)
    if not broken:
        return False
    if group.last_restart is None:
        return True
    wait = restart_backoff(group.restarts, minimum, maximum)
    return now - group.last_restart >= wait
