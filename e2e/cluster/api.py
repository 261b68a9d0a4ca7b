"""A small JSON client for the harness (the DNS server, the cluster's start), on urllib3.

They work on plain dicts (the JSON the API server sends), which keeps field names as in
the Kubernetes docs (`containerStatuses`, `fieldRef`) and avoids converting models back
and forth. Identity comes from a kubeconfig with client-certificate files, as the
harness writes them.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlencode

import urllib3
import yaml

log = logging.getLogger("kubeshard.api")


class ApiError(Exception):
    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        try:
            self.message = json.loads(body).get("message", body)
        except ValueError:
            self.message = body
        super().__init__(f"{method} {path}: {status} {self.message}")


class Gone(Exception):
    """The watch's resourceVersion is too old (410): relist."""


class Api:
    def __init__(self, kubeconfig: Path, timeout: float = 30.0) -> None:
        cfg = yaml.safe_load(Path(kubeconfig).read_text())
        cluster = cfg["clusters"][0]["cluster"]
        user = cfg["users"][0]["user"]
        self.server = cluster["server"].rstrip("/")
        self.timeout = timeout
        self.pool = urllib3.PoolManager(
            num_pools=2, maxsize=16, block=False, retries=False,
            cert_reqs="CERT_REQUIRED", ca_certs=cluster["certificate-authority"],
            cert_file=user["client-certificate"], key_file=user["client-key"],
        )

    def request(self, method: str, path: str, body: Any = None, params: dict | None = None,
                content_type: str = "application/json", timeout: float | None = None) -> dict | None:
        """The decoded response; None for 404 on GET and DELETE (already gone)."""
        url = self.server + path + ("?" + urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        resp = self.pool.request(method, url, body=data, headers=headers,
                                 timeout=urllib3.Timeout(connect=5.0, read=timeout or self.timeout))
        if resp.status == 404 and method in ("GET", "DELETE"):
            return None
        if resp.status >= 300:
            raise ApiError(method, path, resp.status, resp.data.decode(errors="replace"))
        return json.loads(resp.data) if resp.data else {}

    def get(self, path: str, **params) -> dict | None:
        return self.request("GET", path, params=params or None)

    def create(self, path: str, body: dict) -> dict | None:
        return self.request("POST", path, body)

    def patch(self, path: str, body: dict, kind: str = "strategic-merge-patch") -> dict | None:
        return self.request("PATCH", path, body, content_type=f"application/{kind}+json")

    def delete(self, path: str, body: dict | None = None) -> dict | None:
        return self.request("DELETE", path, body)

    def watch(self, path: str, resource_version: str, stop_after: float = 240.0,
              **params) -> Iterator[tuple[str, dict]]:
        """(type, object) events from one watch request; ends after `stop_after` seconds."""
        params = dict(params, watch="true", resourceVersion=resource_version,
                      allowWatchBookmarks="true", timeoutSeconds=str(int(stop_after)))
        url = self.server + path + "?" + urlencode(params)
        resp = self.pool.request("GET", url, preload_content=False, headers={"Accept": "application/json"},
                                 timeout=urllib3.Timeout(connect=5.0, read=stop_after + 30))
        try:
            if resp.status == 410:
                raise Gone(path)
            if resp.status >= 300:
                raise ApiError("WATCH", path, resp.status, resp.read().decode(errors="replace"))
            buf = b""
            for chunk in resp.stream(65536):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        if event["object"].get("code") == 410:
                            raise Gone(path)
                        raise ApiError("WATCH", path, event["object"].get("code", 500),
                                       json.dumps(event["object"]))
                    yield event["type"], event["object"]
        finally:
            resp.release_conn()


def informer(api: Api, path: str, on_event, stopped, **params) -> None:
    """List then watch `path` forever (until `stopped()`), calling on_event(type, obj).

    A 'SYNC' event with the full list starts each (re)list, so callers can drop objects
    that disappeared while the watch was down.
    """
    backoff = 0.5
    while not stopped():
        try:
            listing = api.get(path, **params) or {}
            on_event("SYNC", listing.get("items") or [])
            rv = listing["metadata"]["resourceVersion"]
            backoff = 0.5
            while not stopped():
                for etype, obj in api.watch(path, rv, **params):
                    rv = obj["metadata"].get("resourceVersion", rv)
                    if etype != "BOOKMARK":
                        on_event(etype, obj)
                    if stopped():
                        return
        except Gone:
            continue
        except (ApiError, urllib3.exceptions.HTTPError, OSError, ValueError, KeyError) as e:
            if stopped():
                return
            log.warning("watch %s failed, relisting in %.1f s: %s", path, backoff, e)
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
