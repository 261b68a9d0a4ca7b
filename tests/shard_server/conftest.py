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


@pytest.fixture(params=["x86-64-v3", "x86-64"])
def portable_kernels(request):
    """The CPU kernels built for an AVX2-only CPU and for plain x86-64 (other vector widths
    than this CPU's own: 8 floats, not 16 with AVX-512; SSE pairs on x86-64); skipped
    only where this CPU cannot run the build, failed where it does not build."""
    from tests.support.cpu_kernels import kernels_for_level

    return kernels_for_level(request.param)
