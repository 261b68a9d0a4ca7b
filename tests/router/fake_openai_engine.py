"""FakeOpenAIEngine: a TEST DOUBLE of an OpenAI-compatible HTTP engine (vLLM's API server,
llama-cpp-python's server, or a generic one such as SGLang's or TGI's), for the router's
``openai`` backend kind in the normal test suite. The real engines take 15-60 minutes to
build here (llama.cpp compiles from source; vLLM's CPU build is several GB) and are
covered by tests/router/test_peer_engines.py under ``make test-engines``.

It is not a model. It serves ``POST /v1/completions`` (streamed as SSE, or one JSON
answer), ``GET /v1/models``, the engine's health route and, for vLLM, ``/metrics`` with
``vllm:num_requests_running``/``waiting``; its "greedy model" answers a prompt with words
of the model's real tokenizer that are one token each (so the router's own tokenization
of a streamed piece gives back the engine's token id), chosen by a function of the
prompt's tokens. It speaks each engine's dialect closely enough for the router:

- ``vllm``: the prompt as token ids or text; ``return_tokens_as_token_ids`` with
  ``logprobs`` gives ``token_id:N`` tokens, their logprobs and the top-n alternatives;
  stop strings stay in the text (``include_stop_str_in_output``) and ``stop_reason`` names
  them; EOS comes as the EOS token with empty text and ``finish_reason`` "stop".
- ``llamacpp``: the prompt as text; one chunk per token, no logprobs, a last empty chunk
  carrying ``finish_reason``; SSE lines end in CRLF (sse-starlette); no /health route
  (its /openapi.json answers once the model is loaded).
- ``openai``: standard OpenAI fields only (text prompt, ``stop`` trimmed from the text,
  no ``stop_reason``); two tokens per chunk, as servers that stream text increments may
  send; /health.

A test steers it (``token_delay_s``, ``eos_after``, ``fail_status``, ``healthy``,
``idle_close_s``) and observes it (``bodies``, ``running``, ``disconnects``, ``dropped``,
``connections``).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Optional

import orjson
from aiohttp import web
from tokenizers import Tokenizer

DIALECTS = ("vllm", "llamacpp", "openai")
HEALTH_PATH = {"vllm": "/health", "llamacpp": "/openapi.json", "openai": "/health"}


def one_token_words(tokenizer: Tokenizer) -> list[int]:
    """Ids whose text is a space and letters and whose text encodes back to that id alone."""
    out = []
    for i in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([i])
        if text[:1] == " " and text[1:].isalpha() and \
                tokenizer.encode(text, add_special_tokens=False).ids == [i]:
            out.append(i)
    if len(out) < 16:
        raise ValueError("the tokenizer has too few one-token words for the fake engine")
    return out


class FakeOpenAIEngine:
    def __init__(self, dialect: str, model: Path, model_id: str, *, eos_id: int = 2) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        self.dialect, self.model_id, self.eos_id = dialect, model_id, eos_id
        self.tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
        self.special = {self.tokenizer.token_to_id(t) for t in ("<s>", "</s>", "<pad>", "<unk>")} - {None}
        self.words = one_token_words(self.tokenizer)
        # steering
        self.token_delay_s = 0.0
        self.eos_after: Optional[int] = None     # tokens before EOS (None: never)
        self.fail_status: Optional[int] = None   # /v1/completions answers this status
        self.healthy = True
        self.idle_close_s: Optional[float] = None  # drop a request arriving on a connection idle this long
        # observations
        self.bodies: list[dict[str, Any]] = []   # every /v1/completions body
        self.running = 0
        self.disconnects = 0                     # streams whose client went away mid-answer
        self.dropped = 0                         # requests dropped on an idle kept-alive connection
        self.connections = 0                     # distinct connections seen
        self._last_done: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transport → idle since
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"fake {dialect}", daemon=True)
        self._runner: Optional[web.AppRunner] = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeOpenAIEngine":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get(HEALTH_PATH[self.dialect], self._health)
        if self.dialect == "vllm":
            app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    # the "model" -------------------------------------------------------------------

    def prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list):
            return [int(i) for i in prompt]
        return self.tokenizer.encode(prompt, add_special_tokens=False).ids

    def answer(self, prompt: Any, max_tokens: int) -> list[int]:
        """Its greedy answer: up to ``max_tokens`` ids, ending with EOS after ``eos_after``."""
        key = sum(i for i in self.prompt_ids(prompt) if i not in self.special)
        out = []
        for k in range(max_tokens):
            if self.eos_after is not None and k == self.eos_after:
                out.append(self.eos_id)
                break
            out.append(self.words[(key * 31 + k * 7) % len(self.words)])
        return out

    def text(self, ids: list[int]) -> str:
        return "".join(self.tokenizer.decode([i]) for i in ids if i != self.eos_id)

    # routes ------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.Response(status=503, text="not ready")
        if self.dialect == "llamacpp":
            return web.json_response({"openapi": "3.1.0", "info": {"title": "🦙 llama.cpp Python API"}})
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "owned_by": self.dialect}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        labels = f'{{model_name="{self.model_id}"}}'
        return web.Response(text=f"# TYPE vllm:num_requests_running gauge\n"
                                 f"vllm:num_requests_running{labels} {float(self.running)}\n"
                                 f"# TYPE vllm:num_requests_waiting gauge\n"
                                 f"vllm:num_requests_waiting{labels} 0.0\n")

    def _connection_is_stale(self, request: web.Request) -> bool:
        """True when this request arrived on a kept-alive connection idle ``idle_close_s``
        or longer: the connection is closed without an answer, as an engine's server does
        when its keep-alive timer fires just as the request arrives."""
        last = self._last_done.get(request.transport)
        if last is None:
            self.connections += 1
            return False
        return self.idle_close_s is not None and time.monotonic() - last >= self.idle_close_s

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if self._connection_is_stale(request):
            self.dropped += 1
            self._last_done.pop(request.transport, None)
            request.transport.close()
            raise asyncio.CancelledError()
        try:
            return await self._complete(request)
        finally:
            if request.transport is not None:
                self._last_done[request.transport] = time.monotonic()

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        if self.fail_status is not None:
            return web.json_response({"error": {"message": "the fake engine fails as told"}},
                                     status=self.fail_status)
        if body.get("model") != self.model_id:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist."}},
                                     status=404)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and self.dialect != "vllm":
            return web.json_response({"error": {"message": "prompt must be a string"}}, status=422)
        pieces = self._pieces(body)
        cid = f"cmpl-{next(self._ids)}"
        if not body.get("stream"):
            text = "".join(p["text"] for p in pieces)
            usage = {"prompt_tokens": len(self.prompt_ids(prompt)), "completion_tokens": len(pieces),
                     "total_tokens": len(self.prompt_ids(prompt)) + len(pieces)}
            return web.json_response({"id": cid, "object": "text_completion", "model": self.model_id,
                                      "choices": [{"index": 0, "text": text, "logprobs": None,
                                                   "finish_reason": pieces[-1]["finish_reason"]}],
                                      "usage": usage})
        return await self._stream(request, body, cid, pieces)

    def _pieces(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """One dict per generated token: text, id, finish_reason (on the last), stop_reason."""
        ids = self.answer(body["prompt"], int(body.get("max_tokens") or 16))
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        keep_stop = bool(body.get("include_stop_str_in_output"))
        pieces, text = [], ""
        for k, i in enumerate(ids):
            piece = {"id": i, "text": "" if i == self.eos_id else self.tokenizer.decode([i]),
                     "finish_reason": None, "stop_reason": None}
            pieces.append(piece)
            if i == self.eos_id:
                piece["finish_reason"] = "stop"
                break
            text += piece["text"]
            hit = next((s for s in stops if s in text), None)
            if hit is not None:
                end = text.index(hit) + (len(hit) if keep_stop else 0)
                piece["text"] = piece["text"][:len(piece["text"]) - (len(text) - end)]
                piece["finish_reason"], piece["stop_reason"] = "stop", hit
                break
            if k == len(ids) - 1:
                piece["finish_reason"] = "length"
        return pieces

    def _chunk(self, cid: str, piece: dict[str, Any], body: dict[str, Any], last: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": piece["text"], "logprobs": None,
                                  "finish_reason": piece["finish_reason"] if last else None}
        if self.dialect == "vllm":
            choice["stop_reason"] = piece["stop_reason"] if last else None
            n = body.get("logprobs")
            if n is not None:
                name = (lambda i: f"token_id:{i}") if body.get("return_tokens_as_token_ids") \
                    else (lambda i: self.tokenizer.decode([i]))
                lp = -0.25
                tops = None
                if n:
                    alternatives = [piece["id"]] + [w for w in self.words if w != piece["id"]][:n - 1]
                    tops = [{name(a): lp - j for j, a in enumerate(alternatives)}]
                choice["logprobs"] = {"text_offset": [0], "token_logprobs": [lp],
                                      "tokens": [name(piece["id"])], "top_logprobs": tops}
        return {"id": cid, "object": "text_completion", "created": int(time.time()),
                "model": self.model_id, "choices": [choice]}

    async def _stream(self, request: web.Request, body: dict[str, Any], cid: str,
                      pieces: list[dict[str, Any]]) -> web.StreamResponse:
        eol = b"\r\n" if self.dialect == "llamacpp" else b"\n"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.running += 1
        sent = 0
        try:
            chunks = []
            if self.dialect == "vllm":
                chunks = [self._chunk(cid, piece, body, k == len(pieces) - 1) for k, piece in enumerate(pieces)]
            else:  # llama.cpp: one chunk per token; a generic server may send several at once
                step = 2 if self.dialect == "openai" else 1
                for k in range(0, len(pieces), step):
                    group = pieces[k:k + step]
                    chunks.append(self._chunk(cid, {"text": "".join(p["text"] for p in group), "id": group[-1]["id"],
                                                    "finish_reason": None, "stop_reason": None}, body, False))
                # then an empty chunk with the finish
                chunks.append(self._chunk(cid, {"text": "", "finish_reason": pieces[-1]["finish_reason"],
                                                "stop_reason": None, "id": 0}, body, True))
            if (body.get("stream_options") or {}).get("include_usage"):
                n = len(self.prompt_ids(body["prompt"]))
                chunks.append({"id": cid, "object": "text_completion", "model": self.model_id, "choices": [],
                               "usage": {"prompt_tokens": n, "completion_tokens": len(pieces),
                                         "total_tokens": n + len(pieces)}})
            for chunk in chunks:
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("the client went away")
                await response.write(b"data: " + orjson.dumps(chunk) + eol + eol)
                sent += 1
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
            await response.write(b"data: [DONE]" + eol + eol)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        finally:
            self.running -= 1
        return response
