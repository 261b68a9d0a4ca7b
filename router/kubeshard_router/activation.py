"""Scale from zero: hold requests for a model that has no ready replica.

When a request arrives for a model with zero ready replicas, the activator calls the
``ScaleUpHook`` (at most once per ``hook_interval_s`` per model, and again every
``hook_interval_s`` while requests are still held, so a scale-up lost in a race with a
scale-down is asked for again) and holds the request in a bounded per-model queue until
a replica becomes ready. Beyond the bound a request gets 429 with ``Retry-After``; one
held past ``timeout_s`` gets a 503 saying the model is starting and how long it waited.
Requests are held, not refused, while a model wakes (as KEDA's HTTP add-on and
Knative's activator do). On Kubernetes the hook is ``KubernetesScaleUpHook``
(backends/kubernetes.py): one replica through the InferenceService's /scale.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional, Protocol

from kubeshard_router.backends.model import ModelState
from kubeshard_router.errors import NoBackend, Overloaded

log = logging.getLogger("kubeshard.router.activation")


class ScaleUpHook(Protocol):
    async def scale_up(self, model: str) -> None:
        """Asks the platform for at least one replica of ``model``; returns once asked."""


class LoggingScaleUpHook:
    """The default hook: nothing to scale (static backends); says so in the log."""

    async def scale_up(self, model: str) -> None:
        log.info("model %s has no ready replica; no scale-up hook is configured, waiting", model)


class Activator:
    def __init__(self, hook: ScaleUpHook, *, max_waiting: int, timeout_s: float,
                 hook_interval_s: float = 10.0,
                 on_scale_up: Optional[Callable[[str], None]] = None) -> None:
        """``on_scale_up(model)`` is told of every hook call (the router counts them)."""
        self.hook = hook
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.hook_interval_s = hook_interval_s
        self.waiting: dict[str, int] = {}
        self._last_call: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self._on_scale_up = on_scale_up

    def held(self, model: str) -> int:
        """Requests held now for ``model`` (counted as queued)."""
        return self.waiting.get(model, 0)

    async def wait_ready(self, model: ModelState) -> float:
        """Returns at once when the model has a ready replica; else holds. Returns seconds held."""
        if model.ready_replicas:
            return 0.0
        name = model.name
        if self.waiting.get(name, 0) >= self.max_waiting:
            raise Overloaded(f"Model `{name}` is starting and {self.max_waiting} requests already wait "
                             f"for it", retry_after_s=5)
        model.load.arrived()
        self._call_hook(name)
        self.waiting[name] = self.waiting.get(name, 0) + 1
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                while not model.ready_replicas:
                    try:
                        await asyncio.wait_for(model.ready_event.wait(), self.hook_interval_s)
                    except TimeoutError:
                        self._call_hook(name)  # still nothing: ask again
        except TimeoutError:
            raise NoBackend(f"model `{name}` has no ready replica: it is starting, and none became "
                            f"ready within {self.timeout_s:g}s (the request waited "
                            f"{time.perf_counter() - start:.1f}s)") from None
        finally:
            self.waiting[name] -= 1
        return time.perf_counter() - start

    def _call_hook(self, name: str) -> None:
        now = time.monotonic()
        if now - self._last_call.get(name, -1e9) < self.hook_interval_s:
            return
        self._last_call[name] = now
        if self._on_scale_up is not None:
            self._on_scale_up(name)
        task = asyncio.create_task(self._run_hook(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_hook(self, name: str) -> None:
        try:
            async with asyncio.timeout(30):
                await self.hook.scale_up(name)
        except Exception:
            log.exception("scale-up hook failed for model %s", name)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
