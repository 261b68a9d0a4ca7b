"""Runs the engine loop in one thread and streams outputs to asyncio callers in another.

The loop thread owns the engine: callers never touch it, they post commands (add,
abort) to a queue and wake the loop. Each step's outputs cross back to the event loop
in one ``call_soon_threadsafe`` call. A cancelled or abandoned stream posts an abort,
which the loop applies before its next step, freeing the request's KV blocks at once.

The model server runs the loop in the process's main thread (``run``) and asyncio in a
second one, and no other thread that lives on runs parallel torch ops: each such thread
keeps an OpenMP team of its own, and with more teams' threads than CPUs libgomp stops
spinning between parallel regions (a decode step stepped from a second thread took 32 ms
here against 22-25 ms from the main thread, which had its team already; see
``server.fresh_thread``). The engine loop is the hot path. ``start`` runs the loop in a
thread of its own, for callers that only have an event loop (tests, tools).

While the only work left waits on the activation cache (a fetch from Redis, another
rank's status), the loop sleeps until the cache's worker wakes it or its hint passes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from kubeshard_shard.engine.llm_engine import EngineStats, LLMEngine, TokenOutput
from kubeshard_shard.engine.sequence import SamplingParams

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests (loading, stopped, failed, or lost a peer)."""


class EngineOverloaded(RuntimeError):
    """More requests are in flight than --max-concurrent-requests allows."""


class EngineFailed(RuntimeError):
    """The engine failed while serving a request."""


