"""The custom metrics API on aiohttp's test server, with the Kubernetes calls it makes
(TokenReview, SubjectAccessReview, InferenceService reads) answered by a stand-in; the
e2e tests run it behind the real aggregator."""

from __future__ import annotations

import asyncio
import datetime as dt

from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict

from kubeshard_operator.delegated_auth import DelegatedAuth, FrontProxy
from kubeshard_operator.load import ModelLoad, sum_loads
from kubeshard_operator.metrics_api import MetricsAPI, quantity

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
BASE = "/apis/custom.metrics.k8s.io/v1beta2"
OBJ = f"{BASE}/namespaces/ml/inferenceservices.kubeshard.io"


class ApiServer:
    """Answers what the metrics server asks the Kubernetes API, and records it."""

    def __init__(self) -> None:
        self.isvcs = {("ml", "tiny"): {"metadata": {"name": "tiny", "namespace": "ml"}}}
        self.denied: set[str] = set()  # users SubjectAccessReviews refuse
        self.reviews: list[dict] = []

    def get(self, kind, namespace, name):
        return self.isvcs.get((namespace, name))

    def request(self, method, path, *, query=None, body=None, content_type=None):
        if path.endswith("/tokenreviews"):
            ok = body["spec"]["token"] == "good-token"
            return {"status": {"authenticated": ok, "user": {
                "username": "system:serviceaccount:kube-system:horizontal-pod-autoscaler",
                "groups": ["system:serviceaccounts"]}}}
        if path.endswith("/subjectaccessreviews"):
            self.reviews.append(body["spec"])
            return {"status": {"allowed": body["spec"]["user"] not in self.denied}}
        if path == "/apis/kubeshard.io/v1alpha1/namespaces/ml/inferenceservices":
            return {"items": [v for (ns, _), v in sorted(self.isvcs.items()) if ns == "ml"]}
        raise AssertionError(f"unexpected {method} {path}")


class Reader:
    def __init__(self, load):
        self.load = load

    def read(self, model):
        return self.load


def run(api: MetricsAPI, check) -> None:
    async def main():
        client = TestClient(TestServer(api.app()))
        await client.start_server()
        try:
            await check(client)
        finally:
            await client.close()
    asyncio.run(main())


def make(load=ModelLoad(in_flight=3, queued=2, tokens_in_flight=700, tokens_per_second=12.5,
                        routers=2)):
    server = ApiServer()
    auth = DelegatedAuth(server, FrontProxy(ca_pem=""))
    return server, MetricsAPI(auth, server, Reader(load), clock=lambda: NOW)


GOOD = {"Authorization": "Bearer good-token"}


def test_metric_values_of_an_inference_service():
    server, api = make()

    async def check(client):
        r = await client.get(f"{OBJ}/tiny/concurrency", headers=GOOD)
        assert r.status == 200
        assert await r.json() == {
            "kind": "MetricValueList", "apiVersion": "custom.metrics.k8s.io/v1beta2", "metadata": {},
            "items": [{"describedObject": {"kind": "InferenceService", "namespace": "ml", "name": "tiny",
                                           "apiVersion": "kubeshard.io/v1alpha1"},
                       "metric": {"name": "concurrency", "selector": None},
                       "timestamp": "2026-01-02T03:04:05Z", "windowSeconds": 1, "value": "5"}]}
        values = {}
        for metric in ("queue_depth", "tokens_in_flight", "tokens_per_second"):
            body = await (await client.get(f"{OBJ}/tiny/{metric}", headers=GOOD)).json()
            values[metric] = body["items"][0]["value"]
        assert values == {"queue_depth": "2", "tokens_in_flight": "700", "tokens_per_second": "12500m"}
        listed = await (await client.get(f"{OBJ}/*/concurrency", headers=GOOD)).json()
        assert [i["describedObject"]["name"] for i in listed["items"]] == ["tiny"]
    run(api, check)
    # Each read was authorized as the API server would: get of the metric's subresource.
    assert server.reviews[0]["resourceAttributes"] == {
        "namespace": "ml", "verb": "get", "group": "custom.metrics.k8s.io", "version": "v1beta2",
        "resource": "inferenceservices.kubeshard.io", "subresource": "concurrency", "name": "tiny"}
    assert server.reviews[-1]["resourceAttributes"]["verb"] == "list"


