"""Router test fixtures: the real router on loopback HTTP in front of StubBackend test doubles."""

from __future__ import annotations

import pytest

from tests.support.router_harness import RouterHarness


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
