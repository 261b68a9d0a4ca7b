"""A small Kubernetes REST helper over the official client's connection and auth.

Plain dicts in and out (the builders' shape), server-side apply for every child, and
errors that carry the API server's own message (it names the field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional
from urllib.parse import quote

from kubernetes import client as k8s

from kubeshard_operator import API_GROUP, PLURAL, VERSION
from kubeshard_operator.naming import FIELD_MANAGER


@dataclass(frozen=True)
class Kind:
    api_group: str  # "" for the core API
    version: str
    plural: str

    def path(self, namespace: str, name: Optional[str] = None,
             subresource: Optional[str] = None) -> str:
        base = f"/api/{self.version}" if not self.api_group else \
            f"/apis/{self.api_group}/{self.version}"
        path = f"{base}/namespaces/{quote(namespace)}/{self.plural}"
        if name is not None:
            path += f"/{quote(name)}"
        if subresource:
            path += f"/{subresource}"
        return path


KINDS: dict[str, Kind] = {
    "StatefulSet": Kind("apps", "v1", "statefulsets"),
    "Service": Kind("", "v1", "services"),
    "Pod": Kind("", "v1", "pods"),
    "PodDisruptionBudget": Kind("policy", "v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": Kind("autoscaling", "v2", "horizontalpodautoscalers"),
    "InferenceService": Kind(API_GROUP, VERSION, PLURAL),
    "EndpointSlice": Kind("discovery.k8s.io", "v1", "endpointslices"),
}


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class Kube:
    def __init__(self, api_client: k8s.ApiClient, timeout: float = 30.0):
        self.api = api_client
        self.timeout = timeout

    def request(self, method: str, path: str, *, query: Optional[list] = None,
                body: Any = None, content_type: str = "application/json") -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        # The client serializes JSON bodies itself; other types (apply-patch+yaml) go as
        # text, and JSON is valid YAML.
        payload = body if body is None or content_type.endswith("json") else json.dumps(body)
        method, url, headers, payload, post = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers,
            body=payload, auth_settings=["BearerToken"])
        resp = self.api.call_api(method, url, headers, payload, post,
                                 _request_timeout=self.timeout)
        data = resp.read()
        if not 200 <= resp.status <= 299:
            try:
                status = json.loads(data)
                raise KubeError(resp.status, status.get("reason", ""), status.get("message", ""))
            except (ValueError, AttributeError):
                raise KubeError(resp.status, resp.reason or "", data[:500].decode(
                    errors="replace")) from None
        return json.loads(data) if data else None

    def get(self, kind: str, namespace: str, name: str) -> Optional[dict]:
        try:
            return self.request("GET", KINDS[kind].path(namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: Mapping[str, str]) -> list[dict]:
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        out = self.request("GET", KINDS[kind].path(namespace),
                           query=[("labelSelector", label_selector)])
        return list(out.get("items") or ())

    def apply(self, obj: Mapping[str, Any]) -> dict:
        """Server-side apply as the operator's field manager; `force` takes back fields a
        person edited by hand (drift repair) while leaving fields we never set alone."""
        meta = obj["metadata"]
        path = KINDS[obj["kind"]].path(meta["namespace"], meta["name"])
        return self.request("PATCH", path, body=obj,
                            content_type="application/apply-patch+yaml",
                            query=[("fieldManager", FIELD_MANAGER), ("force", "true")])

    def delete(self, kind: str, namespace: str, name: str, *,
               propagation: str = "Background", uid: Optional[str] = None) -> bool:
        """False when it was already gone. `uid` guards against deleting a newer object
        of the same name."""
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1",
                                "propagationPolicy": propagation}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", KINDS[kind].path(namespace, name), body=body)
            return True
        except KubeError as e:
            if e.status in (404, 409):
                return False
            raise

    def merge_patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any],
                    subresource: Optional[str] = None) -> dict:
        return self.request("PATCH", KINDS[kind].path(namespace, name, subresource),
                            body=patch, content_type="application/merge-patch+json")
