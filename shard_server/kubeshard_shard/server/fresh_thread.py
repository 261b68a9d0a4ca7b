"""Torch work off the event loop, in a thread that ends with it.

``asyncio.to_thread`` runs its function in a pool thread that outlives it. A pool thread
that ran one parallel torch op keeps its own OpenMP team for the rest of the process,
and libgomp, counting more of its threads than the machine has CPUs, then stops
spinning between parallel regions: every one of the engine's hundreds of regions per
step waits for its worker to wake. Measured here (2 cores, the default model, batch 1):
loading the model in a pool thread made each decode step 34-36 ms against 26-28 ms
loaded in a thread that ended, or in the main thread. A thread that ends frees its team.
So the model load and LoRA loads run through ``run_in_fresh_thread``; the KV cache
workers, which live on, copy with numpy instead (``activations.worker``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


async def run_in_fresh_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()``, run in a new thread named ``name``, joined before this returns."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():  # the awaiting task may have been cancelled
            (future.set_result if ok else future.set_exception)(value)

    def target() -> None:
        try:
            outcome = (True, fn())
        except BaseException as exc:  # handed to the awaiting task, which raises it
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody is waiting
            pass

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    try:
        return await future
    finally:
        if not future.cancelled():  # settled: the thread's last act was to settle it, so it is ending
            thread.join()
