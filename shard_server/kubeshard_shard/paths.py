"""Where kubeshard keeps what it builds once and reuses: ``$KUBESHARD_CACHE``.

Compiled kernels, demo checkpoints, converted models, Kubernetes binaries and images
live there, outside any clone (default ``~/.cache/kubeshard``); delete it to rebuild.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("KUBESHARD_CACHE") or Path.home() / ".cache" / "kubeshard")
