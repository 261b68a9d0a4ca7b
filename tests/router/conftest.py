"""Router test fixtures: the real router on loopback HTTP in front of StubBackend test doubles."""

from __future__ import annotations

import pytest

from tests.support.router_harness import RouterHarness
from tests.support.servers import start_serve


@pytest.fixture
def make_router():
    made: list[RouterHarness] = []

    def make(**kwargs) -> RouterHarness:
        h = RouterHarness(**kwargs).start()
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def router(make_router) -> RouterHarness:
    """One model ``stub`` with one stub replica, no Redis."""
    return make_router()


@pytest.fixture(scope="module")
def demo_serve(demo_model):
    """`kubeshard serve` of the llama demo model: one thread, 64 MiB of KV cache, 1024 input
    and 1536 total tokens."""
    proc = start_serve(demo_model(), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                       "--max-input-tokens", "1024", "--max-total-tokens", "1536")
    yield proc
    proc.stop()
