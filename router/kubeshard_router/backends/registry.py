"""Models and their replicas, as the sources (static, Kubernetes) declare them.

Every replica gets one gRPC client and one probe task: the task fetches ``Info`` once
(retrying with backoff), then checks ``Health`` every ``health_interval_s``. A replica is
*ready* when its Info is known and it reports serving; a request that finds a replica
unreachable marks it not ready and wakes its probe. The tokenizer is built once per
model, from the first replica's Info (and rebuilt only if a later replica serves a
different tokenizer, e.g. during a revision roll-out).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Callable, Iterable, Optional

import grpc

from kubeshard_proto import pb
from kubeshard_router.admission import UNLIMITED, Admission
from kubeshard_router.backends.grpc_client import ReplicaClient
from kubeshard_router.config import RouterConfig
from kubeshard_router.tokenization import ModelTokenizer
from kubeshard_router.validation import Limits

log = logging.getLogger("kubeshard.router.backends")


class Replica:
    __slots__ = ("address", "model", "client", "outstanding", "ready", "info", "_probe",
                 "_wake", "last_error")

    def __init__(self, address: str, model: "ModelState", client: ReplicaClient) -> None:
        self.address = address
        self.model = model
        self.client = client
        self.outstanding = 0
        self.ready = False
        self.info: Optional[pb.InfoResponse] = None
        self._probe: Optional[asyncio.Task] = None
        self._wake = asyncio.Event()
        self.last_error = ""

    def __repr__(self) -> str:
        return f"Replica({self.model.name}@{self.address}, ready={self.ready}, out={self.outstanding})"


class ModelState:
    def __init__(self, name: str, config: RouterConfig, revision_hint: Optional[str] = None) -> None:
        self.name = name
        self.revision_hint = revision_hint
        self.replicas: dict[str, Replica] = {}
        self.ready_replicas: list[Replica] = []
        self.ready_event = asyncio.Event()
        self.info: Optional[pb.InfoResponse] = None
        self.tokenizer: Optional[ModelTokenizer] = None
        self.limits: Optional[Limits] = None
        self._tokenizer_digest = b""
        self._config = config
        self.admission = Admission(name, max_queue=config.max_queue_per_model,
                                   queue_timeout_s=config.queue_timeout_s)

    @property
    def revision(self) -> str:
        if self.info is not None and self.info.revision:
            return self.info.revision
        return self.revision_hint or "unknown"

    @property
    def block_size(self) -> int:
        return self.info.block_size if self.info is not None and self.info.block_size else 16

    def refresh_ready(self) -> None:
        self.ready_replicas = [r for r in self.replicas.values() if r.ready]
        capacity = 0
        for r in self.ready_replicas:
            cap = r.info.max_concurrent_requests if r.info is not None else 0
            capacity += cap if cap > 0 else UNLIMITED
        self.admission.set_capacity(min(capacity, UNLIMITED))
        if self.ready_replicas:
            self.ready_event.set()
        else:
            self.ready_event.clear()

    async def adopt_info(self, info: pb.InfoResponse) -> None:
        digest = hashlib.blake2b(info.tokenizer_json + b"\0" + info.tokenizer_config_json).digest()
        if self.tokenizer is not None and digest == self._tokenizer_digest:
            if self.info is None or info.revision != self.info.revision:
                self.info = info
            return
        tokenizer = await asyncio.to_thread(ModelTokenizer, info.tokenizer_json, info.tokenizer_config_json)
        if self.tokenizer is not None:
            log.warning("model %s: replica serves a different tokenizer (revision %s); switching to it",
                        self.name, info.revision)
        self.tokenizer, self._tokenizer_digest, self.info = tokenizer, digest, info
        self.limits = Limits(max_input_tokens=info.max_input_tokens,
                             max_total_tokens=info.max_total_tokens,
                             vocab_size=info.vocab_size or tokenizer.vocab_size,
                             max_top_n_tokens=self._config.max_top_n_tokens,
                             max_stop_sequences=self._config.max_stop_sequences)


class Registry:
    def __init__(self, config: RouterConfig, *,
                 client_factory: Callable[[str], ReplicaClient] | None = None) -> None:
        self.config = config
        self.models: dict[str, ModelState] = {}
        self._client_factory = client_factory or (lambda addr: ReplicaClient(
            addr, info_timeout_s=config.info_timeout_s, health_timeout_s=config.connect_timeout_s))
        self._closing = False
        self._closers: set[asyncio.Task] = set()
        self.listeners: list[Callable[[ModelState], None]] = []

    def get(self, name: str) -> Optional[ModelState]:
        return self.models.get(name)

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
                replica._probe = asyncio.create_task(self._probe(replica), name=f"probe {name}@{address}")
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
        replica.ready = False
        if replica._probe is not None:
            replica._probe.cancel()
        # Let in-flight streams finish on the old channel; close it once they have.
        closer = asyncio.create_task(self._close_when_idle(replica))
        self._closers.add(closer)
        closer.add_done_callback(self._closers.discard)
        log.info("model %s: replica %s removed", model.name, address)

    async def _close_when_idle(self, replica: Replica) -> None:
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        while replica.outstanding > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
        await replica.client.close()

    def report_failure(self, replica: Replica, error: str) -> None:
        """A request could not reach this replica: take it out until a probe says otherwise."""
        replica.last_error = error
        if replica.ready:
            log.warning("model %s: replica %s failed (%s); marked not ready", replica.model.name,
                        replica.address, error)
            replica.ready = False
            replica.model.refresh_ready()
            self._notify(replica.model)
        replica._wake.set()

    def _set_ready(self, replica: Replica, ready: bool, why: str = "") -> None:
        if replica.ready == ready:
            return
        replica.ready = ready
        if ready:
            log.info("model %s: replica %s ready", replica.model.name, replica.address)
        else:
            log.warning("model %s: replica %s not ready: %s", replica.model.name, replica.address, why)
        replica.model.refresh_ready()
        self._notify(replica.model)

    def _notify(self, model: ModelState) -> None:
        for listener in self.listeners:
            listener(model)

    async def _probe(self, replica: Replica) -> None:
        backoff = 0.1
        interval = self.config.health_interval_s
        while not self._closing:
            try:
                if replica.info is None:
                    info = await replica.client.info()
                    await replica.model.adopt_info(info)
                    replica.info = info
                    log.info("model %s: replica %s serves %s@%s (%s, max %d input / %d total tokens)",
                             replica.model.name, replica.address, info.model_id, info.revision,
                             info.device_type, info.max_input_tokens, info.max_total_tokens)
                health = await replica.client.health()
                self._set_ready(replica, health.serving, health.message)
                backoff = 0.1
                wait = interval
            except grpc.aio.AioRpcError as exc:
                self._set_ready(replica, False, f"{exc.code().name}: {exc.details()}")
                replica.last_error = f"{exc.code().name}: {exc.details()}"
                wait = backoff
                backoff = min(backoff * 2, interval)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad tokenizer, ...: keep the replica out, say why
                self._set_ready(replica, False, repr(exc))
                replica.last_error = repr(exc)
                log.exception("model %s: replica %s probe failed", replica.model.name, replica.address)
                wait = interval
            replica._wake.clear()
            try:
                await asyncio.wait_for(replica._wake.wait(), wait)
                await asyncio.sleep(0.05)  # a woken probe: give the replica a moment
            except TimeoutError:
                pass

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
                if replica._probe is not None:
                    replica._probe.cancel()
        for model in list(self.models.values()):
            for replica in model.replicas.values():
                await replica.client.close()
        self.models.clear()
