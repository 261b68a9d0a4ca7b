"""Multi-LoRA: PEFT adapters applied per row of one batch.

An adapter (a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors`` or
``.bin``) is loaded into a *slot*; slot 0 is the base model. ``enable_lora`` wraps each
projection a LoRA may target (q, k, v, o, gate, up, down) in a ``LoraLinear``; our fused
layers (q|k|v, gate|up) take each sub-projection's A stacked and its B block-diagonal,
so one adapter costs one GEMM pair per fused layer: ``y += ((x Aᵀ) Bᵀ) · scale``.

Per step the runner orders the step's decode rows by adapter and hands the registry each
token's slot (``begin_step``), which cuts them into runs of one adapter; every wrapped
layer then adds each run's delta in place on its slice of the output (``addmm_``: no
gather, no scatter), so requests for different adapters — and for the base model —
share one batch and one base GEMM (the segmented approach of Punica/S-LoRA's SGMV, on
contiguous rows). Rows of the base model cost nothing extra. A first version gathered
and scattered rows by index: on this 2-core machine ``index_add_`` alone cost more than
the base step (bench/results/api-run1.md).

Sharding: adapters apply with the unsharded engine (one process per replica). A tensor
or zero3 group refuses them at load time with a message saying so: their projections
hold slices (or all-gathered partitions) of each weight, and the deltas would need the
same split plus the row-parallel all-reduce, which is not written yet.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

# PEFT module names -> (our layer attribute, index of the sub-projection in a fused layer)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}


class AdapterError(ValueError):
    """An adapter that cannot be loaded or used; the message says why."""


@dataclass
class Adapter:
    name: str
    source: str
    rank: int
    alpha: float
    target_modules: list[str]
    digest: bytes  # content hash: the root of this adapter's prefix-cache block hashes
    # layer key ("layers.3.self_attn.qkv_proj") -> (A [r_total, in], B [out, r_total]) with the scale in B
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def hash_root(self) -> int:
        return int.from_bytes(self.digest[:16], "little")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    st = folder / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    pt = folder / "adapter_model.bin"
    if pt.is_file():
        return torch.load(str(pt), map_location="cpu", weights_only=True)
    raise AdapterError(f"{folder}: no adapter_model.safetensors or adapter_model.bin")


def load_adapter(name: str, source: str, model: nn.Module, dtype: torch.dtype, device: torch.device,
                 max_rank: int) -> Adapter:
    folder = Path(source).expanduser()
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise AdapterError(f"adapter {name!r}: {folder} has no adapter_config.json (a PEFT LoRA adapter folder)")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    rank = int(config.get("r", 8))
    if not 1 <= rank <= max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} is outside [1, --max-lora-rank {max_rank}]")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
    if config.get("use_dora"):
        raise AdapterError(f"adapter {name!r}: DoRA adapters are not supported")
    tensors = _read_tensors(folder)
    digest = hashlib.blake2b(config_path.read_bytes(), digest_size=32)
    per_layer: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    targets: set[str] = set()
    for key in sorted(tensors):
        if ".lora_A." not in key:
            if ".lora_B." not in key and "lora_" in key:
                raise AdapterError(f"adapter {name!r}: unsupported tensor {key} (only lora_A/lora_B)")
            continue
        prefix = key.split(".lora_A.")[0]  # base_model.model.model.layers.3.self_attn.q_proj
        module = prefix.rsplit(".", 1)[-1]
        if module not in TARGETS:
            raise AdapterError(f"adapter {name!r}: it adapts {module!r}; kubeshard applies LoRA to "
                               f"{', '.join(TARGETS)}")
        layer = prefix.split("layers.")[1].split(".")[0] if "layers." in prefix else None
        if layer is None:
            raise AdapterError(f"adapter {name!r}: tensor {key} is not in a decoder layer")
        a = tensors[key]
        b = tensors.get(prefix + ".lora_B.weight")
        if b is None:
            raise AdapterError(f"adapter {name!r}: {key} has no matching lora_B")
        digest.update(key.encode())
        digest.update(a.float().numpy().tobytes())
        digest.update(b.float().numpy().tobytes())
        attr, index = TARGETS[module]
        per_layer.setdefault(f"layers.{layer}.{attr}", {})[index] = (a, b)
        targets.add(module)
    if not per_layer:
        raise AdapterError(f"adapter {name!r}: no lora_A/lora_B tensors in {folder}")
    modules = dict(model.named_modules())
    adapter = Adapter(name, source, rank, alpha, sorted(targets), digest.digest())
    for layer_key, parts in per_layer.items():
        wrapper = modules.get("model." + layer_key)
        if not isinstance(wrapper, LoraLinear):
            raise AdapterError(f"adapter {name!r}: the model has no LoRA-capable layer {layer_key}")
        base = wrapper.base
        sizes = getattr(base, "output_sizes", [base.out_features])
        a_parts, b_full = [], torch.zeros(base.out_features, rank * len(parts), dtype=torch.float32)
        offset_r = 0
        for index, (a, b) in sorted(parts.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            if a.shape[1] != base.in_features:
                raise AdapterError(f"adapter {name!r}: {layer_key} lora_A has {a.shape[1]} inputs, the model "
                                   f"{base.in_features}; the adapter belongs to another model")
            start = 0 if index is None else sum(sizes[:index])
            size = base.out_features if index is None else sizes[index]
            if b.shape != (size, a.shape[0]):
                raise AdapterError(f"adapter {name!r}: {layer_key} lora_B has shape {tuple(b.shape)}, "
                                   f"expected {(size, a.shape[0])}")
            a_parts.append(a.float())
            b_full[start:start + size, offset_r:offset_r + a.shape[0]] = b.float() * scale
            offset_r += a.shape[0]
        a_all = torch.cat(a_parts, 0)
        adapter.weights[layer_key] = (a_all.to(device=device, dtype=dtype).contiguous(),
                                      b_full[:, :offset_r].to(device=device, dtype=dtype).contiguous())
    return adapter


class StepLora:
    """Runs of this step's rows that use one adapter: [(slot, start, end)], base rows left out."""

    __slots__ = ("runs",)

    def __init__(self, runs: list[tuple[int, int, int]]) -> None:
        self.runs = runs


