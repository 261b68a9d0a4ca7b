"""One rank's cache worker: moves this rank's KV blocks between its pool and Redis.

Every rank of a group has one, with its own Redis connection and its own layout (a
tensor rank moves only its heads). It takes the leader's ``CacheOps`` in ``apply`` on
the rank's main thread, which only starts work and answers statuses; the transfers run
in background threads, off the engine step:

- a fetch reads a chain, checks each entry (``codec.decode``) and copies it straight
  into the block the leader reserved for it, stopping at the first missing or refused
  entry; its status is the number of leading blocks loaded (every copy finished);
- a write copies the pinned blocks out of the pool (then its status says the leader may
  release them) and writes them to Redis with the model's byte budget.

The pool is shared with the engine thread without locks: a reserved block belongs to
no sequence until the leader adopts it, and a pinned full block is never rewritten.
A CPU pool is copied with numpy (``KVCache.host_view``), in the worker's own thread:
torch would wake its thread pool beside the engine's (on a loaded machine a block copy
through torch took ten times as long). On CUDA the copies run on a side stream; a
write first waits for the step that filled its blocks (an event recorded in ``apply``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from kubeshard_shard.activations import codec
from kubeshard_shard.activations.layout import KVLayout, count_field
from kubeshard_shard.activations.ops import NOT_MINE, RUNNING, CacheOps, Transfer
from kubeshard_shard.activations.store import Budget, RedisTier, TierUnavailable
from kubeshard_shard.engine.attention import KVCache

log = logging.getLogger(__name__)

COUNT_TTL_S = 600     # a prompt counter's lifetime (at most the entries'): min_hits prompts within it
COUNT_FIELD_BYTES = 64  # charged to the budget per counted block (Redis uses 13-56)


class CacheWorker:
    def __init__(self, tier: RedisTier, layout: KVLayout, cache: KVCache, lane: int, shards: int, ttl_s: int,
                 budget: Budget | None) -> None:
        self.tier, self.layout, self.cache = tier, layout, cache
        self.lane = lane        # the lane whose blocks this rank holds
        self.shards = shards
        self.ttl_s, self.budget = ttl_s, budget
        self.count_ttl_s = min(ttl_s, COUNT_TTL_S)
        self.on_done: Callable[[], None] | None = None  # the leader's engine loop wakes on it
        self._status: dict[int, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = self.blocks_written = 0
        self.rejected: Counter[str] = Counter()
        self._fetching = ThreadPoolExecutor(2, thread_name_prefix="kv-fetch")
        self._writing = ThreadPoolExecutor(1, thread_name_prefix="kv-write")
        self._counting = ThreadPoolExecutor(1, thread_name_prefix="kv-count")
        self._stream = torch.cuda.Stream(cache.device) if cache.device.type == "cuda" else None
        self._host = cache.host_view() if self._stream is None else None  # a CPU pool, as numpy
        self._fetching.submit(self._connect)  # the first request should not pay for the connection

    def _connect(self) -> None:
        try:
            self.tier.run("connect", lambda client: client.ping())
        except TierUnavailable:
            pass

    # ---- the rank's main thread --------------------------------------------------------
    def apply(self, ops: CacheOps) -> list[int]:
        """Starts this rank's share of ``ops``; returns its counters and the statuses asked."""
        for t in ops.fetches:
            if t.lane == self.lane:
                self._set(t.op_id, RUNNING)
                self._fetching.submit(self._fetch, t)
        for t in ops.writes:
            if t.lane == self.lane:
                self._set(t.op_id, RUNNING)
                event = None
                if self._stream is not None:
                    event = torch.cuda.Event()
                    event.record()  # after the steps that filled these blocks
                self._writing.submit(self._write, t, event)
        row = self.counters()
        with self._lock:
            row += [self._status.get(q, NOT_MINE) for q in ops.queries]
            for op_id in ops.releases:
                self._status.pop(op_id, None)
        return row

    def counters(self) -> list[int]:
        return [self.bytes_read, self.bytes_written, sum(self.rejected.values()), self.tier.errors,
                self.blocks_written]

    def status(self, op_id: int) -> int:
        with self._lock:
            return self._status.get(op_id, NOT_MINE)

    def count_and_probe(self, root: int, hashes: list[int]) -> Future:
        """(leader) Counts the prompts that held each block and whether every rank has
        it in Redis: a future of (counts, present), or None when Redis failed."""
        layouts = [self.layout.of_rank(self.shards, r) for r in range(self.shards)] \
            if self.layout.sharding != "full" else [self.layout]

        def run():
            try:
                return self.tier.count_and_probe(self.layout.seen_key(root), [count_field(h) for h in hashes],
                                                 [[lay.key(root, h) for lay in layouts] for h in hashes],
                                                 self.count_ttl_s, self.budget, self.ttl_s, COUNT_FIELD_BYTES)
            except TierUnavailable:
                return None
            except Exception:  # noqa: BLE001 - a bug here must not fail the engine step that reads it
                log.exception("activation cache: counting failed")
                return None

        return self._counting.submit(run)

    def drain(self, timeout: float = 10.0) -> None:
        """Waits until the writes started so far are in Redis (or failed)."""
        self._writing.submit(lambda: None).result(timeout)

    def close(self) -> None:
        for pool in (self._fetching, self._writing, self._counting):
            pool.shutdown(wait=False, cancel_futures=True)
        self.tier.close()

    # ---- background threads ----------------------------------------------------------------
    def _set(self, op_id: int, status: int) -> None:
        with self._lock:
            self._status[op_id] = status

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def _finish(self, op_id: int, status: int) -> None:
        self._set(op_id, status)
        if self.on_done is not None:
            self.on_done()

    def _fetch(self, t: Transfer) -> None:
        layout, loaded = self.layout, 0
        keys = [layout.key(t.root, h) for h in t.hashes]

        def take(i: int, value: memoryview | None) -> bool:
            nonlocal loaded
            if value is None:
                return False
            try:
                payload = codec.decode(value, layout, t.hashes[i])
            except codec.EntryRejected as exc:
                with self._lock:
                    self.rejected[exc.reason] += 1
                log.warning("activation cache: ignoring the entry %s (%s)", keys[i], exc)
                return False
            if self._host is not None:
                np.copyto(self._host[:, :, self._slots(t.block_ids[i])], codec.as_array(payload, layout))
            else:
                with torch.cuda.stream(self._stream):
                    self.cache.block(t.block_ids[i]).copy_(codec.as_block(payload, layout))
            loaded += 1
            self._count("bytes_read", len(value))
            return True

        try:
            self.tier.fetch_chain(keys, take, codec.HEADER_BYTES + layout.block_bytes)
        except TierUnavailable:
            pass
        except Exception:  # never let a bad entry or a bug take the rank down
            log.exception("activation cache: fetch failed")
        finally:
            if self._stream is not None:
                self._stream.synchronize()
            self._finish(t.op_id, loaded)

    def _slots(self, block_id: int) -> slice:
        bs = self.cache.block_size
        return slice(block_id * bs, (block_id + 1) * bs)

    def _write(self, t: Transfer, event) -> None:
        host = None
        try:
            if self._host is not None:
                host = [np.ascontiguousarray(self._host[:, :, self._slots(b)]) for b in t.block_ids]
            else:
                self._stream.wait_event(event)
                with torch.cuda.stream(self._stream):
                    blocks = self.cache.read_blocks(t.block_ids).to("cpu")
                self._stream.synchronize()
                host = [b.view(torch.uint8).numpy() for b in blocks]
        except Exception:
            log.exception("activation cache: reading blocks to write failed")
        finally:
            self._finish(t.op_id, 1)  # the pool is not read any more: the leader may release them
        if host is None:
            return
        try:
            entries = [(self.layout.key(t.root, h), codec.encode(self.layout, h, host[i]))
                       for i, h in enumerate(t.hashes)]
            self._count("bytes_written", self.tier.put(entries, self.ttl_s, self.budget))
            self._count("blocks_written", len(entries))
        except TierUnavailable:
            pass
        except Exception:
            log.exception("activation cache: write failed")
