"""The runtime LoRA adapters' book (backends/runtime_adapters.py) against a real
redis-server: two routers share it, one's unload reaches the other, and a load made
while Redis is down stays in memory and is written when it answers again. (Through real
routers and shard servers: tests/router/test_lora_api.py.)"""

from __future__ import annotations

import logging

import redis

from kubeshard_router.backends.model import ModelState
from kubeshard_router.backends.runtime_adapters import RuntimeAdapters, adapters_key
from kubeshard_router.config import RouterConfig
from kubeshard_router.redis_store import RedisStore

CONFIG = RouterConfig(backends={"demo": ("127.0.0.1:1",)})


def _router(url: str) -> tuple[RuntimeAdapters, ModelState]:
    """One router's book and its own copy of the model's state."""
    return RuntimeAdapters(RedisStore(url, timeout_s=1.0, retry_s=0.0)), ModelState("demo", CONFIG)


def _stored(url: str) -> dict[str, str]:
    raw = redis.Redis.from_url(url).hgetall(adapters_key("demo"))
    return {k.decode(): v.decode() for k, v in raw.items()}


async def test_two_routers_share_loads_and_unloads(redis_url):
    one, model_one = _router(redis_url)
    two, model_two = _router(redis_url)
    await one.loaded(model_one, "alpha", "/lora/alpha")
    await one.loaded(model_one, "beta", "/lora/beta")
    assert _stored(redis_url) == {"alpha": "/lora/alpha", "beta": "/lora/beta", "": ""}
    assert model_two.runtime_adapters == {}
    assert await two.sync(model_two) == {"alpha": "/lora/alpha", "beta": "/lora/beta"}
    await two.unloaded(model_two, "alpha")
    assert await one.sync(model_one) == {"beta": "/lora/beta"}  # Redis is the truth when it answers
    assert _stored(redis_url) == {"beta": "/lora/beta", "": ""}
    assert adapters_key("demo") == "kubeshard:demo:lora"  # under the operator's clean-up pattern


async def test_a_change_while_redis_is_down_is_kept_and_written_later(redis_url, redis_server, caplog):
    one, model = _router(redis_url)
    await one.loaded(model, "alpha", "/lora/alpha")
    redis_server.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="kubeshard.router.backends"):
            await one.loaded(model, "gamma", "/lora/gamma")
            await one.unloaded(model, "alpha")
        assert "runtime LoRA adapters ['alpha', 'gamma'] kept in this router's memory only" in caplog.text
        # what replicas becoming ready now get: this router's memory
        assert await one.sync(model) == {"gamma": "/lora/gamma"}
    finally:
        redis_server.start()
    assert _stored(redis_url) == {}  # restarted without persistence: it lost the hash too
    assert await one.sync(model) == {"gamma": "/lora/gamma"}  # the missed changes written, then read
    assert _stored(redis_url) == {"gamma": "/lora/gamma", "": ""}
    other, other_model = _router(redis_url)
    assert await other.sync(other_model) == {"gamma": "/lora/gamma"}


async def test_the_probes_flush_writes_a_missed_change_with_what_a_restart_lost(redis_url, redis_server, caplog):
    """A change Redis missed reaches it without a sync (the registry's probe calls flush
    each round), and when Redis lost the hash meanwhile, all this router knows goes back."""
    one, model = _router(redis_url)
    await one.loaded(model, "alpha", "/lora/alpha")
    redis_server.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="kubeshard.router.backends"):
            await one.loaded(model, "beta", "/lora/beta")
            await one.flush(model)  # still down: kept, and said once
        assert caplog.text.count("kept in this router's memory only") == 1
    finally:
        redis_server.start()
    await one.flush(model)
    assert _stored(redis_url) == {"alpha": "/lora/alpha", "beta": "/lora/beta", "": ""}
    other, other_model = _router(redis_url)
    assert await other.sync(other_model) == {"alpha": "/lora/alpha", "beta": "/lora/beta"}
    await other.unloaded(other_model, "alpha")
    await one.flush(model)  # nothing missed: reads nothing, writes nothing back
    assert _stored(redis_url) == {"beta": "/lora/beta", "": ""}


class _UnloadDuringRead(RedisStore):
    """The real store, but the answer to the first read of the hash reaches the caller
    only after ``book`` unloaded ``name`` (whose write Redis took after the read): the
    interleaving of a probe's sync and an unload through the API."""

    def __init__(self, url: str, name: str) -> None:
        super().__init__(url, timeout_s=1.0, retry_s=0.0)
        self.name, self.book, self.model, self.reads = name, None, None, 0

    async def run(self, op, fn, timeout_s=None):
        answer = await super().run(op, fn, timeout_s)
        if op == "lora_read":
            self.reads += 1
            if self.reads == 1:
                await self.book.unloaded(self.model, self.name)
        return answer


async def test_a_read_that_an_unload_overtook_is_read_again(redis_url):
    store = _UnloadDuringRead(redis_url, "alpha")
    book, model = RuntimeAdapters(store), ModelState("demo", CONFIG)
    store.book, store.model = book, model
    await book.loaded(model, "alpha", "/lora/alpha")
    await book.loaded(model, "beta", "/lora/beta")
    assert await book.sync(model) == {"beta": "/lora/beta"}  # not alpha again, from the stale answer
    assert store.reads == 2
    assert _stored(redis_url) == {"beta": "/lora/beta", "": ""}


async def test_a_router_writes_back_what_a_redis_that_lost_its_data_forgot(redis_url, redis_server):
    one, model = _router(redis_url)
    await one.loaded(model, "alpha", "/lora/alpha")
    await one.unloaded(model, "alpha")
    assert _stored(redis_url) == {"": ""}  # every adapter unloaded: the hash stays, empty
    two, model_two = _router(redis_url)
    await two.loaded(model_two, "beta", "/lora/beta")
    redis_server.flushall()  # what a restart without persistence leaves
    assert await one.sync(model) == {}  # nothing in its memory to give back
    assert await two.sync(model_two) == {"beta": "/lora/beta"}
    assert _stored(redis_url) == {"beta": "/lora/beta", "": ""}
    assert await one.sync(model) == {"beta": "/lora/beta"}


async def test_without_redis_the_book_is_this_routers_memory():
    book, model = RuntimeAdapters(), ModelState("demo", CONFIG)
    await book.loaded(model, "alpha", "/lora/alpha")
    assert await book.sync(model) == {"alpha": "/lora/alpha"}
    await book.unloaded(model, "alpha")
    assert await book.sync(model) == {}
