"""One reconcile pass after another against FakeKube (a test double) and a fixed clock.

Every write the reconciler makes is asserted in order, by kind and name."""

from __future__ import annotations

import copy
import logging

import pytest

from kubeshard_operator import API_VERSION, naming as n
from kubeshard_operator.builders import build_headless_service, owner_reference, template_hash
from kubeshard_operator.load import ModelLoad
from kubeshard_operator.reconciler import Reconciler
from tests.operator.factories import CFG, make_spec, spec_dict
from tests.operator.fake_kube import FakeKube, FixedClock

NS, NAME = "ml", "tiny"
T0 = 1_700_000_000.0
LOG = logging.getLogger("tests.operator.reconciler")

# The writes of a pass that only re-applies a one-group `tiny` (before its status).
SHARED = [("apply", "Service", "tiny"), ("apply", "PodDisruptionBudget", "tiny"),
          ("delete", "HorizontalPodAutoscaler", "tiny", "Background", None)]
GROUP0 = [("apply", "Service", "tiny-g0"), ("apply", "StatefulSet", "tiny-g0")]
STATUS = ("merge_patch", "InferenceService", "tiny", "status")


class FakeLoad:
    """Stands in for the LoadReader: the routers' summed counts, as a test sets them."""

    def __init__(self) -> None:
        self.load: ModelLoad | None = None
        self.reads: list[str] = []
        self.on_read = None  # called on each read: what else happens at that moment

    def read(self, model: str) -> ModelLoad | None:
        self.reads.append(model)
        if self.on_read is not None:
            self.on_read()
        return self.load


class World:
    def __init__(self) -> None:
        self.kube = FakeKube()
        self.clock = FixedClock(T0)
        self.events: list[tuple[str, str, str]] = []
        self.load = FakeLoad()
        self.reconciler = Reconciler(self.kube, CFG, self.record_event, clock=self.clock,
                                     load=self.load)

    def record_event(self, body, type_: str, reason: str, message: str) -> None:
        assert body["metadata"]["name"] == NAME
        self.events.append((type_, reason, message))

    def create(self, **spec) -> dict:
        return self.kube.create({"apiVersion": API_VERSION, "kind": "InferenceService",
                                 "metadata": {"name": NAME, "namespace": NS},
                                 "spec": spec_dict(**spec)})

    def edit(self, **spec) -> None:
        self.kube.edit_spec("InferenceService", NS, NAME, spec_dict(**spec))

    def reconcile(self):
        return self.reconciler.reconcile(NS, NAME, LOG)

    def take(self) -> tuple[list[tuple], list[tuple]]:
        """The writes and the events since the last take."""
        events, self.events = self.events, []
        return self.kube.take_calls(), events

    def obj(self, kind: str, name: str) -> dict:
        return self.kube.objects[(kind, NS, name)]

    def names(self, kind: str) -> list[str]:
        return sorted(name for k, _, name in self.kube.objects if k == kind)

    def status(self) -> dict:
        return self.obj("InferenceService", NAME)["status"]

    def condition(self, type_: str) -> dict:
        return next(c for c in self.status()["conditions"] if c["type"] == type_)

    def ready(self, **spec) -> None:
        """A `tiny` whose groups all run ready pods; writes and events taken."""
        self.create(**spec)
        self.reconcile()
        self.kube.run_statefulsets(ready=True)
        assert self.reconcile() == "Ready"
        self.take()


@pytest.fixture
def world() -> World:
    return World()


