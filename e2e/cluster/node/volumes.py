"""Pod volumes on the host, and the bind mounts that put them at their declared paths.

Each volume becomes a folder (or a host path) on the host; the container's launcher
bind-mounts it inside the container's own mount namespace, so nothing is mounted on the
host. What a mount needs that the host lacks (the folder
/var/run/secrets/kubernetes.io/serviceaccount, say) is created here, recorded in
`mountpoints.txt`, and removed when no pod uses it any more or at cluster teardown.

Supported: emptyDir (medium Memory lives under /dev/shm), hostPath, configMap, secret,
downwardAPI, projected (serviceAccountToken via the TokenRequest API, configMap,
secret, downwardAPI) and persistentVolumeClaim bound to a hostPath/local volume.
Files are written once at pod start; later ConfigMap/Secret edits are not propagated.
"""

from __future__ import annotations

import base64
import collections
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from .env import field_ref, resource_ref


class VolumeError(Exception):
    """A volume cannot be set up (reported as FailedMount / CreateContainerConfigError)."""


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    tmp.replace(path)


def _items(data: dict[str, bytes], items: list[dict] | None, default_mode: int,
           optional: bool, what: str) -> list[tuple[str, bytes, int]]:
    if not items:
        return [(k, v, default_mode) for k, v in data.items()]
    out = []
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise VolumeError(f"{what} has no key {item['key']!r}")
        out.append((item["path"], data[item["key"]], item.get("mode", default_mode)))
    return out


