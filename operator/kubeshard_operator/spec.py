"""The typed, validated InferenceService spec.

The API server already applies the CRD's defaults and CEL rules, so in a cluster
`parse_spec` only converts. It validates again anyway: builders are also called on plain
dicts (tests, `kubectl apply` against an older CRD), and a spec the operator cannot turn
into pods must become a status condition naming the field, never a crash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from kubernetes.utils import parse_quantity

STRATEGIES = ("tensor", "zero3")
# The engine of a replica: kubeshard's own, ONNX Runtime GenAI inside the shard server,
# or a peer engine behind its OpenAI-compatible HTTP API (with kubeshard engine-info):
# vLLM, llama.cpp's server, or any other such server from the user's image (openai:
# SGLang, TGI's own, trtllm-serve).
RUNTIMES = ("kubeshard", "onnx", "vllm", "llamacpp", "openai")
PEER_RUNTIMES = ("vllm", "llamacpp", "openai")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The shard server's speed options (kubeshard runtime only): weight-only quantization at
# load (CPU, float32 compute; gguf keeps a .gguf file's Q8_0/Q4_0/Q4_1 weights packed), the
# int4 group size, what the KV pool stores (fp8 is refused: no CPU has it and CUDA pools
# lack it), and speculative decoding.
QUANTIZE_METHODS = ("none", "int8", "int4", "gguf")
QUANTIZE_GROUP_SIZES = (32, 64)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
DRAFT_QUANTIZE = ("none", "int8", "int4")
MAX_SPECULATIVE_TOKENS = 16
MAX_NGRAM = 64
METRICS = ("concurrency", "queueDepth", "tokensInFlight", "cpu")
# Default HPA target per metric: requests in flight or queued per replica, queued requests
# per replica, tokens in flight (prompt + new tokens still reserved) per replica, CPU
# utilization percent of the shard pods' requests.
DEFAULT_TARGETS = {"concurrency": 8, "queueDepth": 4, "tokensInFlight": 2048, "cpu": 80}
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# StatefulSet pods carry a controller-revision-hash label "<sts>-<10 chars>" that must
# fit in 63 characters, and the StatefulSet is "<name>-g<index>": 47 leaves room for
# three-digit group indexes.
MAX_NAME_LENGTH = 47
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")


class SpecError(ValueError):
    """A spec the operator cannot serve; the message names the field."""


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: a Hugging Face repo, a PVC, or a host path."""

    kind: Literal["hf", "pvc", "host"]
    # hf: "org/name"; pvc: the claim name; host: the absolute path.
    location: str
    # pvc: the folder inside the claim ("" = the claim's root); otherwise "".
    path: str = ""
    # hf: the @REVISION written in the URI, if any.
    revision: Optional[str] = None

    @classmethod
    def parse(cls, uri: str) -> "ModelSource":
        where = "spec.model.source"
        if not uri:
            raise SpecError(f"{where} is required")
        if uri.startswith("hf://"):
            repo, _, revision = uri[len("hf://"):].partition("@")
            if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", repo):
                raise SpecError(f"{where}: {uri!r} is not hf://ORG/NAME[@REVISION]")
            return cls(kind="hf", location=repo, revision=revision or None)
        if uri.startswith("pvc://"):
            claim, _, path = uri[len("pvc://"):].partition("/")
            if not _DNS1123_SUBDOMAIN.fullmatch(claim):
                raise SpecError(f"{where}: {uri!r} is not pvc://CLAIM[/PATH]")
            if ".." in path.split("/"):
                raise SpecError(f"{where}: the path inside the claim may not contain '..'")
            return cls(kind="pvc", location=claim, path=path.strip("/"))
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        if not path.startswith("/"):
            raise SpecError(
                f"{where}: {uri!r} must be hf://ORG/NAME[@REVISION], pvc://CLAIM/PATH, "
                "file:///ABS/PATH or an absolute host path"
            )
        return cls(kind="host", location=path.rstrip("/") or "/")

    @property
    def is_gguf(self) -> bool:
        """A single GGUF file (the shard server converts it once at start), not a folder."""
        return (self.path if self.kind == "pvc" else self.location).lower().endswith(".gguf")