def test_discovery_lists_the_four_metrics():
    _, api = make()

    async def check(client):
        body = await (await client.get(BASE, headers=GOOD)).json()
        assert body["groupVersion"] == "custom.metrics.k8s.io/v1beta2"
        assert [r["name"] for r in body["resources"]] == [
            "inferenceservices.kubeshard.io/concurrency", "inferenceservices.kubeshard.io/queue_depth",
            "inferenceservices.kubeshard.io/tokens_in_flight", "inferenceservices.kubeshard.io/tokens_per_second"]
        assert (await client.get("/healthz")).status == 200  # probes need no identity
    run(api, check)


def test_unauthenticated_forbidden_and_unknown_requests_get_kubernetes_errors():
    server, api = make()
    server.denied.add("system:serviceaccount:kube-system:horizontal-pod-autoscaler")

    async def check(client):
        for headers, code in (({}, 401), ({"Authorization": "Bearer bad"}, 401), (GOOD, 403)):
            r = await client.get(f"{OBJ}/tiny/concurrency", headers=headers)
            body = await r.json()
            assert r.status == code and body["kind"] == "Status" and body["code"] == code
        server.denied.clear()
        r = await client.get(f"{OBJ}/nope/concurrency", headers=GOOD)
        assert r.status == 404 and (await r.json())["message"] == 'inferenceservices.kubeshard.io "nope" not found'
        r = await client.get(f"{OBJ}/tiny/gpu_temperature", headers=GOOD)
        assert r.status == 404 and "could not find the metric gpu_temperature" in (await r.json())["message"]
    run(api, check)


def test_no_load_source_is_a_503_not_a_made_up_zero():
    _, api = make(load=None)

    async def check(client):
        r = await client.get(f"{OBJ}/tiny/concurrency", headers=GOOD)
        assert r.status == 503 and "no load source answered" in (await r.json())["message"]
    run(api, check)


def test_the_front_proxy_user_comes_from_the_aggregators_headers():
    fp = FrontProxy.from_configmap({
        "requestheader-client-ca-file": "PEM", "requestheader-allowed-names": '["front-proxy-client"]',
        "requestheader-username-headers": '["X-Remote-User"]',
        "requestheader-group-headers": '["X-Remote-Group"]',
        "requestheader-extra-headers-prefix": '["X-Remote-Extra-"]'})
    cert = {"subject": ((("commonName", "front-proxy-client"),),)}
    headers = CIMultiDict([("X-Remote-User", "alice"), ("X-Remote-Group", "dev"),
                           ("X-Remote-Group", "system:authenticated"),
                           ("X-Remote-Extra-Scopes%2fA", "x")])
    user = fp.user(cert, headers)
    assert user.name == "alice" and user.groups == ("dev", "system:authenticated")
    assert user.extra == (("scopes/a", ("x",)),)
    # The API server adds system:authenticated to every authenticated user; so do we (the
    # aggregator's own discovery requests come with a user and no group).
    aggregator = fp.user(cert, CIMultiDict([("X-Remote-User", "system:kube-aggregator")]))
    assert aggregator.groups == ("system:authenticated",)
    assert fp.user({"subject": ((("commonName", "someone-else"),),)}, headers) is None
    assert fp.user(cert, CIMultiDict()) is None  # a certificate but nobody named


def test_quantities_and_sums():
    assert [quantity(v) for v in (0, 7, 2.5, 0.001)] == ["0", "7", "2500m", "1m"]
    total = sum_loads([{"in_flight": "2", "queued": "1", "last_request_at": "100.5"},
                       {"in_flight": 1, "tokens_per_second": 3.25, "last_request_at": 90}], "redis")
    assert (total.concurrency, total.tokens_per_second, total.last_request_at, total.routers) == \
        (4, 3.25, 100.5, 2)
