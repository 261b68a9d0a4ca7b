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
