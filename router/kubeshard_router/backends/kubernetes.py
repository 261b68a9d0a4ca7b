"""Kubernetes discovery: models from ``InferenceService`` objects, replica leaders from
the EndpointSlices of their leader Services.

The operator labels each leader Service ``kubeshard.io/inference-service=<name>`` and
``kubeshard.io/role=leader``; the EndpointSlice controller copies a Service's labels to
its slices, so one label-selected watch finds every leader endpoint. The gRPC port is
the slice port named ``grpc`` (50051 when unnamed). A model exists as long as its
InferenceService does, even with no endpoint (scaled to zero: requests are held by the
activator). Watches run in threads with the kubernetes client and hand snapshots to
the event loop, so replicas come and go without restarts.

Scale from zero (``KubernetesScaleUpHook``): asks for one replica through the
InferenceService's ``/scale`` subresource, only while it is at zero, with the object's
resourceVersion as a precondition. Two routers that see the first request at once both
read 0 and patch; the API server takes one patch and answers the other 409 Conflict,
whose router reads again, finds 1 and stops: the model scales once. The router's RBAC
is ``patch`` on ``inferenceservices/scale`` and nothing more (the read is the ``get`` on
InferenceServices discovery already has).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kubeshard_router.activation import ScaleUpHook
from kubeshard_router.backends.registry import Registry

log = logging.getLogger("kubeshard.router.kubernetes")

GROUP, VERSION, PLURAL = "kubeshard.io", "v1alpha1", "inferenceservices"
ISVC_LABEL = "kubeshard.io/inference-service"
ROLE_SELECTOR = "kubeshard.io/role=leader"
PORT_NAME = "grpc"
DEFAULT_PORT = 50051


def load_kube_config() -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, _snake(key), None)
    return obj


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def slice_addresses(endpoint_slice: Any) -> list[str]:
    """Ready, non-terminating endpoint addresses of one EndpointSlice, as HOST:PORT."""
    port = DEFAULT_PORT
    for p in _get(endpoint_slice, "ports") or []:
        if _get(p, "name") == PORT_NAME and _get(p, "port"):
            port = int(_get(p, "port"))
            break
    out = []
    for ep in _get(endpoint_slice, "endpoints") or []:
        conditions = _get(ep, "conditions") or {}
        if _get(conditions, "ready") is False or _get(conditions, "terminating") is True:
            continue
        for addr in _get(ep, "addresses") or []:
            out.append(f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}")
    return out


@dataclass(frozen=True)
class DesiredModel:
    addresses: tuple[str, ...]
    revision: Optional[str]


def desired_models(services: dict[tuple[str, str], Any],
                   slices: dict[tuple[str, str], Any]) -> dict[str, DesiredModel]:
    """InferenceServices (by (namespace, name)) and leader EndpointSlices → models."""
    by_isvc: dict[tuple[str, str], list[str]] = {}
    for (namespace, _), sl in slices.items():
        isvc = (_get(sl, "metadata", "labels") or {}).get(ISVC_LABEL)
        if isvc:
            by_isvc.setdefault((namespace, isvc), []).extend(slice_addresses(sl))
    out: dict[str, DesiredModel] = {}
    for (namespace, name), obj in sorted(services.items()):
        if name in out:
            log.warning("InferenceService %s exists in several namespaces; serving the first one "
                        "(use --namespace)", name)
            continue
        revision = _get(obj, "spec", "model", "revision")
        out[name] = DesiredModel(tuple(sorted(set(by_isvc.get((namespace, name), [])))),
                                 str(revision) if revision else None)
    return out


class _Watch(threading.Thread):
    """List, then watch from the list's resourceVersion; relist on expiry or error."""

    def __init__(self, name: str, lister: Callable[..., Any], kwargs: dict,
                 on_change: Callable[[str, Any], None], on_reset: Callable[[list], None],
                 stop: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self.lister, self.kwargs = lister, kwargs
        self.on_change, self.on_reset, self.stop_event = on_change, on_reset, stop

    def run(self) -> None:
        from kubernetes import watch
        while not self.stop_event.is_set():
            try:
                listed = self.lister(**self.kwargs)
                items = _get(listed, "items") or []
                self.on_reset(items)
                version = _get(listed, "metadata", "resourceVersion")
                w = watch.Watch()
                for event in w.stream(self.lister, resource_version=version, timeout_seconds=60,
                                      **self.kwargs):
                    if self.stop_event.is_set():
                        w.stop()
                        return
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.on_change(event["type"], event["object"])
            except Exception as exc:
                log.warning("watch %s failed (%s); relisting", self.name, exc)
                self.stop_event.wait(2.0)


def _key(obj: Any) -> tuple[str, str]:
    return (_get(obj, "metadata", "namespace") or "", _get(obj, "metadata", "name") or "")


class KubernetesSource:
    def __init__(self, namespace: Optional[str] = None, api_client: Any = None) -> None:
        self.namespace = namespace
        self._api_client = api_client
        self._services: dict[tuple[str, str], Any] = {}
        self._slices: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._registry: Optional[Registry] = None
        self._declared: set[str] = set()
        self.synced = asyncio.Event()
        self._listed: set[str] = set()

    def static_models(self) -> list[str]:
        return []

    async def start(self, registry: Registry) -> None:
        from kubernetes import client
        if self._api_client is None:
            await asyncio.to_thread(load_kube_config)
            self._api_client = client.ApiClient()
        self._loop = asyncio.get_running_loop()
        self._registry = registry
        custom = client.CustomObjectsApi(self._api_client)
        discovery = client.DiscoveryV1Api(self._api_client)
        if self.namespace:
            isvc_list = custom.list_namespaced_custom_object
            isvc_kwargs = dict(group=GROUP, version=VERSION, plural=PLURAL, namespace=self.namespace)
            slice_list = discovery.list_namespaced_endpoint_slice
            slice_kwargs = dict(namespace=self.namespace, label_selector=ROLE_SELECTOR)
        else:
            isvc_list = custom.list_cluster_custom_object
            isvc_kwargs = dict(group=GROUP, version=VERSION, plural=PLURAL)
            slice_list = discovery.list_endpoint_slice_for_all_namespaces
            slice_kwargs = dict(label_selector=ROLE_SELECTOR)
        for name, lister, kwargs, store in (("inferenceservices", isvc_list, isvc_kwargs, self._services),
                                            ("endpointslices", slice_list, slice_kwargs, self._slices)):
            _Watch(name, lister, kwargs, self._changer(store), self._resetter(name, store),
                   self._stop).start()

    def _changer(self, store: dict) -> Callable[[str, Any], None]:
        def change(kind: str, obj: Any) -> None:
            with self._lock:
                if kind == "DELETED":
                    store.pop(_key(obj), None)
                else:
                    store[_key(obj)] = obj
            self._publish()
        return change

    def _resetter(self, name: str, store: dict) -> Callable[[list], None]:
        def reset(items: list) -> None:
            with self._lock:
                store.clear()
                for obj in items:
                    store[_key(obj)] = obj
                self._listed.add(name)
            self._publish()
        return reset

    def _publish(self) -> None:
        with self._lock:
            if len(self._listed) < 2:
                return  # wait for both lists, or a half picture would drop replicas
            desired = desired_models(self._services, self._slices)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._apply, desired)

    def _apply(self, desired: dict[str, DesiredModel]) -> None:
        assert self._registry is not None
        for name in self._declared - set(desired):
            self._registry.forget(name)
        for name, model in desired.items():
            self._registry.declare(name, model.addresses, revision_hint=model.revision)
        self._declared = set(desired)
        self.synced.set()

    async def stop(self) -> None:
        self._stop.set()

    def scale_up_hook(self) -> ScaleUpHook:
        return KubernetesScaleUpHook(self)

    def locate(self, model: str) -> Optional[tuple[str, str]]:
        """(namespace, name) of the InferenceService serving ``model`` (what discovery chose)."""
        with self._lock:
            keys = sorted(k for k in self._services if k[1] == model)
        return keys[0] if keys else None

    @property
    def api_client(self) -> Any:
        return self._api_client


