"""The router's one typed configuration, validated once at the edge (the CLI)."""

from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import dataclass, field
from typing import Optional

from kubeshard_router.tool_formats import PARSERS as TOOL_CALL_PARSERS


def _default_router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # Static replica leaders per model name: {"demo": ("127.0.0.1:50051", ...)}.
    backends: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Discover models and replicas from InferenceService objects and EndpointSlices.
    kubernetes: bool = False
    namespace: Optional[str] = None
    default_model: Optional[str] = None
    # How models write tool calls (vLLM's --tool-call-parser): auto (each model's chat
    # template says: <tool_call>, <|python_tag|>, [TOOL_CALLS]), hermes, llama3_json, mistral
    tool_call_parser: str = "auto"

    # Redis: response cache, load counters, rate limits. None disables all three
    # (rate limits then apply per router instance only).
    redis_url: Optional[str] = None
    redis_timeout_s: float = 0.05
    redis_retry_s: float = 1.0
    cache_ttl_s: int = 3600
    cache_max_entry_bytes: int = 4 * 1024 * 1024
    counters_ttl_s: int = 15
    counters_interval_s: float = 1.0
    # File holding the bearer token of GET /internal/load (the load, asked directly by the
    # operator's metrics server when Redis is away); None: the route answers 404.
    load_token_file: Optional[str] = None

    # Authentication and rate limits.
    api_keys_file: Optional[str] = None
    api_keys_secret: Optional[str] = None  # "namespace/name"
    rate_limit_rpm: int = 0  # requests per minute per key; 0 = unlimited
    rate_limit_tpm: int = 0  # tokens (prompt + max new) per minute per key; 0 = unlimited
    # Runtime LoRA loading (POST /v1/load_lora_adapter, /v1/unload_lora_adapter; vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): off unless set; with API keys on, only admin keys.
    # A load's lora_path must lie under lora_root (a folder as the shard pods see it).
    allow_runtime_lora: bool = False
    lora_root: Optional[str] = None

    # Backpressure and activation.
    max_queue_per_model: int = 1024
    queue_timeout_s: float = 60.0
    activation_timeout_s: float = 60.0

    # Outbound timeouts.
    connect_timeout_s: float = 5.0
    info_timeout_s: float = 10.0
    request_timeout_s: float = 600.0
    stall_timeout_s: float = 120.0
    health_interval_s: float = 2.0
    max_retries: int = 2

    # Validation limits (the engine's own limits come from Info).
    max_top_n_tokens: int = 5
    max_stop_sequences: int = 4
    max_body_bytes: int = 8 << 20  # 8 MiB

    # Balancing: prefix affinity on the first `affinity_blocks` full KV blocks.
    affinity_blocks: int = 4
    load_factor: float = 1.25

    drain_timeout_s: float = 30.0
    log_level: str = "info"
    router_id: str = field(default_factory=_default_router_id)

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.backends and not self.kubernetes:
            raise ValueError("backends: give at least one --backend MODEL=HOST:PORT, or --kubernetes")
        for model, addrs in self.backends.items():
            check_model_name(model)
            if not addrs:
                raise ValueError(f"backends: model {model!r} has no HOST:PORT")
            for addr in addrs:
                _check_address(addr, model)
        if self.default_model is not None and self.backends and not self.kubernetes:
            if self.default_model not in self.backends:
                raise ValueError(f"default_model {self.default_model!r} is not one of the backends "
                                 f"({', '.join(sorted(self.backends))})")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.allow_runtime_lora and not self.lora_root:
            raise ValueError("lora_root: --allow-runtime-lora needs --lora-root DIR, the folder (as the shard pods "
                             "see it) under which every lora_path of /v1/load_lora_adapter must lie")
        if self.lora_root is not None and not os.path.isabs(self.lora_root):
            raise ValueError(f"lora_root must be an absolute path, got {self.lora_root!r}")
        if self.api_keys_secret is not None and self.api_keys_secret.count("/") != 1:
            raise ValueError(f"api_keys_secret must be NAMESPACE/NAME, got {self.api_keys_secret!r}")
        positive = {
            "redis_timeout_s": self.redis_timeout_s, "redis_retry_s": self.redis_retry_s,
            "cache_ttl_s": self.cache_ttl_s, "counters_ttl_s": self.counters_ttl_s,
            "counters_interval_s": self.counters_interval_s,
            "queue_timeout_s": self.queue_timeout_s, "activation_timeout_s": self.activation_timeout_s,
            "connect_timeout_s": self.connect_timeout_s, "info_timeout_s": self.info_timeout_s,
            "request_timeout_s": self.request_timeout_s, "stall_timeout_s": self.stall_timeout_s,
            "health_interval_s": self.health_interval_s, "max_body_bytes": self.max_body_bytes,
            "affinity_blocks": self.affinity_blocks, "cache_max_entry_bytes": self.cache_max_entry_bytes,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        non_negative = {
            "rate_limit_rpm": self.rate_limit_rpm, "rate_limit_tpm": self.rate_limit_tpm,
            "max_queue_per_model": self.max_queue_per_model, "max_retries": self.max_retries,
            "max_top_n_tokens": self.max_top_n_tokens, "max_stop_sequences": self.max_stop_sequences,
            "drain_timeout_s": self.drain_timeout_s,
        }
        for name, value in non_negative.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1.0, got {self.load_factor}")
        if self.log_level.lower() not in {"debug", "info", "warning", "error", "critical"}:
            raise ValueError(f"log_level must be debug|info|warning|error|critical, got {self.log_level!r}")


_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,252}$")


def check_model_name(model: str) -> None:
    """Model names appear in URLs and Redis keys: letters, digits, '.', '_', '-', '/'."""
    if not _MODEL_NAME.match(model) or model.endswith("/") or "//" in model:
        raise ValueError(f"invalid model name {model!r}: use letters, digits, '.', '_', '-' and '/'")


def _check_address(addr: str, model: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
        raise ValueError(f"backends: {addr!r} for model {model!r} is not HOST:PORT")


def parse_backend_flag(value: str) -> tuple[str, tuple[str, ...]]:
    """Parses ``MODEL=HOST:PORT[,HOST:PORT...]``."""
    model, sep, addrs = value.partition("=")
    model = model.strip()
    if not sep or not model:
        raise ValueError(f"--backend {value!r}: expected MODEL=HOST:PORT[,HOST:PORT...]")
    parts = tuple(a.strip() for a in addrs.split(",") if a.strip())
    if not parts:
        raise ValueError(f"--backend {value!r}: no HOST:PORT after '='")
    check_model_name(model)
    for addr in parts:
        _check_address(addr, model)
    return model, parts
