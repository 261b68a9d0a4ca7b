"""Pure: the pod template of a group's shards (every rank of a group runs the same one).

The rank comes from the pod's ordinal at run time, so one template serves every pod of
a group, and the template's hash (builders.template_hash) says which groups are stale.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from kubernetes.utils import parse_quantity

from kubeshard_operator import naming as n
from kubeshard_operator.config import OperatorConfig
from kubeshard_operator.spec import InferenceServiceSpec

MODEL_ROOT = "/models"
ADAPTER_ROOT = "/adapters"  # spec.model.adapters[i] is mounted at ADAPTER_ROOT/NAME
# spec.model.adapterRoot is mounted here, in every model's pods alike: the chart's router
# (router.runtimeLora) passes the same path as its --lora-root, under which a runtime
# load's lora_path must lie
LORA_ROOT = "/lora-root"
# spec.engine.speculative.draftModel: a folder mounted at DRAFT_ROOT, a .gguf file at
# DRAFT_ROOT/FILE. Not under MODEL_ROOT: an hf:// model's volume is mounted read-only
# there, and a mount point inside a read-only mount cannot be created.
DRAFT_ROOT = "/draft"
# Probe periods: a gRPC health call is cheap, so the probes ask every second. The startup
# probe then adds at most a second to a cold start (a model woken from zero serves as soon
# as it loaded), and readiness notices a broken group within five; the startup probe's
# failure threshold is derived from spec.pod.startupTimeoutSeconds so loading a large
# model is not killed.
PROBE_PERIOD = 1
# A restricted container: non-root, nothing writable but its volumes, no capabilities.
CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def model_dir(spec: InferenceServiceSpec) -> str:
    """Where the shard server finds the weights inside the pod."""
    source = spec.model.source
    if source.kind == "pvc":
        return f"{MODEL_ROOT}/pvc/{source.path}".rstrip("/")
    if source.kind == "host" and source.is_gguf:
        return f"{MODEL_ROOT}/{source.location.rsplit('/', 1)[-1]}"
    return f"{MODEL_ROOT}/model"


def draft_dir(spec: InferenceServiceSpec) -> Optional[str]:
    """Where the shard server finds the draft model (speculative method draft): its own
    mount, or the model's checkpoint when spec.engine.speculative.draftModel is unset."""
    s = spec.engine.speculative
    if s.method != "draft":
        return None
    if s.draft_model is None:
        return model_dir(spec)
    if s.draft_model.is_gguf:
        name = (s.draft_model.path if s.draft_model.kind == "pvc" else s.draft_model.location).rsplit("/", 1)[-1]
        return f"{DRAFT_ROOT}/{name}"
    return DRAFT_ROOT


def speed_args(spec: InferenceServiceSpec) -> list[str]:
    """Quantization, the KV cache dtype and speculative decoding: only what differs from
    the shard server's defaults, so a spec without them keeps its pods (and their hash)."""
    m, e, s = spec.model, spec.engine, spec.engine.speculative
    args: list[str] = []
    if m.quantize != "none":
        args += ["--quantize", m.quantize]
    if m.quantize_group_size != 32:
        args += ["--quantize-group-size", str(m.quantize_group_size)]
    if e.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", e.kv_cache_dtype]
    if not s.enabled:
        return args
    args += ["--speculative", s.method, "--num-speculative-tokens", str(s.num_tokens)]
    if s.disable_by_batch_size:
        args += ["--speculative-disable-by-batch-size", str(s.disable_by_batch_size)]
    if s.method == "ngram":
        args += ["--speculative-ngram-min", str(s.ngram_min), "--speculative-ngram-max", str(s.ngram_max)]
    draft = draft_dir(spec)
    if draft is not None:
        args += ["--speculative-draft-model", draft]
        if s.draft_quantize != "none":
            args += ["--speculative-draft-quantize", s.draft_quantize]
    return args


def shard_image(spec: InferenceServiceSpec, cfg: OperatorConfig) -> str:
    if spec.pod.image:
        return spec.pod.image
    return cfg.shard_image_cuda if spec.resources.gpu > 0 else cfg.shard_image


