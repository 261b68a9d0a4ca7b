"""The leader's side of the activation cache: what to fetch, what to write, who waits.

The engine asks three things of it, all on the engine thread and none of them waiting
on Redis:

- ``hold(lane, seq)`` when a request arrives. After the local prefix cache, the blocks
  of the prompt that follow are looked up in Redis: the leader reserves blocks for them
  in the lane's pool, asks the ranks to fetch (``CacheOps.fetches``) and keeps the
  request aside. Requests wanting the same chain on the same lane wait on one fetch.
- ``tick()`` before each step. It sends new ops to the ranks, asks for the statuses of
  ops whose result may be in, and settles them. A fetch is used only when every rank
  that holds a share of the lane has it: the group adopts the longest chain all ranks
  loaded (the blocks enter the prefix cache like computed ones) and frees the rest,
  then its requests are scheduled and find that prefix cached. A fetch not settled
  by its deadline lets its requests go on without it (its blocks stay reserved until
  the ranks are done with them).
- ``prefilled(lane, seq)`` when a prompt has been computed. In the background the
  leader counts, in Redis, the prompts that held each of its full blocks and probes
  which ones every rank already stored; blocks seen ``min_hits`` times and missing are
  pinned and written by every rank (``CacheOps.writes``), then released.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from kubeshard_shard.activations.ops import COUNTERS, RUNNING, CacheOps, Transfer
from kubeshard_shard.activations.worker import CacheWorker
from kubeshard_shard.config import ActivationCacheConfig
from kubeshard_shard.engine.lane import Lane
from kubeshard_shard.engine.sequence import Sequence

log = logging.getLogger(__name__)

FETCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
POLL_S = 0.002              # between status queries of ops other ranks still run
LATE_POLL_S = 0.05          # ... of fetches whose requests went on without them
KNOWN_S = 60.0              # a block seen in Redis is not probed again for this long
KNOWN_MAX = 1 << 16
MAX_COUNTING = 64           # prompts whose blocks are being counted at once
MAX_WRITE_BLOCKS = 4096     # blocks pinned for writes at once (per lane: a quarter of the pool at most)


@dataclass
class ActivationCacheStats:
    """The group's activation-cache figures since start (bytes summed over ranks)."""

    lookups: int = 0            # requests whose prefix was looked up in Redis
    hits: int = 0               # ... that loaded at least one block
    hit_blocks: int = 0         # blocks loaded and used
    miss_blocks: int = 0        # blocks looked up and not loaded (missing, refused, late)
    tokens_saved: int = 0       # prompt tokens not computed thanks to Redis
    timeouts: int = 0           # fetches whose requests went on without them
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    rejected: int = 0           # entries refused: truncated, another format, layout or block, bad checksum
    errors: int = 0             # failed or timed-out Redis calls
    redis_up: bool = True
    fetch_seconds_sum: float = 0.0
    fetch_buckets: list[int] = field(default_factory=lambda: [0] * (len(FETCH_BUCKETS) + 1))

    @property
    def fetch_count(self) -> int:
        return sum(self.fetch_buckets)

    def observe_fetch(self, seconds: float) -> None:
        self.fetch_seconds_sum += seconds
        self.fetch_buckets[bisect.bisect_left(FETCH_BUCKETS, seconds)] += 1


@dataclass(eq=False)
class _Fetch:
    op: Transfer
    lane: "Lane"
    started: float
    deadline: float
    waiters: list[Sequence]
    chain: set[int]
    last_query: float = float("-inf")
    others_running: bool = False  # the last query found another rank still at it
    gave_up: bool = False         # its requests went on without it


@dataclass(eq=False)
class _Write:
    op: Transfer
    lane: "Lane"
    last_query: float = float("-inf")
    others_running: bool = False


@dataclass(eq=False)
class _Count:
    lane: "Lane"
    root: int
    hashes: list[int]
    result: Future


