"""The custom metrics API (`custom.metrics.k8s.io/v1beta2`) for InferenceServices: an
aggregated API server the HPA reads the routers' live load from.

Why it is written here on aiohttp instead of on a library: the one maintained library
for metrics API servers is Go's sigs.k8s.io/custom-metrics-apiserver (prometheus-adapter
and KEDA build on it); no maintained Python equivalent exists (the PyPI packages that
serve this API are single-purpose exporters, unmaintained, without delegated
authentication), and a Go binary would be a fourth image and toolchain for about 300
lines of HTTP. What k8s.io/apiserver would give us we do explicitly: TLS with the
chart's serving certificate, delegated authentication and authorization
(delegated_auth.py), Kubernetes `Status` errors, and discovery.

Routes (all over TLS; the kube-apiserver proxies /apis/custom.metrics.k8s.io/v1beta2/…
here once the chart's APIService registers it):

    GET /apis/custom.metrics.k8s.io/v1beta2
        discovery: one resource `inferenceservices.kubeshard.io/<metric>` per metric
    GET /apis/custom.metrics.k8s.io/v1beta2/namespaces/NS/inferenceservices.kubeshard.io/NAME/METRIC
        a MetricValueList with the InferenceService's value (what an HPA Object metric
        reads); NAME `*` lists every InferenceService of NS (`labelSelector` honoured)
    GET /healthz, /livez, /readyz   unauthenticated probes

Metrics (naming.CUSTOM_METRICS), each the InferenceService's total over every live
router (load.py); the HPA's AverageValue target divides it by the replicas:

    concurrency        requests in flight plus queued (held at zero included)
    queue_depth        requests queued
    tokens_in_flight   prompt tokens plus the new tokens still reserved
    tokens_per_second  output tokens per second over the last ten seconds

When neither Redis nor any router answers, a read is a 503: the HPA then keeps the
replicas it has instead of acting on a made-up zero.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from kubeshard_operator import API_VERSION, KIND, PLURAL
from kubeshard_operator import API_GROUP as ISVC_GROUP
from kubeshard_operator import naming as n
from kubeshard_operator.delegated_auth import DelegatedAuth
from kubeshard_operator.kube import KINDS, Kube, KubeError
from kubeshard_operator.load import LoadReader, ModelLoad

LOG = logging.getLogger("kubeshard_operator.metrics_api")
GROUP, VERSION = "custom.metrics.k8s.io", "v1beta2"
BASE = f"/apis/{GROUP}/{VERSION}"
RESOURCE = f"{PLURAL}.{ISVC_GROUP}"
WINDOW_S = {"tokens_per_second": 10}


def status(code: int, reason: str, message: str) -> web.Response:
    """A Kubernetes `Status` error, as kubectl and client-go expect one."""
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {},
                              "status": "Failure", "message": message, "reason": reason,
                              "code": code}, status=code)


def discovery() -> dict[str, Any]:
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{GROUP}/{VERSION}",
            "resources": [{"name": f"{RESOURCE}/{m}", "singularName": "", "namespaced": True,
                           "kind": "MetricValueList", "verbs": ["get"]}
                          for m in n.CUSTOM_METRICS]}


def quantity(value: float) -> str:
    """A Kubernetes quantity: whole numbers plain, others in thousandths ("1500m")."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def metric_value(namespace: str, name: str, metric: str, load: ModelLoad,
                 now: dt.datetime) -> dict[str, Any]:
    return {
        "describedObject": {"kind": KIND, "namespace": namespace, "name": name,
                            "apiVersion": API_VERSION},
        "metric": {"name": metric, "selector": None},
        "timestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "windowSeconds": WINDOW_S.get(metric, 1),
        "value": quantity(load.metric(metric)),
    }


