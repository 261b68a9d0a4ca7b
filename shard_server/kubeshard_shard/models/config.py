"""The model's shape, read once from a checkpoint's config.json and validated.

Every problem names the file and the field, so a bad checkpoint fails at start with a
message a person can act on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Registry of supported architectures: config.json "architectures" entry -> family.
# One implementation serves the whole Llama family; the differences are flags below.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class CheckpointError(ValueError):
    """A model folder that kubeshard cannot serve; the message says why."""


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # llama.cpp's per-dimension divisors of the rotary frequencies (a GGUF's
    # ``rope_freqs.weight``, written for Llama 3.1/3.2): one per frequency, head_dim / 2.
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _require(raw: dict[str, Any], key: str, where: Path, kind: type = int, positive: bool = True):
    if key not in raw:
        raise CheckpointError(f"{where}: missing required field '{key}'")
    value = raw[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise CheckpointError(f"{where}: field '{key}' must be an integer, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise CheckpointError(f"{where}: field '{key}' must be a number, got {value!r}")
    if positive and value <= 0:
        raise CheckpointError(f"{where}: field '{key}' must be > 0, got {value!r}")
    return value


def _parse_rope_scaling(raw: Any, where: Path) -> RopeScaling:
    if raw is None:
        return RopeScaling()
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: field 'rope_scaling' must be an object or null, got {raw!r}")
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{where}: rope_scaling type '{rope_type}' is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    factor = float(raw.get("factor", 1.0))
    if factor <= 0 or not math.isfinite(factor):
        raise CheckpointError(f"{where}: rope_scaling.factor must be a positive number, got {raw.get('factor')!r}")
    return RopeScaling(
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=raw.get("original_max_position_embeddings"),
    )


def _parse_freq_factors(raw: Any, head_dim: int, where: Path) -> tuple[float, ...] | None:
    """kubeshard's own config field ``rope_freq_factors`` (transformers has none): the
    divisors llama.cpp applies to each rotary frequency, kept from a GGUF file."""
    if raw is None:
        return None
    if (not isinstance(raw, list) or len(raw) != head_dim // 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in raw)
            or not all(math.isfinite(x) and x > 0 for x in raw)):
        raise CheckpointError(f"{where}: field 'rope_freq_factors' must be a list of {head_dim // 2} positive "
                              f"numbers (one per rotary frequency), got {raw!r}"[:400])
    return tuple(float(x) for x in raw)


def _eos_ids(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    if isinstance(raw, int):
        return (raw,)
    return tuple(int(x) for x in raw)


def load_model_config(model_dir: Path) -> ModelConfig:
    """Reads and validates ``model_dir/config.json``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model folder {model_dir} does not exist or is not a directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json; is this a Hugging Face checkpoint folder?")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")

    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise CheckpointError(f"{path}: field 'architectures' is missing; cannot tell which model this is")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: architecture '{arch}' is not supported; supported architectures: "
            + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        )
    family = SUPPORTED_ARCHITECTURES[arch]

    hidden = _require(raw, "hidden_size", path)
    heads = _require(raw, "num_attention_heads", path)
    kv_heads = raw.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise CheckpointError(f"{path}: field 'num_key_value_heads' must be a positive integer, got {kv_heads!r}")
    if heads % kv_heads:
        raise CheckpointError(
            f"{path}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    head_dim = raw.get("head_dim") or hidden // heads
    if not raw.get("head_dim") and hidden % heads:
        raise CheckpointError(f"{path}: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads})")
    if head_dim % 2:
        raise CheckpointError(f"{path}: head dimension {head_dim} must be even for rotary embeddings")

    sliding = raw.get("sliding_window")
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        sliding = None  # Qwen2 carries the field but only uses it when asked to

    return ModelConfig(
        architecture=arch,
        family=family,
        vocab_size=_require(raw, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_require(raw, "intermediate_size", path),
        num_hidden_layers=_require(raw, "num_hidden_layers", path),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rope_scaling=replace(_parse_rope_scaling(raw.get("rope_scaling"), path),
                             freq_factors=_parse_freq_factors(raw.get("rope_freq_factors"), head_dim, path)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama and Mistral have them only when configured.
        attention_bias=bool(raw.get("attention_bias", family == "qwen2")),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=int(sliding) if sliding else None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
    )
