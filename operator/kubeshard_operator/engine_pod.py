"""Pure: the pod template of a group served by a peer engine (vLLM, llama.cpp's server).

One pod per group: the engine's container (its own image, its OpenAI-compatible HTTP API
on ``spec.runtime.port``, ready when its health route answers) and ``kubeshard
engine-info`` beside it (the shard-server image, on the gRPC port the leader Service and
the router already use), which answers the router's Info and Health from the model's
files and names the engine's port, so the router sends generations to the engine
directly. vLLM shards inside its pod: ``spec.sharding.shards`` is its tensor-parallel
size (and the pod gets that many times ``spec.resources.gpu``).

A registry of engines, not a chain of ifs: each gives its default image, its command
line and its health route. The generic ``openai`` engine (SGLang, TGI's own server,
trtllm-serve, ...) has neither image nor command of ours: the container runs
``spec.runtime.image``'s own entrypoint with ``spec.runtime.args``, which may name what
kubeshard decided through Kubernetes' ``$(VAR)`` expansion: ``$(KUBESHARD_MODEL_DIR)``
(the weights), ``$(KUBESHARD_MODEL_NAME)`` (the served model name the router sends),
``$(KUBESHARD_PORT)`` (``spec.runtime.port``) and ``$(KUBESHARD_SHARDS)`` (the GPUs'
tensor-parallel size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kubeshard_operator import naming as n
from kubeshard_operator.config import OperatorConfig
from kubeshard_operator.shard_pod import (CONTAINER_SECURITY, PROBE_PERIOD, _volumes, download_container,
                                          model_dir, pod_spec_overrides, shard_env, shard_image,
                                          shard_labels)
from kubeshard_operator.spec import InferenceServiceSpec

# llama.cpp's context when spec.engine.maxTotalTokens is unset (its own default is 2048,
# below what engine-info reports for most models)
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class PeerEngine:
    health_path: str
    # None: spec.runtime.image is required (the CRD says so), run with its own entrypoint
    default_image: Optional[Callable[[OperatorConfig, InferenceServiceSpec], str]]
    command: Optional[Callable[[InferenceServiceSpec], list[str]]]


def _vllm_command(spec: InferenceServiceSpec) -> list[str]:
    e = spec.engine
    cmd = ["vllm", "serve", model_dir(spec), "--served-model-name", spec.model.name, "--host", "0.0.0.0",
           "--port", str(spec.runtime.port), "--tensor-parallel-size", str(spec.sharding.shards)]
    if spec.model.dtype != "auto":
        cmd += ["--dtype", spec.model.dtype]
    if e.max_total_tokens:
        cmd += ["--max-model-len", str(e.max_total_tokens)]
    if e.max_batch_tokens:
        cmd += ["--max-num-batched-tokens", str(e.max_batch_tokens)]
    if e.kv_cache_memory and "." in e.kv_cache_memory:
        cmd += ["--gpu-memory-utilization", e.kv_cache_memory]
    if e.prefix_caching:
        cmd.append("--enable-prefix-caching")
    return cmd


def _llamacpp_command(spec: InferenceServiceSpec) -> list[str]:
    threads = None if spec.resources.cpu is None else max(1, math.ceil(float(_cpus(spec.resources.cpu))))
    cmd = ["python3", "-m", "llama_cpp.server", "--model", model_dir(spec), "--model_alias", spec.model.name,
           "--host", "0.0.0.0", "--port", str(spec.runtime.port),
           "--n_ctx", str(spec.engine.max_total_tokens or DEFAULT_CONTEXT),
           "--interrupt_requests", "False", "--logits_all", "False"]
    if threads is not None:
        cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    if spec.resources.gpu > 0:
        cmd += ["--n_gpu_layers", "-1"]
    return cmd


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


PEER_ENGINES = {
    "vllm": PeerEngine("/health", lambda cfg, spec: cfg.vllm_image if spec.resources.gpu > 0
                       else cfg.vllm_cpu_image, _vllm_command),
    "llamacpp": PeerEngine("/openapi.json", lambda cfg, spec: cfg.llamacpp_image, _llamacpp_command),
    "openai": PeerEngine("/health", None, None),
}


def _named_for_args(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """What the generic engine's args may name as $(VAR)."""
    return [{"name": "KUBESHARD_MODEL_DIR", "value": model_dir(spec)},
            {"name": "KUBESHARD_MODEL_NAME", "value": spec.model.name},
            {"name": "KUBESHARD_PORT", "value": str(spec.runtime.port)},
            {"name": "KUBESHARD_SHARDS", "value": str(spec.sharding.shards)}]