_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the service's namespace, given to a container as a variable
    (valueFrom.secretKeyRef): spec.model.tokenSecretRef (the hub token, HF_TOKEN of the
    download init container) and spec.cache.activations.urlSecretRef (a Redis URL with
    its password, KUBESHARD_REDIS_URL of the shards)."""

    name: str
    key: str


_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def _secret_ref(ref: Any, where: str, default_key: str) -> Optional[SecretKeyRef]:
    if ref is None:
        return None
    if not isinstance(ref, Mapping) or not ref.get("name"):
        raise SpecError(f"{where}.name is required")
    name, key = str(ref["name"]), str(ref.get("key") or default_key)
    if not _DNS1123_SUBDOMAIN.fullmatch(name) or len(name) > 253:
        raise SpecError(f"{where}.name {name!r} is not a Secret name (lowercase letters, digits, '-' and '.')")
    if not _SECRET_KEY.fullmatch(key) or len(key) > 253:
        raise SpecError(f"{where}.key {key!r} is not a Secret key (letters, digits, '-', '_' and '.')")
    return SecretKeyRef(name=name, key=key)


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource
    # The engine's model id (default: metadata.name): the shard server's --model-id, which
    # its Info answer reports (the router shows it as TGI `served_model_id` and OpenAI
    # `root`) and its metrics carry as `model_name`. Clients do not ask for it: the router
    # names the model after the InferenceService's metadata.name (OpenAI `model`, the
    # /models/{name}/ prefix, the {model} part of its Redis keys). The finalizer removes
    # the Redis keys under both names.
    name: str
    # The {revision} part of the Redis keys; for hf:// sources also what is downloaded.
    revision: str
    dtype: str
    token_secret: Optional[SecretKeyRef]
    adapters: tuple[Adapter, ...] = ()
    # weight-only quantization at load (QUANTIZE_METHODS) and the int4 group size (also
    # the group size of an int4 draft)
    quantize: str = "none"
    quantize_group_size: int = 32
    # a folder of adapter folders the router's /v1/load_lora_adapter may load from at run
    # time (mounted at shard_pod.LORA_ROOT, the chart router's --lora-root)
    adapter_root: Optional[ModelSource] = None


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter served beside the model (spec.model.adapters[])."""

    name: str
    source: ModelSource  # a PVC folder or a host folder


@dataclass(frozen=True)
class Sharding:
    """spec.sharding: how each group splits the model (tensor or zero3) over its shards."""

    strategy: str
    shards: int


@dataclass(frozen=True)
class Resources:
    """Per shard (per pod). Quantities stay strings: Kubernetes parses them."""

    cpu: Optional[str]
    memory: Optional[str]
    gpu: int


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    metric: str
    target: int
    idle_seconds: int
    scale_up_stabilization_seconds: int
    scale_down_stabilization_seconds: int


@dataclass(frozen=True)
class Speculative:
    """spec.engine.speculative: tokens proposed cheaply and verified in one pass. ngram
    looks proposals up in the sequence's own tokens; draft runs a smaller model of the same
    tokenizer (draft_model, or the model's own checkpoint when None, then quantized)."""

    method: str = "none"
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: Optional[ModelSource] = None  # a PVC or host folder or .gguf file
    draft_quantize: str = "none"
    disable_by_batch_size: int = 0  # no speculation while this many sequences run (0: never off)

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class Engine:
    max_input_tokens: Optional[int]
    max_total_tokens: Optional[int]
    max_batch_tokens: Optional[int]
    max_concurrent_requests: Optional[int]
    kv_cache_memory: Optional[str]
    block_size: int
    prefix_caching: bool
    kv_cache_dtype: str = "auto"
    speculative: Speculative = Speculative()


@dataclass(frozen=True)
class PodOverrides:
    image: Optional[str]
    image_pull_policy: Optional[str]
    image_pull_secrets: tuple[str, ...]
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Optional[Mapping[str, Any]]
    env: tuple[Mapping[str, Any], ...]
    annotations: Mapping[str, str]
    labels: Mapping[str, str]
    service_account_name: Optional[str]
    priority_class_name: Optional[str]
    shm_size: str
    startup_timeout_seconds: int
    termination_grace_period_seconds: int


@dataclass(frozen=True)
class Runtime:
    """spec.runtime: the engine, and for a peer engine its image, extra args and port."""

    name: str = "kubeshard"
    image: Optional[str] = None
    args: tuple[str, ...] = ()
    port: int = 8000  # the peer engine's HTTP port in the pod

    @property
    def is_peer(self) -> bool:
        return self.name in PEER_RUNTIMES


