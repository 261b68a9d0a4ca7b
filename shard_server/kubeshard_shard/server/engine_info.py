"""``kubeshard engine-info``: the gRPC contract's Info, Health and Stats for a peer engine.

A peer engine (vLLM, llama.cpp's server, or any OpenAI-compatible server as ``openai``:
SGLang, TGI's own, trtllm-serve) generates over its own OpenAI-compatible HTTP
API; what that API lacks, the router still needs: the model's tokenizer and chat
template (to validate, count, render chat and hash prefixes), its limits, its EOS ids,
and a readiness that means "the model answers". This small server, beside the engine
(same pod, or same host locally), answers them from the model's own files — a Hugging
Face folder, or a GGUF file's metadata (no weights are read) — and names the engine
and its HTTP port in Info (``runtime``, ``openai_port``): the router then sends
generations straight to the engine (``kubeshard_router.backends.openai_http``), so this
server is never on the data path.

Health is SERVING while the engine's health URL answers 200; grpc.health.v1 follows it
(the pod's readiness probe). Stats (waiting, running) come from the engine's Prometheus
gauges where it has them: vLLM's ``vllm:num_requests_*``, SGLang's
``sglang:num_queue_reqs``/``num_running_reqs``, TGI's ``tgi_queue_size``/
``tgi_batch_current_size``; an engine without them (llama-cpp-python has no metrics)
reports zeros. Generate answers UNIMPLEMENTED, naming where generations go.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import types
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import grpc

from kubeshard_proto import pb, pb_grpc
from kubeshard_shard import __version__
from kubeshard_shard.config import ListenConfig
from kubeshard_shard.models.config import CheckpointError
from kubeshard_shard.paths import build_once, cache_root
from kubeshard_shard.server.serve import install_signal_handlers, open_grpc_server
from kubeshard_shard.tokenizer import ModelTokenizer, load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOTAL_TOKENS = 4096


@dataclass(frozen=True)
class PeerEngine:
    """What kubeshard knows of one peer engine's HTTP API."""

    name: str
    health_path: str           # 200 once the model is loaded
    metrics_path: Optional[str]
    max_concurrent_requests: int  # what one server runs at once (the rest wait in the router)


# A registry, not a chain of ifs. llama-cpp-python's server runs one request at a time
# and has no health route: its OpenAPI page answers once the model is loaded (the
# server starts listening after loading). SGLang, TGI and trtllm-serve all answer
# /health once the model is loaded; 128 is TGI's default limit of concurrent requests
# (--max-concurrent-requests says what the engine really runs).
PEER_ENGINES = {
    "vllm": PeerEngine("vllm", "/health", "/metrics", 256),
    "llamacpp": PeerEngine("llamacpp", "/openapi.json", None, 1),
    "openai": PeerEngine("openai", "/health", "/metrics", 128),
}


@dataclass(frozen=True)
class EngineInfoConfig:
    runtime: str
    model: Path                # a Hugging Face folder or a .gguf file
    model_id: str              # the engine's served model name
    revision: str
    engine_url: str            # http://HOST:PORT of the engine, as this server reaches it
    openai_port: int           # the port the router uses, on this server's host
    max_total_tokens: Optional[int] = None
    max_input_tokens: Optional[int] = None
    max_concurrent_requests: Optional[int] = None
    block_size: int = 16
    dtype: str = "auto"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.runtime not in PEER_ENGINES:
            raise ValueError(f"--runtime {self.runtime!r} is not a peer engine (one of: "
                             f"{', '.join(sorted(PEER_ENGINES))})")
        if not 0 < self.openai_port < 65536:
            raise ValueError(f"--openai-port must be in [1, 65535], got {self.openai_port}")


@dataclass(frozen=True)
class ModelMeta:
    architecture: str
    max_positions: int
    vocab_size: int
    tokenizer: ModelTokenizer


def _gguf_tokenizer_folder(path: Path) -> tuple[Path, dict]:
    """tokenizer.json, tokenizer_config.json and config.json of a GGUF file's metadata,
    written once to a small cached folder (no weights); its HF config."""
    from kubeshard_shard.models.gguf_checkpoint import _digest, hf_config, hf_tokenizer, open_gguf

    def build(out: Path) -> None:
        reader = open_gguf(path)
        config = hf_config(reader)
        tokenizer_json, tokenizer_config = hf_tokenizer(reader)
        out.mkdir(parents=True)
        (out / "tokenizer.json").write_text(tokenizer_json)
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        (out / "config.json").write_text(json.dumps(config, indent=2))

    folder = build_once(cache_root() / "tokenizers" / f"{path.stem}-{_digest(path)}", build)
    return folder, json.loads((folder / "config.json").read_text())


def model_meta(model: Path) -> ModelMeta:
    """The architecture, positions, vocabulary and tokenizer of a folder or GGUF file."""
    model = Path(model)
    if model.is_file() and model.suffix.lower() == ".gguf":
        folder, config = _gguf_tokenizer_folder(model)
    elif model.is_dir():
        folder = model
        path = model / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read the model's config ({exc})") from exc
    else:
        raise CheckpointError(f"model {model} is neither a checkpoint folder nor a .gguf file")
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    vocab = int(config.get("vocab_size") or 0)
    tokenizer = load_tokenizer(folder, types.SimpleNamespace(vocab_size=vocab or 1 << 31,
                                                             eos_token_ids=eos_ids))
    archs = config.get("architectures") or ["unknown"]
    return ModelMeta(architecture=str(archs[0]),
                     max_positions=int(config.get("max_position_embeddings") or DEFAULT_MAX_TOTAL_TOKENS),
                     vocab_size=vocab or tokenizer.tokenizer.get_vocab_size(with_added_tokens=True),
                     tokenizer=tokenizer)


