"""The models and replicas the sources (static, Kubernetes) declare, and their probes.

Every replica gets one gRPC client and one probe task: the task fetches ``Info`` once
(retrying with backoff), then checks ``Health`` every ``health_interval_s``. A replica is
*ready* when its Info is known and it reports serving; a request that finds a replica
unreachable marks it not ready and wakes its probe. An Info that names a peer engine's
OpenAI-compatible port (``openai_port``, from ``kubeshard engine-info``) gives the replica
an HTTP generator on that port of the same host (``backends.engine``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, Optional

import grpc

from kubeshard_router.backends.engine import Generator
from kubeshard_router.backends.grpc_client import ReplicaClient
from kubeshard_router.backends.model import ModelState, Replica
from kubeshard_router.backends.openai_http import OpenAIEngine
from kubeshard_router.backends.runtime_adapters import RuntimeAdapters
from kubeshard_router.config import RouterConfig

log = logging.getLogger("kubeshard.router.backends")


class Registry:
    def __init__(self, config: RouterConfig, *,
                 client_factory: Callable[[str], ReplicaClient] | None = None,
                 runtime_adapters: RuntimeAdapters | None = None) -> None:
        self.config = config
        self.runtime_adapters = runtime_adapters or RuntimeAdapters()
        self.models: dict[str, ModelState] = {}
        self._client_factory = client_factory or (lambda addr: ReplicaClient(
            addr, info_timeout_s=config.info_timeout_s, health_timeout_s=config.connect_timeout_s))
        self._closing = False
        self._closers: set[asyncio.Task] = set()

    def declare(self, name: str, addresses: Iterable[str], revision_hint: Optional[str] = None) -> ModelState:
        """Sets the full replica set of a model (adding it if new). Idempotent."""
        model = self.models.get(name)
        if model is None:
            model = self.models[name] = ModelState(name, self.config, revision_hint)
            log.info("model %s: declared", name)
        if revision_hint:
            model.revision_hint = revision_hint
        wanted = list(dict.fromkeys(addresses))
        for address in list(model.replicas):
            if address not in wanted:
                self._drop(model, address)
        for address in wanted:
            if address not in model.replicas:
                replica = Replica(address, model, self._client_factory(address))
                model.replicas[address] = replica
                replica.start_probe(self._probe_loop(replica))
                log.info("model %s: replica %s added", name, address)
        model.refresh_ready()
        return model

    def forget(self, name: str) -> None:
        model = self.models.pop(name, None)
        if model is None:
            return
        for address in list(model.replicas):
            self._drop(model, address)
        model.refresh_ready()
        log.info("model %s: removed", name)

    def _drop(self, model: ModelState, address: str) -> None:
        replica = model.replicas.pop(address)
        replica.set_ready(False)
        replica.stop_probe()
        # Let in-flight streams finish on the old channel; close it once they have.
        closer = asyncio.create_task(self._close_when_idle(replica))
        self._closers.add(closer)
        closer.add_done_callback(self._closers.discard)
        log.info("model %s: replica %s removed", model.name, address)

    async def _close_when_idle(self, replica: Replica) -> None:
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        while replica.outstanding > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
        await self._close_replica(replica)

    @staticmethod
    async def _close_replica(replica: Replica) -> None:
        if replica.generator is not replica.client:
            await replica.generator.close()
        await replica.client.close()

    def _generator(self, replica: Replica, info) -> Generator:
        """What generates on this replica: its gRPC server, or the peer engine it names."""
        if not info.openai_port:
            return replica.client
        host = replica.address.rpartition(":")[0]
        return OpenAIEngine(f"http://{host}:{info.openai_port}", info.runtime, info,
                            lambda: replica.model.tokenizer,
                            connect_timeout_s=self.config.connect_timeout_s)

    def report_failure(self, replica: Replica, error: str) -> None:
        """A request could not reach this replica: take it out until a probe says otherwise."""
        replica.record_error(error)
        if replica.set_ready(False):
            log.warning("model %s: replica %s failed (%s); marked not ready", replica.model.name,
                        replica.address, error)
            replica.model.refresh_ready()
        replica.wake_probe()

    def _set_ready(self, replica: Replica, ready: bool, why: str = "") -> None:
        if not replica.set_ready(ready):
            return
        if ready:
            log.info("model %s: replica %s ready", replica.model.name, replica.address)
        else:
            log.warning("model %s: replica %s not ready: %s", replica.model.name, replica.address, why)
        replica.model.refresh_ready()

    async def _probe_loop(self, replica: Replica) -> None:
        backoff = 0.1
        interval = self.config.health_interval_s
        while not self._closing:
            try:
                fresh = replica.info is None
                if fresh:
                    info = await replica.client.info()
                    await replica.model.adopt_info(info)
                    replica.set_info(info, self._generator(replica, info))
                    log.info("model %s: replica %s serves %s@%s (%s, max %d input / %d total tokens)",
                             replica.model.name, replica.address, info.model_id, info.revision,
                             info.device_type, info.max_input_tokens, info.max_total_tokens)
                health = await replica.client.health()
                await self.runtime_adapters.flush(replica.model)  # a load or unload Redis missed
                becoming_ready = health.serving and not replica.ready
                if becoming_ready:  # what to replay: Redis may know more
                    await self.runtime_adapters.sync(replica.model)
                if becoming_ready and (replica.model.runtime_adapters or not fresh):
                    await self._refresh(replica, replay=True)  # it may have restarted: Info again, adapters replayed
                elif health.serving and frozenset(health.adapters) != replica.adapters:
                    await self._refresh(replica, replay=False)  # adapters changed (another router, a restart)
                self._set_ready(replica, health.serving, health.message)
                backoff = 0.1
                wait = interval
            except grpc.aio.AioRpcError as exc:
                self._set_ready(replica, False, f"{exc.code().name}: {exc.details()}")
                replica.record_error(f"{exc.code().name}: {exc.details()}")
                wait = backoff
                backoff = min(backoff * 2, interval)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad tokenizer, ...: keep the replica out, say why
                self._set_ready(replica, False, repr(exc))
                replica.record_error(repr(exc))
                log.exception("model %s: replica %s probe failed", replica.model.name, replica.address)
                wait = interval
            await replica.probe_pause(wait)

    async def _refresh(self, replica: Replica, replay: bool) -> None:
        """Reads a replica's Info again; with ``replay`` (it is about to become ready), first
        loads on it the adapters loaded through this router at run time that it lacks (it
        started, or restarted, after the load). An adapter it refuses stays off it;
        requests for that adapter then go to the replicas that have it."""
        info = await replica.client.info()
        have = {a.name for a in info.adapters}
        loaded = False
        for name, path in list(replica.model.runtime_adapters.items()) if replay else ():
            if name in have or not hasattr(replica.client, "load_adapter"):
                continue
            try:
                await replica.client.load_adapter(name, path)
                loaded = True
                log.info("model %s: replica %s: LoRA adapter %s loaded again from %s", replica.model.name,
                         replica.address, name, path)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    continue
                log.warning("model %s: replica %s refused LoRA adapter %s (%s): %s", replica.model.name,
                            replica.address, name, path, exc.details())
        if loaded:
            info = await replica.client.info()
        await replica.model.adopt_info(info)
        replica.set_info(info)

    async def wait_info(self, names: Iterable[str]) -> None:
        """Waits until every replica of these models has answered Info."""
        while True:
            pending = [r for n in names for r in self.models[n].replicas.values() if r.info is None]
            if not pending:
                return
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self._closing = True
        for model in list(self.models.values()):
            for replica in model.replicas.values():
                replica.stop_probe()
        for model in list(self.models.values()):
            for replica in model.replicas.values():
                await self._close_replica(replica)
        self.models.clear()
