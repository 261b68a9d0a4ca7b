"""The activation cache: KV blocks of popular prompt prefixes shared through Redis.

A replica that never saw a prefix (a new group after a scale-up or a wake from zero,
a restarted one, another group) loads the prefix's keys and values instead of
computing them. It sits behind the engine's own prefix cache and speaks its language:
a full KV block named by its chained hash (``engine.block_manager.hash_block``).

- ``layout``: what one rank's block holds (model, revision, dtype, block size, sharding
  layout) and the Redis keys that name it;
- ``codec``: an entry's bytes, a small versioned header and the raw block;
- ``store``: the Redis connection (one server or a Cluster), bounded and skipped while
  down, with pipelined chain reads, the hit counters and the per-model byte budget;
- ``ops``: the transfers the leader asks of its ranks, as plain int64 tensors;
- ``worker``: one per rank, moving its own blocks between its KV pool and Redis in
  background threads;
- ``coordinator``: on the leader, deciding what to fetch and write, holding requests
  while their prefix arrives, and counting what it saved.
"""
