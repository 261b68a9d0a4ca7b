"""The ``openai`` kind of generator: an OpenAI-compatible HTTP engine (``backends.engine``).

A generation is one streamed ``POST /v1/completions`` whose SSE chunks become
``pb.Token`` messages, so the router's APIs, cache, balancing, retries and counters treat
the engine like a shard server. What each engine accepts and returns differs; a
*dialect* holds that, one per engine (``backends.dialects``: vllm, llamacpp, and the
generic openai for SGLang, TGI's own server, trtllm-serve and the like).

What an engine cannot do is refused before anything is sent, as INVALID_ARGUMENT (a
422 naming the field and the engine). HTTP failures map to the gRPC codes the dispatcher
already understands: connection refused or 503 → UNAVAILABLE (retried elsewhere, the
replica leaves the ready set), 429 → RESOURCE_EXHAUSTED, 400/422 → INVALID_ARGUMENT,
other statuses → INTERNAL, a timeout → DEADLINE_EXCEEDED. ``cancel`` closes the HTTP
connection; both engines abort a request whose client went away.

Kept-alive connections: the engines' servers (uvicorn) close a connection after 5 s
idle, so the router keeps one idle for ``KEEPALIVE_S`` only. Should the engine still
close one just as a request goes out on it (nothing was answered), the request is sent
once more on a new connection; that is not the replica failing, so it is neither
reported nor retried elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable, Optional

import aiohttp
import grpc
import orjson

from kubeshard_proto import pb
from kubeshard_router.backends.dialects import DIALECTS, NAN, Unsupported
from kubeshard_router.backends.engine import BackendError
from kubeshard_router.tokenization import ModelTokenizer

__all__ = ["DIALECTS", "KEEPALIVE_S", "OpenAIEngine", "OpenAIStream", "Unsupported"]

log = logging.getLogger("kubeshard.router.openai_http")

_END = object()
# Idle seconds a connection to an engine is kept for reuse: below the 5 s after which
# uvicorn (vLLM, llama-cpp-python, SGLang, trtllm-serve) closes an idle connection.
KEEPALIVE_S = 3.0
# Seconds to wait for the end of a body after the engine's last token (it follows at once).
DRAIN_S = 1.0


def _status_code(status: int) -> grpc.StatusCode:
    if status in (400, 422):
        return grpc.StatusCode.INVALID_ARGUMENT
    if status == 429:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if status in (502, 503, 504):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def _error_message(raw: bytes) -> str:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return str(body)[:500]


class OpenAIStream:
    """One streamed completion. A task reads the SSE response into a queue; ``read`` takes
    from it; ``cancel`` ends the task (closing the connection) and wakes a waiting
    ``read`` with ``CancelledError``."""

    __slots__ = ("_engine", "_request", "_timeout_s", "_queue", "_task", "_cancelled", "_ended")

    def __init__(self, engine: "OpenAIEngine", request: pb.GenerateRequest, timeout_s: float) -> None:
        self._engine, self._request, self._timeout_s = engine, request, timeout_s
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: Optional[asyncio.Task] = None
        self._cancelled = False
        self._ended = False  # the last token was emitted

    async def read(self) -> Optional[pb.Token]:
        if self._task is None:
            if self._cancelled:
                raise asyncio.CancelledError()
            self._task = asyncio.create_task(self._run(), name="openai stream")
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)
            return None
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)
            raise item
        return item

    def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        if self._task is not None and not self._task.done() and not self._ended:
            # (once the last token is out, the task only reads the end of the body, so
            # that the connection is kept: let it)
            self._task.cancel()
        self._queue.put_nowait(asyncio.CancelledError())

    def _emit(self, token: pb.Token) -> None:
        if token.HasField("finish"):
            self._ended = True
        self._queue.put_nowait(token)

    async def _run(self) -> None:
        try:
            await self._engine.stream(self._request, self._timeout_s, self._emit)
            self._queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BackendError as exc:
            self._queue.put_nowait(exc)
        except Exception as exc:  # a malformed chunk, ...: the engine's fault, not retried
            self._queue.put_nowait(BackendError(grpc.StatusCode.INTERNAL,
                                                f"{self._engine.runtime} stream: {exc!r}"))


class OpenAIEngine:
    """Generations on one OpenAI-compatible engine at ``base_url`` (``kind`` "openai").

    ``tokenizer`` gives the model's tokenizer when a generation starts (the model's, built
    from the replica's Info); ``info`` the served model id and EOS ids."""

    kind = "openai"

    def __init__(self, base_url: str, runtime: str, info: pb.InfoResponse,
                 tokenizer: Callable[[], Optional[ModelTokenizer]], *,
                 connect_timeout_s: float = 5.0) -> None:
        if runtime not in DIALECTS:
            raise ValueError(f"runtime {runtime!r} has no HTTP dialect (known: "
                             f"{', '.join(sorted(DIALECTS))})")
        self.base_url = base_url.rstrip("/")
        self.runtime = runtime
        self.dialect = DIALECTS[runtime]
        self.model_id = info.model_id
        self.eos_id = info.eos_token_ids[0] if info.eos_token_ids else 0
        self._tokenizer = tokenizer
        self._connect_timeout_s = connect_timeout_s
        self._session: Optional[aiohttp.ClientSession] = None
        self._fresh: Optional[aiohttp.ClientSession] = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = _session(aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))
        return self._session

    def _fresh_client(self) -> aiohttp.ClientSession:
        """A session whose every request opens a new connection."""
        if self._fresh is None or self._fresh.closed:
            self._fresh = _session(aiohttp.TCPConnector(limit=0, force_close=True))
        return self._fresh

    async def _post(self, body: dict[str, Any], timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        url = f"{self.base_url}/v1/completions"
        try:
            return await self._client().post(url, json=body, timeout=timeout)
        except aiohttp.ClientConnectionError as exc:
            if not _closed_before_answering(exc):
                raise
            log.debug("%s at %s closed a kept-alive connection (%s); sending again on a new one",
                      self.runtime, self.base_url, exc)
            return await self._fresh_client().post(url, json=body, timeout=timeout)

    def generate(self, request: pb.GenerateRequest, timeout_s: float) -> OpenAIStream:
        return OpenAIStream(self, request, timeout_s)

    async def close(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()

    async def stream(self, request: pb.GenerateRequest, timeout_s: float,
                     emit: Callable[[Any], None]) -> None:
        """Sends ``request`` and emits its tokens (the last one with ``finish``)."""
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise BackendError(grpc.StatusCode.UNAVAILABLE, "the model's tokenizer is not loaded yet")
        try:
            body = self.dialect.body(request, self.model_id, tokenizer)
        except Unsupported as exc:
            raise BackendError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_timeout_s)
        started = time.perf_counter_ns()
        try:
            async with await self._post(body, timeout) as response:
                if response.status != 200:
                    raw = await response.read()
                    raise BackendError(_status_code(response.status),
                                       f"{self.runtime} answered {response.status}: "
                                       f"{_error_message(raw)}")
                decoder = _Decoder(self, request, tokenizer, started, emit)
                try:
                    async for line in response.content:
                        if line.startswith(b"data:"):
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                break
                            if decoder.chunk(orjson.loads(data)):
                                break
                    if decoder.engine_finished:
                        # the engine ended the generation: read the end of its body (a usage
                        # chunk, [DONE]) so the connection goes back to the pool, not closed
                        async with asyncio.timeout(DRAIN_S):
                            async for _ in response.content:
                                pass
                except TimeoutError:
                    if not decoder.engine_finished:
                        raise
                finally:
                    if not response.content.at_eof():
                        # finished early (a stop matched here) or cancelled: closing the
                        # connection is how the engine learns to abort the request
                        response.close()
        except aiohttp.ClientConnectionError as exc:
            raise BackendError(grpc.StatusCode.UNAVAILABLE, f"{self.runtime} at {self.base_url}: "
                               f"{exc}") from None
        except TimeoutError:
            raise BackendError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"{self.runtime} gave no answer within {timeout_s:g}s") from None