@dataclass(frozen=True)
class ActivationCache:
    """spec.cache.activations: the KV blocks of popular prompt prefixes shared through
    Redis between the model's replicas (on whenever the operator knows a Redis without a
    password in its URL, or ``url_secret`` names a Secret's key holding a Redis URL)."""

    enabled: bool = True
    min_hits: int = 2           # prompts that must hold a block before it is written
    ttl_seconds: int = 3600
    max_bytes: int = 512 * 1024**2  # Redis bytes for this model's entries: half the chart's Redis
    url_secret: Optional[SecretKeyRef] = None


@dataclass(frozen=True)
class InferenceServiceSpec:
    name: str
    namespace: str
    replicas: int
    model: ModelSpec
    sharding: Sharding
    resources: Resources
    autoscaling: Optional[Autoscaling]
    engine: Engine
    pod: PodOverrides
    runtime: Runtime = Runtime()
    activations: ActivationCache = ActivationCache()

    @property
    def pods_per_group(self) -> int:
        """kubeshard: one pod per shard; a peer engine shards inside its one pod (vLLM's
        tensor-parallel size), and llama.cpp and onnx have one shard."""
        return 1 if self.runtime.is_peer else self.sharding.shards


def parse_spec(name: str, namespace: str, spec: Mapping[str, Any]) -> InferenceServiceSpec:
    """Builds the typed spec from an InferenceService's `spec` dict (defaults applied)."""
    if not _DNS1035.fullmatch(name) or len(name) > MAX_NAME_LENGTH:
        raise SpecError(
            f"metadata.name {name!r} must be a DNS-1035 label (lowercase letters, digits "
            f"and '-', starting with a letter) of at most {MAX_NAME_LENGTH} characters"
        )
    replicas = _int(spec, "replicas", "spec.replicas", default=1, minimum=0)
    parsed = InferenceServiceSpec(
        name=name,
        namespace=namespace,
        replicas=replicas,
        model=_model(name, _obj(spec, "model", "spec.model", required=True)),
        sharding=_sharding(_obj(spec, "sharding", "spec.sharding")),
        resources=_resources(_obj(spec, "resources", "spec.resources")),
        autoscaling=_autoscaling(spec.get("autoscaling")),
        engine=_engine(_obj(spec, "engine", "spec.engine")),
        pod=_pod(_obj(spec, "pod", "spec.pod")),
        runtime=_runtime(_obj(spec, "runtime", "spec.runtime")),
        activations=_activations(_obj(_obj(spec, "cache", "spec.cache"), "activations", "spec.cache.activations")),
    )
    check_runtime(parsed)
    check_speed_options(parsed)
    return parsed


def _activations(a: Mapping[str, Any]) -> ActivationCache:
    where = "spec.cache.activations"
    max_bytes = a.get("maxBytes", "512Mi")
    try:
        size = int(parse_quantity(str(max_bytes)))
    except ValueError:
        size = 0
    if size < 1:
        raise SpecError(f"{where}.maxBytes {max_bytes!r} must be a positive byte quantity such as 1Gi")
    return ActivationCache(enabled=bool(a.get("enabled", True)),
                           min_hits=_int(a, "minHits", f"{where}.minHits", default=2, minimum=1),
                           ttl_seconds=_int(a, "ttlSeconds", f"{where}.ttlSeconds", default=3600, minimum=1),
                           max_bytes=size, url_secret=_secret_ref(a.get("urlSecretRef"), f"{where}.urlSecretRef",
                                                                  "url"))


def _runtime(r: Mapping[str, Any]) -> Runtime:
    name = _enum(r, "name", "spec.runtime.name", RUNTIMES, "kubeshard")
    args = r.get("args") or ()
    if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        raise SpecError("spec.runtime.args must be a list of strings")
    return Runtime(name=name, image=_str(r, "image", "spec.runtime.image"), args=tuple(args),
                   port=_int(r, "port", "spec.runtime.port", default=8000, minimum=1, maximum=65535))