def engine_info_args(spec: InferenceServiceSpec) -> list[str]:
    e = spec.engine
    args = ["engine-info", "--runtime", spec.runtime.name, "--model", model_dir(spec),
            "--model-id", spec.model.name, "--revision", spec.model.revision,
            "--engine-url", f"http://127.0.0.1:{spec.runtime.port}", "--openai-port", str(spec.runtime.port),
            "--host", "0.0.0.0", "--port", str(n.GRPC_PORT), "--block-size", str(e.block_size),
            "--dtype", spec.model.dtype, "--device", "cuda" if spec.resources.gpu > 0 else "cpu"]
    total = e.max_total_tokens or (DEFAULT_CONTEXT if spec.runtime.name == "llamacpp" else None)
    for flag, value in (("--max-total-tokens", total), ("--max-input-tokens", e.max_input_tokens),
                        ("--max-concurrent-requests", e.max_concurrent_requests)):
        if value is not None:
            args += [flag, str(value)]
    return args


def _engine_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    r = spec.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if r.cpu is not None:
        requests["cpu"] = r.cpu
    if r.memory is not None:
        requests["memory"] = limits["memory"] = r.memory
    if r.gpu > 0:  # the whole group's GPUs: vLLM's tensor-parallel ranks share the pod
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = r.gpu * spec.sharding.shards
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def pod_template(spec: InferenceServiceSpec, cfg: OperatorConfig, index: int) -> dict[str, Any]:
    peer = PEER_ENGINES[spec.runtime.name]
    info_image = shard_image(spec, cfg)
    pull = spec.pod.image_pull_policy or cfg.image_pull_policy
    volumes, mounts = _volumes(spec)
    port = spec.runtime.port
    http_probe = {"httpGet": {"path": peer.health_path, "port": port}, "periodSeconds": PROBE_PERIOD,
                  "timeoutSeconds": 5}
    env = shard_env(spec, index)
    if peer.command is not None:
        run = {"command": peer.command(spec) + list(spec.runtime.args)}
        engine_env = env
    else:
        run = {"args": list(spec.runtime.args)}
        ours = {v["name"] for v in env}
        engine_env = env + [v for v in _named_for_args(spec) if v["name"] not in ours]
    engine = {
        "name": "engine",
        "image": spec.runtime.image or peer.default_image(cfg, spec),
        "imagePullPolicy": pull,
        **run,
        "env": engine_env,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": _engine_resources(spec),
        "volumeMounts": mounts,
        "startupProbe": {**http_probe, "failureThreshold":
                         max(1, math.ceil(spec.pod.startup_timeout_seconds / PROBE_PERIOD))},
        "readinessProbe": {**http_probe, "failureThreshold": 2},
        "livenessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 10, "timeoutSeconds": 3,
                          "failureThreshold": 6},
        "securityContext": CONTAINER_SECURITY,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    grpc_probe = {"grpc": {"port": n.GRPC_PORT}, "periodSeconds": PROBE_PERIOD, "timeoutSeconds": 3}
    info = {
        "name": "engine-info",
        "image": info_image,
        "imagePullPolicy": pull,
        "args": engine_info_args(spec),
        "env": env,
        "ports": [{"name": "grpc", "containerPort": n.GRPC_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": mounts,
        # SERVING while the engine's health route answers: "the model answers"
        "readinessProbe": {**grpc_probe, "failureThreshold": 2},
        "livenessProbe": {"tcpSocket": {"port": n.GRPC_PORT}, "periodSeconds": 10, "timeoutSeconds": 3,
                          "failureThreshold": 6},
        "securityContext": CONTAINER_SECURITY,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {"containers": [engine, info], "volumes": volumes}
    if spec.model.source.kind == "hf":
        pod_spec["initContainers"] = [download_container(spec, info_image, pull)]
    pod_spec.update(pod_spec_overrides(spec))
    return {"metadata": shard_labels(spec, index), "spec": pod_spec}