def test_first_pass_creates_the_children_and_writes_status(world, caplog):
    body = world.create()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert world.reconcile() == "Pending"
    assert world.take() == (SHARED + GROUP0 + [STATUS],
                            [("Normal", "GroupCreated", "created group tiny-g0")])
    assert "created group 0 of ml/tiny" in caplog.messages
    assert world.names("Service") == ["tiny", "tiny-g0"]
    assert world.names("PodDisruptionBudget") == ["tiny"]
    assert world.names("StatefulSet") == ["tiny-g0"]
    sts = world.obj("StatefulSet", "tiny-g0")
    assert sts["metadata"]["ownerReferences"] == [owner_reference(body)]
    assert sts["metadata"]["labels"][n.LABEL_HASH] == template_hash(make_spec(), CFG)
    assert sts["spec"]["replicas"] == 2
    status = world.status()
    assert status["observedGeneration"] == 1 and status["replicas"] == 0
    assert status["url"] == "http://kubeshard-router.kubeshard.svc:8080/models/tiny"
    assert world.condition("Reconciled")["status"] == "True"

    world.kube.run_statefulsets(ready=True)
    assert world.reconcile() == "Ready"
    assert world.take() == (SHARED + GROUP0 + [STATUS], [])
    assert world.status()["readyReplicas"] == 1
    assert world.status()["groups"] == [{"name": "tiny-g0", "index": 0, "shards": 2,
                                         "readyShards": 2, "ready": True, "current": True}]
    # Nothing changed: the same children again, and no status write.
    assert world.reconcile() == "Ready"
    assert world.take() == (SHARED + GROUP0, [])


def test_scale_two_to_one_deletes_the_highest_group_in_the_foreground(world, caplog):
    world.ready(replicas=2)
    doomed = world.obj("StatefulSet", "tiny-g1")["metadata"]["uid"]
    world.edit(replicas=1)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert world.reconcile() == "Ready"
    assert world.take() == (
        SHARED + [("delete", "StatefulSet", "tiny-g1", "Foreground", doomed),
                  ("delete", "Service", "tiny-g1", "Background", None)] + GROUP0 + [STATUS],
        [("Normal", "GroupRemoved", "removed group tiny-g1")])
    assert "removed group 1 of ml/tiny" in caplog.messages
    # Foreground: the StatefulSet waits, terminating, for its pods.
    assert world.obj("StatefulSet", "tiny-g1")["metadata"]["deletionTimestamp"]
    assert world.names("Service") == ["tiny", "tiny-g0"]

    # While it terminates, it holds index 1 and is neither deleted again nor replaced.
    assert world.reconcile() == "Ready"
    assert world.take() == (SHARED + GROUP0 + [STATUS], [])
    assert world.status()["replicas"] == 1 and world.status()["observedGeneration"] == 2
    world.kube.collect_garbage()
    assert world.reconcile() == "Ready"
    assert world.take() == (SHARED + GROUP0, [])
    assert world.names("StatefulSet") == ["tiny-g0"]


def test_a_template_change_surges_a_current_group_then_removes_the_stale_one(world):
    world.ready()
    stale = copy.deepcopy(world.obj("StatefulSet", "tiny-g0"))
    world.edit(engine={"maxTotalTokens": 512})
    assert world.reconcile() == "Ready"  # the stale group still serves
    # The stale StatefulSet is left as it is; the surge group comes first.
    assert world.take() == (
        SHARED + [("apply", "Service", "tiny-g0"), ("apply", "Service", "tiny-g1"),
                  ("apply", "StatefulSet", "tiny-g1"), STATUS],
        [("Normal", "GroupCreated", "created group tiny-g1")])
    assert world.obj("StatefulSet", "tiny-g0") == stale
    assert world.condition("Progressing")["reason"] == "RollingUpdate"

    world.kube.run_statefulsets(ready=True)
    world.reconcile()
    assert world.take() == (
        SHARED + [("delete", "StatefulSet", "tiny-g0", "Foreground", stale["metadata"]["uid"]),
                  ("delete", "Service", "tiny-g0", "Background", None),
                  ("apply", "Service", "tiny-g1"), ("apply", "StatefulSet", "tiny-g1"),
                  STATUS],
        [("Normal", "GroupRemoved", "removed group tiny-g0")])


