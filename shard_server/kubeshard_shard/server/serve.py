"""The model-server process: gRPC (TextGeneration + grpc.health.v1) and /metrics.

The gRPC port opens first, answering NOT_SERVING while the model loads (a startup probe
sees the process is alive; readiness waits for the model). SIGTERM drains in-flight
streams, bounded by a grace period, then stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable

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


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass


async def serve_leader(model_id: str, revision: str, group: GroupInfo, listen: ListenConfig,
                       load: Callable[[], ServedModel],
                       watch: Callable[[AsyncEngine], Awaitable[None]] | None = None,
                       on_ready: Callable[[int], None] | None = None) -> int:
    """Serves one model replica from this process until SIGTERM. ``load`` runs in a
    thread (the health port answers meanwhile); ``watch`` may fail the engine (a dead
    peer rank). Returns the process exit code."""
    stop = asyncio.Event()
    install_signal_handlers(stop)
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
    engine.start()
    service.attach(served, engine, metrics)
    if listen.metrics_port is not None:
        metrics.serve(listen.metrics_host, listen.metrics_port)
    await health_reporter.set(True)
    print(f"kubeshard shard ready: model {model_id} on {listen.host}:{port}", flush=True)
    if on_ready is not None:
        on_ready(port)

    exit_code = 0
    watcher = asyncio.create_task(watch(engine)) if watch is not None else None
    health_task = asyncio.create_task(_track_health(engine, health_reporter))
    stop_task = asyncio.create_task(stop.wait())
    waiters = [stop_task, health_task] + ([watcher] if watcher else [])
    done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    if stop_task in done:
        log.info("stopping: draining %d in-flight requests (up to %.0fs)", engine.in_flight, listen.drain_seconds)
        await health_reporter.set(False)
        await engine.drain(listen.drain_seconds)
    else:
        exit_code = 1
        log.error("engine failed: %s", engine.error)
        await health_reporter.set(False)
    for task in waiters:
        task.cancel()
    engine.stop()
    await server.stop(grace=2)
    return exit_code


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
