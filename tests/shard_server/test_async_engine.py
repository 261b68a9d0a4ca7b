"""The engine loop's thread and the event loop it serves (``AsyncEngine``)."""

from __future__ import annotations

import asyncio
import time

from kubeshard_shard.engine.async_engine import AsyncEngine
from tests.support.engine import build_engine, greedy, random_prompts


def test_stats_count_every_token_a_client_has_seen(demo_model):
    """A /metrics scrape made after a client saw a token counts that token: the loop
    publishes its stats before it hands a step's outputs to the clients. Reading the
    stats is slowed down here so that the other order would show."""
    served = build_engine(demo_model("llama"))
    engine = served.engine
    read = engine.stats

    def slow_stats():
        time.sleep(0.02)
        return read()

    engine.stats = slow_stats

    async def run() -> list[int]:
        loop_engine = AsyncEngine(engine, max_concurrent_requests=4)
        loop_engine.start()
        try:
            seen, counted = 0, []
            prompt = random_prompts(1, 1000, (8, 8), seed=3)[0]
            async for _ in loop_engine.generate("r", prompt, greedy(6)):
                seen += 1
                counted.append(loop_engine.stats.generated_tokens_total - seen)
            return counted
        finally:
            await asyncio.to_thread(loop_engine.stop)

    counted = asyncio.run(run())
    assert len(counted) == 6
    assert min(counted) >= 0, counted


def test_a_call_runs_in_the_loop_thread_between_steps_and_answers_its_caller(demo_model):
    """``call`` runs a function in the engine's thread while a request decodes (a group's
    runtime adapter load goes this way), gives back its result or raises its exception;
    once the engine has stopped a call is refused, not left waiting."""
    import threading

    import pytest

    from kubeshard_shard.engine.async_engine import EngineUnavailable

    served = build_engine(demo_model("llama"))

    async def run():
        loop_engine = AsyncEngine(served.engine, max_concurrent_requests=4)
        loop_engine.start()
        prompt = random_prompts(1, 1000, (8, 8), seed=3)[0]
        tokens = []

        async def decode():
            async for out in loop_engine.generate("r", prompt, greedy(12)):
                tokens.append(out)

        task = asyncio.create_task(decode())
        while not tokens:
            await asyncio.sleep(0.005)
        thread = await loop_engine.call(lambda: threading.current_thread().name)
        with pytest.raises(KeyError, match="no such adapter"):
            await loop_engine.call(lambda: {}["no such adapter"])
        await task
        await asyncio.to_thread(loop_engine.stop)
        with pytest.raises(EngineUnavailable):
            await loop_engine.call(lambda: "late")
        return thread, len(tokens)

    thread, count = asyncio.run(run())
    assert (thread, count) == ("engine-loop", 12)
