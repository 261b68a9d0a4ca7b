"""Tiny factories for operator unit tests: plain dicts in, typed specs out."""

from __future__ import annotations

import copy
from typing import Any

from kubeshard_operator.config import OperatorConfig
from kubeshard_operator.spec import InferenceServiceSpec, parse_spec

CFG = OperatorConfig(shard_image="ghcr.io/kubeshard/shard-server:test",
                     shard_image_cuda="ghcr.io/kubeshard/shard-server:test-cuda",
                     router_url="http://kubeshard-router.kubeshard.svc:8080")

OWNER_BODY = {"apiVersion": "kubeshard.io/v1alpha1", "kind": "InferenceService",
              "metadata": {"name": "tiny", "namespace": "ml", "uid": "uid-1"}}


def spec_dict(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "replicas": 1,
        "model": {"source": "/cache/demo-models/llama-tiny"},
        "sharding": {"strategy": "tensor", "shards": 2},
        "resources": {"cpu": "1", "memory": "2Gi"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return copy.deepcopy(base)


def make_spec(name: str = "tiny", namespace: str = "ml", **overrides: Any) -> InferenceServiceSpec:
    return parse_spec(name, namespace, spec_dict(**overrides))
