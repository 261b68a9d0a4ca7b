"""In-process engines with the activation cache on a Redis URL, and their greedy tokens."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kubeshard_shard.config import ActivationCacheConfig
from tests.support.engine import build_engine, greedy, run_to_completion


def engine(model, url, kv="16MiB", dtype="auto", **settings):
    """An engine with the activation cache on ``url`` (``settings``: ActivationCacheConfig's,
    or EngineConfig's such as ``quantize``)."""
    cache = {k: settings.pop(k) for k in list(settings) if k in {f.name for f in fields(ActivationCacheConfig)}}
    cache.setdefault("min_hits", 1)
    eng = build_engine(model, kv=kv, dtype=dtype, activations=ActivationCacheConfig(redis_url=url, **cache),
                       **settings).engine
    _made.append(eng)
    return eng


_made: list = []  # this test's engines: their last writes must land before the next test


@pytest.fixture(autouse=True)
def writes_land_before_the_next_test():
    """A finished write op only means the blocks left the pool: its SET may still be in
    flight. Without this, a test's last entries could land after the next test flushed
    Redis (seen once: a stray key failed a test that expects none)."""
    yield
    while _made:
        eng = _made.pop()
        if eng.cache is None:
            continue
        try:
            eng.cache.worker.drain()
        except Exception:  # noqa: BLE001 - a Redis the test stopped or slowed: nothing to wait for
            pass
        eng.cache.worker.close()


def generate(eng, prompts, n=8) -> list[list[int]]:
    outs = run_to_completion(eng, [(p, greedy(n)) for p in prompts])
    return [[o.token_id for o in out] for out in outs]


def populate(eng, prompts):
    """Runs the prompts and waits until their blocks are in Redis."""
    out = generate(eng, prompts)
    eng.cache.worker.drain()
    return out
