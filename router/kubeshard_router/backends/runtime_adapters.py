"""The LoRA adapters loaded at run time (vLLM's /v1/load_lora_adapter), per model: what a
replica that becomes ready without them must load too (the registry's probe replays them).

Each router keeps them in memory (``ModelState.runtime_adapters``, name -> folder) and,
with Redis, in one hash per model, ``kubeshard:{model}:lora``, so that a router that did
not take the load replays them as well: another replica of the router, or this one after
a restart (the HPA scales routers down; a model scaled to zero comes back with fresh
replicas). An adapter an admin loaded is not lost with the router that loaded it, and
the operator's clean-up of a deleted model's keys (``kubeshard:{model}:*``) takes the
hash with it.

When Redis answers, its hash is the truth (another router may have unloaded an
adapter); a change made while it did not is kept in this router's memory and written
when it answers again (the registry's probe tries each round, ``flush``: the load or
unload answered 200 already, and no other router would hear of it otherwise). The hash
keeps one more field, "" (no adapter has an empty name), from its first write on, so
that it exists even when every adapter was unloaded: a hash that is missing means a
Redis that lost its data (a restart without persistence), and a router then writes
what it has in memory back.
"""

from __future__ import annotations

import logging
from typing import Optional

from kubeshard_router.backends.model import ModelState
from kubeshard_router.redis_store import RedisStore, StoreUnavailable

log = logging.getLogger("kubeshard.router.backends")


EXISTS = ""  # the field that marks the hash as written (see above)


def adapters_key(model: str) -> str:
    return f"kubeshard:{model}:lora"


class RuntimeAdapters:
    def __init__(self, store: Optional[RedisStore] = None) -> None:
        self.store = store
        # per model, the changes Redis has not taken yet: name -> folder, or None (unloaded)
        self._unwritten: dict[str, dict[str, Optional[str]]] = {}
        # per model, how many loads and unloads this router has made (a read of the hash
        # that one overtook is stale)
        self._changes: dict[str, int] = {}

    async def loaded(self, model: ModelState, name: str, path: str) -> None:
        model.runtime_adapters[name] = path
        self._changes[model.name] = self._changes.get(model.name, 0) + 1
        await self._write(model, {name: path})

    async def unloaded(self, model: ModelState, name: str) -> None:
        model.runtime_adapters.pop(name, None)
        self._changes[model.name] = self._changes.get(model.name, 0) + 1
        await self._write(model, {name: None})

    async def sync(self, model: ModelState) -> dict[str, str]:
        """The model's runtime adapters, read again from Redis when it answers (after
        writing what it missed); this router's memory otherwise."""
        if self.store is None or not await self._write(model, {}):
            return model.runtime_adapters
        key = adapters_key(model.name)
        for _ in range(3):
            changes = self._changes.get(model.name, 0)
            try:
                stored = await self.store.run("lora_read", lambda client: client.hgetall(key))
            except StoreUnavailable:
                return model.runtime_adapters
            if self._changes.get(model.name, 0) == changes:
                break
            # a load or unload here while the read was out (Redis may have answered before
            # its write): read again, lest the replicas get back an adapter just unloaded
        else:
            return model.runtime_adapters
        if not stored:  # never written, or lost: this router's memory is all there is
            await self._write(model, dict(model.runtime_adapters))
            return model.runtime_adapters
        model.runtime_adapters = {name.decode(): path.decode() for name, path in stored.items() if name}
        return model.runtime_adapters

    async def flush(self, model: ModelState) -> None:
        """Writes the changes Redis missed, if there are any (without a new warning when
        it still does not answer)."""
        if self._unwritten.get(model.name):
            await self._write(model, {})

    async def _write(self, model: ModelState, changes: dict[str, Optional[str]]) -> bool:
        """Writes ``changes`` and any earlier ones Redis missed; False when it did not
        answer (they wait for the next try)."""
        if self.store is None:
            return False
        pending = self._unwritten.setdefault(model.name, {})
        pending.update(changes)
        if not pending:
            return True
        key = adapters_key(model.name)
        writing = dict(pending)  # a change made while this write waits on Redis stays pending
        added = {name: path for name, path in writing.items() if path is not None}
        added[EXISTS] = ""
        removed = [name for name, path in writing.items() if path is None]

        async def write(client) -> None:
            async with client.pipeline(transaction=True) as pipe:
                pipe.exists(key)
                pipe.hset(key, mapping=added)
                if removed:
                    pipe.hdel(key, *removed)
                existed = (await pipe.execute())[0]
            if not existed:  # never written, or lost while the changes waited: all this router has
                await client.hset(key, mapping={**model.runtime_adapters, EXISTS: ""})

        try:
            await self.store.run("lora_write", write)
        except StoreUnavailable as exc:
            if changes:
                log.warning("model %s: runtime LoRA adapters %s kept in this router's memory only until Redis "
                            "answers (%s)", model.name, sorted(pending), exc)
            return False
        for name, path in writing.items():
            if name in pending and pending[name] == path:
                del pending[name]
        return True
