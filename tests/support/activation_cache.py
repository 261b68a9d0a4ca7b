"""In-process engines with the activation cache on a Redis URL, and their greedy tokens."""

from __future__ import annotations

from dataclasses import fields

from kubeshard_shard.config import ActivationCacheConfig
from tests.support.engine import build_engine, greedy, run_to_completion


def engine(model, url, kv="16MiB", dtype="auto", **settings):
    """An engine with the activation cache on ``url`` (``settings``: ActivationCacheConfig's,
    or EngineConfig's such as ``quantize``)."""
    cache = {k: settings.pop(k) for k in list(settings) if k in {f.name for f in fields(ActivationCacheConfig)}}
    cache.setdefault("min_hits", 1)
    return build_engine(model, kv=kv, dtype=dtype, activations=ActivationCacheConfig(redis_url=url, **cache),
                        **settings).engine


def generate(eng, prompts, n=8) -> list[list[int]]:
    outs = run_to_completion(eng, [(p, greedy(n)) for p in prompts])
    return [[o.token_id for o in out] for out in outs]


def populate(eng, prompts):
    """Runs the prompts and waits until their blocks are in Redis."""
    out = generate(eng, prompts)
    eng.cache.worker.drain()
    return out