class ActivationCache:
    def __init__(self, config: ActivationCacheConfig, worker: CacheWorker,
                 exchange: Callable[[CacheOps], list[list[int]]], block_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``exchange`` hands ops to every rank's worker (this one's included) and returns
        each rank's answer row."""
        self.config, self.worker, self.exchange = config, worker, exchange
        self.block_size = block_size
        self.clock = clock
        self._next_op = 1
        self._fetches: dict[int, _Fetch] = {}
        self._writes: dict[int, _Write] = {}
        self._counting: list[_Count] = []
        self._outbox = CacheOps()
        self._known: OrderedDict[int, float] = OrderedDict()  # block hash -> until when it is known stored
        self._pinned_for_writes = 0
        self._rank_counters: list[list[int]] = []
        self._stats = ActivationCacheStats()
        self._event = threading.Event()
        self._wake: Callable[[], None] | None = None
        worker.on_done = self._worker_done

    def _worker_done(self) -> None:
        self._event.set()
        if self._wake is not None:
            self._wake()

    # ---- the engine's questions ----------------------------------------------------------
    @property
    def num_held(self) -> int:
        return sum(len(f.waiters) for f in self._fetches.values() if not f.gave_up)

    def held_on(self, lane: "Lane") -> int:
        return sum(len(f.waiters) for f in self._fetches.values() if f.lane is lane and not f.gave_up)

    def busy(self) -> bool:
        return bool(self._fetches or self._writes or self._counting or not self._outbox.empty)

    def ready(self) -> bool:
        """Whether ``tick`` has something to do now."""
        if not self._outbox.empty or any(c.result.done() for c in self._counting):
            return True
        now = self.clock()
        return any(self._due(op, now) for op in (*self._fetches.values(), *self._writes.values())) or \
            any(not f.gave_up and now >= f.deadline for f in self._fetches.values())

    def wait_hint(self) -> float:
        """How long the engine loop may sleep before ``tick`` is due again (it is woken
        earlier when this rank's worker finishes something)."""
        now, hint = self.clock(), 0.05
        for f in self._fetches.values():
            if not f.gave_up:
                hint = min(hint, max(f.deadline - now, 0.0))
        for op in (*self._fetches.values(), *self._writes.values()):
            if op.op.lane != self.worker.lane or op.others_running:
                late = isinstance(op, _Fetch) and op.gave_up
                hint = min(hint, max(op.last_query + (LATE_POLL_S if late else POLL_S) - now, 0.0))
        return hint

    def wake_with(self, wake: Callable[[], None]) -> None:
        """``wake`` runs in the worker's threads when one of this rank's transfers ends."""
        self._wake = wake

    def wait(self, timeout: float) -> None:
        """Sleeps until this rank's worker finishes a transfer, at most ``timeout``."""
        self._event.wait(timeout)
        self._event.clear()

    def stats(self) -> ActivationCacheStats:
        s = self._stats
        rows = [self.worker.counters(), *self._rank_counters[1:]]   # other ranks': as of the last exchange
        totals = [sum(row[i] for row in rows) for i in range(len(COUNTERS))]
        s.bytes_read, s.bytes_written, s.rejected, s.errors, s.blocks_written = totals
        s.redis_up = self.worker.tier.up
        return ActivationCacheStats(**{**s.__dict__, "fetch_buckets": list(s.fetch_buckets)})

    # ---- a new request -------------------------------------------------------------------
    def hold(self, lane: "Lane", seq: Sequence) -> bool:
        """True when ``seq`` waits for a fetch (``tick`` hands it back to be scheduled)."""
        if seq.params.prefill_details or seq.num_computed_tokens or not self.worker.tier.available:
            return False  # prompt log-probabilities need every position computed
        bm = lane.block_manager
        if not bm.enable_prefix_caching:
            return False
        hashes = bm.prompt_hashes(seq)
        want = hashes[bm.count_cached(hashes):]
        if not want:
            return False
        for f in self._fetches.values():
            if f.lane is lane and not f.gave_up and want[0] in f.chain:
                f.waiters.append(seq)
                return True
        block_ids = bm.reserve(len(want), keep_free=bm.num_blocks // 4)
        if not block_ids:
            return False
        op = Transfer(self._op_id(), lane.index, hashes[0], block_ids, want[:len(block_ids)])
        now = self.clock()
        self._fetches[op.op_id] = _Fetch(op, lane, now, now + self.config.timeout_s, [seq], set(op.hashes))
        self._outbox.fetches.append(op)
        self._stats.lookups += 1
        return True

    def forget(self, seq: Sequence) -> None:
        """An aborted request leaves the fetch it waited for."""
        for f in self._fetches.values():
            f.waiters = [s for s in f.waiters if s is not seq]

    # ---- a computed prompt ---------------------------------------------------------------------
    def prefilled(self, lane: "Lane", seq: Sequence) -> None:
        n = seq.num_prompt_tokens // self.block_size
        if getattr(seq, "index", 0) or n == 0 or len(seq.block_hashes) < n or len(self._counting) >= MAX_COUNTING or \
                not self.worker.tier.available:
            return
        now = self.clock()
        fresh = [h for h in seq.block_hashes[:n] if self._known.get(h, 0.0) < now]
        if fresh:
            root = seq.block_hashes[0]
            self._counting.append(_Count(lane, root, fresh, self.worker.count_and_probe(root, fresh)))

    # ---- before each step ------------------------------------------------------------------------
    def tick(self) -> list[tuple["Lane", Sequence]]:
        """Settles what it can; returns the held requests to schedule now, in order."""
        ready: list[tuple["Lane", Sequence]] = []
        for c in [c for c in self._counting if c.result.done()]:
            self._counting.remove(c)
            self._plan_write(c)
        now = self.clock()
        ops, self._outbox = self._outbox, CacheOps()
        starting = {t.op_id for t in (*ops.fetches, *ops.writes)}
        pending: list[_Fetch | _Write] = [op for op in (*self._fetches.values(), *self._writes.values())
                                          if op.op.op_id not in starting and self._due(op, now)]
        ops.queries = [p.op.op_id for p in pending]
        if not ops.empty:
            table = self.exchange(ops)
            self._rank_counters = [row[:len(COUNTERS)] for row in table]
            for j, p in enumerate(pending):
                statuses = [row[len(COUNTERS) + j] for row in table]
                if RUNNING in statuses:
                    p.last_query, p.others_running = now, RUNNING in statuses[1:]
                    continue
                result = min((s for s in statuses if s >= 0), default=0)
                if isinstance(p, _Fetch):
                    ready += self._settle_fetch(p, result)
                else:
                    self._settle_write(p)
        for f in self._fetches.values():
            if not f.gave_up and now >= f.deadline:
                f.gave_up = True
                self._stats.timeouts += 1
                self.worker.tier.too_slow("fetch", now - f.started)  # the next requests do not wait
                ready += [(f.lane, s) for s in f.waiters]
                f.waiters = []
        return ready

    def _due(self, op: _Fetch | _Write, now: float) -> bool:
        """Whether to ask the ranks for an op's status now: as soon as this rank's part
        is done (its worker wakes the engine then), and every POLL_S while other ranks
        are still at it."""
        mine = op.op.lane == self.worker.lane
        if mine and self.worker.status(op.op.op_id) == RUNNING:
            return False
        if mine and not op.others_running:
            return True
        late = isinstance(op, _Fetch) and op.gave_up   # nobody waits on it: only its blocks are held
        return now - op.last_query >= (LATE_POLL_S if late else POLL_S)

    def _settle_fetch(self, f: _Fetch, loaded: int) -> list[tuple["Lane", Sequence]]:
        del self._fetches[f.op.op_id]
        self._outbox.releases.append(f.op.op_id)
        bm, op = f.lane.block_manager, f.op
        bm.adopt(op.block_ids[:loaded], op.hashes[:loaded])
        bm.release(op.block_ids[loaded:])
        until = self.clock() + KNOWN_S
        for h in op.hashes[:loaded]:
            self._remember(h, until)
        if f.gave_up:
            return []
        s = self._stats
        s.observe_fetch(self.clock() - f.started)
        s.hits += loaded > 0
        s.hit_blocks += loaded
        s.miss_blocks += len(op.hashes) - loaded
        s.tokens_saved += loaded * self.block_size
        return [(f.lane, seq) for seq in f.waiters]

    def _plan_write(self, c: _Count) -> None:
        try:
            result = c.result.result()
        except Exception:  # noqa: BLE001 - a failed count skips the write; it never fails the step
            log.exception("activation cache: counting the blocks of a prompt failed")
            return
        if result is None:
            return
        bm = c.lane.block_manager
        until = self.clock() + KNOWN_S
        block_ids, hashes = [], []
        for h, count, stored in zip(c.hashes, *result):
            if stored:
                self._remember(h, until)
            elif count >= self.config.min_hits:
                block_id = bm.cached_block(h)
                if block_id is not None:
                    block_ids.append(block_id)
                    hashes.append(h)
        room = min(MAX_WRITE_BLOCKS, bm.num_blocks // 4) - self._pinned_for_writes
        block_ids, hashes = block_ids[:max(room, 0)], hashes[:max(room, 0)]
        if not block_ids:
            return
        bm.pin(block_ids)
        self._pinned_for_writes += len(block_ids)
        op = Transfer(self._op_id(), c.lane.index, c.root, block_ids, hashes)
        self._writes[op.op_id] = _Write(op, c.lane)
        self._outbox.writes.append(op)
        for h in hashes:
            self._remember(h, until)

    def _settle_write(self, w: _Write) -> None:
        del self._writes[w.op.op_id]
        self._outbox.releases.append(w.op.op_id)
        w.lane.block_manager.release(w.op.block_ids)
        self._pinned_for_writes -= len(w.op.block_ids)

    def _remember(self, h: int, until: float) -> None:
        self._known[h] = until
        self._known.move_to_end(h)
        while len(self._known) > KNOWN_MAX:
            self._known.popitem(last=False)

    def _op_id(self) -> int:
        op_id, self._next_op = self._next_op, self._next_op + 1
        return op_id
