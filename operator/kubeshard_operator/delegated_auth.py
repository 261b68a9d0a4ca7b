"""Delegated authentication and authorization of an aggregated API server, done the way
k8s.io/apiserver does it (its `--authentication-kubeconfig`/`--authorization-kubeconfig`
defaults), for the custom metrics API (metrics_api.py).

Authentication, in this order:

1. the aggregator's client certificate. The kube-apiserver proxies a request to an
   APIService with a certificate signed by its front-proxy CA and the caller's identity in
   headers. The CA, the allowed certificate names and the header names come from the
   `kube-system/extension-apiserver-authentication` ConfigMap (readable through the
   `extension-apiserver-authentication-reader` Role). The TLS layer verifies the
   certificate against that CA alone, so a verified peer certificate is the aggregator's;
   its common name must be one of `requestheader-allowed-names` (any when empty);
2. a bearer token, checked with a TokenReview (the `system:auth-delegator` ClusterRole);

and anything else is refused (401). Authorization: a SubjectAccessReview for every
request, with the attributes the Kubernetes API server would use (a metric read is verb
get on resource `inferenceservices.kubeshard.io`, subresource the metric, in API group
custom.metrics.k8s.io; discovery is a non-resource path). The HPA controller's built-in
role allows get/list on every custom.metrics.k8s.io resource. TokenReview and
SubjectAccessReview answers are cached for `ttl_s` (10 s, as k8s.io/apiserver does).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

from kubeshard_operator.kube import Kube, KubeError

LOG = logging.getLogger("kubeshard_operator.auth")
AUTH_CONFIGMAP = "/api/v1/namespaces/kube-system/configmaps/extension-apiserver-authentication"


@dataclass(frozen=True)
class UserInfo:
    name: str
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()
    uid: str = ""

    def review_fields(self) -> dict[str, Any]:
        """The user as a SubjectAccessReview's spec names it."""
        out: dict[str, Any] = {"user": self.name, "groups": list(self.groups)}
        if self.extra:
            out["extra"] = {k: list(v) for k, v in self.extra}
        if self.uid:
            out["uid"] = self.uid
        return out


@dataclass(frozen=True)
class FrontProxy:
    """What the kube-apiserver says about its front-proxy (requestheader) client."""

    ca_pem: str
    allowed_names: tuple[str, ...] = ()
    username_headers: tuple[str, ...] = ("X-Remote-User",)
    group_headers: tuple[str, ...] = ("X-Remote-Group",)
    extra_prefixes: tuple[str, ...] = ("X-Remote-Extra-",)

    @classmethod
    def from_configmap(cls, data: Mapping[str, str]) -> "FrontProxy":
        def names(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
            raw = data.get(key)
            return tuple(json.loads(raw)) if raw else default

        return cls(ca_pem=data.get("requestheader-client-ca-file", ""),
                   allowed_names=names("requestheader-allowed-names", ()),
                   username_headers=names("requestheader-username-headers", ("X-Remote-User",)),
                   group_headers=names("requestheader-group-headers", ("X-Remote-Group",)),
                   extra_prefixes=names("requestheader-extra-headers-prefix", ("X-Remote-Extra-",)))

    def user(self, peer_cert: Mapping[str, Any], headers: Any) -> Optional[UserInfo]:
        """The user the aggregator vouches for, from a verified peer certificate and the
        request's headers (a multidict: groups may repeat); None if it vouches for none."""
        cn = next((v for rdn in peer_cert.get("subject", ()) for k, v in rdn
                   if k == "commonName"), None)
        if self.allowed_names and cn not in self.allowed_names:
            LOG.warning("refused a front-proxy certificate for %r (allowed: %s)", cn,
                        ", ".join(self.allowed_names))
            return None
        name = next((headers.get(h) for h in self.username_headers if headers.get(h)), None)
        if not name:
            return None
        groups = with_authenticated(g for h in self.group_headers for g in headers.getall(h, ()) if g)
        extra: dict[str, list[str]] = {}
        for header, value in headers.items():
            for prefix in self.extra_prefixes:
                if header.lower().startswith(prefix.lower()):
                    key = urllib.parse.unquote(header[len(prefix):].lower())
                    extra.setdefault(key, []).append(value)
        return UserInfo(name=name, groups=groups,
                        extra=tuple(sorted((k, tuple(v)) for k, v in extra.items())))


def with_authenticated(groups: Iterable[str]) -> tuple[str, ...]:
    """The groups plus system:authenticated, as the Kubernetes API server adds it to every
    authenticated user (discovery is allowed to that group: the aggregator's own discovery
    requests name a user and no group)."""
    out = tuple(groups)
    return out if "system:authenticated" in out else out + ("system:authenticated",)


def load_front_proxy(kube: Kube) -> FrontProxy:
    data = (kube.request("GET", AUTH_CONFIGMAP) or {}).get("data") or {}
    return FrontProxy.from_configmap(data)


@dataclass
class _Cache:
    ttl_s: float
    clock: Callable[[], float]
    entries: dict[str, tuple[float, Any]] = field(default_factory=dict)

    def get(self, key: str) -> Any:
        hit = self.entries.get(key)
        if hit is not None and self.clock() - hit[0] < self.ttl_s:
            return hit[1]
        return None

    def put(self, key: str, value: Any) -> None:
        if len(self.entries) > 10_000:
            self.entries.clear()
        self.entries[key] = (self.clock(), value)


class DelegatedAuth:
    def __init__(self, kube: Kube, front_proxy: FrontProxy, *, ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.front_proxy = front_proxy
        self._tokens = _Cache(ttl_s, clock)
        self._decisions = _Cache(ttl_s, clock)

    async def authenticate(self, peer_cert: Optional[Mapping[str, Any]],
                           headers: Any) -> Optional[UserInfo]:
        if peer_cert:
            return self.front_proxy.user(peer_cert, headers)
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer ") and len(auth) > 7:
            return await self._token_user(auth[7:].strip())
        return None

    async def _token_user(self, token: str) -> Optional[UserInfo]:
        key = hashlib.sha256(token.encode()).hexdigest()
        cached = self._tokens.get(key)
        if cached is not None:
            return cached or None
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                  "spec": {"token": token}}
        try:
            out = await asyncio.to_thread(self.kube.request, "POST",
                                          "/apis/authentication.k8s.io/v1/tokenreviews", body=review)
        except KubeError as e:
            LOG.error("TokenReview failed: %s", e)
            return None
        status = (out or {}).get("status") or {}
        user = None
        if status.get("authenticated"):
            u = status.get("user") or {}
            user = UserInfo(name=u.get("username", ""), groups=with_authenticated(u.get("groups") or ()),
                            extra=tuple(sorted((k, tuple(v)) for k, v in (u.get("extra") or {}).items())),
                            uid=u.get("uid", ""))
        self._tokens.put(key, user or False)
        return user

    async def allowed(self, user: UserInfo, attributes: Mapping[str, Any]) -> tuple[bool, str]:
        """(allowed, reason) of a SubjectAccessReview; `attributes` is
        {"resourceAttributes": {...}} or {"nonResourceAttributes": {...}}."""
        spec = {**user.review_fields(), **attributes}
        key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
        cached = self._decisions.get(key)
        if cached is not None:
            return cached
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": spec}
        try:
            out = await asyncio.to_thread(self.kube.request, "POST",
                                          "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                                          body=review)
        except KubeError as e:
            LOG.error("SubjectAccessReview failed: %s", e)
            return False, "the authorization check failed"
        status = (out or {}).get("status") or {}
        decision = (bool(status.get("allowed")), status.get("reason") or "")
        self._decisions.put(key, decision)
        return decision