def value_list(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"kind": "MetricValueList", "apiVersion": f"{GROUP}/{VERSION}", "metadata": {},
            "items": items}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class MetricsAPI:
    def __init__(self, auth: DelegatedAuth, kube: Kube, reader: LoadReader,
                 clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)
                 ) -> None:
        self.auth = auth
        self.kube = kube
        self.reader = reader
        self.clock = clock

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        for path in ("/healthz", "/livez", "/readyz"):
            app.router.add_get(path, self.probe)
        app.router.add_get(BASE, self.discover)
        app.router.add_get(f"{BASE}/namespaces/{{namespace}}/{{resource}}/{{name}}/{{metric}}",
                           self.namespaced)
        app.router.add_get(f"{BASE}/{{resource}}/{{name}}/{{metric}}", self.cluster_scoped)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return status(404, "NotFound", f"the server could not find the requested resource "
                                           f"({request.path})")
        except web.HTTPException:
            raise
        except Exception:
            LOG.exception("GET %s failed", request.path)
            return status(500, "InternalError", "the metrics server failed; see its log")

    async def probe(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _authorize(self, request: web.Request, attributes: dict) -> Optional[web.Response]:
        """None when the caller may proceed, else the 401 or 403 to answer."""
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        user = await self.auth.authenticate(peer, request.headers)
        if user is None:
            return status(401, "Unauthorized", "Unauthorized")
        allowed, reason = await self.auth.allowed(user, attributes)
        if not allowed:
            what = attributes.get("resourceAttributes") or attributes.get("nonResourceAttributes")
            return status(403, "Forbidden", f"user {user.name!r} cannot {what}"
                                            + (f": {reason}" if reason else ""))
        return None

    async def discover(self, request: web.Request) -> web.Response:
        refused = await self._authorize(request, {"nonResourceAttributes": {
            "path": request.path, "verb": "get"}})
        return refused or web.json_response(discovery())

    async def cluster_scoped(self, request: web.Request) -> web.Response:
        return status(404, "NotFound", f"{RESOURCE} are namespaced: use "
                                       f"{BASE}/namespaces/NAMESPACE/{RESOURCE}/NAME/METRIC")

    async def namespaced(self, request: web.Request) -> web.Response:
        namespace, resource = request.match_info["namespace"], request.match_info["resource"]
        name, metric = request.match_info["name"], request.match_info["metric"]
        listing = name == "*"
        refused = await self._authorize(request, {"resourceAttributes": {
            "namespace": namespace, "verb": "list" if listing else "get", "group": GROUP,
            "version": VERSION, "resource": resource, "subresource": metric,
            "name": "" if listing else name}})
        if refused is not None:
            return refused
        if resource != RESOURCE or metric not in n.CUSTOM_METRICS:
            return status(404, "NotFound", f"the server could not find the metric {metric} for "
                                           f"{resource}; it serves {', '.join(n.CUSTOM_METRICS)} "
                                           f"for {RESOURCE}")
        if listing:
            objects = await asyncio.to_thread(self._list, namespace,
                                              request.query.get("labelSelector", ""))
        else:
            obj = await asyncio.to_thread(self.kube.get, "InferenceService", namespace, name)
            if obj is None:
                return status(404, "NotFound", f'{RESOURCE} "{name}" not found')
            objects = [obj]
        now = self.clock()
        items = []
        for obj in objects:
            isvc = obj["metadata"]["name"]
            load = await asyncio.to_thread(self.reader.read, isvc)
            if load is None:
                return status(503, "ServiceUnavailable",
                              f"no load source answered for {namespace}/{isvc}: Redis is "
                              "unreachable and no router pod reported its load")
            items.append(metric_value(namespace, isvc, metric, load, now))
        return web.json_response(value_list(items))

    def _list(self, namespace: str, selector: str) -> list[dict]:
        query = [("labelSelector", selector)] if selector else []
        try:
            out = self.kube.request("GET", KINDS["InferenceService"].path(namespace), query=query)
        except KubeError as e:
            if e.status == 404:
                return []
            raise
        return list((out or {}).get("items") or ())