@dataclass(eq=False)
class _Stream:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    outputs: asyncio.Queue
    key: int | None = None
    finished: bool = False
    submitted: float = field(default_factory=time.monotonic)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_concurrent_requests: int,
                 on_step: Callable[[EngineStats], None] | None = None,
                 on_idle: Callable[[], None] | None = None, idle_interval: float = 2.0,
                 on_stop: Callable[[], None] | None = None) -> None:
        """``on_idle`` runs in the loop thread at most every ``idle_interval`` seconds
        while there is no work (a sharded group's heartbeat); ``on_stop`` runs in the
        loop thread when it ends cleanly. An exception from either fails the engine."""
        self.engine = engine
        self.max_concurrent_requests = max_concurrent_requests
        self.on_step = on_step
        self.on_idle = on_idle
        self.idle_interval = idle_interval
        self.on_stop = on_stop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, _Stream] = {}   # owned by the loop thread
        self._in_flight = 0                       # owned by the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopping = False
        self.error: BaseException | None = None
        self.stats = engine.stats()
        engine.wake_with(self._wake.set)

    # ---- lifecycle ---------------------------------------------------------------
    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that receives outputs; call before ``run`` or ``generate``."""
        self._loop = loop
        self._running = True

    def run(self) -> None:
        """Runs the engine loop in the calling thread until ``stop``."""
        try:
            self._run()
        finally:
            self._running = False

    def start(self) -> None:
        """Binds the running event loop and runs the engine loop in a thread of its own."""
        self.bind(asyncio.get_running_loop())
        self._thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._running and self.error is None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def drain(self, timeout: float) -> None:
        """Stops taking requests and waits (bounded) for the in-flight ones to end."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def fail(self, error: BaseException) -> None:
        """Marks the engine dead from outside (e.g. a peer rank is gone)."""
        self.error = error
        self._commands.put(("fail", error))
        self._wake.set()

    # ---- requests ----------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenOutput]:
        if self.error is not None:
            raise EngineUnavailable(f"the engine is not serving: {self.error}")
        if self._stopping or not self.alive:
            raise EngineUnavailable("the engine is shutting down" if self._stopping else "the engine is not running")
        if self._in_flight >= self.max_concurrent_requests:
            raise EngineOverloaded(
                f"{self._in_flight} requests in flight; the limit is --max-concurrent-requests "
                f"({self.max_concurrent_requests})")
        stream = _Stream(request_id, prompt_ids, params, asyncio.Queue())
        self._in_flight += 1
        self._commands.put(("add", stream))
        self._wake.set()
        try:
            while True:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.done:
                    stream.finished = True
                    return
        finally:
            self._in_flight -= 1
            if not stream.finished:
                self._commands.put(("abort", stream))
                self._wake.set()

    async def call(self, fn: Callable[[], object]) -> object:
        """``fn()`` run in the loop thread between two steps (what must not interleave with
        a step: a sharded group's runtime adapter load, which its other ranks take from
        the step channel); its result, or its exception raised here."""
        if self.error is not None or not self.alive:
            raise EngineUnavailable(f"the engine is not serving: {self.error or 'stopped'}")
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", (fn, future)))
        self._wake.set()
        return await future

    # ---- the loop thread ---------------------------------------------------------
    def _apply_commands(self) -> bool:
        """Applies queued commands; False when the loop must end."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "add":
                if self.error is not None:
                    self._post([(arg, EngineUnavailable(f"the engine is not serving: {self.error}"))])
                    continue
                arg.key = self.engine.add_request(arg.request_id, arg.prompt_ids, arg.params)
                self._streams[arg.key] = arg
            elif kind == "abort":
                if arg.key is not None and self._streams.pop(arg.key, None) is not None:
                    self.engine.abort(arg.key)
            elif kind == "call":
                fn, future = arg
                if self.error is not None:
                    self._settle(future, None, EngineUnavailable(f"the engine is not serving: {self.error}"))
                    continue
                try:
                    result, error = fn(), None
                except Exception as exc:  # the caller's to report
                    result, error = None, exc
                self._settle(future, result, error)
            elif kind == "fail":
                self._fail_all(arg)
            elif kind == "stop":
                self._fail_all(EngineUnavailable("the engine stopped"))
                return False

    def _fail_all(self, error: BaseException) -> None:
        exc = error if isinstance(error, (EngineUnavailable, EngineFailed)) else EngineFailed(str(error))
        posts = [(s, exc) for s in self._streams.values()]
        for key in list(self._streams):
            self.engine.abort(key)
        self._streams.clear()
        self._post(posts)

    def _settle(self, future: asyncio.Future, result, error: BaseException | None) -> None:
        def settle():
            if future.done():  # the caller went away
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(settle)

    def _post(self, items: list) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_deliver, items)

    def _run(self) -> None:
        last_active = time.monotonic()
        try:
            while self._apply_commands():
                if not self.engine.has_work() or self.error is not None:
                    self._publish_stats()
                    self._wake.wait(timeout=min(0.5, self.idle_interval))
                    self._wake.clear()
                    if self.on_idle is not None and self.error is None and \
                            time.monotonic() - last_active >= self.idle_interval:
                        last_active = time.monotonic()
                        try:
                            self.on_idle()
                        except Exception as exc:
                            log.error("engine heartbeat failed: %s", exc)
                            self.error = exc
                            self._fail_all(EngineUnavailable(f"the shard group failed: {exc}"))
                    continue
                if not self.engine.ready():  # waiting on Redis or on another rank's transfer
                    self._wake.wait(timeout=self.engine.wait_hint())
                    self._wake.clear()
                    continue
                last_active = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # the step failed: end every stream, stop serving
                    log.exception("engine step failed")
                    self.error = exc
                    self._fail_all(EngineFailed(f"engine step failed: {exc}"))
                    continue
                items = []
                for out in outputs:
                    stream = self._streams.get(out.request_key)
                    if stream is None:
                        continue
                    items.append((stream, out))
                    if out.done:
                        del self._streams[out.request_key]
                # stats first: a scrape after a client saw a token counts that token
                self._publish_stats()
                self._post(items)
            if self.on_stop is not None and self.error is None:
                try:
                    self.on_stop()
                except Exception as exc:
                    log.warning("stop hook failed: %s", exc)
        except BaseException as exc:  # pragma: no cover - last resort: never leave callers hanging
            log.exception("engine loop crashed")
            self.error = exc
            self._fail_all(EngineFailed(f"engine loop crashed: {exc}"))
        finally:  # calls queued behind the stop (or the crash) are answered, not left waiting
            while True:
                try:
                    kind, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "call":
                    self._settle(arg[1], None, EngineUnavailable("the engine stopped"))
                elif kind == "add":
                    self._post([(arg, EngineUnavailable("the engine stopped"))])

    def _publish_stats(self) -> None:
        self.stats = self.engine.stats()
        if self.on_step is not None:
            try:
                self.on_step(self.stats)
            except Exception:  # metrics must never break serving
                log.exception("stats callback failed")


def _deliver(items: list) -> None:
    for stream, item in items:
        stream.outputs.put_nowait(item)