def check_runtime(spec: InferenceServiceSpec) -> None:
    """What a runtime cannot honour (the CRD's CEL rules say the same at admission)."""
    rt = spec.runtime.name
    if spec.model.adapters and rt != "kubeshard":
        raise SpecError(f"spec.model.adapters are applied by the kubeshard runtime only, not {rt}")
    if spec.model.adapter_root is not None and rt != "kubeshard":
        raise SpecError(f"spec.model.adapterRoot: adapters are loaded at run time by the kubeshard runtime only, "
                        f"not {rt}")
    if rt == "kubeshard":
        if spec.runtime.image or spec.runtime.args:
            raise SpecError("spec.runtime.image and spec.runtime.args are for other runtimes; the kubeshard "
                            "runtime takes its image from spec.pod.image")
        return
    if spec.sharding.strategy != "tensor":
        raise SpecError(f"spec.sharding.strategy zero3 needs spec.runtime.name kubeshard; the {rt} runtime "
                        "shards with tensor parallelism only")
    if rt in ("llamacpp", "onnx") and spec.sharding.shards != 1:
        raise SpecError(f"spec.runtime.name {rt} serves a replica from one process: spec.sharding.shards "
                        f"must be 1, not {spec.sharding.shards}")
    if rt == "llamacpp" and not spec.model.source.is_gguf:
        raise SpecError("spec.runtime.name llamacpp needs a .gguf file in spec.model.source")
    if rt == "onnx" and spec.resources.gpu > 0:
        raise SpecError("spec.runtime.name onnx runs ONNX Runtime GenAI's CPU build: spec.resources.gpu must be 0")
    if rt == "vllm" and spec.model.source.is_gguf:
        raise SpecError("spec.runtime.name vllm serves a Hugging Face folder (hf://, pvc:// or a host folder), "
                        "not a .gguf file")
    if rt == "openai" and not spec.runtime.image:
        raise SpecError("spec.runtime.name openai needs spec.runtime.image: the image of an OpenAI-compatible "
                        "server (SGLang, TGI, trtllm-serve, ...), started by spec.runtime.args")
    if rt == "onnx" and (spec.runtime.image or spec.runtime.args):
        raise SpecError("spec.runtime.image and spec.runtime.args are for peer engines; the onnx runtime "
                        "runs in the shard server (spec.pod.image)")


def check_speed_options(spec: InferenceServiceSpec) -> None:
    """What the shard server would refuse at start about quantization, the KV cache dtype
    and speculative decoding, refused here naming the field (the CRD's CEL rules say the
    same at admission)."""
    m, e, s = spec.model, spec.engine, spec.engine.speculative
    if spec.runtime.name != "kubeshard":
        for field, value, default in (("spec.model.quantize", m.quantize, "none"),
                                      ("spec.engine.kvCacheDtype", e.kv_cache_dtype, "auto"),
                                      ("spec.engine.speculative.method", s.method, "none")):
            if value != default:
                raise SpecError(f"{field} {value} is an option of kubeshard's own engine (spec.runtime.name "
                                f"kubeshard); the {spec.runtime.name} runtime would ignore it: set it in its "
                                "own terms (a quantized checkpoint, spec.runtime.args) or leave it unset")
    if m.quantize != "none":
        if spec.resources.gpu > 0:
            raise SpecError(f"spec.model.quantize {m.quantize} runs CPU kernels: spec.resources.gpu must be 0 "
                            "(on GPUs serve spec.model.dtype bfloat16 or float16 with quantize none)")
        if spec.sharding.strategy == "zero3" and spec.sharding.shards > 1:
            raise SpecError(f"spec.model.quantize {m.quantize} is not available with spec.sharding.strategy zero3: "
                            "its flat partitions hold one float dtype; use strategy tensor (each shard packs "
                            "its slice)")
    if s.method != "draft" or s.draft_quantize == "none":
        return
    if spec.resources.gpu > 0:
        raise SpecError(f"spec.engine.speculative.draftQuantize {s.draft_quantize} runs CPU kernels: "
                        "spec.resources.gpu must be 0")
    if m.dtype not in ("auto", "float32"):
        raise SpecError(f"spec.engine.speculative.draftQuantize {s.draft_quantize} computes in float32: "
                        f"spec.model.dtype must be auto or float32, not {m.dtype}")


