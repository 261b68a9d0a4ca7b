"""Where a process sits in its shard group, from flags, the environment, or its pod name.

Precedence per value: flag, then the torchrun-style variable (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), then — inside a StatefulSet with ``--headless-service`` —
the pod name's ordinal as the rank and ``<statefulset>-0.<service>`` as the leader, so
a pod needs no per-pod configuration.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Mapping

from kubeshard_shard.config import DistributedConfig

_ORDINAL = re.compile(r"^(?P<set>.+)-(?P<ordinal>\d+)$")


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got '{value}'") from None


def pod_identity(env: Mapping[str, str]) -> tuple[str, int]:
    """(statefulset name, ordinal) from POD_NAME or the hostname."""
    name = env.get("POD_NAME") or socket.gethostname()
    m = _ORDINAL.match(name)
    if not m:
        raise ValueError(f"--headless-service is set but the pod name '{name}' has no StatefulSet ordinal "
                         "(expected NAME-N); set POD_NAME from the downward API")
    return m.group("set"), int(m.group("ordinal"))


def resolve_group(strategy: str | None, shards: int | None, rank: int | None, master_addr: str | None,
                  master_port: int | None, headless_service: str | None, timeout_s: float,
                  offload: str | None, env: Mapping[str, str] | None = None) -> DistributedConfig:
    env = os.environ if env is None else env
    world = shards if shards is not None else _int_env(env, "WORLD_SIZE")
    pod_set = pod_rank = None
    if headless_service:
        pod_set, pod_rank = pod_identity(env)
    if rank is None:
        rank = _int_env(env, "RANK")
    if rank is None:
        rank = pod_rank if pod_rank is not None else 0
    if master_addr is None:
        master_addr = env.get("MASTER_ADDR") or None
    if master_addr is None:
        master_addr = f"{pod_set}-0.{headless_service}" if headless_service else "127.0.0.1"
    if master_port is None:
        master_port = _int_env(env, "MASTER_PORT") or 29500
    return DistributedConfig(
        strategy=strategy or env.get("KUBESHARD_STRATEGY") or "tensor",
        world_size=world or 1,
        rank=rank,
        master_addr=master_addr,
        master_port=master_port,
        timeout_s=timeout_s,
        offload=offload,
    )