def _session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=connector, json_serialize=lambda o: orjson.dumps(o).decode(),
                                 auto_decompress=False)


def _closed_before_answering(exc: aiohttp.ClientConnectionError) -> bool:
    """The engine closed (or reset) an established connection before any answer: a
    kept-alive connection it was closing as the request went out. A refused connection
    (the engine is down) is not that."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False
    return isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionResetError))


class _Decoder:
    """SSE chunks → tokens: counts, the router's stop matching (llamacpp), the finish."""

    __slots__ = ("engine", "request", "tokenizer", "started", "emit", "count", "text",
                 "stops", "max_new", "last_id", "cumulative", "engine_finished")

    def __init__(self, engine: OpenAIEngine, request: pb.GenerateRequest,
                 tokenizer: ModelTokenizer, started: int, emit: Callable[[Any], None]) -> None:
        self.engine, self.request, self.tokenizer = engine, request, tokenizer
        self.started, self.emit = started, emit
        self.count = 0
        self.text = ""
        self.stops = tuple(request.stopping.stop_sequences) if engine.dialect.router_stops else ()
        self.max_new = request.stopping.max_new_tokens
        self.last_id = 0
        self.cumulative = 0.0
        self.engine_finished = False  # the engine ends too (not a stop the router matched)

    def _finish(self, reason: "pb.FinishReason.ValueType") -> pb.FinishDetails:
        return pb.FinishDetails(reason=reason, generated_tokens=self.count,
                                prompt_tokens=len(self.request.input_ids),
                                inference_time_ns=time.perf_counter_ns() - self.started,
                                cumulative_logprob=self.cumulative)

    def _token(self, token_id: int, text: str, logprob: float, tops: list) -> pb.Token:
        token = pb.Token(id=token_id, text=text, logprob=logprob, index=self.count,
                         top_tokens=tops, special=token_id in self.tokenizer.special_ids)
        self.count += 1
        self.last_id = token_id
        if not math.isnan(logprob):
            self.cumulative += logprob
        return token

    def chunk(self, chunk: dict) -> bool:
        """Emits the chunk's tokens; True when the stream is finished."""
        choices = chunk.get("choices") or []
        if not choices:
            return False  # a usage-only chunk
        choice = choices[0]
        text = choice.get("text") or ""
        finish = choice.get("finish_reason")
        dialect = self.engine.dialect
        pieces = dialect.token_ids(choice.get("logprobs"), text, self.tokenizer) if text or \
            choice.get("logprobs") else []
        tokens = []
        for k, (token_id, logprob, tops) in enumerate(pieces):
            # the chunk's text goes with its last token (the concatenation stays exact)
            tokens.append(self._token(token_id, text if k == len(pieces) - 1 else "", logprob, tops))
        if self.stops and tokens:
            start = max(0, len(self.text) - max(map(len, self.stops)))
            self.text += text
            hit = min(((self.text.find(s, start), s) for s in self.stops if s in self.text[start:]),
                      default=None)
            if hit is not None:
                end = hit[0] + len(hit[1])
                tokens[-1].text = text[:len(text) - (len(self.text) - end)]
                tokens[-1].finish.CopyFrom(self._finish(pb.FINISH_REASON_STOP_SEQUENCE))
                self._send(tokens)
                return True
        if finish is None and tokens and self.count >= self.max_new:
            self.engine_finished = True  # it was asked for max_new tokens: its end follows
            tokens[-1].finish.CopyFrom(self._finish(pb.FINISH_REASON_LENGTH))
            self._send(tokens)
            return True
        if finish is not None:
            self.engine_finished = True
            reason = dialect.finish(choice, eos=True)
            if not tokens:
                if reason == pb.FINISH_REASON_LENGTH and self.count:
                    # the engine counted a token our derivation merged: end on an empty piece
                    tokens.append(self._token(self.last_id, "", NAN, []))
                else:  # EOS: the end-of-sequence token, as kubeshard's engine sends it
                    tokens.append(self._token(self.engine.eos_id, "", NAN, []))
                    tokens[-1].special = True
            tokens[-1].finish.CopyFrom(self._finish(reason))
            self._send(tokens)
            return True
        self._send(tokens)
        return False

    def _send(self, tokens: list[pb.Token]) -> None:
        for token in tokens:
            self.emit(token)

