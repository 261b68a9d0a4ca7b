"""Thin kopf handlers: wiring only; the work lives in the reconciler and the builders.

- One daemon per InferenceService runs the reconcile loop: a pass now, then whenever the
  object or one of its children changes (watch events wake it), and at least every
  `reconcile_interval` seconds. One loop per object means passes never race each other.
- The finalizer removes the model's Redis keys (bounded; gives up with a Warning event).
- Settings live in the startup handler; peering (KopfPeering objects installed by the
  chart) pauses every operator pod but the highest-priority one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Optional

import kopf
import redis
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from prometheus_client import Counter, Histogram

from kubeshard_operator import API_GROUP, PLURAL, VERSION
from kubeshard_operator import naming as n
from kubeshard_operator.cleanup import delete_model_keys, redact
from kubeshard_operator.config import OperatorConfig
from kubeshard_operator.kube import Kube
from kubeshard_operator.load import LoadReader
from kubeshard_operator.reconciler import Reconciler
from kubeshard_operator.spec import SpecError, parse_spec

LOG = logging.getLogger("kubeshard_operator")
FINALIZER = "kubeshard.io/finalizer"
MANAGED = {"app.kubernetes.io/managed-by": n.MANAGED_BY}

RECONCILES = Counter("kubeshard_operator_reconciles_total",
                     "Reconcile passes of InferenceServices, by result", ["result"])
RECONCILE_SECONDS = Histogram("kubeshard_operator_reconcile_seconds",
                              "Duration of one reconcile pass")
REDIS_CLEANUPS = Counter("kubeshard_operator_redis_cleanups_total",
                         "Finalizer Redis cleanups, by result", ["result"])

registry = kopf.OperatorRegistry()


class Wakeups:
    """Per-object asyncio events that child watch events set to wake the reconciler."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}

    def event(self, namespace: str, name: str) -> asyncio.Event:
        return self._events.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: Optional[str], name: Optional[str]) -> None:
        if namespace and name and (namespace, name) in self._events:
            self._events[(namespace, name)].set()

    def forget(self, namespace: str, name: str) -> None:
        self._events.pop((namespace, name), None)


def _api_client() -> k8s.ApiClient:
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config()
    else:
        k8s_config.load_kube_config()
    return k8s.ApiClient()


def _post_event(body: Any, type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message)