def _model(default_name: str, m: Mapping[str, Any]) -> ModelSpec:
    source = ModelSource.parse(_str(m, "source", "spec.model.source") or "")
    name = _str(m, "name", "spec.model.name") or default_name
    if not _MODEL_NAME.fullmatch(name):
        raise SpecError(f"spec.model.name {name!r} may hold only letters, digits and . _ / -")
    revision = _str(m, "revision", "spec.model.revision")
    if source.revision and revision and source.revision != revision:
        raise SpecError(
            f"spec.model.revision {revision!r} contradicts the @{source.revision} "
            "in spec.model.source; give the revision in one place"
        )
    dtype = _enum(m, "dtype", "spec.model.dtype", DTYPES, "auto")
    quantize = _enum(m, "quantize", "spec.model.quantize", QUANTIZE_METHODS, "none")
    group = _int(m, "quantizeGroupSize", "spec.model.quantizeGroupSize", default=32)
    if group not in QUANTIZE_GROUP_SIZES:
        raise SpecError(f"spec.model.quantizeGroupSize must be 32 or 64, not {group}")
    if quantize != "none" and dtype not in ("auto", "float32"):
        raise SpecError(f"spec.model.quantize {quantize} computes in float32: spec.model.dtype must be auto or "
                        f"float32, not {dtype}")
    if quantize == "gguf" and not source.is_gguf:
        raise SpecError("spec.model.quantize gguf keeps a GGUF file's quantized weights: spec.model.source must "
                        "be a .gguf file (int8 or int4 quantize a folder's weights at load)")
    return ModelSpec(source=source, name=name, revision=revision or source.revision or "main",
                     dtype=dtype, token_secret=_secret_ref(m.get("tokenSecretRef"), "spec.model.tokenSecretRef",
                                                           "token"), adapters=_adapters(m.get("adapters"), name),
                     quantize=quantize, quantize_group_size=group, adapter_root=_adapter_root(m.get("adapterRoot")))


def _mounted_source(uri: str, where: str, what: str) -> ModelSource:
    """A folder or file mounted read-only into the shard pods: pvc:// or a host path."""
    try:
        source = ModelSource.parse(uri)
    except SpecError as exc:
        raise SpecError(str(exc).replace("spec.model.source", where)) from None
    if source.kind == "hf":
        raise SpecError(f"{where}: hf:// {what} are not downloaded; put it on a PVC (pvc://CLAIM/PATH) or a "
                        "host path")
    return source


def _adapter_root(raw: Any) -> Optional[ModelSource]:
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str):
        raise SpecError("spec.model.adapterRoot must be a string: pvc://CLAIM/PATH or a host path")
    source = _mounted_source(raw, "spec.model.adapterRoot", "adapter folders")
    if source.is_gguf:
        raise SpecError("spec.model.adapterRoot must be a folder (of adapter folders), not a .gguf file")
    return source


