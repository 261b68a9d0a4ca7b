"""FakeKube, a test double for `kubeshard_operator.kube.Kube`, and a fixed clock.

An in-memory stand-in for the API server, on plain dicts, so the reconciler can be
tested alone (the e2e tests run it against a real API server). It is not one:

- `apply` stores the manifest as the object, keeping what the API server or another
  field manager owns (uid, annotations, deletionTimestamp, status);
- no controllers run: `run_statefulsets` makes the pods a StatefulSet controller and a
  kubelet would, and `collect_garbage` finishes foreground deletions;
- a deletion takes the object's dependents (ownerReferences) with it, at once in the
  background, or marked terminating in the foreground.

Writes are recorded in `calls`; reads are not.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Mapping, Optional

from kubeshard_operator.kube import KubeError

Key = tuple[str, str, str]  # (kind, namespace, name)
DELETED_AT = "2026-01-01T00:00:00Z"


def _merge(target: dict, patch: Mapping[str, Any]) -> None:
    """JSON merge patch (RFC 7386): None removes a key, objects merge, the rest replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[Key, dict] = {}
        self.calls: list[tuple] = []
        # kind -> message: `apply` of that kind fails as the API server refusing it.
        self.refuse: dict[str, str] = {}
        self._uids = itertools.count(1)

    # -- the Kube interface ---------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> Optional[dict]:
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, kind: str, namespace: str, selector: Mapping[str, str]) -> list[dict]:
        return [copy.deepcopy(obj) for (k, ns, _), obj in sorted(self.objects.items())
                if k == kind and ns == namespace and
                all((obj["metadata"].get("labels") or {}).get(label) == value
                    for label, value in selector.items())]

    def apply(self, obj: Mapping[str, Any]) -> dict:
        meta = obj["metadata"]
        self.calls.append(("apply", obj["kind"], meta["name"]))
        if obj["kind"] in self.refuse:
            raise KubeError(422, "Invalid", self.refuse[obj["kind"]])
        key = (obj["kind"], meta["namespace"], meta["name"])
        new = copy.deepcopy(dict(obj))
        old = self.objects.get(key)
        if old is None:
            new["metadata"]["uid"] = f"uid-{next(self._uids)}"
        else:
            kept = {k: v for k, v in old["metadata"].items()
                    if k in ("uid", "annotations", "deletionTimestamp", "generation")}
            new["metadata"] = {**kept, **new["metadata"]}
            if "status" in old:
                new["status"] = old["status"]
        self.objects[key] = new
        return copy.deepcopy(new)

    def delete(self, kind: str, namespace: str, name: str, *,
               propagation: str = "Background", uid: Optional[str] = None) -> bool:
        self.calls.append(("delete", kind, name, propagation, uid))
        obj = self.objects.get((kind, namespace, name))
        if obj is None or (uid is not None and obj["metadata"]["uid"] != uid):
            return False  # 404 or 409, as Kube.delete answers them
        self._delete(kind, namespace, name, foreground=propagation == "Foreground")
        return True

    def merge_patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any],
                    subresource: Optional[str] = None) -> dict:
        self.calls.append(("merge_patch", kind, name, subresource))
        obj = self.objects.get((kind, namespace, name))
        if obj is None:
            raise KubeError(404, "NotFound", f"{kind} {namespace}/{name} not found")
        meta = dict(patch.get("metadata") or {})
        version = meta.pop("resourceVersion", None)
        if version is not None and obj["metadata"].get("resourceVersion", version) != version:
            raise KubeError(409, "Conflict", "the object has been modified; please apply your "
                                             "changes to the latest version and try again")
        patch = {**patch, "metadata": meta} if "metadata" in patch else patch
        _merge(obj, patch)
        if subresource == "scale":
            obj["metadata"]["generation"] = obj["metadata"].get("generation", 0) + 1
        return copy.deepcopy(obj)

    # -- what a test does besides the operator -------------------------------------------

    def create(self, obj: Mapping[str, Any]) -> dict:
        """A person's `kubectl create`: not recorded, generation 1."""
        new = copy.deepcopy(dict(obj))
        new["metadata"].update(uid=f"uid-{next(self._uids)}", generation=1)
        self.objects[(new["kind"], new["metadata"]["namespace"], new["metadata"]["name"])] = new
        return copy.deepcopy(new)

    def edit_spec(self, kind: str, namespace: str, name: str, spec: Mapping[str, Any]) -> None:
        """A person's `kubectl replace` of the spec: the generation goes up."""
        obj = self.objects[(kind, namespace, name)]
        obj["spec"] = copy.deepcopy(dict(spec))
        obj["metadata"]["generation"] += 1

    def remove(self, kind: str, namespace: str, name: str) -> None:
        """A person's `kubectl delete` (background): not recorded."""
        self._delete(kind, namespace, name, foreground=False)

    def take_calls(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls

    def run_statefulsets(self, *, ready: bool) -> None:
        """Stands in for the StatefulSet controller and the kubelet: every StatefulSet
        that is not terminating gets the pods it lacks, Running and `ready` or not."""
        for (kind, ns, name), sts in list(self.objects.items()):
            if kind != "StatefulSet" or sts["metadata"].get("deletionTimestamp"):
                continue
            template = sts["spec"]["template"]["metadata"]
            for rank in range(sts["spec"]["replicas"]):
                if ("Pod", ns, f"{name}-{rank}") in self.objects:
                    continue
                self.objects[("Pod", ns, f"{name}-{rank}")] = {
                    "kind": "Pod",
                    "metadata": {
                        "name": f"{name}-{rank}", "namespace": ns,
                        "uid": f"uid-{next(self._uids)}",
                        "labels": dict(template["labels"]),
                        "ownerReferences": [{"kind": "StatefulSet", "name": name,
                                             "uid": sts["metadata"]["uid"],
                                             "controller": True}],
                    },
                    "status": _pod_status(ready=ready, restarts=0),
                }

    def set_pod(self, namespace: str, name: str, *, ready: bool, restarts: int) -> None:
        """The kubelet's view of a pod changes: readiness and container restarts."""
        self.objects[("Pod", namespace, name)]["status"] = _pod_status(ready, restarts)

    def collect_garbage(self) -> None:
        """Finishes foreground deletions: terminating objects go."""
        for key, obj in list(self.objects.items()):
            if obj["metadata"].get("deletionTimestamp"):
                del self.objects[key]

    def _delete(self, kind: str, namespace: str, name: str, *, foreground: bool) -> None:
        obj = self.objects[(kind, namespace, name)]
        uid = obj["metadata"]["uid"]
        for key, child in list(self.objects.items()):
            if any(ref.get("uid") == uid for ref in child["metadata"].get("ownerReferences") or ()):
                self._delete(*key, foreground=foreground)
        if foreground:
            obj["metadata"]["deletionTimestamp"] = DELETED_AT
        else:
            del self.objects[(kind, namespace, name)]


def _pod_status(ready: bool, restarts: int) -> dict[str, Any]:
    return {"phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "shard", "restartCount": restarts}]}


class FixedClock:
    """Epoch seconds that move only when the test says so."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