@kopf.on.login(registry=registry)
def login(**kwargs: Any) -> Optional[kopf.ConnectionInfo]:
    """In a pod: the service account's token (the chart's RBAC); elsewhere: kubeconfig."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup(registry=registry)
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    cfg: OperatorConfig = memo.config
    settings.persistence.finalizer = FINALIZER
    # Annotations, not status: the status belongs to the reconciler and the CRD schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kubeshard.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kubeshard.io", key="last-handled-configuration")
    # No CRD/namespace scanning: the resources exist before the operator starts (the
    # chart installs the CRDs), and scanning would need cluster-wide list/watch of CRDs
    # and namespaces that the operator has no other use for.
    settings.scanning.disabled = True
    # Only our own explicit events reach Kubernetes; handler chatter stays in the log.
    settings.posting.level = logging.ERROR
    # Watch only the children we manage, filtered by the API server.
    for resource in (("v1", "pods"), ("v1", "services"), ("apps", "v1", "statefulsets")):
        settings.watching.label_selectors[resource] = \
            f"app.kubernetes.io/managed-by={n.MANAGED_BY}"
    # Reconnect watches regularly instead of trusting a silent connection forever.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    settings.peering.priority = memo.priority
    settings.peering.mandatory = memo.peering_mandatory
    settings.execution.max_workers = 8

    memo.kube = Kube(_api_client())
    # The routers' load (scale to zero): Redis, else the router pods directly.
    load = None
    if cfg.redis_url or (cfg.router_service and cfg.load_token_file):
        load = LoadReader(redis_url=cfg.redis_url, kube=memo.kube,
                          router_service=cfg.router_service_ref(), token_file=cfg.load_token_file)
    memo.reconciler = Reconciler(memo.kube, cfg, _post_event, load=load)
    memo.wakeups = Wakeups()
    LOG.info("kubeshard operator configured: shard image %s, router %s, redis %s",
             cfg.shard_image, cfg.router_url or "-",
             redact(cfg.redis_url) if cfg.redis_url else "-")


@kopf.daemon(API_GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=5.0)
async def reconcile_loop(name: str, namespace: str, memo: kopf.Memo,
                         stopped: kopf.DaemonStopped, **_: Any) -> None:
    cfg: OperatorConfig = memo.config
    wake = memo.wakeups.event(namespace, name)
    failures = 0
    try:
        while not stopped:
            wake.clear()
            started = time.monotonic()
            try:
                await asyncio.to_thread(memo.reconciler.reconcile, namespace, name, LOG)
                RECONCILES.labels("ok").inc()
                failures = 0
                delay = cfg.reconcile_interval
            except Exception as e:  # the API server away, a bug: log, back off, go on
                RECONCILES.labels("error").inc()
                failures += 1
                delay = min(60.0, 2.0 ** failures)
                LOG.error("reconcile of %s/%s failed (retry in %.0f s): %s",
                          namespace, name, delay, e, exc_info=failures == 1)
            RECONCILE_SECONDS.observe(time.monotonic() - started)
            if await _woken(wake, stopped, delay):
                # Coalesce a burst of events (a group's pods change together).
                await asyncio.sleep(0.2)
    finally:
        memo.wakeups.forget(namespace, name)


async def _woken(wake: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float) -> bool:
    """Waits until an event wakes the loop (True), or kopf stops it or time passes."""
    waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())}
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return wake.is_set() and not stopped


@kopf.on.event(API_GROUP, VERSION, PLURAL, registry=registry)
async def inference_service_changed(name: str, namespace: str, memo: kopf.Memo,
                                    **_: Any) -> None:
    memo.wakeups.wake(namespace, name)


@kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED, registry=registry)
@kopf.on.event("v1", "services", labels=MANAGED, registry=registry)
@kopf.on.event("v1", "pods", labels=MANAGED, registry=registry)
async def child_changed(labels: dict, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    memo.wakeups.wake(namespace, labels.get(n.LABEL_ISVC))


@kopf.on.delete(API_GROUP, VERSION, PLURAL, registry=registry)
def remove_redis_keys(name: str, namespace: str, spec: dict, body: Any, retry: int,
                      memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Children go with the garbage collector (owner references); the Redis keys are
    the one thing Kubernetes cannot clean up."""
    cfg: OperatorConfig = memo.config
    if not cfg.redis_url:
        return
    # The router keys a model by its InferenceService's name; spec.model.name (the
    # engine's model id) may differ, so both go.
    models = {name}
    try:
        models.add(parse_spec(name, namespace, spec).model.name)
    except SpecError:
        pass
    model = ", ".join(sorted(models))
    try:
        removed = sum(delete_model_keys(cfg.redis_url, m, timeout=cfg.redis_timeout)
                      for m in sorted(models))
    except (redis.RedisError, OSError) as e:
        reason = f"{type(e).__name__}: {e}"
        if retry + 1 >= cfg.redis_cleanup_tries:
            REDIS_CLEANUPS.labels("gave_up").inc()
            message = (f"could not remove the Redis keys of model {model!r} after "
                       f"{retry + 1} tries ({reason}); deleting anyway, the keys expire "
                       "with their TTL")
            logger.warning(message)
            kopf.warn(body, reason="RedisCleanupFailed", message=message)
            return
        REDIS_CLEANUPS.labels("retry").inc()
        raise kopf.TemporaryError(f"Redis unreachable: {reason}", delay=5) from e
    REDIS_CLEANUPS.labels("ok").inc()
    LOG.info("removed %d Redis keys of model %r (%s/%s)", removed, model, namespace, name)