def _adapters(raw: Any, model_name: str) -> tuple[Adapter, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError("spec.model.adapters must be a list of {name, source}")
    out: list[Adapter] = []
    for i, a in enumerate(raw):
        where = f"spec.model.adapters[{i}]"
        if not isinstance(a, Mapping):
            raise SpecError(f"{where} must be an object with name and source")
        name = _str(a, "name", f"{where}.name") or ""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
            raise SpecError(f"{where}.name {name!r} may hold only letters, digits and . _ - (at most 64)")
        if name == model_name or any(o.name == name for o in out):
            raise SpecError(f"{where}.name {name!r} is taken (by the model or another adapter)")
        source = _mounted_source(_str(a, "source", f"{where}.source") or "", f"{where}.source", "adapters")
        out.append(Adapter(name=name, source=source))
    if len(out) > 8:
        raise SpecError("spec.model.adapters holds more than 8 adapters")
    return tuple(out)


def _sharding(s: Mapping[str, Any]) -> Sharding:
    strategy = _enum(s, "strategy", "spec.sharding.strategy", STRATEGIES, "tensor")
    shards = _int(s, "shards", "spec.sharding.shards", default=1, minimum=1)
    return Sharding(strategy=strategy, shards=shards)


def _resources(r: Mapping[str, Any]) -> Resources:
    return Resources(
        cpu=_quantity(r, "cpu", "spec.resources.cpu"),
        memory=_quantity(r, "memory", "spec.resources.memory"),
        gpu=_int(r, "gpu", "spec.resources.gpu", default=0, minimum=0),
    )


def _autoscaling(a: Any) -> Optional[Autoscaling]:
    if a is None:
        return None
    if not isinstance(a, Mapping):
        raise SpecError("spec.autoscaling must be an object")
    lo = _int(a, "minReplicas", "spec.autoscaling.minReplicas", default=1, minimum=0)
    hi = _int(a, "maxReplicas", "spec.autoscaling.maxReplicas", default=None, minimum=1)
    if lo > hi:
        raise SpecError(
            f"spec.autoscaling.minReplicas ({lo}) must be less than or equal to "
            f"spec.autoscaling.maxReplicas ({hi})"
        )
    metric = _enum(a, "metric", "spec.autoscaling.metric", METRICS, "concurrency")
    return Autoscaling(
        min_replicas=lo,
        max_replicas=hi,
        metric=metric,
        target=_int(a, "target", "spec.autoscaling.target",
                    default=DEFAULT_TARGETS[metric], minimum=1),
        idle_seconds=_int(a, "idleSeconds", "spec.autoscaling.idleSeconds",
                          default=300, minimum=0),
        scale_up_stabilization_seconds=_int(
            a, "scaleUpStabilizationSeconds", "spec.autoscaling.scaleUpStabilizationSeconds",
            default=0, minimum=0, maximum=3600),
        scale_down_stabilization_seconds=_int(
            a, "scaleDownStabilizationSeconds",
            "spec.autoscaling.scaleDownStabilizationSeconds",
            default=300, minimum=0, maximum=3600),
    )


def _engine(e: Mapping[str, Any]) -> Engine:
    def opt(key: str) -> Optional[int]:
        return _int(e, key, f"spec.engine.{key}", default=None, minimum=1)

    engine = Engine(
        max_input_tokens=opt("maxInputTokens"),
        max_total_tokens=opt("maxTotalTokens"),
        max_batch_tokens=opt("maxBatchTokens"),
        max_concurrent_requests=opt("maxConcurrentRequests"),
        kv_cache_memory=_kv_memory(e.get("kvCacheMemory")),
        block_size=_int(e, "blockSize", "spec.engine.blockSize", default=16, minimum=1,
                        maximum=1024),
        prefix_caching=bool(e.get("prefixCaching", True)),
        kv_cache_dtype=_enum(e, "kvCacheDtype", "spec.engine.kvCacheDtype", KV_CACHE_DTYPES, "auto"),
        speculative=_speculative(_obj(e, "speculative", "spec.engine.speculative")),
    )
    if engine.max_input_tokens and engine.max_total_tokens and \
            engine.max_input_tokens >= engine.max_total_tokens:
        raise SpecError(
            f"spec.engine.maxInputTokens ({engine.max_input_tokens}) must be less than "
            f"spec.engine.maxTotalTokens ({engine.max_total_tokens})"
        )
    if engine.max_input_tokens and engine.max_batch_tokens and \
            engine.max_batch_tokens < engine.max_input_tokens:
        raise SpecError(
            f"spec.engine.maxBatchTokens ({engine.max_batch_tokens}) must be at least "
            f"spec.engine.maxInputTokens ({engine.max_input_tokens})"
        )
    return engine


def _speculative(s: Mapping[str, Any]) -> Speculative:
    where = "spec.engine.speculative"
    method = _enum(s, "method", f"{where}.method", SPECULATIVE_METHODS, "none")
    lo = _int(s, "ngramMin", f"{where}.ngramMin", default=2, minimum=1, maximum=MAX_NGRAM)
    hi = _int(s, "ngramMax", f"{where}.ngramMax", default=4, minimum=1, maximum=MAX_NGRAM)
    if lo > hi:
        raise SpecError(f"{where}.ngramMin ({lo}) must be at most {where}.ngramMax ({hi}; default 4)")
    raw_draft = _str(s, "draftModel", f"{where}.draftModel")
    draft = None if raw_draft is None else _mounted_source(raw_draft, f"{where}.draftModel", "draft models")
    draft_quantize = _enum(s, "draftQuantize", f"{where}.draftQuantize", DRAFT_QUANTIZE, "none")
    if draft is not None and method != "draft":
        raise SpecError(f"{where}.draftModel is only used with {where}.method draft, not {method}")
    if method == "draft" and draft is None and draft_quantize == "none":
        raise SpecError(f"{where}.method draft without draftModel drafts with the model's own checkpoint, which "
                        f"is only cheaper quantized: set {where}.draftQuantize int8 or int4, or a draftModel")
    return Speculative(method=method,
                       num_tokens=_int(s, "numTokens", f"{where}.numTokens", default=4, minimum=1,
                                       maximum=MAX_SPECULATIVE_TOKENS),
                       ngram_min=lo, ngram_max=hi, draft_model=draft, draft_quantize=draft_quantize,
                       disable_by_batch_size=_batch_size_off(s, f"{where}.disableByBatchSize"))


def _batch_size_off(s: Mapping[str, Any], where: str) -> int:
    value = _int(s, "disableByBatchSize", where, default=0, minimum=0, maximum=4096)
    if value == 1:
        raise SpecError(f"{where} must be 0 (never) or between 2 and 4096, not 1 (which would never speculate)")
    return value


def _kv_memory(value: Any) -> Optional[str]:
    """Bytes as a quantity ("8Gi") or a fraction of the device memory in (0, 1)."""
    if value is None:
        return None
    text = str(value)
    try:
        fraction = float(text)
    except ValueError:
        fraction = None
    if fraction is not None and "." in text:
        if not 0 < fraction < 1:
            raise SpecError(f"spec.engine.kvCacheMemory fraction {text} must be in (0, 1)")
        return text
    try:
        if parse_quantity(text) <= 0:
            raise SpecError(f"spec.engine.kvCacheMemory {text!r} must be positive")
    except ValueError:
        raise SpecError(
            f"spec.engine.kvCacheMemory {text!r} must be a byte quantity such as 8Gi "
            "or a fraction such as 0.9"
        ) from None
    return text


def _pod(p: Mapping[str, Any]) -> PodOverrides:
    env = tuple(p.get("env") or ())
    for i, var in enumerate(env):
        if not isinstance(var, Mapping) or not var.get("name"):
            raise SpecError(f"spec.pod.env[{i}].name is required")
    return PodOverrides(
        image=_str(p, "image", "spec.pod.image"),
        image_pull_policy=_enum(p, "imagePullPolicy", "spec.pod.imagePullPolicy",
                                PULL_POLICIES, None),
        image_pull_secrets=tuple(str(s) for s in p.get("imagePullSecrets") or ()),
        node_selector=dict(p.get("nodeSelector") or {}),
        tolerations=tuple(p.get("tolerations") or ()),
        affinity=p.get("affinity") or None,
        env=env,
        annotations=dict(p.get("annotations") or {}),
        labels=dict(p.get("labels") or {}),
        service_account_name=_str(p, "serviceAccountName", "spec.pod.serviceAccountName"),
        priority_class_name=_str(p, "priorityClassName", "spec.pod.priorityClassName"),
        shm_size=_quantity(p, "shmSize", "spec.pod.shmSize") or "1Gi",
        startup_timeout_seconds=_int(p, "startupTimeoutSeconds", "spec.pod.startupTimeoutSeconds",
                                     default=1800, minimum=30),
        termination_grace_period_seconds=_int(
            p, "terminationGracePeriodSeconds", "spec.pod.terminationGracePeriodSeconds",
            default=30, minimum=0),
    )


# -- small typed accessors: every error names its field ------------------------------


def _obj(d: Mapping[str, Any], key: str, where: str, required: bool = False) -> Mapping[str, Any]:
    value = d.get(key)
    if value is None:
        if required:
            raise SpecError(f"{where} is required")
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where} must be an object")
    return value


