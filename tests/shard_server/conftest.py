"""Fixtures of the engine tests (their helpers: tests/support/engine.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cpu_kernels():
    """The compiled CPU kernels' module (built on first use); a missing compiler fails
    the tests that need it instead of skipping them."""
    from kubeshard_shard.engine import kernels

    built = kernels.module()
    if built is None:
        pytest.fail("the CPU kernels failed to build on this machine")
    return built


@pytest.fixture(params=["kernel", "torch-fallback"])
def decode_path(request) -> dict:
    """Runs a test with the compiled decode kernel and with the torch fallback: the
    engine settings to pass to ``build_engine``."""
    from kubeshard_shard.engine import kernels

    if request.param == "kernel" and kernels.load() is None:
        pytest.fail("the paged decode kernel failed to build on this machine")
    return {"cpu_kernels": request.param == "kernel"}
