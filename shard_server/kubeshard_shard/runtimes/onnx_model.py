"""The served model of ``--runtime onnx``: an ONNX Runtime GenAI export of the checkpoint.

``--model`` may be an ONNX Runtime GenAI folder (``genai_config.json``, what its model
builder writes) or a Hugging Face folder / GGUF file, which is exported once with the
model builder (``python -m onnxruntime_genai.models.builder``, fp32 for CPU) into
``$KUBESHARD_CACHE/models/onnx/``. The builder needs a newer transformers than the
shard server's, so it runs from its own environment (``hack/engines.sh onnx``; or
``KUBESHARD_ONNX_BUILDER`` names its python); the runtime itself (``onnxruntime-genai``)
runs in this process. The tokenizer, chat template and limits come from the Hugging
Face folder, as for kubeshard's own engine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import torch

from kubeshard_shard.compute import Compute
from kubeshard_shard.config import EngineConfig, ListenConfig
from kubeshard_shard.distributed.strategy import Single
from kubeshard_shard.hardware import CpuFeatures
from kubeshard_shard.models.config import CheckpointError, load_model_config
from kubeshard_shard.paths import build_once, cache_root
from kubeshard_shard.runtimes.onnx_engine import OnnxEngine
from kubeshard_shard.server.factory import ServedModel, resolve_limits
from kubeshard_shard.server.grpc_service import GroupInfo
from kubeshard_shard.server.serve import run_leader
from kubeshard_shard.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

BUILDER_VERSION = "0.18.0"  # hack/engines.sh ONNX_GENAI_VERSION
PRECISION = "fp32"


def builder_python() -> Path:
    configured = os.environ.get("KUBESHARD_ONNX_BUILDER")
    path = Path(configured) if configured else cache_root() / "engines" / f"onnx-{BUILDER_VERSION}" / "bin" / "python"
    if not path.is_file():
        raise CheckpointError(
            f"exporting to ONNX needs ONNX Runtime GenAI's model builder, not found at {path}: build it with "
            "`hack/engines.sh onnx` (or `make engines`), set KUBESHARD_ONNX_BUILDER to its python, or give "
            "--model an exported folder (genai_config.json)")
    return path


def _digest(folder: Path) -> str:
    """Names and sizes of the folder's files, and its config: enough to tell checkpoints apart."""
    h = hashlib.sha256(f"onnx {BUILDER_VERSION} {PRECISION}".encode())
    for p in sorted(folder.iterdir()):
        if p.is_file():
            h.update(f"{p.name}:{p.stat().st_size}\n".encode())
    h.update((folder / "config.json").read_bytes())
    return h.hexdigest()[:16]


def exported(model_dir: Path) -> Path:
    """The ONNX Runtime GenAI folder of ``model_dir`` (itself, or its export, built once)."""
    if (model_dir / "genai_config.json").is_file():
        return model_dir
    target = cache_root() / "models" / "onnx" / f"{model_dir.name}-{_digest(model_dir)}"
    if (target / "genai_config.json").is_file():
        return target
    python = builder_python()

    def build(out: Path) -> None:
        log.info("exporting %s to ONNX (%s, CPU) under %s, once", model_dir, PRECISION, target)
        work = out.parent / "builder-cache"
        cmd = [str(python), "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o", str(out),
               "-p", PRECISION, "-e", "cpu", "-c", str(work)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0 or not (out / "genai_config.json").is_file():
            raise CheckpointError(f"the ONNX model builder failed ({' '.join(cmd)}): "
                                  f"{(done.stderr or done.stdout)[-2000:]}")

    return build_once(target, build, marker="genai_config.json")


def build_onnx_served_model(config: EngineConfig) -> ServedModel:
    model_config = load_model_config(config.model_dir)
    tokenizer = load_tokenizer(config.model_dir, model_config)
    limits = resolve_limits(config, model_config)
    onnx_dir = exported(config.model_dir)
    engine = OnnxEngine(onnx_dir, tokenizer, config.max_num_seqs)
    compute = Compute(device=torch.device("cpu"), dtype=torch.float32, gemm=None, gemm_name="onnxruntime",
                      decode_kernel=None, cpu=CpuFeatures.detect())
    weights = sum(p.stat().st_size for p in onnx_dir.glob("*.onnx*"))
    log.info("loaded %s with ONNX Runtime GenAI from %s; limits input %d, total %d", config.model_id, onnx_dir,
             limits.max_input_tokens, limits.max_total_tokens)
    return ServedModel(engine, replace(config, enable_prefix_caching=False), model_config, tokenizer, limits,
                       compute, 0, Single(), [weights], runtime="onnx", check_request=engine.check)


def run_onnx_shard(config: EngineConfig, shards: int, listen: ListenConfig) -> int:
    """One ONNX Runtime GenAI replica (a group of one process: it has no sharding)."""
    if shards != 1:
        raise ValueError(f"--runtime onnx serves a replica from one process; --shards {shards} needs the "
                         "kubeshard runtime")
    exported(config.model_dir)  # before the port opens: an export is a start-up step, with its errors
    return run_leader(config.model_id, config.revision, GroupInfo("tensor", 1), listen,
                      lambda: build_onnx_served_model(config))
