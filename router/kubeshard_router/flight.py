"""One generation on one replica (a *flight*), and the watchdog that cuts off stalled ones.

A flight reads the replica's ``GenerateStream`` (``backends.engine``: the gRPC contract's
Generate, or an OpenAI-compatible HTTP engine). It counts as outstanding on its replica
from its start until ``close``; closing it cancels the stream (a no-op once it ended),
which tells the engine to free the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from kubeshard_proto import pb
from kubeshard_router.backends.engine import GenerateStream
from kubeshard_router.backends.model import Replica


class Flight:
    __slots__ = ("replica", "call", "last", "stalled", "_closed")

    def __init__(self, replica: Replica, request: pb.GenerateRequest, timeout_s: float) -> None:
        self.replica = replica
        self.call: GenerateStream = replica.generator.generate(request, timeout_s)
        replica.request_started()
        self.last = time.monotonic()  # when the replica last sent something
        self.stalled = False
        self._closed = False

    async def read(self) -> Optional[pb.Token]:
        """The next token, or None when the replica ended the stream; raises
        ``BackendError``, or ``CancelledError`` when cancelled (by the watchdog: ``cut_off``)."""
        token = await self.call.read()
        if token is None:
            return None
        self.last = time.monotonic()
        return token

    def stall(self) -> None:
        """The watchdog's verdict: nothing came for too long; cancels the call."""
        self.stalled = True
        self.call.cancel()

    def cut_off(self) -> bool:
        """True when a CancelledError came from the watchdog cancelling the call (a cancelled
        stream raises CancelledError in its reader), not from this task being cancelled."""
        task = asyncio.current_task()
        return self.stalled and (task is None or task.cancelling() == 0)

    def close(self) -> None:
        """Cancels the call and stops counting it on the replica (once)."""
        if self._closed:
            return
        self._closed = True
        self.call.cancel()
        self.replica.request_ended()


class StallWatchdog:
    """Cancels flights that produced nothing for ``timeout_s`` (a hung leader behind a live
    connection); one sweep per second for all flights, so tokens pay only a timestamp."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._flights: set[Flight] = set()
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._sweep(), name="stall watchdog")

    def watch(self, flight: Flight) -> None:
        self._flights.add(flight)

    def forget(self, flight: Flight) -> None:
        self._flights.discard(flight)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 2))
            limit = time.monotonic() - self.timeout_s
            for flight in list(self._flights):
                if flight.last < limit:
                    flight.stall()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
