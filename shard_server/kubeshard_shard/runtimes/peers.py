"""Peer engines with an OpenAI-compatible HTTP API, as ``kubeshard serve --runtime`` runs them.

Each lives in its own environment, ``$KUBESHARD_CACHE/engines/NAME-VERSION`` (built by
``hack/engines.sh NAME``; ``KUBESHARD_<NAME>_PYTHON`` names another python), and runs
beside ``kubeshard engine-info``, which answers the router's Info and Health for it. A
registry, not a chain of ifs: the command line and the model each engine needs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kubeshard_shard.models.config import CheckpointError
from kubeshard_shard.paths import cache_root

RUNTIMES = ("kubeshard", "onnx", "vllm", "llamacpp")


@dataclass(frozen=True)
class Launch:
    """What one engine process needs: where the model is and how it is served."""

    model: Path       # the GGUF file (llamacpp) or Hugging Face folder (vllm)
    model_id: str
    host: str
    port: int
    max_total_tokens: int
    threads: int


@dataclass(frozen=True)
class PeerRuntime:
    name: str
    version: str  # as pinned in hack/engines.sh
    wants_gguf: bool
    argv: Callable[[Path, Launch], list[str]]
    env: Callable[[Launch], dict[str, str]]

    def python(self) -> Path:
        configured = os.environ.get(f"KUBESHARD_{self.name.upper()}_PYTHON")
        if configured:
            return Path(configured)
        return cache_root() / "engines" / f"{self.name}-{self.version}" / "bin" / "python"

    def check_built(self) -> Path:
        python = self.python()
        if not python.is_file():
            raise CheckpointError(
                f"the {self.name} engine is not built ({python} is missing): run `hack/engines.sh {self.name}` "
                f"(or `make engines`) once; it is cached under $KUBESHARD_CACHE/engines")
        return python

    def model_for(self, source: Path, checkpoint: Path) -> Path:
        """The model file this engine loads: a GGUF file as given, or the checkpoint folder."""
        if self.wants_gguf:
            if source.suffix.lower() != ".gguf":
                raise CheckpointError(f"--runtime {self.name} serves a .gguf file; {source} is not one")
            return source
        return checkpoint

    def command(self, launch: Launch) -> list[str]:
        return self.argv(self.check_built(), launch)


def _llamacpp(python: Path, x: Launch) -> list[str]:
    # interrupt_requests off: by default a new request cuts the running one short;
    # logits_all off: its buffer would take n_ctx x vocab floats (top-n is refused instead)
    return [str(python), "-m", "llama_cpp.server", "--model", str(x.model), "--model_alias", x.model_id,
            "--host", x.host, "--port", str(x.port), "--n_ctx", str(x.max_total_tokens),
            "--n_threads", str(x.threads), "--n_threads_batch", str(x.threads),
            "--interrupt_requests", "False", "--logits_all", "False", "--verbose", "False"]


def _vllm(python: Path, x: Launch) -> list[str]:
    # --optimization-level 0: no torch.compile. Compiled, vLLM's CPU build starts in 10 to
    # 16 min on two shared cores (its cache helps only for the same shapes); eager, in
    # about 90 s, with the same greedy output.
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(x.model),
            "--served-model-name", x.model_id, "--host", x.host, "--port", str(x.port),
            "--max-model-len", str(x.max_total_tokens),
            "--optimization-level", os.environ.get("KUBESHARD_VLLM_OPTIMIZATION_LEVEL", "0")]


def _vllm_env(x: Launch) -> dict[str, str]:
    # a KV cache that fits beside the other engines of a small machine (GiB)
    return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            "OMP_NUM_THREADS": str(x.threads)}


PEERS: dict[str, PeerRuntime] = {
    "llamacpp": PeerRuntime("llamacpp", "0.3.36", True, _llamacpp, lambda x: {}),
    "vllm": PeerRuntime("vllm", "0.32.0", False, _vllm, _vllm_env),
}
