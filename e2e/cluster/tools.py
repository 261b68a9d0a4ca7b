"""Where the pinned Kubernetes, etcd and helm binaries are (built by hack/k8s-tools.sh)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kubeshard_shard.paths import cache_root

from .config import REPO_ROOT

TOOLS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy",
         "kubelet", "kubectl", "etcd", "helm")


def find_bin_dir(build: bool = True) -> Path:
    """The folder holding all of TOOLS.

    KUBESHARD_K8S_BIN names it explicitly; otherwise hack/k8s-tools.sh reports (and, the
    first time, builds) the cached one. `build=False` refuses to start a build, which
    takes minutes, and says what to run instead.
    """
    explicit = os.environ.get("KUBESHARD_K8S_BIN")
    if explicit:
        return _checked(Path(explicit), "KUBESHARD_K8S_BIN")
    script = REPO_ROOT / "hack" / "k8s-tools.sh"
    if not build:
        cache = cache_root()
        candidates = sorted((cache / "k8s").glob("v*/bin"))
        if not candidates:
            raise FileNotFoundError(f"no Kubernetes binaries under {cache}/k8s: run `make k8s-tools`")
        return _checked(candidates[-1], "the k8s-tools cache")
    try:
        proc = subprocess.run([str(script)], capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{script} did not finish within an hour") from e
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return _checked(Path(proc.stdout.strip().splitlines()[-1]), str(script))


def _checked(path: Path, source: str) -> Path:
    missing = [t for t in TOOLS if not os.access(path / t, os.X_OK)]
    if missing:
        raise FileNotFoundError(f"{source}: {path} lacks {', '.join(missing)}")
    return path