def test_hand_deleted_children_come_back_on_the_next_pass(world):
    world.ready()
    world.kube.remove("Service", NS, "tiny")
    world.kube.remove("StatefulSet", NS, "tiny-g0")  # its pods go with it
    assert world.names("Pod") == []
    assert world.reconcile() == "Pending"
    # The leader Service is applied again; group 0 is gone, so the plan creates it anew.
    assert world.take() == (SHARED + GROUP0 + [STATUS],
                            [("Normal", "GroupCreated", "created group tiny-g0")])
    assert world.names("Service") == ["tiny", "tiny-g0"]
    assert world.names("StatefulSet") == ["tiny-g0"]


def test_a_headless_service_without_its_group_is_deleted(world):
    world.ready()
    spec = make_spec()
    owner = owner_reference(world.obj("InferenceService", NAME))
    world.kube.create(build_headless_service(spec, 7, owner))
    world.reconcile()
    assert world.take() == (SHARED + GROUP0 + [("delete", "Service", "tiny-g7", "Background",
                                                None)], [])
    assert world.names("Service") == ["tiny", "tiny-g0"]
    # A Service of another owner is not ours to delete.
    world.kube.create(build_headless_service(spec, 8, {**owner, "uid": "someone-else"}))
    world.reconcile()
    assert world.take() == (SHARED + GROUP0, [])


def test_invalid_spec_is_reported_in_status_and_creates_nothing(world):
    world.create(sharding={"shards": 0})
    assert world.reconcile() == "Failed"
    assert world.take() == ([STATUS], [])
    reconciled = world.condition("Reconciled")
    assert reconciled["status"] == "False" and reconciled["reason"] == "InvalidSpec"
    assert reconciled["message"] == "spec.sharding.shards must be at least 1, not 0"
    assert world.status()["observedGeneration"] == 1
    assert [key[0] for key in world.kube.objects] == ["InferenceService"]


def test_a_refused_apply_is_reported_in_status(world):
    world.create()
    world.kube.refuse["StatefulSet"] = "spec.template.spec.containers[0].image: Required value"
    assert world.reconcile() == "Failed"
    assert world.take() == (SHARED + GROUP0 + [STATUS], [])
    reconciled = world.condition("Reconciled")
    assert reconciled["reason"] == "ApplyFailed"
    assert reconciled["message"] == "spec.template.spec.containers[0].image: Required value"


def test_a_broken_group_restarts_whole_once_then_waits_out_the_backoff(world):
    world.ready()
    pods = {name: world.obj("Pod", name)["metadata"]["uid"] for name in world.names("Pod")}
    assert sorted(pods) == ["tiny-g0-0", "tiny-g0-1"]
    world.kube.set_pod(NS, "tiny-g0-1", ready=False, restarts=1)

    assert world.reconcile() == "Pending"  # no pod of the group is left
    message = "a shard of group tiny-g0 restarted; restarting all 2 shards together (restart 1)"
    assert world.take() == (
        [("delete", "Pod", "tiny-g0-0", "Background", pods["tiny-g0-0"]),
         ("delete", "Pod", "tiny-g0-1", "Background", pods["tiny-g0-1"]),
         ("merge_patch", "StatefulSet", "tiny-g0", None)] + SHARED + GROUP0 + [STATUS],
        [("Warning", "GroupRestarted", message)])
    annotations = world.obj("StatefulSet", "tiny-g0")["metadata"]["annotations"]
    assert annotations == {n.ANNOTATION_RESTARTS: "1", n.ANNOTATION_LAST_RESTART: f"{T0:.0f}"}
    assert world.status()["readyReplicas"] == 0

    # The StatefulSet brings fresh pods, and a shard dies again: within the 10 s backoff
    # the group is left alone.
    world.kube.run_statefulsets(ready=False)
    world.kube.set_pod(NS, "tiny-g0-0", ready=False, restarts=1)
    world.clock.advance(9)
    world.reconcile()
    assert world.take() == (SHARED + GROUP0 + [STATUS], [])
    world.clock.advance(1)
    world.reconcile()
    calls, events = world.take()
    assert [c[:3] for c in calls[:3]] == [("delete", "Pod", "tiny-g0-0"),
                                          ("delete", "Pod", "tiny-g0-1"),
                                          ("merge_patch", "StatefulSet", "tiny-g0")]
    assert [e[:2] for e in events] == [("Warning", "GroupRestarted")]
    assert events[0][2].endswith("(restart 2)")
    annotations = world.obj("StatefulSet", "tiny-g0")["metadata"]["annotations"]
    assert annotations[n.ANNOTATION_RESTARTS] == "2"
    assert annotations[n.ANNOTATION_LAST_RESTART] == f"{T0 + 10:.0f}"

    # Ready again: the count goes back to 0 so the next failure backs off from 10 s.
    world.kube.run_statefulsets(ready=True)
    assert world.reconcile() == "Ready"
    assert world.take() == ([("merge_patch", "StatefulSet", "tiny-g0", None)] + SHARED +
                            GROUP0 + [STATUS], [])
    assert world.obj("StatefulSet", "tiny-g0")["metadata"]["annotations"][
        n.ANNOTATION_RESTARTS] == "0"


