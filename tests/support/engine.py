"""A real engine in-process, and a transformers reference, for engine tests and benchmarks."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch

from kubeshard_shard.config import EngineConfig, MemoryBudget
from kubeshard_shard.engine.request import make_sampling_params
from kubeshard_shard.server.factory import build_served_model


def build_engine(model_dir: Path, kv: str = "64MiB", **overrides):
    config = EngineConfig(model_dir=Path(model_dir), model_id=Path(model_dir).name,
                          kv_cache_memory=MemoryBudget.parse(kv), **overrides)
    return build_served_model(config)


def run_to_completion(engine, requests: list[tuple[list[int], object]]) -> list[list]:
    """Adds every (prompt_ids, params) at once and steps until all finish; returns the
    TokenOutputs of each request in order."""
    keys = {engine.add_request(str(i), ids, params): i for i, (ids, params) in enumerate(requests)}
    outs: list[list] = [[] for _ in requests]
    for _ in range(100_000):
        if not engine.has_work():
            break
        for o in engine.step():
            outs[keys[o.request_key]].append(o)
    assert not engine.has_work(), "engine did not finish"
    return outs


def greedy(n: int, **kw):
    return make_sampling_params(max_new_tokens=n, ignore_eos=True, **kw)


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    """transformers' model, with no end-of-sequence id: `generate` then neither stops at
    EOS nor suppresses it, which is what the engine's ignore_eos does (EOS is emitted and
    generation goes on)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = hf_model(str(model_dir))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(count: int, vocab: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def prefill_logits(served, prompt) -> torch.Tensor:
    """The engine's logits at the prompt's last position, from one prefill outside the
    scheduler (its blocks freed after)."""
    from kubeshard_shard.engine.scheduler import SchedulerOutput
    from kubeshard_shard.engine.sequence import Sequence

    engine = served.engine
    seq = Sequence("x", list(prompt), greedy(1))
    assert engine.block_manager.allocate(seq, len(prompt))
    try:
        plan = engine.runner.prepare(SchedulerOutput(prefills=[(seq, len(prompt))]))
        return engine.runner.run(plan.inputs)[0].float()
    finally:
        engine.block_manager.free_sequence(seq)


def relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS of ``a - b`` relative to the RMS of ``a``."""
    return ((a - b).pow(2).mean().sqrt() / a.pow(2).mean().sqrt()).item()
