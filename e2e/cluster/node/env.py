"""A container's environment, built as the kubelet builds it.

Order and precedence follow the kubelet: Service link variables first, then `envFrom`,
then `env` (later wins); `$(VAR)` in `env` values refers to variables defined before it,
and the same expansion applies to command and args.
"""

from __future__ import annotations

import base64
import math
import os
import re
from typing import Any, Callable

from kubernetes.utils import parse_quantity

# Host variables that are workarounds for this machine, not configuration: passed through
# so that numerical libraries in pods behave as they do in tests on the host.
PASSTHROUGH = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS", "TZ")

_EXPANSION = re.compile(r"\$\$|\$\(([^)]*)\)")


class EnvError(Exception):
    """A referenced Secret/ConfigMap key is missing (CreateContainerConfigError)."""


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names are replaced, `$$` escapes a `$`."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _EXPANSION.sub(sub, value)


def service_links(services: list[dict[str, Any]], master: dict[str, Any] | None) -> dict[str, str]:
    """{NAME}_SERVICE_HOST / _PORT and the docker-link style variables for each Service."""
    env: dict[str, str] = {}
    for svc in ([master] if master else []) + services:
        spec = svc.get("spec") or {}
        ip = spec.get("clusterIP")
        if not ip or ip == "None" or not spec.get("ports"):
            continue
        prefix = svc["metadata"]["name"].upper().replace("-", "_")
        ports = spec["ports"]
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        for p in ports:
            if p.get("name"):
                env[f"{prefix}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
        first = ports[0]
        env[f"{prefix}_PORT"] = f"{first.get('protocol', 'TCP').lower()}://{ip}:{first['port']}"
        for p in ports:
            proto = p.get("protocol", "TCP")
            base = f"{prefix}_PORT_{p['port']}_{proto}"
            env[base] = f"{proto.lower()}://{ip}:{p['port']}"
            env[f"{base}_PROTO"] = proto.lower()
            env[f"{base}_PORT"] = str(p["port"])
            env[f"{base}_ADDR"] = ip
    return env


def field_ref(pod: dict[str, Any], path: str, pod_ip: str, host_ip: str) -> str:
    meta = pod["metadata"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    raise EnvError(f"unsupported fieldRef fieldPath {path!r}")


def resource_ref(container: dict[str, Any], ref: dict[str, Any], allocatable: dict[str, str]) -> str:
    """limits.cpu etc. in units of the divisor, rounded up; unset limits read as the node's."""
    kind, _, res = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(res)
    if value is None:
        value = allocatable.get(res, "0")
    divisor = parse_quantity(ref.get("divisor") or "1")
    return str(math.ceil(parse_quantity(value) / divisor))


def build(
    pod: dict[str, Any],
    container: dict[str, Any],
    *,
    image_path: str,
    pod_ip: str,
    host_ip: str,
    services: dict[str, str],
    allocatable: dict[str, str],
    get_configmap: Callable[[str], dict[str, Any] | None],
    get_secret: Callable[[str], dict[str, Any] | None],
) -> dict[str, str]:
    hostname = pod["spec"].get("hostname") or pod["metadata"]["name"]
    env: dict[str, str] = {
        "PATH": image_path,
        "HOSTNAME": hostname,
        "HOME": "/root",
        "LANG": "C.UTF-8",
    }
    env.update({k: os.environ[k] for k in PASSTHROUGH if k in os.environ})
    env.update(services)

    def source_data(kind: str, name: str, optional: bool) -> dict[str, str] | None:
        obj = (get_configmap if kind == "ConfigMap" else get_secret)(name)
        if obj is None:
            if optional:
                return None
            raise EnvError(f'{kind.lower()} "{name}" not found')
        if kind == "ConfigMap":
            return dict(obj.get("data") or {})
        return {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}

    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            ref = src.get(key)
            if ref:
                data = source_data(kind, ref["name"], bool(ref.get("optional")))
                for k, v in (data or {}).items():
                    env[prefix + k] = v

    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var and var["value"] is not None:
            env[name] = expand(var["value"], env)
            continue
        src = var.get("valueFrom") or {}
        if not src:
            env[name] = ""
        elif "fieldRef" in src:
            env[name] = field_ref(pod, src["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in src:
            env[name] = resource_ref(container, src["resourceFieldRef"], allocatable)
        else:
            kind, key = ("ConfigMap", "configMapKeyRef") if "configMapKeyRef" in src else ("Secret", "secretKeyRef")
            ref = src[key]
            data = source_data(kind, ref["name"], bool(ref.get("optional")))
            if data is None:
                continue
            if ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise EnvError(f'couldn\'t find key {ref["key"]} in {kind} {pod["metadata"]["namespace"]}/{ref["name"]}')
            env[name] = data[ref["key"]]
    return env


def decode_secret_data(obj: dict[str, Any]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
