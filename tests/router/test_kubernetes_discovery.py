"""Kubernetes discovery: pure mapping of InferenceServices and EndpointSlices to models, and
the router following a real API server (the e2e local control plane) without restarts."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from kubeshard_router.backends.kubernetes import desired_models, slice_addresses
from tests.support.stub_backend import StubBackend
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


def leader_slice(isvc: str, name: str, addresses: list[str], port: int = 50051, ready=True, **extra) -> dict:
    return {"metadata": {"name": name, "labels": {"kubeshard.io/inference-service": isvc,
                                                  "kubeshard.io/role": "leader"}},
            "ports": [{"name": "metrics", "port": 9090}, {"name": "grpc", "port": port}],
            "endpoints": [{"addresses": addresses, "conditions": {"ready": ready, **extra}}]}


def test_slice_addresses_keep_ready_endpoints_on_the_grpc_port():
    assert slice_addresses(leader_slice("m", "s", ["10.0.0.1", "10.0.0.2"], 7000)) == ["10.0.0.1:7000",
                                                                                         "10.0.0.2:7000"]
    assert slice_addresses(leader_slice("m", "s", ["10.0.0.1"], ready=False)) == []
    assert slice_addresses(leader_slice("m", "s", ["10.0.0.1"], ready=None)) == ["10.0.0.1:50051"]  # unknown = ready
    assert slice_addresses(leader_slice("m", "s", ["10.0.0.1"], terminating=True)) == []
    assert slice_addresses(leader_slice("m", "s", ["fd00::1"])) == ["[fd00::1]:50051"]
    unnamed = {"ports": [{"port": 1234}], "endpoints": [{"addresses": ["10.0.0.9"]}]}
    assert slice_addresses(unnamed) == ["10.0.0.9:50051"]  # the default leader port


def test_models_come_from_inference_services_and_replicas_from_their_slices():
    services = {("ns", "llama"): {"spec": {"model": {"revision": "abc123"}}},
                ("ns", "idle"): {"spec": {}}}
    slices = {("ns", "llama-a"): leader_slice("llama", "llama-a", ["10.0.0.1"]),
              ("ns", "llama-b"): leader_slice("llama", "llama-b", ["10.0.0.2", "10.0.0.1"]),
              ("other", "llama-x"): leader_slice("llama", "llama-x", ["10.9.9.9"]),  # another namespace
              ("ns", "orphan"): leader_slice("gone", "orphan", ["10.0.0.3"])}
    models = desired_models(services, slices)
    assert set(models) == {"llama", "idle"}
    assert models["llama"].addresses == ("10.0.0.1:50051", "10.0.0.2:50051")
    assert models["llama"].revision == "abc123"
    assert models["idle"].addresses == () and models["idle"].revision is None  # scaled to zero: still served


# --- against a real API server ---------------------------------------------------------------

@pytest.fixture(scope="module")
def kube(tmp_path_factory):
    try:
        try:
            from e2e.cluster.sharing import acquire, release  # the e2e harness's shared cluster
        except ImportError:
            from e2e.cluster.local import acquire, release
        from e2e.cluster.tools import find_bin_dir
        find_bin_dir(build=False)
    except Exception as exc:  # no Kubernetes binaries on this machine
        pytest.skip(f"no local Kubernetes control plane available: {exc}")
    local, cluster = acquire()
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "kubeshard.io_inferenceservices.yaml"))
        cluster.kubectl("wait", "--for=condition=Established", "crd/inferenceservices.kubeshard.io", timeout=60)
        yield cluster
    finally:
        release(local)


def _apply(cluster, manifest: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=manifest)


def _node_gateway() -> str:
    """The host's address on the local cluster's pod bridge: not loopback (EndpointSlices
    refuse 127.0.0.0/8), yet nothing sent to it leaves the machine."""
    from e2e.cluster.local import LocalCluster
    return LocalCluster().config.node_specs[0].gateway


def _slice(namespace: str, name: str, isvc: str, host: str, port: int) -> str:
    return f"""
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  namespace: {namespace}
  labels:
    kubernetes.io/service-name: {isvc}-leader
    endpointslice.kubernetes.io/managed-by: kubeshard-router-test
    kubeshard.io/inference-service: {isvc}
    kubeshard.io/role: leader
addressType: IPv4
ports:
  - name: grpc
    port: {port}
    protocol: TCP
endpoints:
  - addresses: ["{host}"]
    conditions: {{ready: true}}
"""


@pytest.mark.e2e
def test_router_follows_inference_services_and_endpoint_slices(kube, make_router):
    from kubernetes import config as kconfig

    from kubeshard_router.backends.kubernetes import KubernetesSource

    namespace = f"router-{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", namespace)
    api = kconfig.new_client_from_config(config_file=kube.kubeconfig)
    h = make_router(models={}, kubernetes=True, namespace=namespace, activation_timeout_s=30,
                    sources=[KubernetesSource(namespace=namespace, api_client=api)])
    gateway = _node_gateway()
    stubs = [h.call(StubBackend(model_id="demo-id").start(host=gateway)) for _ in range(2)]
    try:
        _apply(kube, f"""
apiVersion: kubeshard.io/v1alpha1
kind: InferenceService
metadata: {{name: demo, namespace: {namespace}}}
spec:
  model: {{source: "hf://kubeshard/demo", revision: "rev-7"}}
""")
        # Declared with no replica yet: listed, and requests would be held for activation.
        assert wait_for(lambda: "demo" in h.state.registry.models, timeout=30)
        assert h.state.registry.models["demo"].revision == "rev-7"
        assert [m["id"] for m in httpx.get(h.url + "/v1/models").json()["data"]] == ["demo"]
        _apply(kube, _slice(namespace, "demo-leader-a", "demo", gateway, stubs[0].port))
        h.wait_ready("demo", 1, timeout=30)
        r = httpx.post(h.url + "/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and stubs[0].counters.completed == 1
        _apply(kube, _slice(namespace, "demo-leader-b", "demo", gateway, stubs[1].port))
        h.wait_ready("demo", 2, timeout=30)
        kube.kubectl("delete", "endpointslice", "demo-leader-a", "-n", namespace)
        h.wait_ready("demo", 1, timeout=30)
        assert list(h.state.registry.models["demo"].replicas) == [stubs[1].address]
        for _ in range(3):
            assert httpx.post(h.url + "/v1/completions", json={"model": "demo", "prompt": "x",
                                                               "max_tokens": 1}).status_code == 200
        assert stubs[1].counters.completed == 3 and stubs[0].counters.completed == 1
        kube.kubectl("delete", "inferenceservice", "demo", "-n", namespace)
        assert wait_for(lambda: "demo" not in h.state.registry.models, timeout=30)
        assert httpx.post(h.url + "/v1/completions", json={"model": "demo", "prompt": "x"}).status_code == 404
    finally:
        for stub in stubs:
            h.call(stub.stop())
        kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
