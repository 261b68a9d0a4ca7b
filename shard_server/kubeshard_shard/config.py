"""The model server's configuration: typed, validated objects built once at the edge.

``kubeshard serve-shard`` and ``kubeshard serve`` parse their flags into these (the
``from_args`` constructors) and pass them down; nothing below the command line reads
flags or the environment. ``EngineConfig.to_flags`` turns a config back into a
``serve-shard`` command line, which is how the local launcher starts its shards.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

STRATEGIES = ("tensor", "zero3")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_GEMMS = ("auto", "onednn", "torch")
QUANTIZE_METHODS = ("none", "int8", "int4", "gguf")
QUANTIZE_GROUP_SIZES = (32, 64)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mi": 1024**2, "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
          "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4}
_ORDINAL = re.compile(r"^(?P<set>.+)-(?P<ordinal>\d+)$")


@dataclass(frozen=True)
class MemoryBudget:
    """Either an absolute size in bytes or a fraction of the device's memory."""

    bytes: int | None = None
    fraction: float | None = None
    text: str = ""  # as the user wrote it (for command lines and messages)

    @classmethod
    def parse(cls, text: str, flag: str = "--kv-cache-memory") -> "MemoryBudget":
        text = str(text).strip()
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is not None and 0 < value < 1 and "." in text:
            return cls(fraction=value, text=text)
        m = _SIZE.match(text)
        if not m:
            raise ValueError(f"{flag}: '{text}' is neither a size (e.g. 2GiB, 512MB, 1000000) "
                             "nor a fraction in (0, 1) (e.g. 0.2)")
        number, unit = float(m.group(1)), (m.group(2) or "").lower()
        size = int(number * _UNITS[unit])
        if size <= 0:
            raise ValueError(f"{flag}: must be positive, got '{text}'")
        return cls(bytes=size, text=text)

    def resolve(self, device_total: int) -> int:
        return self.bytes if self.bytes is not None else int(self.fraction * device_total)


