"""Per-model backpressure: an in-flight limit and a bounded FIFO queue.

A model admits as many concurrent requests as its ready replicas accept together
(``max_concurrent_requests`` from each replica's Info). Beyond that, requests wait in a
FIFO queue of at most ``max_queue`` entries for at most ``queue_timeout_s``; a full
queue or an expired wait answers 429 with a ``Retry-After`` estimated from recent
request durations.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from kubeshard_router.errors import Overloaded

UNLIMITED = 1 << 30


class Admission:
    def __init__(self, model: str, *, max_queue: int, queue_timeout_s: float) -> None:
        self.model = model
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.capacity = 0
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._mean_duration_s = 1.0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def retry_after_s(self) -> int:
        per_slot = self._mean_duration_s / max(1, min(self.capacity, UNLIMITED))
        return max(1, min(60, math.ceil(per_slot * (self.queued + 1))))

    def set_capacity(self, capacity: int) -> None:
        self.capacity = capacity
        while self._waiters and self.in_flight < self.capacity:
            fut = self._waiters.popleft()
            if not fut.done():
                self.in_flight += 1
                fut.set_result(None)

    def try_acquire(self) -> bool:
        """Takes a slot if one is free and nobody queues ahead (no await: the fast path)."""
        if self.in_flight < self.capacity and not self._waiters:
            self.in_flight += 1
            return True
        return False

    async def acquire(self) -> float:
        """Takes a slot, waiting in the queue if needed; returns the seconds waited."""
        if self.try_acquire():
            return 0.0
        if len(self._waiters) >= self.max_queue:
            raise Overloaded(f"Model `{self.model}` is overloaded: {self.in_flight} requests in flight "
                             f"and {len(self._waiters)} queued (max {self.max_queue})",
                             retry_after_s=self.retry_after_s())
        start = time.perf_counter()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await fut
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed to us just as we gave up
            else:
                fut.cancel()
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            if isinstance(exc, TimeoutError):
                raise Overloaded(f"Model `{self.model}` is overloaded: no slot freed within "
                                 f"{self.queue_timeout_s:g}s",
                                 retry_after_s=self.retry_after_s()) from None
            raise
        return time.perf_counter() - start

    def release(self, duration_s: float | None = None) -> None:
        if duration_s is not None:
            self._mean_duration_s += 0.05 * (duration_s - self._mean_duration_s)
        if self.in_flight <= self.capacity:
            while self._waiters:
                fut = self._waiters.popleft()
                if not fut.done():
                    fut.set_result(None)  # hand our slot to the oldest waiter
                    return
        self.in_flight -= 1
