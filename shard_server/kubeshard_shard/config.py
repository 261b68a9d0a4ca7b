"""The model server's configuration: one typed, validated object built at the edge (CLI)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

STRATEGIES = ("tensor", "zero3")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mi": 1024**2, "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
          "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4}


@dataclass(frozen=True)
class MemoryBudget:
    """Either an absolute size in bytes or a fraction of the device's memory."""

    bytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str, flag: str = "--kv-cache-memory") -> "MemoryBudget":
        text = str(text).strip()
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is not None and 0 < value < 1 and "." in text:
            return cls(fraction=value)
        m = _SIZE.match(text)
        if not m:
            raise ValueError(f"{flag}: '{text}' is neither a size (e.g. 2GiB, 512MB, 1000000) "
                             "nor a fraction in (0, 1) (e.g. 0.2)")
        number, unit = float(m.group(1)), (m.group(2) or "").lower()
        size = int(number * _UNITS[unit])
        if size <= 0:
            raise ValueError(f"{flag}: must be positive, got '{text}'")
        return cls(bytes=size)

    def resolve(self, device_total: int) -> int:
        return self.bytes if self.bytes is not None else int(self.fraction * device_total)


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
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be one of auto, float32, bfloat16, float16; got '{self.dtype}'")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N; got '{self.device}'")


@dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in its shard group."""

    strategy: str = "tensor"
    world_size: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 60.0
    offload: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}; got '{self.strategy}'")
        if self.world_size < 1:
            raise ValueError(f"--shards must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the group of {self.world_size} shards")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be a TCP port, got {self.master_port}")
        if self.offload not in (None, "cpu"):
            raise ValueError(f"--offload must be 'cpu' when given, got '{self.offload}'")
