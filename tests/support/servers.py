"""Real kubeshard servers for integration tests and benchmarks, on loopback ports: a
``kubeshard serve-shard`` leader with small defaults (as a plain ``Proc``; groups and
ranks: ``shard_process``), the ``kubeshard-router`` CLI, and the ``kubeshard serve``
launcher."""

from __future__ import annotations

import re
import sys

from tests.support.ports import free_port
from tests.support.processes import Proc, start
from tests.support.shard_process import READY as SHARD_READY

__all__ = ["ROUTER_READY", "start_shard", "start_router", "start_serve"]

ROUTER_READY = re.compile(r"^kubeshard ready on http://(?P<host>[^:\s]+):(?P<port>\d+)$")


def start_shard(model_dir, *flags: str, threads: int = 1) -> Proc:
    cmd = [sys.executable, "-m", "kubeshard_shard.cli", "serve-shard", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--num-threads", str(threads),
           "--kv-cache-memory", "64MiB", *flags]
    return start("serve-shard", cmd, SHARD_READY)


def start_router(*flags: str) -> Proc:
    cmd = [sys.executable, "-m", "kubeshard_router.cli", "--host", "127.0.0.1", "--port", "0", *flags]
    return start("kubeshard-router", cmd, ROUTER_READY, timeout=120)


def start_serve(model_dir, *flags: str) -> Proc:
    cmd = [sys.executable, "-m", "kubeshard_shard.cli", "serve", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(free_port()), *flags]
    return start("kubeshard serve", cmd, ROUTER_READY)