@dataclass(frozen=True)
class ActivationCacheConfig:
    """The activation cache: KV blocks of popular prompt prefixes shared through Redis.

    On whenever there is a Redis URL, unless turned off. ``key_model`` is the ``{model}``
    part of its keys (default: the served model id); on Kubernetes it is the
    InferenceService's name, whose keys the operator's finalizer deletes."""

    redis_url: str | None = None
    enabled: bool = True
    key_model: str | None = None
    min_hits: int = 2            # prompts that must have held a block before it is written
    ttl_s: int = 3600            # lifetime of an entry (and of the counters)
    max_bytes: int | None = 1024**3  # per model; None: only Redis's own eviction
    timeout_s: float = 1.0       # longest a request waits for Redis before it computes
    retry_s: float = 1.0         # after a Redis failure, skip it this long

    def __post_init__(self) -> None:
        if self.min_hits < 1:
            raise ValueError(f"--activation-cache-min-hits must be >= 1, got {self.min_hits}")
        if self.ttl_s < 1:
            raise ValueError(f"--activation-cache-ttl must be >= 1 second, got {self.ttl_s}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"--activation-cache-max-bytes must be positive, got {self.max_bytes}")
        if not 0 < self.timeout_s <= 60:
            raise ValueError(f"--activation-cache-timeout must be in (0, 60] seconds, got {self.timeout_s}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            from kubeshard_shard.activations.store import redact  # the URL may hold a password

            raise ValueError(f"--redis-url must start with redis://, rediss:// or unix://, got "
                             f"'{redact(self.redis_url)}'")
        if self.key_model is not None and (not self.key_model or any(c in self.key_model for c in "{}*?[]: ")):
            raise ValueError(f"--redis-key-model must be a plain name (no braces, glob characters, colons or "
                             f"spaces), got '{self.key_model}'")

    @property
    def active(self) -> bool:
        return self.enabled and self.redis_url is not None

    @classmethod
    def from_args(cls, args: Any, redis_url: str | None) -> "ActivationCacheConfig":
        return cls(redis_url=redis_url, enabled=not args.no_activation_cache,
                   key_model=getattr(args, "redis_key_model", None), min_hits=args.activation_cache_min_hits,
                   ttl_s=args.activation_cache_ttl, max_bytes=_byte_budget(args.activation_cache_max_bytes),
                   timeout_s=args.activation_cache_timeout)

    def to_flags(self) -> list[str]:
        """As ``serve-shard`` flags (the URL included when set)."""
        out = ["--activation-cache-min-hits", str(self.min_hits), "--activation-cache-ttl", str(self.ttl_s),
               "--activation-cache-max-bytes", str(self.max_bytes or 0),
               "--activation-cache-timeout", str(self.timeout_s)]
        if self.redis_url is not None:
            out += ["--redis-url", self.redis_url]
        if self.key_model is not None:
            out += ["--redis-key-model", self.key_model]
        if not self.enabled:
            out.append("--no-activation-cache")
        return out


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``engine.speculative``): ``method`` none, ngram (proposals
    looked up in the sequence's own tokens: suffixes of ``ngram_min`` to ``ngram_max``
    tokens) or draft (``draft_model``, a smaller checkpoint of the same tokenizer,
    optionally quantized); at most ``num_tokens`` proposed per step; none while
    ``disable_by_batch_size`` or more sequences run (0: at any batch size)."""

    method: str = "none"
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: Path | None = None
    draft_quantize: str = "none"
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative must be one of {', '.join(SPECULATIVE_METHODS)}; got '{self.method}'")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ValueError(f"--speculative-ngram-min ({self.ngram_min}) and --speculative-ngram-max "
                             f"({self.ngram_max}) must satisfy 1 <= min <= max <= 64")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("--speculative draft needs --speculative-draft-model (a folder or .gguf file)")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"--speculative-draft-model is only used with --speculative draft (got "
                             f"--speculative {self.method})")
        if self.draft_quantize not in ("none", "int8", "int4"):
            raise ValueError(f"--speculative-draft-quantize must be none, int8 or int4; got '{self.draft_quantize}'")
        if self.disable_by_batch_size < 0 or self.disable_by_batch_size == 1:
            raise ValueError(f"--speculative-disable-by-batch-size must be 0 (never) or at least 2 (1 would never "
                             f"speculate); got {self.disable_by_batch_size}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @classmethod
    def from_args(cls, args: Any) -> "SpeculativeConfig":
        draft = getattr(args, "speculative_draft_model", None)
        return cls(method=getattr(args, "speculative", "none"), num_tokens=getattr(args, "num_speculative_tokens", 4),
                   ngram_min=getattr(args, "speculative_ngram_min", 2),
                   ngram_max=getattr(args, "speculative_ngram_max", 4),
                   draft_model=Path(draft).expanduser() if draft else None,
                   draft_quantize=getattr(args, "speculative_draft_quantize", "none"),
                   disable_by_batch_size=getattr(args, "speculative_disable_by_batch_size", 0))

    def to_flags(self) -> list[str]:
        out = ["--speculative", self.method, "--num-speculative-tokens", str(self.num_tokens),
               "--speculative-ngram-min", str(self.ngram_min), "--speculative-ngram-max", str(self.ngram_max),
               "--speculative-draft-quantize", self.draft_quantize,
               "--speculative-disable-by-batch-size", str(self.disable_by_batch_size)]
        if self.draft_model is not None:
            out += ["--speculative-draft-model", str(self.draft_model)]
        return out


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    model_id: str
    revision: str = "main"
    dtype: str = "auto"
    device: str = "auto"
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_batch_tokens: int = 2048
    max_concurrent_requests: int = 512
    max_num_seqs: int = 256
    kv_cache_memory: MemoryBudget | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    # CPU paths: the compiled decode-attention kernel (off: torch's portable path), and
    # which library runs the GEMMs (auto: oneDNN where it is faster and works for the dtype).
    cpu_kernels: bool = True
    cpu_gemm: str = "auto"
    # weight-only quantization at load (models/quant.py): none, int8, int4 or gguf (keep a
    # GGUF file's Q8_0/Q4_0/Q4_1), and the int4 group size
    quantize: str = "none"
    quantize_group_size: int = 32
    # what the KV pool stores (auto: the model's dtype; int8: one scale per token and head)
    kv_cache_dtype: str = "auto"
    activations: ActivationCacheConfig = ActivationCacheConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    # LoRA: adapters loaded at start ((name, folder) pairs), runtime loading, slots and rank
    lora_adapters: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    # the folder runtime loads (LoadAdapter) must lie under, symbolic links resolved; None:
    # runtime loads are refused (start-up adapters are not affected). Implies enable_lora.
    lora_root: Path | None = None
    max_loras: int = 8
    max_lora_rank: int = 64

    @property
    def lora_on(self) -> bool:
        """Whether the engine wraps its projections for LoRA adapters."""
        return self.enable_lora or bool(self.lora_adapters) or self.lora_root is not None

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_concurrent_requests", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("max_input_tokens", "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.max_input_tokens and self.max_total_tokens and self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(f"--max-input-tokens ({self.max_input_tokens}) must be less than "
                             f"--max-total-tokens ({self.max_total_tokens})")
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise ValueError(f"--block-size must be a power of two up to 256, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got '{self.dtype}'")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N; got '{self.device}'")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"--cpu-gemm must be one of {', '.join(CPU_GEMMS)}; got '{self.cpu_gemm}'")
        if self.quantize not in QUANTIZE_METHODS:
            raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_METHODS)}; got '{self.quantize}'")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got '{self.kv_cache_dtype}'")
        if self.quantize_group_size not in QUANTIZE_GROUP_SIZES:
            raise ValueError(f"--quantize-group-size must be one of {', '.join(map(str, QUANTIZE_GROUP_SIZES))}; "
                             f"got {self.quantize_group_size}")
        names = [name for name, _ in self.lora_adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-adapter names must be unique; got {', '.join(names)}")
        if len(names) > self.max_loras:
            raise ValueError(f"--lora-adapter gives {len(names)} adapters, more than --max-loras ({self.max_loras})")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer")
        if self.lora_root is not None and not (self.lora_root.is_absolute() and self.lora_root.is_dir()):
            raise ValueError(f"--lora-root must be an absolute path to a folder; got '{self.lora_root}'")

    @classmethod
    def from_args(cls, args: Any, model_dir: Path | None = None, model_id: str | None = None) -> "EngineConfig":
        """From parsed ``serve-shard``/``serve`` flags; ``model_dir`` and ``model_id``
        stand in for ``--model``/``--model-id`` when the caller resolved a default."""
        model_dir = Path(model_dir if model_dir is not None else args.model).expanduser()
        return cls(
            model_dir=model_dir,
            model_id=model_id or args.model_id or model_dir.resolve().name,
            revision=args.revision,
            dtype=args.dtype,
            device=args.device,
            max_input_tokens=args.max_input_tokens,
            max_total_tokens=args.max_total_tokens,
            max_batch_tokens=args.max_batch_tokens,
            max_concurrent_requests=args.max_concurrent_requests,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory=MemoryBudget.parse(args.kv_cache_memory) if args.kv_cache_memory else None,
            block_size=args.block_size,
            enable_prefix_caching=not args.no_prefix_caching,
            num_threads=args.num_threads,
            cpu_kernels=not args.no_cpu_kernels,
            cpu_gemm=args.cpu_gemm,
            quantize=getattr(args, "quantize", "none"),
            quantize_group_size=getattr(args, "quantize_group_size", 32),
            kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
            activations=ActivationCacheConfig.from_args(args, getattr(args, "redis_url", None)),
            speculative=SpeculativeConfig.from_args(args),
            lora_adapters=tuple(parse_lora_adapter(a) for a in getattr(args, "lora_adapter", None) or ()),
            enable_lora=getattr(args, "enable_lora", False),
            lora_root=Path(args.lora_root) if getattr(args, "lora_root", None) else None,
            max_loras=getattr(args, "max_loras", 8),
            max_lora_rank=getattr(args, "max_lora_rank", 64),
        )

    def to_flags(self) -> list[str]:
        """This config as ``serve-shard`` flags (the inverse of ``from_args``)."""
        out = ["--model", str(self.model_dir), "--model-id", self.model_id, "--revision", self.revision,
               "--dtype", self.dtype, "--device", self.device, "--max-batch-tokens", str(self.max_batch_tokens),
               "--max-concurrent-requests", str(self.max_concurrent_requests),
               "--max-num-seqs", str(self.max_num_seqs), "--block-size", str(self.block_size),
               "--cpu-gemm", self.cpu_gemm, "--quantize", self.quantize,
               "--quantize-group-size", str(self.quantize_group_size), "--kv-cache-dtype", self.kv_cache_dtype]
        for flag, value in (("--max-input-tokens", self.max_input_tokens),
                            ("--max-total-tokens", self.max_total_tokens),
                            ("--kv-cache-memory", self.kv_cache_memory.text if self.kv_cache_memory else None),
                            ("--num-threads", self.num_threads)):
            if value is not None:
                out += [flag, str(value)]
        if not self.enable_prefix_caching:
            out.append("--no-prefix-caching")
        if not self.cpu_kernels:
            out.append("--no-cpu-kernels")
        for name, source in self.lora_adapters:
            out += ["--lora-adapter", f"{name}={source}"]
        if self.enable_lora:
            out.append("--enable-lora")
        if self.lora_root is not None:
            out += ["--lora-root", str(self.lora_root)]
        out += ["--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank)]
        return out + self.activations.to_flags() + self.speculative.to_flags()


def parse_lora_adapter(text: str) -> tuple[str, str]:
    """``NAME=FOLDER`` (a PEFT LoRA adapter folder) of --lora-adapter."""
    name, sep, source = str(text).partition("=")
    if not sep or not name.strip() or not source.strip():
        raise ValueError(f"--lora-adapter must be NAME=FOLDER (a PEFT adapter folder); got '{text}'")
    return name.strip(), source.strip()


@dataclass(frozen=True)
class Placement:
    """Where this process sits in its shard group: the strategy, the group's size, this
    process's rank and the leader's rendezvous address."""

    strategy: str = "tensor"
    shards: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 60.0
    offload: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}; got '{self.strategy}'")
        if self.shards < 1:
            raise ValueError(f"--shards must be >= 1, got {self.shards}")
        if not 0 <= self.rank < self.shards:
            raise ValueError(f"rank {self.rank} is outside the group of {self.shards} shards")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be a TCP port, got {self.master_port}")
        if self.offload not in (None, "cpu"):
            raise ValueError(f"--offload must be 'cpu' when given, got '{self.offload}'")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def resolve(cls, strategy: str | None, shards: int | None, rank: int | None, master_addr: str | None,
                master_port: int | None, headless_service: str | None, timeout_s: float,
                offload: str | None, env: Mapping[str, str]) -> "Placement":
        """Precedence per value: flag, then the torchrun-style variable (RANK, WORLD_SIZE,
        MASTER_ADDR, MASTER_PORT), then — inside a StatefulSet with ``headless_service`` —
        the pod name's ordinal as the rank and ``<statefulset>-0.<service>`` as the
        leader, so a pod needs no per-pod configuration."""
        shards = shards if shards is not None else _int_env(env, "WORLD_SIZE")
        pod_set = pod_rank = None
        if headless_service:
            pod_set, pod_rank = pod_identity(env)
        if rank is None:
            rank = _int_env(env, "RANK")
        if rank is None:
            rank = pod_rank if pod_rank is not None else 0
        if master_addr is None:
            master_addr = env.get("MASTER_ADDR") or None
        if master_addr is None:
            master_addr = f"{pod_set}-0.{headless_service}" if headless_service else "127.0.0.1"
        if master_port is None:
            master_port = _int_env(env, "MASTER_PORT") or 29500
        return cls(strategy=strategy or "tensor", shards=shards or 1, rank=rank, master_addr=master_addr,
                   master_port=master_port, timeout_s=timeout_s, offload=offload)

    @classmethod
    def from_args(cls, args: Any, env: Mapping[str, str] | None = None) -> "Placement":
        return cls.resolve(args.strategy, args.shards, args.rank, args.master_addr, args.master_port,
                           args.headless_service, args.dist_timeout, args.offload,
                           os.environ if env is None else env)


def _byte_budget(text: str) -> int | None:
    """--activation-cache-max-bytes: a size, or 0 for none."""
    if str(text).strip() == "0":
        return None
    budget = MemoryBudget.parse(text, "--activation-cache-max-bytes")
    if budget.bytes is None:
        raise ValueError(f"--activation-cache-max-bytes must be a size (e.g. 2GiB) or 0, got '{text}'")
    return budget.bytes


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got '{value}'") from None


def pod_identity(env: Mapping[str, str]) -> tuple[str, int]:
    """(statefulset name, ordinal) from POD_NAME or the hostname."""
    name = env.get("POD_NAME") or socket.gethostname()
    m = _ORDINAL.match(name)
    if not m:
        raise ValueError(f"--headless-service is set but the pod name '{name}' has no StatefulSet ordinal "
                         "(expected NAME-N); set POD_NAME from the downward API")
    return m.group("set"), int(m.group("ordinal"))


@dataclass(frozen=True)
class ListenConfig:
    """Where a model-server process listens."""

    host: str = "0.0.0.0"
    port: int = 50051
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = 9400
    drain_seconds: float = 30.0

    @classmethod
    def from_args(cls, args: Any) -> "ListenConfig":
        return cls(host=args.host, port=args.port, metrics_host=args.metrics_host,
                   metrics_port=args.metrics_port or None, drain_seconds=args.drain_seconds)
