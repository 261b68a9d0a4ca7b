"""Where kubeshard keeps what it builds once and reuses: ``$KUBESHARD_CACHE``.

Compiled kernels, demo checkpoints, converted models, Kubernetes binaries and images
live there, outside any clone (default ``~/.cache/kubeshard``); delete it to rebuild.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("KUBESHARD_CACHE") or Path.home() / ".cache" / "kubeshard")


def build_once(target: Path, build: Callable[[Path], None], marker: str = "config.json") -> Path:
    """``target``, built by ``build(folder)`` unless it already holds ``marker``. Safe
    across processes: the folder is written under a temporary name next to ``target``
    and renamed into place; a writer that loses the race keeps the winner's folder."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp / "out")
        try:
            os.rename(tmp / "out", target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, then readable by every user like the folder's other
    files (it writes 0600 whatever the umask): a model server running as another user (a
    pod's uid 10001 reading what the host's root wrote) must read the checkpoints built here."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    path.chmod(0o644)
