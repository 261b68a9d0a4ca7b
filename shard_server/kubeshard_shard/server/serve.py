"""The model-server process: gRPC (TextGeneration + grpc.health.v1) and /metrics.

The gRPC port opens first, answering NOT_SERVING while the model loads (a startup probe
sees the process is alive; readiness waits for the model). SIGTERM drains in-flight
streams, bounded by a grace period, then stops.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import signal
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kubeshard_proto import pb, pb_grpc
from kubeshard_shard.config import ListenConfig
from kubeshard_shard.engine.async_engine import AsyncEngine
from kubeshard_shard.server.factory import ServedModel
from kubeshard_shard.server.fresh_thread import run_in_fresh_thread
from kubeshard_shard.server.grpc_service import GroupInfo, TextGenerationService
from kubeshard_shard.server.metrics import EngineMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


class HealthReporter:
    """Sets both the overall ("") and the TextGeneration service health."""

    def __init__(self, servicer: health.aio.HealthServicer) -> None:
        self.servicer = servicer

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.servicer.set(name, status)


async def open_grpc_server(listen: ListenConfig, service: pb_grpc.TextGenerationServicer | None,
                           ) -> tuple[grpc.aio.Server, HealthReporter, int]:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    if service is not None:
        pb_grpc.add_TextGenerationServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{listen.host}:{listen.port}")
    if port == 0:
        raise OSError(f"cannot listen on {listen.host}:{listen.port}")
    await server.start()
    reporter = HealthReporter(health_servicer)
    await reporter.set(False)
    return server, reporter, port


def install_signal_handlers(on_signal: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call ``on_signal`` (in the main thread)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: on_signal())


class Handoff:
    """What the main thread (the engine loop) and the server thread (gRPC, asyncio) pass
    each other: the loaded engine one way; a stop request, the exit code or the error
    the other way."""

    def __init__(self) -> None:
        self._engines: queue.Queue = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.code = 1
        self.error: BaseException | None = None

    # the server thread
    def bind(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        """Called once the server's event loop runs; returns the event a stop sets."""
        self._loop, self._stop = loop, asyncio.Event()
        return self._stop

    def give_engine(self, engine: AsyncEngine | None) -> None:
        """Hands the loaded engine to the main thread (None: there will be none)."""
        self._engines.put(engine)

    def finish(self, code: int) -> None:
        self.code = code

    def fail(self, error: BaseException) -> None:
        self.error = error

    # the main thread
    def request_stop(self) -> None:
        """SIGTERM/SIGINT: asks the server to drain and stop (a no-op before it runs)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def take_engine(self) -> AsyncEngine | None:
        while True:  # a timeout, so that signals are handled while we wait
            try:
                return self._engines.get(timeout=0.5)
            except queue.Empty:
                continue


def run_leader(model_id: str, revision: str, group: GroupInfo, listen: ListenConfig,
               load: Callable[[], ServedModel]) -> int:
    """Serves one model replica from this process until SIGTERM; returns the exit code.

    The engine loop runs in this (the main) thread, gRPC and asyncio in a second one
    (see ``engine.async_engine`` for why). ``load`` runs in a third, which ends when it
    has loaded (see ``fresh_thread``), while the health port already answers NOT_SERVING."""
    handoff = Handoff()

    def server_thread() -> None:
        try:
            handoff.finish(asyncio.run(_serve(model_id, revision, group, listen, load, handoff)))
        except BaseException as exc:  # handed to the main thread, which re-raises it
            handoff.fail(exc)
        finally:
            handoff.give_engine(None)

    install_signal_handlers(handoff.request_stop)
    thread = threading.Thread(target=server_thread, name="grpc-server", daemon=True)
    thread.start()
    engine = handoff.take_engine()
    if engine is not None:
        engine.run()
    thread.join()
    if handoff.error is not None:
        raise handoff.error
    return handoff.code


async def _serve(model_id: str, revision: str, group: GroupInfo, listen: ListenConfig,
                 load: Callable[[], ServedModel], handoff: Handoff) -> int:
    stop = handoff.bind(asyncio.get_running_loop())
    service = TextGenerationService(model_id, revision, group)
    server, health_reporter, port = await open_grpc_server(listen, service)
    log.info("gRPC listening on %s:%d (NOT_SERVING while loading)", listen.host, port)
    try:
        served = await run_in_fresh_thread(load, "load")
    except Exception as exc:
        log.error("cannot load the model: %s", exc)
        await server.stop(0)
        raise
    metrics = EngineMetrics(model_id, lambda: engine.stats)
    engine = AsyncEngine(served.engine, served.config.max_concurrent_requests, on_step=metrics.on_step,
                         on_idle=served.strategy.heartbeat, on_stop=served.strategy.stop)
    engine.bind(asyncio.get_running_loop())
    handoff.give_engine(engine)  # the main thread runs the engine loop from here on
    service.attach(served, engine, metrics)
    if listen.metrics_port is not None:
        metrics.serve(listen.metrics_host, listen.metrics_port)
    await health_reporter.set(True)
    print(f"kubeshard shard ready: model {model_id} on {listen.host}:{port}", flush=True)

    exit_code = 0
    health_task = asyncio.create_task(_track_health(engine, health_reporter))
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stop_task, health_task], return_when=asyncio.FIRST_COMPLETED)
    if stop_task in done:
        log.info("stopping: draining %d in-flight requests (up to %.0fs)", engine.in_flight, listen.drain_seconds)
        await health_reporter.set(False)
        await engine.drain(listen.drain_seconds)
    else:
        exit_code = 1
        log.error("engine failed: %s", engine.error)
        await health_reporter.set(False)
    for task in (stop_task, health_task):
        task.cancel()
    engine.stop()
    await server.stop(grace=2)
    return exit_code


class HealthServer:
    """grpc.health.v1 alone, on its own thread (a follower rank's probes), while the main
    thread loads and follows its leader."""

    def __init__(self, listen: ListenConfig) -> None:
        self.listen = listen
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed: asyncio.Event | None = None
        self._reporter: HealthReporter | None = None
        self.port: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="health", daemon=True)

    async def _main(self) -> None:
        self._loop, self._closed = asyncio.get_running_loop(), asyncio.Event()
        try:
            server, self._reporter, self.port = await open_grpc_server(self.listen, None)
        except BaseException as exc:
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._closed.wait()
        await self._reporter.set(False)
        await server.stop(grace=1)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def set(self, serving: bool) -> None:
        asyncio.run_coroutine_threadsafe(self._reporter.set(serving), self._loop).result(timeout=10)

    def close(self) -> None:
        if self._loop is not None and self._closed is not None:
            self._loop.call_soon_threadsafe(self._closed.set)
        self._thread.join(timeout=10)


async def _track_health(engine: AsyncEngine, reporter: HealthReporter) -> None:
    """Returns when the engine stops being alive (after turning health NOT_SERVING)."""
    while engine.alive:
        await asyncio.sleep(0.5)
    await reporter.set(False)
    # leave the failed engine answering errors briefly so in-flight streams end cleanly
    await asyncio.sleep(0.5)