def limits(config: EngineInfoConfig, meta: ModelMeta) -> tuple[int, int]:
    """(max input, max total) tokens: kubeshard's defaults, which the launcher and the
    operator also hand the engine (its context length)."""
    total = config.max_total_tokens or min(meta.max_positions, DEFAULT_MAX_TOTAL_TOKENS)
    max_input = config.max_input_tokens or total - 1
    if max_input >= total:
        raise ValueError(f"--max-input-tokens ({max_input}) must be less than --max-total-tokens ({total})")
    return max_input, total


# the engines' gauges of waiting and running requests: vLLM, SGLang, TGI
_GAUGES = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
           "sglang:num_queue_reqs": "waiting", "sglang:num_running_reqs": "running",
           "tgi_queue_size": "waiting", "tgi_batch_current_size": "running"}
_GAUGE = re.compile(r"^(" + "|".join(map(re.escape, _GAUGES)) + r")(?:\{[^}]*\})?\s+(\S+)", re.M)


def engine_load(metrics_text: str) -> tuple[int, int]:
    """(waiting, running) requests from an engine's Prometheus page, summed over its label
    sets; zeros when it has none of the gauges."""
    counts = {"waiting": 0.0, "running": 0.0}
    for name, value in _GAUGE.findall(metrics_text):
        counts[_GAUGES[name]] += float(value)
    return int(counts["waiting"]), int(counts["running"])


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


class EngineInfoService(pb_grpc.TextGenerationServicer):
    def __init__(self, config: EngineInfoConfig, meta: ModelMeta) -> None:
        self.config, self.meta = config, meta
        self.engine = PEER_ENGINES[config.runtime]
        self.max_input, self.max_total = limits(config, meta)
        self.serving = False
        self.reason = f"the {config.runtime} engine at {config.engine_url} has not answered yet"

    async def check(self) -> bool:
        url = self.config.engine_url.rstrip("/") + self.engine.health_path
        try:
            status, _ = await asyncio.to_thread(_get, url, 5.0)
        except OSError as exc:
            status, self.reason = 0, f"the {self.config.runtime} engine at {url}: {exc}"
        else:
            if status != 200:
                self.reason = f"the {self.config.runtime} engine answered {status} at {url}"
        self.serving = status == 200
        return self.serving

    def info(self) -> pb.InfoResponse:
        c, m = self.config, self.meta
        return pb.InfoResponse(
            model_id=c.model_id, revision=c.revision, architecture=m.architecture, dtype=c.dtype,
            device_type=c.device, max_input_tokens=self.max_input, max_total_tokens=self.max_total,
            max_concurrent_requests=c.max_concurrent_requests or self.engine.max_concurrent_requests,
            block_size=c.block_size, strategy="tensor", shards=1, vocab_size=m.vocab_size,
            eos_token_ids=sorted(m.tokenizer.eos_ids), tokenizer_json=m.tokenizer.tokenizer_json,
            tokenizer_config_json=m.tokenizer.tokenizer_config_json, version=__version__,
            max_sequences_per_request=1, runtime=c.runtime, openai_port=c.openai_port)

    async def Info(self, request, context):
        return self.info()

    async def Health(self, request, context):
        return pb.HealthResponse(serving=self.serving, message="" if self.serving else self.reason)

    async def Stats(self, request, context):
        stats = pb.StatsResponse()
        if self.engine.metrics_path is None:
            return stats
        try:
            status, body = await asyncio.to_thread(
                _get, self.config.engine_url.rstrip("/") + self.engine.metrics_path, 5.0)
        except OSError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.config.runtime} metrics: {exc}")
        stats.waiting, stats.running = engine_load(body.decode("utf-8", "replace"))
        return stats

    async def Generate(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"this server answers Info/Health/Stats for a {self.config.runtime} engine; "
                            f"generate over its OpenAI-compatible API on port {self.config.openai_port}")
        yield pb.Token()  # pragma: no cover (a generator, for grpc)


async def serve(config: EngineInfoConfig, listen: ListenConfig, interval_s: float = 2.0) -> int:
    meta = await asyncio.to_thread(model_meta, config.model)
    service = EngineInfoService(config, meta)
    server, health, port = await open_grpc_server(listen, service)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    install_signal_handlers(lambda: loop.call_soon_threadsafe(stop.set))
    log.info("engine-info for %s (%s) on %s:%d; engine %s", config.model_id, config.runtime, listen.host,
             port, config.engine_url)
    announced = False
    while not stop.is_set():
        serving = await service.check()
        await health.set(serving)
        if serving and not announced:
            announced = True
            print(f"kubeshard shard ready: model {config.model_id} ({config.runtime}) on "
                  f"{listen.host}:{port}", flush=True)
        try:
            await asyncio.wait_for(stop.wait(), interval_s if serving else 0.5)
        except TimeoutError:
            pass
    await health.set(False)
    await server.stop(grace=1)
    return 0
