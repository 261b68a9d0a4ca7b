"""What the router knows of one model (``ModelState``) and of each of its replicas.

A *replica* is one shard group of a model, reached through its leader's address. A
model's tokenizer is built once, from the first replica's Info (and rebuilt only if a
later replica serves a different tokenizer, e.g. during a revision roll-out); its
admission capacity is what its ready replicas accept together.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any, Coroutine, Optional

from kubeshard_proto import pb
from kubeshard_router.admission import UNLIMITED, Admission
from kubeshard_router.backends.engine import Generator
from kubeshard_router.backends.grpc_client import ReplicaClient
from kubeshard_router.config import RouterConfig
from kubeshard_router.load import LoadTracker
from kubeshard_router.tokenization import ModelTokenizer
from kubeshard_router.validation import Limits

log = logging.getLogger("kubeshard.router.backends")


class Replica:
    """One shard group of a model, reached through its leader's address.

    ``ready``, ``info``, ``generator`` and ``last_error`` are kept current by the
    registry's probe through ``set_ready``, ``set_info`` and ``record_error``;
    ``outstanding`` counts the requests the router has open on this replica. ``client``
    speaks the gRPC contract (Info, Health, Stats); ``generator`` starts generations
    (``backends.engine``): the client itself, or, when the Info names a peer engine's
    OpenAI-compatible port, that engine over HTTP.
    """

    __slots__ = ("address", "model", "client", "generator", "outstanding", "ready", "info", "adapters",
                 "_probe", "_wake", "last_error")

    def __init__(self, address: str, model: "ModelState", client: ReplicaClient) -> None:
        self.address = address
        self.model = model
        self.client = client
        self.generator: Generator = client
        self.outstanding = 0
        self.ready = False
        self.info: Optional[pb.InfoResponse] = None
        self.adapters: frozenset[str] = frozenset()  # the LoRA adapters its Info lists
        self._probe: Optional[asyncio.Task] = None
        self._wake = asyncio.Event()
        self.last_error = ""

    def __repr__(self) -> str:
        return f"Replica({self.model.name}@{self.address}, ready={self.ready}, out={self.outstanding})"

    def set_ready(self, ready: bool) -> bool:
        """Marks the replica ready or not; True when that changed it."""
        changed, self.ready = self.ready != ready, ready
        return changed

    def set_info(self, info: pb.InfoResponse, generator: Optional[Generator] = None) -> None:
        """The Info this replica answered (again, when its adapters changed); ``generator``:
        what generates on it, when this Info decided that."""
        self.info = info
        self.adapters = frozenset(a.name for a in info.adapters)
        if generator is not None:
            self.generator = generator

    def record_error(self, error: str) -> None:
        """What the last failed probe or request on this replica said."""
        self.last_error = error

    def request_started(self) -> None:
        self.outstanding += 1

    def request_ended(self) -> None:
        self.outstanding -= 1

    def start_probe(self, probe: Coroutine[Any, Any, None]) -> None:
        self._probe = asyncio.create_task(probe, name=f"probe {self.model.name}@{self.address}")

    def stop_probe(self) -> None:
        if self._probe is not None:
            self._probe.cancel()

    def wake_probe(self) -> None:
        """Ends the probe's pause now (a request found the replica unreachable)."""
        self._wake.set()

    async def probe_pause(self, seconds: float) -> None:
        """Waits ``seconds`` before the next probe, or less when woken."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
            await asyncio.sleep(0.05)  # a woken probe: give the replica a moment
        except TimeoutError:
            pass


class ModelState:
    """One served model: its replicas, the ready ones, its tokenizer and limits, its admission,
    and its token load (``load``: tokens in flight, tokens/s, last request)."""

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
        self.load = LoadTracker()
        # LoRA adapters loaded at run time (name -> folder), loaded again on a replica that
        # becomes ready without them (registry probe); shared through Redis (runtime_adapters.py)
        self.runtime_adapters: dict[str, str] = {}

    @property
    def revision(self) -> str:
        if self.info is not None and self.info.revision:
            return self.info.revision
        return self.revision_hint or "unknown"

    @property
    def adapters(self) -> dict[str, pb.AdapterInfo]:
        """LoRA adapters that a ready replica (or, before any, the last Info) serves, by name."""
        infos = [r.info for r in self.ready_replicas if r.info is not None] or \
            ([self.info] if self.info is not None else [])
        return {a.name: a for info in infos for a in info.adapters}

    def replicas_for(self, adapter: Optional[str]) -> list[Replica]:
        """The ready replicas that can serve a request for ``adapter`` (None or "": all)."""
        if not adapter:
            return self.ready_replicas
        return [r for r in self.ready_replicas if adapter in r.adapters]

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
            if self.info is None or info.revision != self.info.revision or \
                    [a.name for a in info.adapters] != [a.name for a in self.info.adapters]:
                self.info = info
            return
        tokenizer = await asyncio.to_thread(ModelTokenizer, info.tokenizer_json, info.tokenizer_config_json,
                                            self._config.tool_call_parser)
        if self.tokenizer is not None and digest != self._tokenizer_digest:  # (not a twin built meanwhile)
            log.warning("model %s: replica serves a different tokenizer (revision %s); switching to it",
                        self.name, info.revision)
        self.tokenizer, self._tokenizer_digest, self.info = tokenizer, digest, info
        self.limits = Limits(max_input_tokens=info.max_input_tokens,
                             max_total_tokens=info.max_total_tokens,
                             vocab_size=info.vocab_size or tokenizer.vocab_size,
                             max_top_n_tokens=self._config.max_top_n_tokens,
                             max_stop_sequences=self._config.max_stop_sequences,
                             max_sequences=info.max_sequences_per_request or 1)
