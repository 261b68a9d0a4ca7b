"""The one interface through which the router generates on a replica, whatever its engine.

Two kinds implement it:

- ``grpc``: the Generate stream of the gRPC contract (``proto/``), what kubeshard's shard
  servers serve (its own engine, or ONNX Runtime GenAI in-process) — ``grpc_client``;
- ``openai``: an OpenAI-compatible HTTP engine (vLLM, llama.cpp's server, or any other
  such server: SGLang, TGI's own, trtllm-serve), streamed ``POST /v1/completions`` —
  ``openai_http``, its dialects in ``dialects``.

Either way a generation is a ``GenerateStream`` of ``pb.Token`` messages, its failures are
``BackendError`` with the gRPC contract's status codes (so dispatch retries, refuses and
counts them the same way), and ``cancel`` aborts it at once (a client gone, a stall).
Everything above (APIs, cache, balancing, admission, retries, metrics, load counters)
sees only this. A replica's Info and Health always come over the gRPC contract: from the
shard server, or for an HTTP engine from the ``kubeshard engine-info`` server beside it,
whose Info names the engine (``runtime``) and its HTTP port (``openai_port``).
"""

from __future__ import annotations

from typing import Optional, Protocol

import grpc

from kubeshard_proto import pb


class BackendError(Exception):
    """A generation the replica failed or refused, as a gRPC status (``code()``, ``details()``
    like grpc.aio's errors, so both kinds are handled by one code path)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class GenerateStream(Protocol):
    async def read(self) -> Optional[pb.Token]:
        """The next token; None when the stream ended. Raises ``BackendError``, or
        ``asyncio.CancelledError`` when ``cancel`` was called while it waited."""

    def cancel(self) -> None:
        """Aborts the generation (the engine frees its resources); a no-op once ended."""


class Generator(Protocol):
    """Starts generations on one replica."""

    kind: str  # "grpc" | "openai"

    def generate(self, request: pb.GenerateRequest, timeout_s: float) -> GenerateStream:
        """Starts one generation (nothing is awaited: the first ``read`` sends it)."""

    async def close(self) -> None:
        """Releases connections; in-flight streams end."""