class KubernetesScaleUpHook:
    """One replica for a model at zero, through its InferenceService's /scale (see above)."""

    TRIES = 8

    def __init__(self, source: KubernetesSource) -> None:
        self.source = source

    async def scale_up(self, model: str) -> None:
        where = self.source.locate(model)
        if where is None:
            log.warning("model %s: no InferenceService to scale up", model)
            return
        for attempt in range(self.TRIES):
            if await asyncio.to_thread(self._try_once, *where):
                return
            await asyncio.sleep(0.1 * (attempt + 1))
        log.warning("model %s: the scale-up kept conflicting with other writers; the activator "
                    "asks again while requests wait", model)

    def _try_once(self, namespace: str, name: str) -> bool:
        """True when nothing is left to do (scaled up now, or already above zero)."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        api = client.CustomObjectsApi(self.source.api_client)
        obj = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        replicas = _get(obj, "spec", "replicas")
        if replicas is None or int(replicas) >= 1:
            return True  # someone already asked: another router, the HPA or a person
        body = {"metadata": {"resourceVersion": _get(obj, "metadata", "resourceVersion")},
                "spec": {"replicas": 1}}
        try:
            api.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, name, body,
                                                     _content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status == 409:
                return False  # changed since the read (status, another router): read again
            raise
        log.info("model %s: scaled %s/%s from zero to one replica", name, namespace, name)
        return True