class AdapterRegistry:
    """Loaded adapters by name and slot; the engine thread reads, loads happen off it."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.by_name: dict[str, Adapter] = {}
        self.slots: dict[int, Adapter] = {}
        self.slot_of: dict[str, int] = {}
        self.in_use: dict[str, int] = {}   # sequences using each adapter now (engine thread)
        self.closing: set[str] = set()
        self.step: StepLora | None = None
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def add(self, adapter: Adapter) -> int:
        with self._lock:
            if adapter.name in self.by_name:
                raise FileExistsError(f"adapter {adapter.name!r} is already loaded")
            free = next((s for s in range(1, self.max_loras + 1) if s not in self.slots), None)
            if free is None:
                raise AdapterError(f"{self.max_loras} adapters are loaded (--max-loras); unload one first")
            self.slots[free] = adapter
            self.slot_of[adapter.name] = free
            self.by_name[adapter.name] = adapter
            return free

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self.by_name:
                raise KeyError(f"adapter {name!r} is not loaded")
            self.closing.add(name)
            if self.in_use.get(name):
                self.closing.discard(name)
                raise RuntimeError(f"adapter {name!r} is serving {self.in_use[name]} sequences")
            slot = self.slot_of.pop(name)
            del self.slots[slot], self.by_name[name]
            self.closing.discard(name)

    def resolve(self, name: str) -> Adapter:
        adapter = self.by_name.get(name)
        if adapter is None or name in self.closing:
            known = ", ".join(self.names()) or "none are loaded"
            raise AdapterError(f"adapter {name!r} is not loaded ({known})")
        return adapter

    def begin_step(self, slots: list[int] | None) -> None:
        """Cuts the step's token rows into runs of one adapter slot (None: all base model)."""
        if not slots:
            self.step = None
            return
        runs, start = [], 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[start]:
                if slots[start]:
                    runs.append((slots[start], start, i))
                start = i
        self.step = StepLora(runs) if runs else None


class LoraLinear(nn.Module):
    """A projection plus the deltas of the adapters its rows use this step."""

    def __init__(self, base: nn.Module, key: str, registry: AdapterRegistry) -> None:
        super().__init__()
        self.base = base
        self.key = key
        self.registry = registry

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.registry.step
        if step is None:
            return y
        for slot, start, end in step.runs:
            adapter = self.registry.slots.get(slot)
            weights = adapter.weights.get(self.key) if adapter is not None else None
            if weights is None:
                continue
            a, b = weights
            y[start:end].addmm_(torch.mm(x[start:end], a.t()), b.t())
        return y


def enable_lora(model: nn.Module, registry: AdapterRegistry) -> None:
    """Wraps every LoRA-capable projection of the decoder layers (once, after loading)."""
    for i, layer in enumerate(model.model.layers):
        for attr in {attr for attr, _ in TARGETS.values()}:
            owner_name, leaf = attr.split(".")
            owner = getattr(layer, owner_name)
            base = getattr(owner, leaf)
            if not isinstance(base, LoraLinear):
                setattr(owner, leaf, LoraLinear(base, f"layers.{i}.{attr}", registry))