class PodVolumes:
    """Materializes one pod's volumes under `root` (its folder in the node's state dir)."""

    def __init__(self, pod: dict[str, Any], root: Path, *, api_get: Callable[[str], dict | None],
                 request_token: Callable[[dict], str],
                 allocatable: dict[str, str], pod_ip: str, host_ip: str) -> None:
        self.pod = pod
        self.ns = pod["metadata"]["namespace"]
        self.root = root
        self.api_get = api_get
        self.request_token = request_token
        self.allocatable = allocatable
        self.pod_ip, self.host_ip = pod_ip, host_ip
        self.paths: dict[str, Path] = {}
        self.read_only: set[str] = set()

    # ---- sources -------------------------------------------------------------------
    def _object(self, kind: str, name: str, optional: bool) -> dict | None:
        """The pod's namespace's ConfigMap or Secret ``name`` (``kind``: configmap, secret);
        None when it is missing and optional."""
        obj = self.api_get(f"/api/v1/namespaces/{self.ns}/{kind}s/{name}")
        if obj is None and not optional:
            raise VolumeError(f'{kind} "{name}" not found')
        return obj

    def _configmap(self, name: str, optional: bool) -> dict[str, bytes] | None:
        obj = self._object("configmap", name, optional)
        if obj is None:
            return None
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return data

    def _secret(self, name: str, optional: bool) -> dict[str, bytes] | None:
        obj = self._object("secret", name, optional)
        if obj is None:
            return None
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}

    def _downward(self, items: list[dict]) -> list[tuple[str, bytes, int]]:
        out = []
        containers = {c["name"]: c for c in self.pod["spec"]["containers"]}
        for item in items:
            if "fieldRef" in item:
                value = field_ref(self.pod, item["fieldRef"]["fieldPath"], self.pod_ip, self.host_ip)
            else:
                ref = item["resourceFieldRef"]
                container = containers.get(ref.get("containerName")) or next(iter(containers.values()))
                value = resource_ref(container, ref, self.allocatable)
            out.append((item["path"], value.encode(), item.get("mode", 0o644)))
        return out

    # ---- volumes -------------------------------------------------------------------
    def setup(self) -> None:
        for vol in self.pod["spec"].get("volumes") or []:
            self.paths[vol["name"]] = self._setup_one(vol)

    def _setup_one(self, vol: dict[str, Any]) -> Path:
        name = vol["name"]
        target = self.root / "volumes" / name
        if "emptyDir" in vol:
            if (vol["emptyDir"] or {}).get("medium") == "Memory":
                target = Path("/dev/shm/kubeshard") / self.pod["metadata"]["uid"] / name
            target.mkdir(parents=True, exist_ok=True)
            return target
        if "hostPath" in vol:
            return _host_path(vol["hostPath"])
        if "persistentVolumeClaim" in vol:
            return self._pvc(vol["persistentVolumeClaim"]["claimName"])
        files: list[tuple[str, bytes, int]]
        if "configMap" in vol:
            src = vol["configMap"]
            data = self._configmap(src["name"], bool(src.get("optional")))
            files = _items(data or {}, src.get("items"), src.get("defaultMode", 0o644),
                           bool(src.get("optional")), f'configmap "{src["name"]}"')
        elif "secret" in vol:
            src = vol["secret"]
            data = self._secret(src["secretName"], bool(src.get("optional")))
            files = _items(data or {}, src.get("items"), src.get("defaultMode", 0o644),
                           bool(src.get("optional")), f'secret "{src["secretName"]}"')
        elif "downwardAPI" in vol:
            files = self._downward(vol["downwardAPI"].get("items") or [])
        elif "projected" in vol:
            files = self._projected(vol["projected"])
        else:
            kind = next((k for k in vol if k != "name"), "?")
            raise VolumeError(f"volume {name!r}: type {kind} is not supported by the kubeshard local node")
        target.mkdir(parents=True, exist_ok=True)
        for rel, data, mode in files:
            _write(target / rel, data, mode)
        self.read_only.add(name)
        return target

    def _projected(self, spec: dict[str, Any]) -> list[tuple[str, bytes, int]]:
        mode = spec.get("defaultMode", 0o644)
        files: list[tuple[str, bytes, int]] = []
        for source in spec.get("sources") or []:
            if "serviceAccountToken" in source:
                tok = source["serviceAccountToken"]
                token = self.request_token(tok)
                files.append((tok["path"], token.encode(), mode))
            elif "configMap" in source:
                src = source["configMap"]
                data = self._configmap(src["name"], bool(src.get("optional")))
                files += _items(data or {}, src.get("items"), mode, bool(src.get("optional")),
                                f'configmap "{src["name"]}"')
            elif "secret" in source:
                src = source["secret"]
                data = self._secret(src["name"], bool(src.get("optional")))
                files += _items(data or {}, src.get("items"), mode, bool(src.get("optional")),
                                f'secret "{src["name"]}"')
            elif "downwardAPI" in source:
                files += self._downward(source["downwardAPI"].get("items") or [])
            else:
                raise VolumeError(f"projected source {list(source)} is not supported")
        return files

    def _pvc(self, claim: str) -> Path:
        pvc = self.api_get(f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims/{claim}")
        if pvc is None or not (pvc.get("spec") or {}).get("volumeName"):
            raise VolumeError(f'persistentvolumeclaim "{claim}" is not bound')
        pv = self.api_get(f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}") or {}
        spec = pv.get("spec") or {}
        if "hostPath" in spec:
            return _host_path(spec["hostPath"])
        if "local" in spec:
            return Path(spec["local"]["path"])
        raise VolumeError(f'persistentvolume of claim "{claim}" is neither hostPath nor local')

    def mounts(self, container: dict[str, Any]) -> list[dict[str, Any]]:
        """The bind mounts of one container: source on the host, target inside."""
        out = []
        for m in container.get("volumeMounts") or []:
            if m["name"] not in self.paths:
                raise VolumeError(f"volumeMount {m['name']!r} names no volume of the pod")
            source = self.paths[m["name"]]
            if m.get("subPath"):
                source = source / m["subPath"]
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            out.append({
                "source": str(source),
                "target": m["mountPath"],
                "readOnly": bool(m.get("readOnly")) or m["name"] in self.read_only,
            })
        return sorted(out, key=lambda m: m["target"].rstrip("/").count("/"))

    def cleanup(self) -> None:
        shutil.rmtree(Path("/dev/shm/kubeshard") / self.pod["metadata"]["uid"], ignore_errors=True)
        try:
            Path("/dev/shm/kubeshard").rmdir()
        except OSError:
            pass
        shutil.rmtree(self.root / "volumes", ignore_errors=True)


def _host_path(spec: dict[str, Any]) -> Path:
    path = Path(spec["path"])
    kind = spec.get("type") or ""
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    elif kind == "Directory" and not path.is_dir():
        raise VolumeError(f"hostPath {path} is not a directory")
    elif kind == "File" and not path.is_file():
        raise VolumeError(f"hostPath {path} is not a file")
    elif kind == "Socket" and not path.is_socket():
        raise VolumeError(f"hostPath {path} is not a socket")
    return path


class Mountpoints:
    """Folders and files created on the host only to mount onto; removed when unused.

    Tracks which mount targets are in use; after a release, every recorded path that no
    target in use lies at or under is removed (if still empty). The record file lets
    `down` remove them even after the agent was killed.
    """

    def __init__(self, record: Path) -> None:
        self.record = record
        self._active: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def ensure(self, target: str, is_dir: bool) -> str:
        """Create what is missing of `target`; returns a token for `release`."""
        path = Path(os.path.realpath(target))
        with self._lock:
            missing = []
            p = path
            while not p.exists() and not p.is_symlink():
                missing.append(p)
                p = p.parent
            for m in reversed(missing):
                if m == path and not is_dir:
                    m.touch()
                else:
                    m.mkdir(exist_ok=True)
                with open(self.record, "a") as f:
                    f.write(f"{m}\n")
            self._active[str(path)] += 1
        return str(path)

    def release(self, tokens: list[str]) -> None:
        with self._lock:
            for t in tokens:
                self._active[t] -= 1
                if self._active[t] <= 0:
                    del self._active[t]
            try:
                created = set(self.record.read_text().split())
            except OSError:
                return
            for p in sorted(created, key=lambda x: -x.count("/")):
                if not any(a == p or a.startswith(p + "/") for a in self._active):
                    remove_created(p, self.record)


def remove_created(path: str, record: Path) -> None:
    """Remove one recorded mountpoint if it is still an empty folder or empty file."""
    try:
        created = set(record.read_text().splitlines())
    except OSError:
        return
    if path not in created:
        return
    p = Path(path)
    try:
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        elif p.is_file() and p.stat().st_size == 0:
            p.unlink()
    except OSError:
        return  # not empty: something else put files there; leave it
    record.write_text("".join(f"{c}\n" for c in created if c != path))


def remove_all_created(record: Path) -> list[str]:
    """Teardown: remove every recorded mountpoint; returns those that could not go."""
    try:
        created = record.read_text().splitlines()
    except OSError:
        return []
    for path in sorted(set(created), key=lambda x: -x.count("/")):
        remove_created(path, record)
    try:
        left = record.read_text().splitlines()
    except OSError:
        left = []
    if not left:
        record.unlink(missing_ok=True)
    return left
