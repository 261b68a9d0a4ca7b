"""Fixtures shared by every test folder.

- ``redis_server``: a real redis-server on a free loopback port (session-scoped),
  flushed before each test that uses ``redis_url``; ``.stop()``/``.start()`` simulate
  an outage.
- ``demo_model(arch="llama", size="tiny", seed=0)``: path of a deterministic demo
  checkpoint written by ``kubeshard demo-model``, cached under $KUBESHARD_CACHE so
  later runs reuse it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kubeshard_shard.paths import cache_root
from tests.support.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server) -> str:
    redis_server.start()  # a previous test may have stopped it
    redis_server.flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def demo_model():
    from kubeshard_shard.demo_model import cached_demo_model

    def make(arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
        return cached_demo_model(cache_root() / "demo-models", arch=arch, size=size, seed=seed)

    return make