def shard_args(spec: InferenceServiceSpec, headless_service: str) -> list[str]:
    """The `kubeshard serve-shard` command line. The rank comes from the pod name's
    ordinal (POD_NAME) and the leader is pod 0 behind the group's headless Service, so
    every pod of a group has the same template."""
    m, e = spec.model, spec.engine
    args = [
        "serve-shard",
        "--model", model_dir(spec),
        "--model-id", m.name,
        "--revision", m.revision,
        "--dtype", m.dtype,
        "--device", "cuda" if spec.resources.gpu > 0 else "cpu",
        "--host", "0.0.0.0",
        "--port", str(n.GRPC_PORT),
        "--metrics-port", str(n.METRICS_PORT),
        "--strategy", spec.sharding.strategy,
        "--shards", str(spec.sharding.shards),
        "--headless-service", headless_service,
        "--master-port", str(n.RENDEZVOUS_PORT),
        "--block-size", str(e.block_size),
    ]
    optional = [
        ("--max-input-tokens", e.max_input_tokens),
        ("--max-total-tokens", e.max_total_tokens),
        ("--max-batch-tokens", e.max_batch_tokens),
        ("--max-concurrent-requests", e.max_concurrent_requests),
        ("--kv-cache-memory", e.kv_cache_memory),
    ]
    for flag, value in optional:
        if value is not None:
            args += [flag, str(value)]
    if not e.prefix_caching:
        args.append("--no-prefix-caching")
    args += speed_args(spec)
    # the activation cache (on when the pod has KUBESHARD_REDIS_URL): its keys are named by
    # metadata.name, which the finalizer's kubeshard:<name>:* cleans
    a = spec.activations
    args += ["--redis-key-model", spec.name, "--activation-cache-min-hits", str(a.min_hits),
             "--activation-cache-ttl", str(a.ttl_seconds), "--activation-cache-max-bytes", str(a.max_bytes)]
    if not a.enabled:
        args.append("--no-activation-cache")
    if spec.runtime.name == "onnx":  # ONNX Runtime GenAI inside the shard server
        args += ["--runtime", "onnx"]
    for adapter in m.adapters:  # served at start; more through the router's /v1/load_lora_adapter
        args += ["--lora-adapter", f"{adapter.name}={ADAPTER_ROOT}/{adapter.name}"]
    if m.adapter_root is not None:  # runtime loads from there (implies --enable-lora)
        args += ["--lora-root", LORA_ROOT]
    elif m.adapters:
        args.append("--enable-lora")
    threads = cpu_threads(spec)
    if threads is not None:
        args += ["--num-threads", str(threads)]
    return args


def cpu_threads(spec: InferenceServiceSpec) -> Optional[int]:
    """torch's CPU threads for a CPU shard: its CPU request, rounded up. torch would
    otherwise start one thread per core of the node and fight the other pods there."""
    if spec.resources.gpu > 0 or spec.resources.cpu is None:
        return None
    return max(1, math.ceil(parse_quantity(spec.resources.cpu)))


def shard_redis_url(url: Optional[str]) -> Optional[str]:
    """The operator's Redis URL as shard pods may get it in their spec: not when it
    carries a password (pods in the model's namespace must not hold the secret in their
    spec; spec.cache.activations.urlSecretRef gives them one from a Secret instead)."""
    if not url or re.match(r"^[a-z]+://[^/@]*:[^/@]*@", url):
        return None
    return url


