"""The pinned helm binary (``make k8s-tools`` builds it under ``$KUBESHARD_CACHE/k8s``)
and ``helm template`` of the chart, for tests that check what the chart renders."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from kubeshard_shard.paths import cache_root

CHART = Path(__file__).resolve().parents[2] / "charts" / "kubeshard"


def helm() -> Path:
    """The helm binary; a missing one fails the test (the chart is part of what is tested)."""
    found = sorted(cache_root().glob("k8s/v*/bin/helm"))
    if not found:
        pytest.fail(f"no helm under {cache_root()}/k8s: build it with `make k8s-tools` "
                    "(`make test` and `make test-e2e` do it first)", pytrace=False)
    return found[-1]


def template(*flags: str, check: bool = True, namespace: str = "serving") -> subprocess.CompletedProcess:
    """``helm template t charts/kubeshard -n NAMESPACE FLAGS...``."""
    return subprocess.run([str(helm()), "template", "t", str(CHART), "-n", namespace, *flags],
                          capture_output=True, text=True, timeout=120, check=check)


def rendered(*flags: str) -> list[dict]:
    """The chart's objects as rendered with ``flags``."""
    return [d for d in yaml.safe_load_all(template(*flags).stdout) if d]
