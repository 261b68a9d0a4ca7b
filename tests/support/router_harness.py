"""Runs the real router app on uvicorn (loopback HTTP) in a background thread, in front of
StubBackend test doubles served from the same thread's event loop; ``RecordingHook``, a
TEST DOUBLE of the activator's scale-up hook."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, Optional

import uvicorn

from kubeshard_router.app import create_app
from kubeshard_router.config import RouterConfig
from kubeshard_router.state import RouterState
from tests.support.stub_backend import StubBackend


class RouterHarness:
    def __init__(self, *, models: Optional[dict[str, int]] = None, stub_kwargs: Optional[dict] = None,
                 balance: str = "prefix", hook: Any = None, start_stubs: bool = True,
                 sources: Optional[list] = None, **config: Any) -> None:
        self.models = {"stub": 1} if models is None else models
        self.sources = sources
        self.stub_kwargs = stub_kwargs or {}
        self.balance = balance
        self.hook = hook
        self.start_stubs = start_stubs
        self.config_overrides = config
        self.stubs: dict[str, list[StubBackend]] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="router harness", daemon=True)
        self.server: Optional[uvicorn.Server] = None
        self.app = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> RouterState:
        return self.app.state.kubeshard

    def call(self, coro: Coroutine, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stub(self, model: str = "stub", i: int = 0) -> StubBackend:
        return self.stubs[model][i]

    def start(self) -> "RouterHarness":
        self.thread.start()
        self.call(self._start())
        return self

    async def _start(self) -> None:
        backends = {}
        for model, n in self.models.items():
            self.stubs[model] = []
            for i in range(n):
                stub = StubBackend(model_id=f"{model}-id", **self.stub_kwargs)
                if self.start_stubs:
                    await stub.start()
                else:
                    from tests.support.ports import free_port
                    stub.port = free_port()
                self.stubs[model].append(stub)
            backends[model] = tuple(s.address for s in self.stubs[model])
        defaults = dict(health_interval_s=0.2, activation_timeout_s=5.0, queue_timeout_s=5.0,
                        redis_retry_s=0.3)
        config = RouterConfig(host="127.0.0.1", port=0, backends=backends, **{**defaults, **self.config_overrides})
        sources = None
        if self.sources is not None:
            from kubeshard_router.backends.static import StaticSource
            sources = ([StaticSource(backends)] if backends else []) + self.sources
        self.app = create_app(config, sources=sources, hook=self.hook, balance_mode=self.balance)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, http="httptools",
                                                    lifespan="on", log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=5, log_config=None))
        async def serve() -> None:
            try:
                await self.server.serve()
            except SystemExit as exc:  # uvicorn exits when the app's start-up fails
                raise RuntimeError(f"router start-up failed (exit {exc.code})") from None

        self._serve = asyncio.create_task(serve())
        while not self.server.started:
            if self._serve.done():
                await self._serve
            await asyncio.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        if self.start_stubs:
            await asyncio.wait_for(self.state.wait_static_ready(), 20)
            for model in self.models:
                while not self.state.registry.models[model].ready_replicas:
                    await asyncio.sleep(0.01)

    def wait_ready(self, model: str, count: int, timeout: float = 20) -> None:
        async def wait() -> None:
            while len(self.state.registry.models[model].ready_replicas) != count:
                await asyncio.sleep(0.02)
        self.call(asyncio.wait_for(wait(), timeout), timeout + 1)

    def close(self) -> None:
        if not self.thread.is_alive():
            return

        async def stop() -> None:
            if self.server is not None:
                self.server.should_exit = True
                try:
                    await asyncio.wait_for(self._serve, 10)
                except Exception:
                    pass
            for stubs in self.stubs.values():
                for stub in stubs:
                    await stub.stop()
        try:
            self.call(stop(), 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


class RecordingHook:
    """TEST DOUBLE of the scale-up hook (the Kubernetes patch in production): records the
    models it was asked to wake."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def scale_up(self, model: str) -> None:
        self.calls.append(model)
