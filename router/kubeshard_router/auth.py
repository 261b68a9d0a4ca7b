"""API keys: ``Authorization: Bearer <key>``, loaded from a file or a Kubernetes Secret.

Keys are kept only as SHA-256 digests; logs and metrics
name a key by its *name*, never its value. A key file is YAML::

    keys:
      - name: alice
        key: sk-alice-...
        rpm: 60          # optional: overrides --rate-limit-rpm for this key
        tpm: 100000      # optional: overrides --rate-limit-tpm
      - name: ops
        key: sk-ops-...
        admin: true      # optional: may use the admin routes (/v1/load_lora_adapter, ...)
      - name: ci
        key: sk-ci-...

or plain text, one key per line (``#`` comments; names are then ``key-<digest prefix>``).
Only the YAML form can mark a key ``admin: true``.
A Secret holds one key per data entry (the entry's name is the key's name), or an entry
named ``keys.yaml`` in the YAML form above. Both sources are reloaded when they change.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from kubeshard_router.errors import Unauthorized

log = logging.getLogger("kubeshard.router.auth")


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    rpm: Optional[int] = None
    tpm: Optional[int] = None
    admin: bool = False  # may use the admin routes (runtime LoRA loading)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _limit(entry: dict, field: str, where: str) -> Optional[int]:
    value = entry.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: `{field}` must be a non-negative integer")
    return value


def parse_keys_yaml(text: str, where: str) -> dict[bytes, ApiKey]:
    data = yaml.safe_load(text)
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{where}: expected a mapping with a `keys` list")
    keys: dict[bytes, ApiKey] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not entry["key"]:
            raise ValueError(f"{where}: keys[{i}] needs a non-empty string `key`")
        name = entry.get("name") or f"key-{_digest(entry['key']).hex()[:8]}"
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where} keys[{i}]: `admin` must be true or false")
        keys[_digest(entry["key"])] = ApiKey(str(name), _limit(entry, "rpm", f"{where} keys[{i}]"),
                                             _limit(entry, "tpm", f"{where} keys[{i}]"), admin)
    return keys


def parse_keys_text(text: str, where: str) -> dict[bytes, ApiKey]:
    stripped = [ln.strip() for ln in text.splitlines()]
    if any(ln.startswith("keys:") for ln in stripped):
        return parse_keys_yaml(text, where)
    keys: dict[bytes, ApiKey] = {}
    for line in stripped:
        if line and not line.startswith("#"):
            digest = _digest(line)
            keys[digest] = ApiKey(f"key-{digest.hex()[:8]}")
    return keys


def parse_secret_data(data: dict[str, str], where: str) -> dict[bytes, ApiKey]:
    """``data`` as the API returns it: base64-encoded values."""
    keys: dict[bytes, ApiKey] = {}
    for name, encoded in sorted((data or {}).items()):
        value = base64.b64decode(encoded).decode("utf-8")
        if name.endswith((".yaml", ".yml")):
            keys.update(parse_keys_yaml(value, f"{where}[{name}]"))
        elif value.strip():
            keys[_digest(value.strip())] = ApiKey(name)
    return keys


class ApiKeys:
    """The current key set; ``authenticate`` is a dict lookup on the key's digest."""

    def __init__(self, keys: Optional[dict[bytes, ApiKey]] = None) -> None:
        self._keys: dict[bytes, ApiKey] = keys or {}

    def replace(self, keys: dict[bytes, ApiKey]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, authorization: Optional[str]) -> ApiKey:
        if not authorization:
            raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("invalid Authorization header: expected `Bearer <key>`")
        # The lookup is on the key's SHA-256 digest, so its timing reveals nothing usable
        # about stored keys.
        found = self._keys.get(_digest(token))
        if found is None:
            raise Unauthorized("invalid API key")
        return found


class KeyFileWatcher:
    """Reloads a key file when its modification time changes."""

    def __init__(self, path: str, keys: ApiKeys, interval_s: float = 2.0) -> None:
        self.path = path
        self.keys = keys
        self.interval_s = interval_s
        self._mtime = 0.0
        self._task: Optional[asyncio.Task] = None

    def load(self) -> None:
        with open(self.path, encoding="utf-8") as f:
            text = f.read()
        self._mtime = os.stat(self.path).st_mtime
        self.keys.replace(parse_keys_text(text, self.path))
        log.info("loaded %d API keys from %s", len(self.keys), self.path)

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="api key file watcher")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if os.stat(self.path).st_mtime != self._mtime:
                    self.load()
            except (OSError, ValueError, yaml.YAMLError) as exc:
                log.error("reloading API keys from %s failed (keeping the previous keys): %s", self.path, exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class SecretKeyWatcher:
    """Loads keys from a Kubernetes Secret and follows its changes (a watch in a thread)."""

    def __init__(self, namespace: str, name: str, keys: ApiKeys, api: Any = None) -> None:
        self.namespace = namespace
        self.name = name
        self.keys = keys
        self._api = api
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _core(self) -> Any:
        if self._api is None:
            from kubeshard_router.backends.kubernetes import load_kube_config
            from kubernetes import client
            load_kube_config()
            self._api = client.CoreV1Api()
        return self._api

    def load(self) -> None:
        secret = self._core().read_namespaced_secret(self.name, self.namespace)
        self._apply(secret.data or {})

    def _apply(self, data: dict[str, str]) -> None:
        self.keys.replace(parse_secret_data(data, f"secret {self.namespace}/{self.name}"))
        log.info("loaded %d API keys from secret %s/%s", len(self.keys), self.namespace, self.name)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="api key secret watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from kubernetes import watch
        while not self._stop.is_set():
            try:
                w = watch.Watch()
                for event in w.stream(self._core().list_namespaced_secret, self.namespace,
                                      field_selector=f"metadata.name={self.name}", timeout_seconds=60):
                    if self._stop.is_set():
                        w.stop()
                        break
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._apply(event["object"].data or {})
                    elif event["type"] == "DELETED":
                        log.warning("secret %s/%s deleted: no API key is valid now", self.namespace, self.name)
                        self.keys.replace({})
            except Exception as exc:
                log.warning("watching secret %s/%s failed (%s); retrying", self.namespace, self.name, exc)
                self._stop.wait(2.0)

    async def close(self) -> None:
        self._stop.set()
