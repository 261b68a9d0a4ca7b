"""Multi-LoRA: PEFT adapters applied per row of one batch.

An adapter (a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors`` or
``.bin``) is loaded into a *slot* (1..--max-loras; slot 0 is the base model).
``enable_lora`` wraps each projection a LoRA may target (q, k, v, o, gate, up, down) in
a ``LoraLinear``; our fused layers (q|k|v, gate|up) have one *sub-projection* per part.

The adapters' weights live in one stacked buffer per wrapped layer (``LayerPack``),
rebuilt off the engine thread whenever an adapter is loaded or unloaded and swapped in
whole (the step in flight keeps the buffers it started with):

- ``a``  [S, n_sub · R, in]: slot s's lora_A of every sub-projection, slot-major;
- ``bt`` one [S, R, size_i] per sub-projection i: slot s's lora_Bᵀ with the scale in it;

R is the largest rank loaded (smaller ranks are zero-padded), S the highest slot in use.
Per step the runner puts the decode rows of one adapter side by side, and ``begin_step``
reads each token's slot into runs of rows (slot, first, end). On the CPU, in float32, a
wrapped layer's deltas are one call to the kernel of ``engine/csrc/lora.cpp``
(``LayerPack.native``): per run, x·A_sᵀ, then each sub-projection's columns of that
times B_sᵀ added to the base output. The fused decode step calls the same kernel after
each base GEMM, so a step's adapter rows have the same bits either way.

Elsewhere (other devices and dtypes) the torch path builds one 0/1 mask [T, k] over the
window of used slots lo..hi (k = hi - lo + 1; base rows are all zero), and every wrapped
layer costs a fixed number of ops whatever the number of adapters in the batch:

    xa = x · A[lo..hi]ᵀ            one GEMM for every slot and sub-projection
    xa ⊙ mask                       one multiply (for a fused layer it also lays xa out
                                    sub-projection-major)
    y[:, part_i] += xa_i · Bᵀ_i     one addmm_ per sub-projection, in place

so requests for different adapters — and for the base model — share one batch and one
base GEMM, with no gather and no scatter. When one adapter's rows are one contiguous
run, the layer takes the single-adapter path: one GEMM on that slice and one addmm_ per
sub-projection, no mask. The k-fold arithmetic of the window costs little: decode is
bound by reading weights, and every used adapter's weights are read once either way.
The deltas never touch the base weight, so a quantized base layer (whose ``forward``
calls its packed GEMM, ``models/quant.py``) is wrapped the same way.

History: a first version gathered and scattered rows by index (``index_add_`` alone cost
more than the base step); a second cut the batch into one run per adapter with two GEMMs
per run and B block-diagonal over the fused sub-projections (3.4x the base step on a
loaded machine). The stacked version, measured in-process at batch 16 with four rank-16
adapters on all seven projections against the base engine on the demo model: 1.28x the
base step (bench/results/api.md, two threads) and 1.28x its CPU time (api-lora.md, one
thread); base rows on the LoRA engine cost 1.00-1.03x. Once the base step got the fused
decode step (the whole layer stack in one C++ call), adapter steps, still through the
modules, cost 1.83x it; the CPU kernel brought them into the fused step.

Sharding: every rank of a group holds the adapters. A tensor-parallel rank cuts each one
as its projection is cut (``lora_slice``): B's rows of the outputs a column-parallel
layer keeps; A's columns of the inputs a row-parallel layer keeps, whose x·Aᵀ·Bᵀ then
joins the partial product before the all-reduce, so the sum carries the delta once. A
zero3 rank applies whole adapters to its own lane's rows (its layers compute whole, on
the gathered weights). Each step's slots reach the ranks with its inputs (the step
channel); a runtime load or unload reaches them between two steps (``LoraCommand``,
``AdapterRegistry.apply``), and every rank adds and removes adapters in the same order,
so their slots agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kubeshard_shard.distributed.tensor_parallel import RowParallelLinear
from kubeshard_shard.models.readable import unreadable

log = logging.getLogger(__name__)

# PEFT module names -> (our layer attribute, index of the sub-projection in a fused layer)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}


class AdapterError(ValueError):
    """An adapter that cannot be loaded or used; the message says why."""


class RuntimeLoadsOff(Exception):
    """This server loads no adapters at run time (no --lora-root)."""


@dataclass
class Adapter:
    name: str
    source: str
    rank: int
    alpha: float
    target_modules: list[str]
    digest: bytes  # content hash: the root of this adapter's prefix-cache block hashes
    # layer key ("layers.3.self_attn.qkv_proj") -> {sub-projection (0 for an unfused layer): (A [r, in],
    # B [size, r] with the scale in it)}; handed to the registry's stacked buffers by ``add``, then dropped
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def hash_root(self) -> int:
        return int.from_bytes(self.digest[:16], "little")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    st = folder / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        reason = unreadable(st)
        if reason is not None:
            raise AdapterError(reason)
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
        layer = adapter.weights[layer_key] = {}
        for index, (a, b) in parts.items():
            sub = index or 0
            if a.shape[1] != wrapper.full_in_features:
                raise AdapterError(f"adapter {name!r}: {layer_key} lora_A has {a.shape[1]} inputs, the model "
                                   f"{wrapper.full_in_features}; the adapter belongs to another model")
            if a.shape[0] != rank:
                raise AdapterError(f"adapter {name!r}: {layer_key} has rank {a.shape[0]}, the config r {rank}; "
                                   "per-module ranks (rank_pattern) are not supported")
            if b.shape != (wrapper.full_sizes[sub], rank):
                raise AdapterError(f"adapter {name!r}: {layer_key} lora_B has shape {tuple(b.shape)}, "
                                   f"expected {(wrapper.full_sizes[sub], rank)}")
            a, b = wrapper.lora_slice(sub, a, b)
            layer[sub] = (a.to(device=device, dtype=dtype).contiguous(),
                          (b.float() * scale).to(device=device, dtype=dtype).contiguous())
    return adapter


@dataclass(frozen=True)
class LoraCommand:
    """A runtime load (``source``: the folder, already checked under --lora-root) or
    unload the leader of a group sends its other ranks (distributed/step_channel.py)."""

    op: str  # "load" or "unload"
    name: str
    source: str = ""

    def encode(self) -> torch.Tensor:
        name, source = self.name.encode(), self.source.encode()
        return torch.tensor([1 if self.op == "load" else 0, len(name), *name, len(source), *source],
                            dtype=torch.long)

    @classmethod
    def decode(cls, payload: torch.Tensor) -> "LoraCommand":
        values = payload.tolist()
        n = values[1]
        name = bytes(values[2:2 + n]).decode()
        source = bytes(values[3 + n:3 + n + values[2 + n]]).decode()
        return cls("load" if values[0] else "unload", name, source)


class LayerPack:
    """One wrapped layer's adapters, stacked by slot (see the module docstring): ``a``
    [S, n_sub · R, in], ``bt[i]`` [S, R, size_i], and the slots whose adapter adapts
    this layer at all. Built whole and never written after; the views a step needs are
    made once (per slot, and per window of slots when first used), since on CPU making
    a view costs about as much as a small GEMM's dispatch."""

    __slots__ = ("a", "bt", "present", "rank", "native", "slot_views", "_windows")

    def __init__(self, a: torch.Tensor, bt: list[torch.Tensor], present: frozenset[int], rank: int,
                 native=None) -> None:
        self.a, self.bt, self.present, self.rank = a, bt, present, rank
        self.native = native  # the CPU kernels' LoraPack of the same tensors (float32 on the CPU), or None
        # slot -> (A [n_sub·R, in], [Bᵀ_i [R, size_i]])
        self.slot_views = {s: (a[s - 1], [b[s - 1] for b in bt]) for s in present}
        self._windows: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def window(self, lo: int, hi: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Slots lo..hi: (A [k·n_sub·R, in], [Bᵀ_i [k·R, size_i]])."""
        views = self._windows.get((lo, hi))
        if views is None:
            views = (self.a[lo - 1:hi].view(-1, self.a.shape[-1]),
                     [b[lo - 1:hi].reshape(-1, b.shape[-1]) for b in self.bt])
            self._windows[(lo, hi)] = views
        return views


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """The runs of rows of one adapter, in row order: (slot, first row, end row); rows of
    the base model (slot 0) are in none."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            if slots[start]:
                runs.append((slots[start], start, i))
            start = i
    return runs


class StepLora:
    """This step's adapter rows: the used slots in order, each one's contiguous runs of
    rows (and all runs in row order as a [n, 3] tensor, for the CPU kernel), the packs
    the step started with, and (made when the torch path first needs it) the 0/1 mask
    [T, k] of each row over the window ``used[0]..used[-1]`` (k slots)."""

    __slots__ = ("packs", "used", "runs", "ordered", "slots", "_mask", "_masks")

    def __init__(self, packs: dict[str, LayerPack], slots: list[int], ordered: list[tuple[int, int, int]]) -> None:
        self.packs, self.slots = packs, slots
        self.runs: dict[int, list[tuple[int, int]]] = {}
        for slot, start, end in ordered:
            self.runs.setdefault(slot, []).append((start, end))
        self.used = tuple(sorted(self.runs))
        self.ordered = torch.tensor(ordered, dtype=torch.long)
        self._mask: torch.Tensor | None = None
        self._masks: dict[tuple[int, int, int], torch.Tensor] = {}

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            window = torch.arange(self.used[0], self.used[-1] + 1)
            mask = torch.tensor(self.slots)[:, None] == window[None, :]
            some = next(iter(self.packs.values()), None)
            if some is not None:
                mask = mask.to(dtype=some.a.dtype).to(some.a.device, non_blocking=True)
            self._mask = mask
        return self._mask

    def mask_for(self, lo: int, hi: int, n_sub: int) -> torch.Tensor:
        """The mask of slots lo..hi, shaped to multiply xa: [T, k, 1] for an unfused
        layer, [1, T, k, 1] for a fused one (made once per step)."""
        m = self._masks.get((lo, hi, n_sub))
        if m is None:
            first = self.used[0]
            m = self.mask[:, lo - first:hi - first + 1]
            m = m[:, :, None] if n_sub == 1 else m[None, :, :, None]
            self._masks[(lo, hi, n_sub)] = m
        return m


class AdapterRegistry:
    """Loaded adapters by name and slot, and each wrapped layer's stacked buffers; the
    engine thread reads, loads happen off it."""

    def __init__(self, max_loras: int, max_rank: int, kernels=None, runtime_root: Path | None = None) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.runtime_root = runtime_root  # --lora-root: runtime loads come from under it; None: refused
        self.by_name: dict[str, Adapter] = {}
        self.slots: dict[int, Adapter] = {}
        self.slot_of: dict[str, int] = {}
        self.in_use: dict[str, int] = {}   # sequences using each adapter now (engine thread)
        self.closing: set[str] = set()
        self.layers: dict[str, LoraLinear] = {}   # filled by enable_lora
        self.packs: dict[str, LayerPack] = {}     # swapped whole on add/remove
        self.step: StepLora | None = None
        self._lock = threading.Lock()
        self._model: nn.Module | None = None  # bind: what read loads adapters for
        self._dtype, self._device = torch.float32, torch.device("cpu")
        # the CPU kernels' module (engine/csrc), when built: its float32 GEMM streams each
        # adapter's A once and splits the columns over the threads, where torch.mm runs
        # these thin products on one thread; and its LoRA kernel (lora.cpp) takes a float32
        # layer's deltas in one call, the arithmetic the fused decode step runs
        self._gemm_f32 = getattr(kernels, "gemm_f32", None)
        self.native = kernels if hasattr(kernels, "LoraPack") else None

    def shrink(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x Aᵀ for A [n, in] (contiguous)."""
        if self._gemm_f32 is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous():
            return self._gemm_f32(x, a, None)
        return torch.mm(x, a.t())

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def bind(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        """The model (wrapped by ``enable_lora``) whose layers ``read`` loads adapters for."""
        self._model, self._dtype, self._device = model, dtype, device

    def read(self, name: str, source: str) -> Adapter:
        """An adapter read from ``source`` for the bound model (not yet added)."""
        return load_adapter(name, source, self._model, self._dtype, self._device, self.max_rank)

    def apply(self, command: LoraCommand) -> list[int]:
        """A group member's side of a runtime load or unload its leader sent: [1, slot]
        when done (slot 0 for an unload), [0, 0] when refused (the log says why)."""
        try:
            if command.op == "load":
                return [1, self.add(self.read(command.name, self.runtime_source(command.source)))]
            self.remove(command.name)
            return [1, 0]
        except (AdapterError, RuntimeLoadsOff, OSError, ValueError, KeyError, RuntimeError) as exc:
            log.error("LoRA adapter %s: %s from the leader refused: %s", command.name, command.op, exc)
            return [0, 0]

    def runtime_source(self, source: str) -> str:
        """The folder a runtime load (LoadAdapter) may read for ``source``: it must lie under
        --lora-root once symbolic links are resolved. RuntimeLoadsOff when runtime loads
        are off, AdapterError when the folder is outside the root."""
        if self.runtime_root is None:
            raise RuntimeLoadsOff("this server loads no LoRA adapters at run time: start it with --lora-root DIR "
                                  "(the folder runtime loads must lie under)")
        root = self.runtime_root.resolve()
        path = Path(source).expanduser().resolve()
        if not path.is_relative_to(root):
            raise AdapterError(f"lora_path {source} is outside this server's --lora-root {root}")
        return str(path)

    def add(self, adapter: Adapter) -> int:
        with self._lock:
            if adapter.name in self.by_name:
                raise FileExistsError(f"adapter {adapter.name!r} is already loaded")
            free = next((s for s in range(1, self.max_loras + 1) if s not in self.slots), None)
            if free is None:
                raise AdapterError(f"{self.max_loras} adapters are loaded (--max-loras); unload one first")
            self.packs = self._repacked({**self.slots, free: adapter}, adapter, free)
            adapter.weights = {}  # now in the stacked buffers
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
            self.packs = self._repacked(self.slots, None, 0)
            self.closing.discard(name)

    def _repacked(self, slots: dict[int, Adapter], new: Adapter | None, new_slot: int) -> dict[str, LayerPack]:
        """New stacked buffers for ``slots``: the kept slots copied from the current packs,
        ``new`` (if any) written into ``new_slot`` from its own weights."""
        if not slots:
            return {}
        count = max(slots)
        rank = max(a.rank for a in slots.values())
        packs = {}
        for key, layer in self.layers.items():
            old = self.packs.get(key)
            present = {s for s in slots if old is not None and s in old.present}
            new_parts = new.weights.get(key) if new is not None else None
            if new_parts:
                present.add(new_slot)
            if not present:
                continue
            first = next(iter(new_parts.values()))[0] if new_parts else old.a
            n_sub, like = len(layer.sizes), dict(dtype=first.dtype, device=first.device)
            a = torch.zeros(count, n_sub, rank, layer.in_features, **like)
            bt = [torch.zeros(count, rank, size, **like) for size in layer.sizes]
            for s in present - {new_slot}:
                r = min(old.rank, rank)
                a[s - 1, :, :r] = old.a[s - 1].view(n_sub, old.rank, -1)[:, :r]
                for i in range(n_sub):
                    bt[i][s - 1, :r] = old.bt[i][s - 1, :r]
            for i, (sub_a, sub_b) in (new_parts or {}).items():
                a[new_slot - 1, i, :sub_a.shape[0]] = sub_a
                bt[i][new_slot - 1, :sub_a.shape[0]] = sub_b.t()
            a = a.view(count, n_sub * rank, -1)
            native = None
            if self.native is not None and a.dtype == torch.float32 and a.device.type == "cpu":
                native = self.native.LoraPack(a, bt, layer.offsets, sorted(present))
            packs[key] = LayerPack(a, bt, frozenset(present), rank, native)
        return packs

    def add_deltas(self, y: torch.Tensor, x: torch.Tensor, runs: torch.Tensor, pack: LayerPack) -> None:
        """y += x's rows' deltas through the CPU kernel (``pack.native`` set)."""
        self.native.lora_add_(y, x, runs, pack.native)

    def resolve(self, name: str) -> Adapter:
        adapter = self.by_name.get(name)
        if adapter is None or name in self.closing:
            known = ", ".join(self.names()) or "none are loaded"
            raise AdapterError(f"adapter {name!r} is not loaded ({known})")
        return adapter

    def begin_step(self, slots: list[int] | None) -> None:
        """Reads the step's token slots (None: all base model): the used slots and their
        runs of contiguous rows (StepLora)."""
        ordered = slot_runs(slots or [])
        self.step = StepLora(self.packs, slots, ordered) if ordered else None


class LoraLinear(nn.Module):
    """A projection plus the deltas of the adapters its rows use this step.

    Under tensor parallelism the base is a slice of the projection: ``lora_slice`` (the
    base's) cuts each adapter the same way when it is loaded, and a row-parallel base
    (which sums its ranks' partial products) takes the deltas into its partial product
    before the all-reduce (``forward(x, partial)``); the full sizes are the checkpoint's,
    which an adapter must match."""

    def __init__(self, base: nn.Module, key: str, registry: AdapterRegistry) -> None:
        super().__init__()
        self.base = base
        self.key = key
        self.registry = registry
        self.in_features = base.in_features
        self.sizes = list(getattr(base, "output_sizes", [base.out_features]))
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.full_in_features = getattr(base, "full_in_features", base.in_features)
        self.full_sizes = list(getattr(base, "full_sizes", self.sizes))
        self.partial = isinstance(base, RowParallelLinear)

    def lora_slice(self, sub: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [R, in], B [size, R]) as this rank applies them."""
        cut = getattr(self.base, "lora_slice", None)
        return (a, b) if cut is None else cut(sub, a, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.partial:
            return self.base(x, self.add_deltas)
        y = self.base(x)
        self.add_deltas(x, y)
        return y

    def add_deltas(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the deltas of the adapters x's rows use this step, in place."""
        step = self.registry.step
        if step is None:
            return
        pack = step.packs.get(self.key)
        if pack is None:
            return
        if (pack.native is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
                and y.is_contiguous()):
            self.registry.add_deltas(y, x, step.ordered, pack)
            return
        present = pack.present
        used = [s for s in step.used if s in present]
        if not used:
            return
        lo, hi = used[0], used[-1]
        runs = step.runs[lo]
        if lo == hi and len(runs) == 1:  # one adapter, one slice of rows: no mask
            start, end = runs[0]
            a, bts = pack.slot_views[lo]
            if end - start != x.shape[0]:
                x, y_rows = x[start:end], y[start:end]
            else:
                y_rows = y
            xa = self.registry.shrink(x, a)
            if len(bts) == 1:
                y_rows.addmm_(xa, bts[0])
                return
            rank = pack.rank
            for i, bt in enumerate(bts):
                y_rows.narrow(1, self.offsets[i], self.sizes[i]).addmm_(xa.narrow(1, i * rank, rank), bt)
            return
        a, bts = pack.window(lo, hi)
        n_sub = len(bts)
        mask = step.mask_for(lo, hi, n_sub)
        xa = self.registry.shrink(x, a)   # [T, (k, n_sub, R)]
        tokens, k, rank = xa.shape[0], hi - lo + 1, pack.rank
        if n_sub == 1:
            xa.view(tokens, k, rank).mul_(mask)
            y.addmm_(xa, bts[0])
            return
        xs = torch.empty(n_sub, tokens, k * rank, dtype=xa.dtype, device=xa.device)
        torch.mul(xa.view(tokens, k, n_sub, rank).permute(2, 0, 1, 3), mask, out=xs.view(n_sub, tokens, k, rank))
        for i, bt in enumerate(bts):
            y.narrow(1, self.offsets[i], self.sizes[i]).addmm_(xs[i], bt)


def enable_lora(model: nn.Module, registry: AdapterRegistry) -> None:
    """Wraps every LoRA-capable projection of the decoder layers (once, after loading)."""
    for i, layer in enumerate(model.model.layers):
        for attr in {attr for attr, _ in TARGETS.values()}:
            owner_name, leaf = attr.split(".")
            owner = getattr(layer, owner_name)
            base = getattr(owner, leaf)
            if not isinstance(base, LoraLinear):
                base = LoraLinear(base, f"layers.{i}.{attr}", registry)
                setattr(owner, leaf, base)
            registry.layers[base.key] = base
