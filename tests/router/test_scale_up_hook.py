"""KubernetesScaleUpHook against a stand-in for the InferenceService API (resourceVersion
preconditions as the API server applies them); e2e/operator/test_serverless.py runs it
against the real one."""

from __future__ import annotations

import asyncio
import threading

import pytest
from kubernetes.client.rest import ApiException

from kubeshard_router.backends.kubernetes import KubernetesScaleUpHook


class FakeApi:
    def __init__(self, replicas: int) -> None:
        self.obj = {"metadata": {"name": "m", "namespace": "ml", "resourceVersion": "10"},
                    "spec": {"replicas": replicas}}
        self.patches: list[dict] = []
        self.lock = threading.Lock()
        self.read_barrier = threading.Barrier(2, timeout=5)
        self.reads = 0

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        with self.lock:
            snapshot = {"metadata": dict(self.obj["metadata"]), "spec": dict(self.obj["spec"])}
            self.reads += 1
            first_two = self.reads <= 2
        if first_two:
            self.read_barrier.wait()  # both routers read before either writes
        return snapshot

    def patch_namespaced_custom_object_scale(self, group, version, namespace, plural, name, body,
                                             _content_type=None):
        assert _content_type == "application/merge-patch+json"
        with self.lock:
            if body["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
                raise ApiException(status=409, reason="Conflict")
            self.patches.append(body)
            self.obj["spec"]["replicas"] = body["spec"]["replicas"]
            self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)


class Source:
    api_client = None

    def locate(self, model):
        return ("ml", "m") if model == "m" else None


@pytest.fixture
def api(monkeypatch):
    made = {}

    def install(replicas: int) -> FakeApi:
        made["api"] = FakeApi(replicas)
        monkeypatch.setattr("kubernetes.client.CustomObjectsApi", lambda client=None: made["api"])
        return made["api"]
    return install


def test_two_routers_at_once_scale_a_model_at_zero_once(api):
    fake = api(0)

    async def both():
        await asyncio.gather(KubernetesScaleUpHook(Source()).scale_up("m"),
                             KubernetesScaleUpHook(Source()).scale_up("m"))
    asyncio.run(both())
    assert [p["spec"]["replicas"] for p in fake.patches] == [1]  # one patch won, the other saw 1
    assert fake.obj["spec"]["replicas"] == 1


def test_a_model_above_zero_is_left_alone(api):
    fake = api(3)  # groups restarting, say: no ready replica, but three are wanted
    fake.reads = 2
    asyncio.run(KubernetesScaleUpHook(Source()).scale_up("m"))
    assert fake.patches == [] and fake.obj["spec"]["replicas"] == 3
    asyncio.run(KubernetesScaleUpHook(Source()).scale_up("unknown"))  # no InferenceService: nothing
