"""The operator's one typed configuration, built once by the CLI and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kubeshard_operator import __version__

DEFAULT_SHARD_IMAGE = f"ghcr.io/kubeshard/shard-server:{__version__}"
DEFAULT_SHARD_IMAGE_CUDA = f"ghcr.io/kubeshard/shard-server:{__version__}-cuda"
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
DEFAULT_VLLM_CPU_IMAGE = "ghcr.io/kubeshard/vllm-cpu:0.32.0"
DEFAULT_LLAMACPP_IMAGE = "ghcr.io/kubeshard/llamacpp-server:0.3.36"


@dataclass(frozen=True)
class OperatorConfig:
    # Image of shard pods without GPUs, and with GPUs (spec.pod.image overrides both).
    shard_image: str = DEFAULT_SHARD_IMAGE
    shard_image_cuda: str = DEFAULT_SHARD_IMAGE_CUDA
    image_pull_policy: str = "IfNotPresent"
    # Images of the peer engines (spec.runtime.image overrides them): vLLM on GPUs and on
    # CPUs, and llama.cpp's server (llama-cpp-python[server]; hack/images.sh builds it).
    vllm_image: str = DEFAULT_VLLM_IMAGE
    vllm_cpu_image: str = DEFAULT_VLLM_CPU_IMAGE
    llamacpp_image: str = DEFAULT_LLAMACPP_IMAGE
    # KUBESHARD_CACHE of the shard pods: where the shard image keeps what it built ahead
    # (the CPU decode kernel). None: the image's default ($HOME/.cache, an emptyDir).
    shard_cache_dir: Optional[str] = None
    # Base URL of the router's Service; status.url is "<router_url>/models/<name>".
    # None: status.url is the leader Service's gRPC address.
    router_url: Optional[str] = None
    # Redis holding the router's per-model keys; None: the finalizer has nothing to clean.
    # The routers' load counters are read from it too (scale to zero).
    redis_url: Optional[str] = None
    # Bounds on the finalizer's Redis cleanup: per-call timeout, and tries before the
    # finalizer gives up (with a Warning event) so deletion never blocks forever.
    redis_timeout: float = 3.0
    redis_cleanup_tries: int = 3
    # "NAMESPACE/NAME" of the router Service, and the bearer token file of its pods'
    # GET /internal/load: the routers' load asked directly when Redis is away.
    router_service: Optional[str] = None
    load_token_file: Optional[str] = None
    # Seconds between two reconciles of an InferenceService when nothing happened (events
    # on the object and its children wake the reconciler at once).
    reconcile_interval: float = 10.0
    # Shortest and longest wait between two restarts of the same group (exponential
    # backoff in between), so a model that cannot load does not churn pods.
    group_restart_backoff_min: float = 10.0
    group_restart_backoff_max: float = 300.0

    def router_service_ref(self) -> Optional[tuple[str, str]]:
        if not self.router_service:
            return None
        namespace, _, name = self.router_service.partition("/")
        if not namespace or not name:
            raise ValueError(f"router_service must be NAMESPACE/NAME, not {self.router_service!r}")
        return namespace, name
