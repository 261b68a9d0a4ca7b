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
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kubeshard_proto import pb, pb_grpc
from kubeshard_shard.engine.async_engine import AsyncEngine
from kubeshard_shard.engine.factory import ServedModel
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


@dataclass
class ListenConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = 9400
    drain_seconds: float = 30.0


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


def run_leader(model_id: str, revision: str, group: GroupInfo, listen: ListenConfig,
               load: Callable[[], ServedModel]) -> int:
    """Serves one model replica from this process until SIGTERM; returns the exit code.

    The engine loop runs in this (the main) thread, gRPC and asyncio in a second one
    (see ``engine.async_engine`` for why). ``load`` runs in a third while the health
    port already answers NOT_SERVING."""
    handoff: queue.Queue = queue.Queue()
    shared: dict = {}

    def on_signal() -> None:
        loop, stop = shared.get("loop"), shared.get("stop")
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)

    def server_thread() -> None:
        try:
            shared["code"] = asyncio.run(_serve(model_id, revision, group, listen, load, handoff, shared))
        except BaseException as exc:  # handed to the main thread, which re-raises it
            shared["error"] = exc
        finally:
            handoff.put(None)

    install_signal_handlers(on_signal)
    thread = threading.Thread(target=server_thread, name="grpc-server", daemon=True)
    thread.start()
    while True:  # a timeout, so that signals are handled while we wait
        try:
            engine = handoff.get(timeout=0.5)
            break
        except queue.Empty:
            continue
    if engine is not None:
        engine.run()
    thread.join()
    if "error" in shared:
        raise shared["error"]
    return shared.get("code", 1)


async def _serve(model_id: str, revision: str, group: GroupInfo, listen: ListenConfig,
                 load: Callable[[], ServedModel], handoff: queue.Queue, shared: dict) -> int:
    stop = asyncio.Event()
    shared["loop"], shared["stop"] = asyncio.get_running_loop(), stop
    service = TextGenerationService(model_id, revision, group)
    server, health_reporter, port = await open_grpc_server(listen, service)
    log.info("gRPC listening on %s:%d (NOT_SERVING while loading)", listen.host, port)
    try:
        served = await asyncio.to_thread(load)
    except Exception as exc:
        log.error("cannot load the model: %s", exc)
        await server.stop(0)
        raise
    metrics = EngineMetrics(model_id, lambda: engine.stats)
    engine = AsyncEngine(served.engine, served.config.max_concurrent_requests, on_step=metrics.on_step,
                         on_idle=served.on_idle, on_stop=served.on_stop)
    engine.bind(asyncio.get_running_loop())
    handoff.put(engine)  # the main thread runs the engine loop from here on
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


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