def test_the_hpa_is_applied_with_autoscaling_and_deleted_without(world):
    world.create(autoscaling={"minReplicas": 1, "maxReplicas": 3})
    world.reconcile()
    calls, _ = world.take()
    assert calls[:3] == [("apply", "Service", "tiny"), ("apply", "PodDisruptionBudget", "tiny"),
                         ("apply", "HorizontalPodAutoscaler", "tiny")]
    hpa = world.obj("HorizontalPodAutoscaler", "tiny")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "tiny" and hpa["spec"]["maxReplicas"] == 3

    world.edit()  # autoscaling removed
    world.reconcile()
    calls, _ = world.take()
    assert calls[:3] == SHARED
    assert world.names("HorizontalPodAutoscaler") == []


def test_a_deleting_inference_service_is_left_to_the_finalizer(world):
    world.create()
    world.obj("InferenceService", NAME)["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert world.reconcile() is None
    assert world.take() == ([], [])
    world.kube.remove("InferenceService", NS, NAME)
    assert world.reconcile() is None


# -- scale to zero ---------------------------------------------------------------------------

ZERO = {"minReplicas": 0, "maxReplicas": 3, "idleSeconds": 60}
WITH_HPA = [("apply", "Service", "tiny"), ("apply", "PodDisruptionBudget", "tiny"),
            ("apply", "HorizontalPodAutoscaler", "tiny")]
SCALE = ("merge_patch", "InferenceService", "tiny", "scale")


def test_an_idle_model_scales_to_zero_after_idle_seconds_and_says_why(world):
    world.ready(autoscaling=ZERO)
    assert world.condition("Available")["lastTransitionTime"] == "2023-11-14T22:13:20Z"  # T0
    assert world.condition("ScaledToZero") | {"lastTransitionTime": None} == {
        "type": "ScaledToZero", "status": "False", "reason": "Serving",
        "message": "scales to zero after 60 s without a request", "observedGeneration": 1,
        "lastTransitionTime": None}
    world.load.load = ModelLoad(routers=2, last_request_at=T0 + 10)
    world.clock.advance(69)  # 59 s since the last request
    assert world.reconcile() == "Ready"
    assert world.take() == (WITH_HPA + GROUP0, [])

    world.clock.advance(1)
    assert world.reconcile() == "ScaledToZero"
    sts = world.obj("StatefulSet", "tiny-g0")["metadata"]["uid"]
    calls, events = world.take()
    assert calls == [SCALE] + WITH_HPA + [
        ("delete", "StatefulSet", "tiny-g0", "Foreground", sts),
        ("delete", "Service", "tiny-g0", "Background", None), STATUS]
    why = ("no request for 60 s (idleSeconds is 60; the last request came at "
           "2023-11-14T22:13:30Z); the next request scales it up")
    assert events == [("Normal", "ScaledToZero", f"scaled ml/tiny to zero: {why}"),
                      ("Normal", "GroupRemoved", "removed group tiny-g0")]
    isvc = world.obj("InferenceService", NAME)
    assert isvc["spec"]["replicas"] == 0
    zero = world.condition("ScaledToZero")
    assert (zero["status"], zero["reason"], zero["message"]) == ("True", "Idle", why)
    assert zero["lastTransitionTime"] == "2023-11-14T22:14:30Z"  # since when

    # Later passes keep saying why and since when, and read no more load (nothing to decide).
    world.kube.collect_garbage()
    world.load.reads.clear()
    world.clock.advance(30)
    assert world.reconcile() == "ScaledToZero"
    assert world.condition("ScaledToZero") == {**zero, "observedGeneration": 2}  # /scale bumped it
    assert world.load.reads == []
    assert world.names("StatefulSet") == [] and world.names("HorizontalPodAutoscaler") == ["tiny"]


def test_load_in_flight_or_unknown_keeps_the_model_up(world):
    world.ready(autoscaling=ZERO)
    world.clock.advance(3600)
    for load in (ModelLoad(routers=1, in_flight=1), ModelLoad(routers=1, queued=2),
                 ModelLoad(routers=0), None):
        world.load.load = load
        assert world.reconcile() == "Ready", load
        calls, _ = world.take()
        assert SCALE not in calls
    assert world.obj("InferenceService", NAME)["spec"]["replicas"] == 1


def test_a_model_that_may_not_scale_to_zero_is_never_read(world):
    world.ready(autoscaling={"minReplicas": 1, "maxReplicas": 3})
    world.clock.advance(3600)
    world.load.load = ModelLoad(routers=1)
    assert world.reconcile() == "Ready"
    assert world.load.reads == []
    assert world.condition("ScaledToZero")["message"] == "spec.autoscaling.minReplicas is not 0"


def test_a_scale_up_racing_the_scale_down_wins(world):
    """The router's activator scales the model up between this pass's read and its patch:
    the resourceVersion precondition refuses the scale-down."""
    world.ready(autoscaling=ZERO)
    world.obj("InferenceService", NAME)["metadata"]["resourceVersion"] = "7"
    world.clock.advance(3600)
    world.load.load = ModelLoad(routers=1)

    def router_scales_up():
        world.obj("InferenceService", NAME)["metadata"]["resourceVersion"] = "8"
    world.load.on_read = router_scales_up
    assert world.reconcile() == "Ready"
    calls, events = world.take()
    assert SCALE in calls and events == []
    assert world.obj("InferenceService", NAME)["spec"]["replicas"] == 1
    assert world.names("StatefulSet") == ["tiny-g0"]


def test_woken_from_zero_the_idle_time_counts_from_when_a_group_is_ready(world):
    world.ready(autoscaling=ZERO)
    world.load.load = ModelLoad(routers=1)
    world.clock.advance(60)
    assert world.reconcile() == "ScaledToZero"
    world.kube.collect_garbage()
    # A request arrives at zero: the router's activator asks for one replica.
    world.clock.advance(500)
    world.load.load = ModelLoad(routers=1, queued=1, last_request_at=world.clock.now)
    world.kube.merge_patch("InferenceService", NS, NAME, {"spec": {"replicas": 1}},
                           subresource="scale")
    assert world.reconcile() == "Pending"
    world.kube.run_statefulsets(ready=True)
    world.clock.advance(5)
    assert world.reconcile() == "Ready"
    assert world.condition("ScaledToZero")["status"] == "False"
    # The held request was served; its arrival was before the group was ready, so the
    # idle period runs from readiness: 59 s later it is still up, at 60 s it goes.
    world.load.load = ModelLoad(routers=1, last_request_at=world.clock.now - 5)
    world.take()
    world.clock.advance(59)
    assert world.reconcile() == "Ready"
    world.clock.advance(1)
    assert world.reconcile() == "ScaledToZero"
