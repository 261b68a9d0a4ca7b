"""ZeRO-3-style parameter partitioning for inference (as in DeepSpeed ZeRO-Inference).

The model is cut into *units* run in order: the embedding, each decoder layer, the final
norm and the LM head. Each rank keeps for good a 1/N slice of every unit's parameters,
flattened and concatenated (``partition``). Just before a unit runs, the ranks all-gather
its full parameters — the next unit's gather is started first, so it overlaps this
unit's compute — and the full copy is dropped right after. Every rank runs its own batch
(data parallel) and all ranks step in lockstep: a rank without work still runs the
units on zero tokens, so it joins every gather.

Loading reads from the memory-mapped checkpoint only the rows that overlap the rank's
flat range of each unit. With ``offload="cpu"`` on CUDA the partitions live in pinned
host memory and are copied to the GPU only for the gather.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from kubeshard_shard.distributed.comm import Comm
from kubeshard_shard.models.config import CheckpointError
from kubeshard_shard.models.loader import SafetensorsCheckpoint

log = logging.getLogger(__name__)


@dataclass
class ParamSpec:
    name: str                 # our parameter name, e.g. model.layers.0.self_attn.qkv_proj.weight
    module: nn.Module
    attr: str
    shape: torch.Size
    offset: int               # position in the unit's flat buffer

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def cols(self) -> int:
        return self.shape[1] if len(self.shape) == 2 else 1


@dataclass
class Unit:
    name: str
    specs: list[ParamSpec]
    padded_numel: int = 0
    partition: torch.Tensor | None = None
    source: "Unit | None" = None   # an alias (tied LM head) gathers another unit's partition
    full: torch.Tensor | None = None
    pending: object = None         # the async gather in flight, if any

    @property
    def owner(self) -> "Unit":
        return self.source or self


@dataclass
class Zero3Partitions:
    """Every unit's flat partition on this rank, and the gathers that rebuild a unit."""

    comm: Comm
    offload: str | None = None
    units: list[Unit] = field(default_factory=list)
    device: torch.device | None = None
    dtype: torch.dtype | None = None

    # ---- the pass (meta device) ---------------------------------------------------
    def apply(self, model) -> None:
        """Records the unit layout and replaces every parameter with an empty placeholder."""
        named = {id(m): n for n, m in model.named_modules()}

        def unit(name: str, modules: list[nn.Module]) -> Unit:
            specs, offset = [], 0
            for module in modules:
                base = named[id(module)]
                for sub_name, sub in module.named_modules():
                    for attr, param in list(sub._parameters.items()):
                        if param is None:
                            continue
                        full = ".".join(p for p in (base, sub_name, attr) if p)
                        specs.append(ParamSpec(full, sub, attr, param.shape, offset))
                        offset += param.numel()
            shards = self.comm.shards
            return Unit(name, specs, padded_numel=-(-offset // shards) * shards)

        m = model.model
        embed = unit("embed", [m.embed_tokens])
        self.units = [embed] + [unit(f"layer{i}", [layer]) for i, layer in enumerate(m.layers)]
        self.units.append(unit("norm", [m.norm]))
        if model.config.tie_word_embeddings:
            spec = embed.specs[0]
            self.units.append(Unit("lm_head", [ParamSpec("lm_head.weight", model.lm_head, "weight", spec.shape, 0)],
                                   padded_numel=embed.padded_numel, source=embed))
        else:
            self.units.append(unit("lm_head", [model.lm_head]))
        for u in self.units:
            for spec in u.specs:
                spec.module._parameters[spec.attr] = nn.Parameter(torch.empty(0), requires_grad=False)
        order = {u.name: i for i, u in enumerate(self.units)}
        for u in self.units:
            first = u.specs[0].module if u.name in ("norm", "lm_head", "embed") else None
            target = first if first is not None else self._unit_module(model, u)
            target.register_forward_pre_hook(self._pre_hook(order[u.name]))
            target.register_forward_hook(self._post_hook(order[u.name]))

    @staticmethod
    def _unit_module(model, u: Unit) -> nn.Module:
        return model.model.layers[int(u.name.removeprefix("layer"))]

    # ---- partitions -----------------------------------------------------------------
    def allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        on_host = self.offload == "cpu" and device.type == "cuda"
        for u in self.units:
            if u.source is not None:
                continue
            size = u.padded_numel // self.comm.shards
            if on_host:
                u.partition = torch.zeros(size, dtype=dtype, pin_memory=True)
            else:
                u.partition = torch.zeros(size, dtype=dtype, device=device)

    def resident_bytes(self) -> int:
        return sum(u.partition.numel() * u.partition.element_size() for u in self.units if u.source is None)

    def load(self, model, checkpoint: SafetensorsCheckpoint) -> None:
        """Fills this rank's partitions, reading only the rows that overlap them."""
        self.allocate(next(iter(model.rotary.buffers())).device, model.rotary.cos_sin.dtype)
        slices = dict(checkpoint.tensors())
        pieces: dict[str, list[tuple[str, int, int]]] = {}
        modules = dict(model.named_modules())
        for ckpt_name in slices:
            target = model.checkpoint_target(ckpt_name)
            if target is None:
                continue
            pname, shard = target
            module = modules.get(pname.rpartition(".")[0])
            rows = slices[ckpt_name].get_shape()[0] if slices[ckpt_name].get_shape() else 1
            row_offset = module.shard_offset(shard) if shard is not None else 0
            pieces.setdefault(pname, []).append((ckpt_name, row_offset, rows))
        if model.config.tie_word_embeddings:
            pieces["lm_head.weight"] = pieces.get("model.embed_tokens.weight", [])
        rank, shards = self.comm.rank, self.comm.shards
        with torch.no_grad():
            for u in self.units:
                if u.source is not None:
                    continue
                size = u.padded_numel // shards
                lo, hi = rank * size, (rank + 1) * size
                for spec in u.specs:
                    a, b = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
                    have = sum(r for _, _, r in pieces.get(spec.name, []))
                    if have != spec.shape[0]:
                        raise CheckpointError(f"{checkpoint.folder}: checkpoint lacks tensors for {spec.name}")
                    if a >= b:
                        continue
                    la, lb = a - spec.offset, b - spec.offset
                    r0, r1 = la // spec.cols, (lb - 1) // spec.cols + 1
                    rows = self._read_rows(slices, pieces[spec.name], r0, r1, spec)
                    flat = rows.reshape(-1)[la - r0 * spec.cols: lb - r0 * spec.cols]
                    u.partition[a - lo: b - lo].copy_(flat)
        log.info("zero3: rank %d keeps %d parameter bytes in %d units", rank, self.resident_bytes(), len(self.units))

    @staticmethod
    def _read_rows(slices, pieces, r0: int, r1: int, spec: ParamSpec) -> torch.Tensor:
        out = []
        for name, off, rows in sorted(pieces, key=lambda p: p[1]):
            lo, hi = max(r0, off), min(r1, off + rows)
            if lo < hi:
                t = slices[name][lo - off:hi - off]
                if tuple(t.shape[1:]) != tuple(spec.shape[1:]):
                    raise CheckpointError(f"tensor '{name}' has shape {tuple(t.shape)}, expected rows of "
                                          f"{tuple(spec.shape[1:])}")
                out.append(t)
        return torch.cat(out) if len(out) > 1 else out[0]

    # ---- gathers ----------------------------------------------------------------------
    def _start_gather(self, u: Unit) -> None:
        if u.full is not None or u.pending is not None:
            return
        owner = u.owner
        local = owner.partition
        if local.device != self.device:
            local = local.to(self.device, non_blocking=True)
        u.full = torch.empty(u.padded_numel, dtype=self.dtype, device=self.device)
        u.pending = self.comm.all_gather_into(u.full, local, async_op=True)

    def _bind(self, u: Unit) -> None:
        if u.full is None:
            self._start_gather(u)
        if u.pending is not None:
            self.comm.wait(u.pending)
            u.pending = None
        for spec in u.specs:
            view = u.full[spec.offset:spec.offset + spec.numel].view(spec.shape)
            spec.module._parameters[spec.attr] = nn.Parameter(view, requires_grad=False)

    def _release(self, u: Unit) -> None:
        for spec in u.specs:
            spec.module._parameters[spec.attr] = nn.Parameter(torch.empty(0, device=self.device), requires_grad=False)
        u.full = None

    def _pre_hook(self, index: int):
        def hook(module, args):
            u = self.units[index]
            self._bind(u)
            if index + 1 < len(self.units):
                self._start_gather(self.units[index + 1])  # prefetch the next unit
        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            self._release(self.units[index])
        return hook
