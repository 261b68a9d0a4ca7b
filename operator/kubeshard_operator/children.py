"""Pure: the spec, the snapshot and the plan -> the changes one pass makes to the children.

`desired_children` returns the steps in the order the reconciler makes them:

1. the leader Service, the PDB, and the HPA (or the HPA's deletion without autoscaling);
2. each group the plan removes: its StatefulSet, deleted in the foreground (it stays,
   terminating, until its pods are gone, so its index is not reused while old pods still
   hold their names), then its headless Service;
3. each group kept: its headless Service, and its StatefulSet when the group is current
   (re-applying the same template repairs hand edits; stale groups are left as they are
   until the rollout replaces them);
4. each group the plan creates: its headless Service, then its StatefulSet;
5. headless Services whose group is gone (a StatefulSet deleted outside a plan).

The last step of a group's removal or creation carries that change, which the reconciler
logs and posts as an Event once the step is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Union

from kubeshard_operator import naming as n
from kubeshard_operator.builders import (
    build_headless_service, build_hpa, build_leader_service, build_pdb, build_statefulset,
)
from kubeshard_operator.config import OperatorConfig
from kubeshard_operator.observe import Snapshot
from kubeshard_operator.rollout import Plan
from kubeshard_operator.spec import InferenceServiceSpec


@dataclass(frozen=True)
class GroupChange:
    """A group this pass created or removed."""

    action: Literal["created", "removed"]
    index: int
    name: str  # the group's StatefulSet and headless Service

    @property
    def reason(self) -> str:
        return "GroupCreated" if self.action == "created" else "GroupRemoved"


@dataclass(frozen=True)
class Apply:
    """Server-side apply of one manifest."""

    manifest: Mapping[str, Any]
    done: Optional[GroupChange] = None


@dataclass(frozen=True)
class Delete:
    kind: str
    name: str
    # "Foreground": the object stays, terminating, until its dependents are gone.
    propagation: str = "Background"
    # Precondition: delete only the object with this uid, never a newer one of that name.
    uid: Optional[str] = None
    done: Optional[GroupChange] = None


Step = Union[Apply, Delete]


def desired_children(spec: InferenceServiceSpec, cfg: OperatorConfig,
                     owner: Mapping[str, Any], seen: Snapshot, plan: Plan,
                     current_hash: str) -> list[Step]:
    """The steps that converge the children of `spec` on it; see the module's docstring."""
    steps: list[Step] = [Apply(build_leader_service(spec, owner)),
                         Apply(build_pdb(spec, owner))]
    hpa = build_hpa(spec, owner)
    steps.append(Apply(hpa) if hpa is not None else
                 Delete("HorizontalPodAutoscaler", spec.name))

    doomed = set(plan.delete)
    for index in plan.delete:
        meta = seen.statefulsets[index]["metadata"]
        name = n.group_name(spec.name, index)
        steps += [Delete("StatefulSet", meta["name"], propagation="Foreground",
                         uid=meta["uid"]),
                  Delete("Service", name, done=GroupChange("removed", index, name))]

    keep = [g for g in seen.groups if not g.terminating and g.index not in doomed]
    for g in keep:
        steps.append(Apply(build_headless_service(spec, g.index, owner)))
        if g.template_hash == current_hash:
            steps.append(Apply(build_statefulset(spec, cfg, g.index, owner, current_hash)))

    for index in plan.create:
        name = n.group_name(spec.name, index)
        steps += [Apply(build_headless_service(spec, index, owner)),
                  Apply(build_statefulset(spec, cfg, index, owner, current_hash),
                        done=GroupChange("created", index, name))]

    # Services of the groups removed above are already on their way.
    known = {g.index for g in keep} | set(plan.create) | doomed | \
        {g.index for g in seen.groups if g.terminating}
    for svc in seen.services:
        group = svc["metadata"]["labels"].get(n.LABEL_GROUP)
        if group is not None and int(group) not in known:
            steps.append(Delete("Service", svc["metadata"]["name"]))
    return steps