def shard_redis_env(spec: InferenceServiceSpec, operator_url: Optional[str]) -> Optional[dict[str, Any]]:
    """KUBESHARD_REDIS_URL of the shard container (the activation cache's Redis): from the
    Secret key spec.cache.activations.urlSecretRef names (the kubelet reads it; the URL
    and its password stay out of the pod spec and the operator's reach), else the
    operator's URL when it has no password, else none (the cache stays off)."""
    ref = spec.activations.url_secret
    if ref is not None:
        return {"name": "KUBESHARD_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
    url = shard_redis_url(operator_url)
    return {"name": "KUBESHARD_REDIS_URL", "value": url} if url else None


def shard_env(spec: InferenceServiceSpec, index: int,
              cache_dir: Optional[str] = None, redis: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    ours: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE",
         "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "KUBESHARD_GROUP", "value": str(index)},
        # Python writes no .pyc files into the read-only root filesystem.
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        {"name": "HOME", "value": "/tmp"},
    ]
    if cache_dir:
        # A cache that outlives the pod (a hostPath volume): GGUF conversions are found
        # there instead of made again in every new pod. (The CPU kernels come prebuilt in
        # the shard image: KUBESHARD_PREBUILT_KERNELS.)
        ours.append({"name": "KUBESHARD_CACHE", "value": cache_dir})
    if redis:
        ours.append(redis)
    # The user's variables win over ours, and a list with one entry per name keeps
    # server-side apply happy (env is a map keyed by name).
    user = {v["name"]: dict(v) for v in spec.pod.env}
    merged = [user.pop(v["name"], v) for v in ours]
    return merged + list(user.values())


def shard_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    r = spec.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if r.cpu is not None:
        requests["cpu"] = r.cpu  # no CPU limit: throttling a decode loop only adds latency
    if r.memory is not None:
        requests["memory"] = limits["memory"] = r.memory
    if r.gpu > 0:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = r.gpu
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _volumes(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, shard container mounts)."""
    source = spec.model.source
    volumes: list[dict[str, Any]] = [
        # NCCL and torch's shared-memory transport need far more than the 64 MiB default.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.pod.shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if source.kind == "host":
        volumes.append({"name": "model", "hostPath": {
            "path": source.location, "type": "File" if source.is_gguf else "Directory"}})
        mounts.append({"name": "model", "mountPath": model_dir(spec), "readOnly": True})
    elif source.kind == "pvc":
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": source.location, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": f"{MODEL_ROOT}/pvc", "readOnly": True})
    else:
        volumes.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": MODEL_ROOT, "readOnly": True})
    folders = [(f"adapter-{i}", a.source, f"{ADAPTER_ROOT}/{a.name}") for i, a in enumerate(spec.model.adapters)]
    if spec.model.adapter_root is not None:
        folders.append(("lora-root", spec.model.adapter_root, LORA_ROOT))
    for name, source, where in folders:  # read-only folders: a host path or a PVC's (sub)folder
        if source.kind == "host":
            volumes.append({"name": name, "hostPath": {"path": source.location, "type": "Directory"}})
            mounts.append({"name": name, "mountPath": where, "readOnly": True})
        else:
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": source.location, "readOnly": True}})
            mount = {"name": name, "mountPath": where, "readOnly": True}
            if source.path:
                mount["subPath"] = source.path
            mounts.append(mount)
    draft = spec.engine.speculative.draft_model
    if draft is not None and spec.engine.speculative.method == "draft":
        where = draft_dir(spec)
        if draft.kind == "host":
            volumes.append({"name": "draft", "hostPath": {
                "path": draft.location, "type": "File" if draft.is_gguf else "Directory"}})
            mounts.append({"name": "draft", "mountPath": where, "readOnly": True})
        else:
            volumes.append({"name": "draft", "persistentVolumeClaim": {"claimName": draft.location, "readOnly": True}})
            mount = {"name": "draft", "mountPath": where, "readOnly": True}
            if draft.path:
                mount["subPath"] = draft.path
            mounts.append(mount)
    return volumes, mounts


def download_container(spec: InferenceServiceSpec, image: str, pull: str) -> dict[str, Any]:
    """Init container fetching an hf:// model into the pod's model volume."""
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{MODEL_ROOT}/.hf-home"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": "HOME", "value": "/tmp"},
    ]
    token = spec.model.token_secret
    if token is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": token.name, "key": token.key}}})
    return {
        "name": "download",
        "image": image,
        "imagePullPolicy": pull,
        "command": ["hf", "download", spec.model.source.location,
                    "--revision", spec.model.revision,
                    "--local-dir", f"{MODEL_ROOT}/model"],
        "env": env,
        "volumeMounts": [{"name": "model", "mountPath": MODEL_ROOT},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": CONTAINER_SECURITY,
    }


def pod_template(spec: InferenceServiceSpec, cfg: OperatorConfig, index: int) -> dict[str, Any]:
    image = shard_image(spec, cfg)
    pull = spec.pod.image_pull_policy or cfg.image_pull_policy
    volumes, mounts = _volumes(spec)
    inits = [download_container(spec, image, pull)] if spec.model.source.kind == "hf" else []
    grpc_probe = {"grpc": {"port": n.GRPC_PORT}, "periodSeconds": PROBE_PERIOD,
                  "timeoutSeconds": 3}
    container = {
        "name": "shard",
        "image": image,
        "imagePullPolicy": pull,
        "args": shard_args(spec, n.group_name(spec.name, index)),
        "env": shard_env(spec, index, cfg.shard_cache_dir, shard_redis_env(spec, cfg.redis_url)),
        "ports": [
            {"name": "grpc", "containerPort": n.GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": n.METRICS_PORT, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": n.RENDEZVOUS_PORT, "protocol": "TCP"},
        ],
        "resources": shard_resources(spec),
        "volumeMounts": mounts,
        # Health stays NOT_SERVING until every rank of the group has loaded, so these
        # probes mean "the model answers", not "the process is up".
        "startupProbe": {**grpc_probe, "failureThreshold":
                         max(1, math.ceil(spec.pod.startup_timeout_seconds / PROBE_PERIOD))},
        "readinessProbe": {**grpc_probe, "failureThreshold": 5},
        # Liveness only asks whether the process still listens: a loaded engine that is
        # busy must not be killed for a slow health answer.
        "livenessProbe": {"tcpSocket": {"port": n.GRPC_PORT}, "periodSeconds": 10,
                          "timeoutSeconds": 3, "failureThreshold": 6},
        "securityContext": CONTAINER_SECURITY,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {"containers": [container], "volumes": volumes}
    if inits:
        pod_spec["initContainers"] = inits
    pod_spec.update(pod_spec_overrides(spec))
    return {"metadata": shard_labels(spec, index), "spec": pod_spec}


def pod_spec_overrides(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The pod-level settings every group's pods share (whatever runs in them)."""
    pod_spec: dict[str, Any] = {
        "securityContext": POD_SECURITY,
        # Shards never call the Kubernetes API.
        "automountServiceAccountToken": False,
        # Every Service in the namespace would otherwise become environment variables.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.pod.termination_grace_period_seconds,
    }
    tolerations = list(spec.pod.tolerations)
    if spec.resources.gpu > 0 and not any(
            t.get("key") == "nvidia.com/gpu" for t in tolerations):
        # GPU nodes are commonly tainted so only GPU workloads land there.
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists",
                            "effect": "NoSchedule"})
    optional = {
        "nodeSelector": dict(spec.pod.node_selector) or None,
        "tolerations": tolerations or None,
        "affinity": dict(spec.pod.affinity) if spec.pod.affinity else None,
        "serviceAccountName": spec.pod.service_account_name,
        "priorityClassName": spec.pod.priority_class_name,
        "imagePullSecrets": [{"name": s} for s in spec.pod.image_pull_secrets] or None,
    }
    pod_spec.update({k: v for k, v in optional.items() if v is not None})
    return pod_spec


def shard_labels(spec: InferenceServiceSpec, index: int) -> dict[str, Any]:
    """The pod template's metadata: the group's labels, the user's labels and annotations."""
    labels = {
        **dict(spec.pod.labels),
        **n.common_labels(spec.name),
        **n.group_selector(spec.name, index),
        "app.kubernetes.io/component": n.COMPONENT_SHARD,
    }
    meta: dict[str, Any] = {"labels": labels}
    if spec.pod.annotations:
        meta["annotations"] = dict(spec.pod.annotations)
    return meta
