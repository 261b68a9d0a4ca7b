"""Loading a Hugging Face checkpoint folder into a model built on the meta device.

The model is first built on the meta device (no memory), a sharding strategy may swap
its layers, then parameters are materialized on the target device and each one reads
from memory-mapped safetensors only the slice it keeps (``get_slice``). A process never
holds the whole checkpoint unless it keeps all of it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import torch
from safetensors import safe_open

from kubeshard_shard.models.config import CheckpointError, ModelConfig
from kubeshard_shard.models.layers import bind_gemm, bind_kernels
from kubeshard_shard.models.llama import MODEL_REGISTRY, LlamaForCausalLM
from kubeshard_shard.models.readable import unreadable

log = logging.getLogger(__name__)

class ShardingPass(Protocol):
    """What a sharding strategy does to a model while it loads (``distributed.strategy``)."""

    def apply(self, model: LlamaForCausalLM) -> None:
        """Swaps layers on the meta device, before anything is allocated."""

    def load_weights(self, model: LlamaForCausalLM, checkpoint: "SafetensorsCheckpoint") -> None:
        """Fills this process's share of the parameters."""


@dataclass
class SafetensorsCheckpoint:
    """The tensor files of a checkpoint folder, opened lazily and memory-mapped."""

    folder: Path
    files: list[Path]

    @classmethod
    def open(cls, folder: Path) -> "SafetensorsCheckpoint":
        folder = Path(folder)
        single = folder / "model.safetensors"
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
            files = sorted({folder / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        elif single.is_file():
            files = [single]
        else:
            found = sorted(p.name for p in folder.glob("*.bin"))
            hint = (f" (found {', '.join(found)}: PyTorch .bin checkpoints are not supported; convert to safetensors)"
                    if found else "")
            raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json{hint}")
        ckpt = cls(folder, files)
        for _ in ckpt.tensors():  # open every header now: corrupt files fail at start
            pass
        return ckpt

    def tensors(self) -> Iterator[tuple[str, object]]:
        """Yields (name, lazy slice) for every tensor; slices read on indexing."""
        for path in self.files:
            reason = unreadable(path)
            if reason is not None:
                raise CheckpointError(reason)
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({exc})") from exc
            for name in handle.keys():
                yield name, _CheckedSlice(handle.get_slice(name), path, name)


class _CheckedSlice:
    """A safetensors slice whose read errors name the file and tensor."""

    def __init__(self, inner, path: Path, name: str) -> None:
        self._inner, self.path, self.name = inner, path, name

    def get_shape(self) -> list[int]:
        return list(self._inner.get_shape())

    def __getitem__(self, index):
        try:
            return self._inner[index]
        except Exception as exc:
            raise CheckpointError(f"{self.path}: cannot read tensor '{self.name}' ({exc})") from exc


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
                sharding: ShardingPass | None = None, gemm=None, kernels=None) -> LlamaForCausalLM:
    """Builds the model on the meta device, applies a sharding pass, then allocates
    (uninitialized) parameters on ``device``; ``gemm`` is the process's GEMM, ``kernels``
    its compiled CPU kernels (fused layer steps), if any."""
    cls = MODEL_REGISTRY[config.family]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config, max_positions)
            if sharding is not None:  # swaps layers while nothing is allocated
                sharding.apply(model)
        model.to_empty(device=device)
    finally:
        torch.set_default_dtype(previous)
    model.tie_weights()
    model.rotary.materialize(device, dtype)
    if gemm is not None:
        bind_gemm(model, gemm)
    bind_kernels(model, kernels)
    model.eval()
    return model


def load_weights(model: LlamaForCausalLM, checkpoint: SafetensorsCheckpoint) -> None:
    """Fills every parameter from the checkpoint; missing tensors are an error."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    expected: set[tuple[str, int | None]] = set()
    for name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            output_sizes = getattr(module, "output_sizes", None)
            if output_sizes is not None and pname in ("weight", "bias"):
                expected.update((full, i) for i in range(len(output_sizes)))
            else:
                expected.add((full, None))
    if model.config.tie_word_embeddings:
        expected.discard(("lm_head.weight", None))

    loaded: set[tuple[str, int | None]] = set()
    with torch.no_grad():
        for ckpt_name, tensor_slice in checkpoint.tensors():
            target = model.checkpoint_target(ckpt_name)
            if target is None:
                continue
            pname, shard = target
            param = params.get(pname)
            if param is None:
                log.warning("ignoring checkpoint tensor %s: the model has no parameter %s", ckpt_name, pname)
                continue
            module = modules[pname.rpartition(".")[0]]
            try:
                module.load_weight(ckpt_name, param, tensor_slice, shard)
            except CheckpointError:
                raise
            except ValueError as exc:
                raise CheckpointError(f"{checkpoint.folder}: tensor '{ckpt_name}': {exc}") from exc
            loaded.add((pname, shard))
    missing = sorted(f"{n}" + (f"[{s}]" if s is not None else "") for n, s in expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{checkpoint.folder}: checkpoint lacks tensors for {shown}")
    for name, param in params.items():
        if not torch.isfinite(param).all():
            raise CheckpointError(f"{checkpoint.folder}: parameter {name} holds NaN or infinite values")


def load_model(model_dir: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
               max_positions: int = 4096, sharding: ShardingPass | None = None, gemm=None,
               kernels=None) -> LlamaForCausalLM:
    """Builds the model and fills it from the checkpoint (all of it, or the share
    ``sharding`` keeps)."""
    checkpoint = SafetensorsCheckpoint.open(model_dir)
    model = build_model(config, device, dtype, max_positions, sharding, gemm, kernels)
    if sharding is not None:
        sharding.load_weights(model, checkpoint)
    else:
        load_weights(model, checkpoint)
    return model