def _str(d: Mapping[str, Any], key: str, where: str) -> Optional[str]:
    value = d.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise SpecError(f"{where} must be a string")
    return value


def _int(d: Mapping[str, Any], key: str, where: str, *, default: Optional[int],
         minimum: Optional[int] = None, maximum: Optional[int] = None) -> Any:
    value = d.get(key, default)
    if value is None:
        if default is None and key in ("maxReplicas",):
            raise SpecError(f"{where} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where} must be an integer, not {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(f"{where} must be at least {minimum}, not {value}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{where} must be at most {maximum}, not {value}")
    return value


def _enum(d: Mapping[str, Any], key: str, where: str, allowed: tuple[str, ...],
          default: Optional[str]) -> Any:
    value = d.get(key, default)
    if value is not None and value not in allowed:
        raise SpecError(f"{where} {value!r} is not one of: {', '.join(allowed)}")
    return value


def _quantity(d: Mapping[str, Any], key: str, where: str) -> Optional[str]:
    value = d.get(key)
    text = "" if value is None else str(value)  # 2 or "2": YAML gives either
    if not text:
        return None
    try:
        amount = parse_quantity(text)
    except ValueError:
        raise SpecError(f"{where} {text!r} is not a quantity such as 500m, 2 or 4Gi") from None
    if amount < 0:
        raise SpecError(f"{where} {text!r} must not be negative")
    return text
